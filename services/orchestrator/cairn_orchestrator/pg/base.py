"""What every orchestrator store shares: the pool, this process's lease owner and
lease length, the connection that turns asyncpg's errors into the store's own,
and the fence a driver's write takes on its run."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from cairn_libs.db import CONNECTION_ERRORS, Database
from cairn_libs.errors import DependencyUnavailable
from cairn_orchestrator.errors import (
    RunCancelled,
    RunTakenOver,
    StoreRefusedValue,
    StoreUnavailable,
)
from cairn_orchestrator.pg.tx import lost_in

DEFAULT_LEASE_SECONDS = 30.0


def new_instance_id() -> str:
    """Who holds a lease: unique per process start, readable in the database."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class PgStore:
    def __init__(
        self,
        database: Database,
        *,
        owner: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        self._db = database
        self.owner = owner or new_instance_id()
        self.lease_seconds = lease_seconds

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        try:
            async with self._db.pool.acquire(timeout=5) as conn:
                yield conn
        except StoreUnavailable:
            # The store's own answer from inside a transaction (RunTakenOver from a
            # fence) is already what it means: not an outage to wrap again.
            raise
        except asyncpg.DataError as exc:
            # A value PostgreSQL will not take (text it cannot encode, a number out of
            # range) is not an outage: retrying the same request cannot help.
            raise StoreRefusedValue(
                f"the run store refused a value ({type(exc).__name__}); nothing was changed"
            ) from exc
        except (*CONNECTION_ERRORS, asyncpg.PostgresError, DependencyUnavailable) as exc:
            raise StoreUnavailable(f"the run store is unavailable ({type(exc).__name__})") from exc

    async def _lost(self, org_id: str, run_id: str) -> RunTakenOver | RunCancelled:
        async with self._connection() as conn:
            return await lost_in(conn, org_id, run_id)

    async def _fence(self, conn: asyncpg.Connection, org_id: str, run_id: str) -> None:
        held = await conn.fetchval(
            "SELECT run_id FROM runs WHERE org_id = $1 AND run_id = $2 AND state = 'RUNNING' "
            "AND lease_owner = $3 FOR UPDATE",
            org_id,
            run_id,
            self.owner,
        )
        if held is None:
            raise await lost_in(conn, org_id, run_id)
