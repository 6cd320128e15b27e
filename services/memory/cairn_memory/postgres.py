"""Memories, profile facts, erasures and archived blocks in PostgreSQL (schema `memory`),
one adapter per concern: pg_memories, pg_profiles, pg_blocks, pg_subjects (Held and
Forget), over pg_rows (connections and rows made back into domain records).

Every statement narrows by org_id (I5); every time it compares against is a
parameter from the service's clock. Decisions that need the current state (is a
superseded id active, is the previous profile value current, does this user own
the conversation) are taken inside the same transaction as the write, with the
rows locked, so two concurrent calls cannot both win. asyncpg's connection
errors become StorageUnavailable in pg_rows and nowhere else. What a refusal
becomes (a denial, a conflict) is decided by the keeper and the domain, not here.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Final

from cairn_libs.db import Database, Migration, load_migrations
from cairn_memory.domain import PurgeCounts
from cairn_memory.pg_blocks import PostgresBlocks
from cairn_memory.pg_memories import PostgresMemories
from cairn_memory.pg_profiles import PostgresProfiles
from cairn_memory.pg_rows import Rows
from cairn_memory.pg_subjects import PostgresSubjects
from cairn_memory.vault import TextVault

SCHEMA: Final = "memory"
PURGE_BATCH: Final = 5000


def migrations() -> list[Migration]:
    return load_migrations(Path(__file__).parent / "migrations")


def memory_database(url: str) -> Database:
    # Nothing of memory's stays in a session: its locks are transaction-scoped
    # (pg_advisory_xact_lock) and its planner settings SET LOCAL, so a release sends
    # nothing (the "transaction" reset): one round trip a statement, not two.
    return Database(url=url, schema=SCHEMA, migrations=migrations(), reset="transaction")


# The recall statements are module functions so the benchmark can EXPLAIN exactly
# what the service runs.


class PostgresStore:
    """The memory schema, one adapter per concern (ports.Store is what the keeper
    needs of it)."""

    def __init__(self, database: Database, *, vault: TextVault) -> None:
        self._db = database
        rows = Rows(database, vault=vault)
        self._rows = rows
        self.memories = PostgresMemories(rows)
        self.profiles = PostgresProfiles(rows)
        self.blocks = PostgresBlocks(rows)
        self.subjects = PostgresSubjects(rows)

    async def ready(self) -> bool:
        return await self._db.ready()

    async def purge_expired(self, *, now: datetime) -> PurgeCounts:
        """Delete every memory, fact version and block past its expiry, in bounded batches."""
        memories = await self._purge_table("memories", "memory_id", now)
        fact_versions = await self._purge_table("profile_fact_versions", "version_id", now)
        blocks = await self._purge_table("blocks", "block_number", now)
        return PurgeCounts(memories=memories, fact_versions=fact_versions, blocks=blocks)

    async def _purge_table(self, table: str, key: str, now: datetime) -> int:
        total = 0
        while True:
            async with self._rows.connection() as conn:
                status = await conn.execute(
                    f"DELETE FROM {table} WHERE {key} IN "
                    f"(SELECT {key} FROM {table} WHERE expires_at <= $1 LIMIT {PURGE_BATCH})",
                    now,
                )
            deleted = int(status.split()[-1])
            total += deleted
            if deleted < PURGE_BATCH:
                return total
