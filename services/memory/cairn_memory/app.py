"""The memory service's wiring: configuration from the environment, the keeper over
PostgreSQL, the servicer, and the periodic job that purges expired memories.

Environment (read here and nowhere else):
    DATABASE_URL                          PostgreSQL with pgvector (required)
    CAIRN_EMBEDDER                        local (default) | none
    CAIRN_MEMORY_TTL_DAYS                 days until a memory or fact expires (90)
    CAIRN_MEMORY_BLOCK_TTL_DAYS           days until an archived block expires (the memory TTL)
    CAIRN_MEMORY_PURGE_INTERVAL_SECONDS   seconds between purges of expired rows (3600)
    CAIRN_MEMORY_ENCRYPTION_KEY           base64 of 32 bytes: seal text at rest (unset: plain)
    CAIRN_ORCHESTRATOR_ADDR               the orchestrator, whose copies Forget erases too
                                          (unset or `none`: no orchestrator holds copies)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Final

import asyncpg
import grpc
import structlog

from cairn.memory.v1 import memory_pb2_grpc
from cairn_libs.clock import Clock, SystemClock
from cairn_libs.db import Database, database_url
from cairn_libs.embed_cache import cached
from cairn_libs.embedding import Embedder, embedder_from_env
from cairn_libs.errors import CairnError
from cairn_libs.settings import positive_number
from cairn_memory.copies import OrchestratorCopies
from cairn_memory.keeper import MemoryKeeper
from cairn_memory.ports import CopyHolders, NoOtherHolders
from cairn_memory.postgres import PostgresStore, memory_database
from cairn_memory.servicer import SERVICE_NAME, MemoryServicer
from cairn_memory.vault import TextVault, vault_from_key

log = structlog.get_logger(__name__)

DEFAULT_PORT: Final = 50053
DEFAULT_TTL_DAYS: Final = 90.0
DEFAULT_PURGE_INTERVAL_SECONDS: Final = 3600.0
# While the database is not yet usable, the purge retries sooner than its interval.
NOT_READY_RETRY_SECONDS: Final = 5.0


class MemoryApp:
    name = "memory"

    def __init__(
        self,
        *,
        database: Database,
        embedder: Embedder | None,
        vault: TextVault,
        clock: Clock,
        ttl: timedelta,
        block_ttl: timedelta | None = None,
        purge_interval_seconds: float,
        copy_holders: CopyHolders | None = None,
    ) -> None:
        if purge_interval_seconds <= 0:
            raise ValueError(f"purge interval must be positive, got {purge_interval_seconds!r}")
        self._database = database
        self.store = PostgresStore(database, vault=vault)
        self.keeper = MemoryKeeper(
            store=self.store,
            embedder=embedder,
            clock=clock,
            ttl=ttl,
            block_ttl=block_ttl,
            copy_holders=copy_holders,
        )
        self._purge_interval = purge_interval_seconds
        self._purge_task: asyncio.Task[None] | None = None
        # Set after every completed round of upkeep, so a caller can wait for one.
        self.maintained = asyncio.Event()

    @classmethod
    def from_env(cls) -> MemoryApp:
        ttl_days = positive_number("CAIRN_MEMORY_TTL_DAYS", DEFAULT_TTL_DAYS)
        block_ttl_days = positive_number("CAIRN_MEMORY_BLOCK_TTL_DAYS", ttl_days)
        return cls(
            database=memory_database(database_url()),
            embedder=cached(embedder_from_env()),
            vault=vault_from_key(os.environ.get("CAIRN_MEMORY_ENCRYPTION_KEY")),
            clock=SystemClock(),
            ttl=timedelta(days=ttl_days),
            block_ttl=timedelta(days=block_ttl_days),
            purge_interval_seconds=positive_number(
                "CAIRN_MEMORY_PURGE_INTERVAL_SECONDS", DEFAULT_PURGE_INTERVAL_SECONDS
            ),
            copy_holders=_copy_holders_from_env(),
        )

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        memory_pb2_grpc.add_MemoryServiceServicer_to_server(MemoryServicer(self.keeper), server)
        return [SERVICE_NAME]

    async def start(self) -> None:
        self._purge_task = asyncio.create_task(self._maintain_forever(), name="memory-purge")

    async def ready(self) -> bool:
        return await self._database.ready()

    @property
    def maintaining(self) -> bool:
        return self._purge_task is not None and not self._purge_task.done()

    async def stop(self) -> None:
        if self._purge_task is not None:
            self._purge_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._purge_task
            self._purge_task = None
        await self.keeper.close()
        await self._database.close()

    async def maintain_once(self) -> None:
        """One round of upkeep: purge what expired, embed what was kept without an embedder."""
        await self.keeper.purge_expired()
        while await self.keeper.backfill_embeddings():
            pass

    async def _maintain_forever(self) -> None:
        while True:
            delay = self._purge_interval
            try:
                if await self._database.ready():
                    await self.maintain_once()
                    self.maintained.set()
                else:
                    delay = min(delay, NOT_READY_RETRY_SECONDS)
            except (CairnError, asyncpg.PostgresError, OSError) as exc:
                log.warning("memory.maintenance_failed", error=type(exc).__name__)
                delay = min(delay, NOT_READY_RETRY_SECONDS)
            await asyncio.sleep(delay)


def _copy_holders_from_env() -> CopyHolders:
    address = os.environ.get("CAIRN_ORCHESTRATOR_ADDR", "").strip()
    if not address or address.lower() == "none":
        log.info("memory.copy_holders", orchestrator="none")
        return NoOtherHolders()
    log.info("memory.copy_holders", orchestrator=address)
    return OrchestratorCopies(address)
