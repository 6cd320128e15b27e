"""What releasing a pooled connection costs and undoes, per pool: "session" (asyncpg's
full reset, the default) releases session advisory locks; "transaction" sends
nothing after a statement, and still rolls back a transaction left open."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from asyncpg.connection import LoggedQuery

from cairn_libs.db import Database, PoolReset


@pytest.fixture
async def databases(pg_url: str) -> AsyncIterator[dict[PoolReset, Database]]:
    schema = f"reset_{uuid.uuid4().hex[:8]}"
    made: dict[PoolReset, Database] = {
        reset: Database(url=pg_url, schema=schema, migrations=[], max_size=1, reset=reset)
        for reset in ("session", "transaction")
    }
    for database in made.values():
        assert await database.ready()
    yield made
    for database in made.values():
        await database.close()


async def _sent_by(database: Database, statement: str) -> list[str]:
    """Every query the pool's one connection sends for `statement` and its release."""
    seen: list[LoggedQuery] = []
    async with database.pool.acquire() as conn:
        conn.add_query_logger(seen.append)
        await conn.execute(statement)
    async with database.pool.acquire() as conn:
        await asyncio.sleep(0)  # query loggers are called soon after, not inline
        conn.remove_query_logger(seen.append)
    return [q.query for q in seen]


async def test_a_transaction_reset_sends_nothing_after_the_statement(
    databases: dict[PoolReset, Database],
) -> None:
    assert await _sent_by(databases["transaction"], "SELECT 1") == ["SELECT 1"]
    session = await _sent_by(databases["session"], "SELECT 1")
    assert session[0] == "SELECT 1" and "pg_advisory_unlock_all()" in session[1]


async def test_a_transaction_left_open_is_rolled_back_under_either_reset(
    databases: dict[PoolReset, Database],
) -> None:
    for database in databases.values():
        async with database.pool.acquire() as conn:
            await conn.execute("BEGIN; SELECT txid_current()")
        async with database.pool.acquire() as conn:
            assert not conn.is_in_transaction()
            assert await conn.fetchval("SELECT txid_current_if_assigned()") is None


async def test_only_the_session_reset_releases_a_session_advisory_lock(
    databases: dict[PoolReset, Database], pg_url: str
) -> None:
    key = uuid.uuid4().int % 2**62
    held: dict[PoolReset, bool] = {}
    for reset, database in databases.items():
        async with database.pool.acquire() as conn:
            await conn.execute("SELECT pg_advisory_lock($1)", key)
        other = await asyncpg.connect(pg_url)
        try:
            held[reset] = not await other.fetchval("SELECT pg_try_advisory_lock($1)", key)
            await other.execute("SELECT pg_advisory_unlock_all()")
        finally:
            await other.close()
        async with database.pool.acquire() as conn:
            await conn.execute("SELECT pg_advisory_unlock_all()")
    assert held == {"session": False, "transaction": True}
