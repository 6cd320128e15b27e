"""Each service's PostgreSQL: an asyncpg pool on the service's own schema, and its
migrations applied in order, once, under an advisory lock.

Each applied migration's SHA-256 is kept beside its version. A migration file that
was edited after it ran is refused (`MigrationEdited`, a configuration error: the
service says which file and exits), never skipped: the schema it describes is not
the schema the database holds. Rows applied before checksums were kept get the
file's checksum on first sight.

The pool is created lazily and never blocks start-up: a service whose database
is down still starts, reports NOT_SERVING, and becomes SERVING when the database
answers and its migrations are applied.

What a connection's release costs is the pool's `reset`. asyncpg's own ("session")
sends `pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL` on every
release: a second round trip for every statement a store runs. A service whose
code keeps nothing in the session (transaction-scoped locks and SET LOCAL only, no
LISTEN, cursors or session advisory locks) asks for "transaction": a transaction
left open is still rolled back, and nothing else is sent. A service that takes a
session advisory lock keeps "session", which releases it even when the release
follows a cancelled unlock.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import asyncpg
import structlog

from cairn_libs.errors import ConfigurationError, DependencyUnavailable

log = structlog.get_logger("cairn.db")

# Every way a database that is down, restarting or unreachable shows itself through
# asyncpg. Each service's adapter translates these into its own "unavailable" error
# (UNAVAILABLE to callers, a true reason in a run). InternalClientError is listed
# because a server restart mid-protocol surfaces as one ("got result for unknown
# protocol state"), and it derives from neither PostgresError nor InterfaceError.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
)


# "session": asyncpg's full reset on every release (advisory locks, cursors, LISTEN,
# settings); "transaction": only a transaction left open is rolled back.
PoolReset = Literal["session", "transaction"]


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The "transaction" reset. asyncpg has already rolled back any transaction the
    connection was left in before it calls this; there is nothing more to undo."""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


class MigrationEdited(ConfigurationError):
    """An applied migration's file no longer matches what ran."""


def database_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if not url:
        raise ConfigurationError(
            "DATABASE_URL is not set: point it at a PostgreSQL with pgvector "
            "(`make run` starts an embedded one and sets it)"
        )
    return url


def vector_literal(values: Sequence[float]) -> str:
    """pgvector's text form (9 significant digits: float32 round-trips exactly); sent as text and cast with ::vector in SQL."""
    return "[" + ",".join(f"{v:.9g}" for v in values) + "]"


class Database:
    def __init__(
        self,
        *,
        url: str,
        schema: str,
        migrations: Sequence[Migration],
        max_size: int = 10,
        reset: PoolReset = "session",
    ) -> None:
        self._url = url
        self.reset: PoolReset = reset
        self.schema = schema
        self._migrations = sorted(migrations, key=lambda m: m.version)
        self._max_size = max_size
        self._pool: asyncpg.Pool | None = None
        self._migrated = False
        self._lock = asyncio.Lock()

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None or not self._migrated:
            raise DependencyUnavailable("the database is not reachable yet")
        return self._pool

    async def _ensure(self) -> asyncpg.Pool:
        async with self._lock:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    self._url,
                    min_size=0,
                    max_size=self._max_size,
                    server_settings={"search_path": f"{self.schema},public"},
                    timeout=5,
                    reset=None if self.reset == "session" else _keep_session,
                )
            if not self._migrated:
                await self._migrate(self._pool)
                self._migrated = True
            return self._pool

    async def _migrate(self, pool: asyncpg.Pool) -> None:
        lock_key = int.from_bytes(
            hashlib.sha256(self.schema.encode()).digest()[:8], "big", signed=True
        )
        async with pool.acquire() as conn:
            await conn.execute("SELECT pg_advisory_lock($1)", lock_key)
            try:
                await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
                await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
                await conn.execute(
                    f'CREATE TABLE IF NOT EXISTS "{self.schema}".schema_migrations ('
                    "version int PRIMARY KEY, name text NOT NULL, "
                    "applied_at timestamptz NOT NULL DEFAULT now())"
                )
                await conn.execute(
                    f'ALTER TABLE "{self.schema}".schema_migrations '
                    "ADD COLUMN IF NOT EXISTS checksum text"
                )
                applied = {
                    r["version"]: r["checksum"]
                    for r in await conn.fetch(
                        f'SELECT version, checksum FROM "{self.schema}".schema_migrations'
                    )
                }
                await self._check_applied(conn, applied)
                for migration in self._migrations:
                    if migration.version in applied:
                        continue
                    async with conn.transaction():
                        await conn.execute(migration.sql)
                        await conn.execute(
                            f'INSERT INTO "{self.schema}".schema_migrations '
                            "(version, name, checksum) VALUES ($1, $2, $3)",
                            migration.version,
                            migration.name,
                            migration.checksum,
                        )
                    log.info(
                        "db.migrated",
                        schema=self.schema,
                        version=migration.version,
                        name=migration.name,
                    )
            finally:
                try:
                    await conn.execute("SELECT pg_advisory_unlock($1)", lock_key)
                except BaseException:
                    # A session that cannot say it let go must not go back to the pool
                    # holding the lock (a "transaction" reset would keep it): closed,
                    # it releases it.
                    conn.terminate()
                    raise

    async def _check_applied(
        self, conn: asyncpg.Connection, applied: dict[int, str | None]
    ) -> None:
        for migration in self._migrations:
            if migration.version not in applied:
                continue
            recorded = applied[migration.version]
            if recorded is None:
                await conn.execute(
                    f'UPDATE "{self.schema}".schema_migrations SET checksum = $2 '
                    "WHERE version = $1 AND checksum IS NULL",
                    migration.version,
                    migration.checksum,
                )
            elif recorded != migration.checksum:
                raise MigrationEdited(
                    f"migration {migration.version:04d}_{migration.name}.sql of schema "
                    f"{self.schema!r} was edited after it was applied (checksum "
                    f"{migration.checksum[:12]} now, {recorded[:12]} when it ran): restore "
                    "the file as it ran and put the change in a new migration"
                )

    async def ready(self) -> bool:
        """Connect and migrate if not yet done, then prove the database answers.
        An edited migration is not a database that is down: MigrationEdited is raised."""
        try:
            pool = await self._ensure()
            async with pool.acquire(timeout=2) as conn:
                await conn.fetchval("SELECT 1", timeout=2)
            return True
        except (*CONNECTION_ERRORS, asyncpg.PostgresError) as exc:
            log.warning("db.unreachable", schema=self.schema, error=type(exc).__name__)
            return False

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


def load_migrations(folder: str | os.PathLike[str]) -> list[Migration]:
    """Migrations are files named `<version>_<name>.sql` in the service's folder."""
    from pathlib import Path

    found = []
    for path in sorted(Path(folder).glob("*.sql")):
        version, _, name = path.stem.partition("_")
        found.append(Migration(version=int(version), name=name, sql=path.read_text()))
    return found
