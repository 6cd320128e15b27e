"""Several replicas starting at once each migrate their schema under one advisory
lock: every migration is applied exactly once and every replica ends ready. The
memory schema's migrations are the probe because they are not idempotent (a second
CREATE TABLE would fail), so a lock that did not hold would show."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import uuid

import asyncpg

from cairn_libs.stack import REPO_ROOT
from cairn_memory.postgres import migrations

REPLICAS = 4

A_REPLICA = textwrap.dedent(
    """
    import asyncio, sys
    from cairn_libs.db import Database
    from cairn_memory.postgres import migrations

    async def main():
        database = Database(url=sys.argv[1], schema=sys.argv[2], migrations=migrations())
        ready = await database.ready()
        await database.close()
        print("ready" if ready else "not ready")

    asyncio.run(main())
    """
)


def test_replicas_starting_together_apply_each_migration_once_and_all_become_ready(
    pg_url: str,
) -> None:
    schema = f"memory_race_{uuid.uuid4().hex[:8]}"
    replicas = [
        subprocess.Popen(
            [sys.executable, "-c", A_REPLICA, pg_url, schema],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(REPLICAS)
    ]
    outcomes = [replica.communicate(timeout=120) for replica in replicas]

    assert [out.strip().splitlines()[-1] for out, _ in outcomes] == ["ready"] * REPLICAS
    # One replica migrated; the others found the work done when the lock let them in.
    migrated_lines = sum(out.count("db.migrated") for out, _ in outcomes)

    async def applied() -> list[int]:
        conn = await asyncpg.connect(pg_url)
        try:
            rows = await conn.fetch(f'SELECT version FROM "{schema}".schema_migrations')
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        finally:
            await conn.close()
        return sorted(r["version"] for r in rows)

    expected = sorted(m.version for m in migrations())
    assert asyncio.run(applied()) == expected
    assert migrated_lines == len(expected)
