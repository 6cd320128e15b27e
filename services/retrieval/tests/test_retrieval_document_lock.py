"""A document's write lock never outlives its session: an unlock cut short (a
cancelled ingest) closes the session, which releases the lock, and gives its slot
back to the pool, whatever the pool's reset sends on release."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from cairn_retrieval.app import app_from_env
from cairn_retrieval.postgres.document_writes import PostgresDocumentWrites


class _UnlockCutShort:
    """The real pool, but each connection's unlock is cancelled before it reaches
    the server, as when the ingest holding the lock is cancelled during it."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.inner = pool

    async def acquire(self) -> _Connection:
        return _Connection(await self.inner.acquire())

    async def release(self, conn: _Connection) -> None:
        await self.inner.release(conn.inner)


class _Connection:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def execute(self, statement: str, *args: object) -> str:
        if "pg_advisory_unlock" in statement:
            raise asyncio.CancelledError
        result: str = await self.inner.execute(statement, *args)
        return result

    def terminate(self) -> None:
        self.inner.terminate()


class _Database:
    def __init__(self, pool: _UnlockCutShort) -> None:
        self.pool = pool


@pytest.fixture
async def one_connection_pool(pg_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(pg_url, min_size=0, max_size=1)
    yield pool
    await pool.close()


async def test_a_cancelled_unlock_closes_the_session_so_the_document_lock_goes_with_it(
    one_connection_pool: asyncpg.Pool, pg_url: str
) -> None:
    writes = PostgresDocumentWrites(_Database(_UnlockCutShort(one_connection_pool)))  # type: ignore[arg-type]
    org_id, document_id = f"org-{uuid.uuid4().hex[:8]}", "handbook.md"

    with pytest.raises(asyncio.CancelledError):
        async with writes.document_session(org_id, document_id):
            pass

    other = await asyncpg.connect(pg_url)
    try:
        key = f"retrieval\x1f{org_id}\x1f{document_id}"
        assert await other.fetchval("SELECT pg_try_advisory_lock(hashtextextended($1, 0))", key)
        await other.execute("SELECT pg_advisory_unlock(hashtextextended($1, 0))", key)
    finally:
        await other.close()
    # The pool's only slot is free again: a leaked connection would make this wait.
    async with asyncio.timeout(10):
        async with one_connection_pool.acquire() as conn:
            assert await conn.fetchval("SELECT 1") == 1


async def test_the_service_pool_keeps_sessions_and_a_document_lock_still_ends_with_its_session(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DATABASE_URL", pg_url)
    monkeypatch.setenv("CAIRN_EMBEDDER", "none")
    monkeypatch.delenv("CAIRN_RETRIEVAL_EMBEDDER", raising=False)
    monkeypatch.delenv("QDRANT_URL", raising=False)
    monkeypatch.setenv("CAIRN_QDRANT_PATH", str(tmp_path / "qdrant"))
    app = app_from_env()
    try:
        # No reset on release: what a session keeps is the service's to undo.
        assert app.database.reset == "transaction"
        assert await app.database.ready()
        writes = PostgresDocumentWrites(app.database)
        org_id = f"org-{uuid.uuid4().hex[:8]}"
        for _ in range(2):
            async with writes.document_session(org_id, "handbook.md"):
                pass
        other = await asyncpg.connect(pg_url)
        try:
            key = f"retrieval\x1f{org_id}\x1fhandbook.md"
            assert await other.fetchval("SELECT pg_try_advisory_lock(hashtextextended($1, 0))", key)
        finally:
            await other.close()
    finally:
        await app.stop()
