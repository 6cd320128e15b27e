"""A migration file edited after it ran is refused, never skipped: the schema it
describes is no longer the schema the database holds. Each applied migration's
SHA-256 is kept; rows applied before checksums existed get one on first sight."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from cairn_libs.db import Database, Migration, MigrationEdited
from cairn_libs.stack import free_port, stack_env, start_service, wait_for_health

FIRST = Migration(version=1, name="init", sql="CREATE TABLE notes (id int PRIMARY KEY);")
SECOND = Migration(version=2, name="more", sql="ALTER TABLE notes ADD COLUMN body text;")


async def _ready(pg_url: str, schema: str, migrations: list[Migration]) -> bool:
    database = Database(url=pg_url, schema=schema, migrations=migrations)
    try:
        return await database.ready()
    finally:
        await database.close()


async def test_an_applied_migration_edited_afterwards_is_refused_naming_the_file(
    pg_url: str,
) -> None:
    schema = f"checksum_{uuid.uuid4().hex[:8]}"
    assert await _ready(pg_url, schema, [FIRST, SECOND])

    edited = Migration(version=2, name="more", sql="ALTER TABLE notes ADD COLUMN body jsonb;")
    with pytest.raises(MigrationEdited) as refused:
        await _ready(pg_url, schema, [FIRST, edited])

    message = str(refused.value)
    assert "0002_more.sql" in message
    assert repr(schema) in message
    assert "new migration" in message
    # The same files as ran are still accepted.
    assert await _ready(pg_url, schema, [FIRST, SECOND])


async def test_a_new_migration_is_applied_and_its_checksum_kept(pg_url: str) -> None:
    schema = f"checksum_{uuid.uuid4().hex[:8]}"
    assert await _ready(pg_url, schema, [FIRST])
    assert await _ready(pg_url, schema, [FIRST, SECOND])

    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch(
            f'SELECT version, checksum FROM "{schema}".schema_migrations ORDER BY version'
        )
    finally:
        await conn.close()
    assert [(r["version"], r["checksum"]) for r in rows] == [
        (1, FIRST.checksum),
        (2, SECOND.checksum),
    ]


async def test_migrations_applied_before_checksums_were_kept_get_one_and_are_then_guarded(
    pg_url: str,
) -> None:
    schema = f"checksum_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(pg_url)
    try:
        # The table as every deployment before checksums has it.
        await conn.execute(f'CREATE SCHEMA "{schema}"')
        await conn.execute(
            f'CREATE TABLE "{schema}".schema_migrations (version int PRIMARY KEY, '
            "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute(f'SET search_path = "{schema}"; {FIRST.sql}')
        await conn.execute(
            f"INSERT INTO \"{schema}\".schema_migrations (version, name) VALUES (1, 'init')"
        )
    finally:
        await conn.close()

    assert await _ready(pg_url, schema, [FIRST, SECOND])
    edited = Migration(version=1, name="init", sql="CREATE TABLE notes (id bigint PRIMARY KEY);")
    with pytest.raises(MigrationEdited, match="0001_init.sql"):
        await _ready(pg_url, schema, [edited, SECOND])


@pytest.fixture
def own_database(pg_url: str) -> Iterator[str]:
    """A database of its own, so tampering with its gateway schema touches no other test."""
    name = f"edited_{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    parts = urlsplit(pg_url)
    yield urlunsplit(parts._replace(path=f"/{name}"))


def test_a_service_whose_migration_was_edited_exits_2_with_one_line_naming_it(
    own_database: str, dev_keys: tuple[Path, Path], tmp_path: Path
) -> None:
    env = stack_env(
        database_url=own_database,
        keys=dev_keys,
        qdrant_path=tmp_path / "qdrant",
        model_url="http://127.0.0.1:9",
        addresses=dict.fromkeys(("gateway", "retrieval", "memory", "orchestrator"), "127.0.0.1:9"),
    )
    first = start_service("gateway", port=free_port(), env=env, log_dir=tmp_path)
    try:
        wait_for_health(first)
    finally:
        first.stop()

    async def tamper() -> None:
        conn = await asyncpg.connect(own_database)
        try:
            await conn.execute(
                "UPDATE gateway.schema_migrations SET checksum = repeat('0', 64) WHERE version = 1"
            )
        finally:
            await conn.close()

    asyncio.run(tamper())
    second = start_service("gateway", port=free_port(), env=env, log_dir=tmp_path, suffix="-2")
    try:
        assert second.process.wait(timeout=60) == 2
    finally:
        second.stop()  # a gateway that did not refuse must not outlive the test
    lines = [json.loads(line) for line in second.log_text().splitlines() if line.startswith("{")]
    refused = [line for line in lines if line.get("event") == "service.config_invalid"]
    assert len(refused) == 1
    assert "0001_init.sql" in refused[0]["error"]
    assert "edited after it was applied" in refused[0]["error"]
