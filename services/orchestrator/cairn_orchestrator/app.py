"""Wiring: configuration from the environment, the adapters, the tool registry,
the agent specs, and the gRPC servicer, as a cairn_libs.server.ServiceApp.

Readiness is the database alone (reachable and migrated). Gateway, retrieval and
memory are not required to be up: a run without them degrades and says so in its
trajectory (I11), which is better than an orchestrator that refuses to start.
The same holds for tool sources: each is listed at start-up (bounded by
CAIRN_TOOL_LIST_TIMEOUT_SECONDS) and, if it does not answer, again every
CAIRN_TOOL_LIST_RETRY_SECONDS; until then its tools are not offered, and the
log says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
import structlog

from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn_libs.clock import SystemClock
from cairn_libs.db import Database
from cairn_libs.errors import ConfigurationError
from cairn_libs.identity import DEFAULT_AUDIENCE, DEFAULT_ISSUER, TokenIssuer
from cairn_libs.settings import positive_number
from cairn_orchestrator.confirmations import DEFAULT_CONFIRMATION_TTL_SECONDS
from cairn_orchestrator.conversation import ConversationArchiver
from cairn_orchestrator.grpc_tool_source import GrpcToolSource
from cairn_orchestrator.knowledge_tool import search_knowledge_tool
from cairn_orchestrator.loop import LoopSettings, RunLoop
from cairn_orchestrator.mcp_tool_source import McpToolSource
from cairn_orchestrator.memory_tools import memory_tools
from cairn_orchestrator.note_tool import append_note_tool
from cairn_orchestrator.orchestrator import Orchestrator
from cairn_orchestrator.pg.base import DEFAULT_LEASE_SECONDS
from cairn_orchestrator.postgres import SCHEMA, PostgresRunStore, migrations
from cairn_orchestrator.remote import GatewayClient, MemoryClient, RetrievalClient
from cairn_orchestrator.servicer import OrchestratorServicer
from cairn_orchestrator.specs import load_agent_specs
from cairn_orchestrator.tool_sources import (
    TOOL_AUDIENCE,
    DeclaredSource,
    ToolSource,
    ToolSources,
)
from cairn_orchestrator.tools import ToolRegistry

log = structlog.get_logger(__name__)

DEFAULT_PORT = 50054
REPO_ROOT = Path(__file__).resolve().parents[3]
SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name
NOT_CONFIGURED = "none"


@dataclass(frozen=True, slots=True)
class OrchestratorConfig:
    database_url: str
    agents_dir: Path
    gateway_addr: str
    retrieval_addr: str | None
    memory_addr: str | None
    signing_key_file: Path
    jwt_issuer: str = DEFAULT_ISSUER
    jwt_audience: str = DEFAULT_AUDIENCE
    stream_poll_seconds: float = 0.2
    max_completion_tokens: int = 1024
    # What a `remember` card promises; set it to the memory service's own value.
    memory_ttl_days: float = 90.0
    confirmation_ttl_seconds: float = DEFAULT_CONFIRMATION_TTL_SECONDS
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    # Tests only: register the counted `append_note` write tool (note_tool.py).
    test_write_tool: bool = False
    tool_list_timeout_seconds: float = 5.0
    tool_list_retry_seconds: float = 5.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OrchestratorConfig:
        env = os.environ if env is None else env
        database_url = env.get("DATABASE_URL", "")
        if not database_url:
            raise ConfigurationError(
                "DATABASE_URL is not set: point it at a PostgreSQL with pgvector"
            )
        signing_key = env.get("CAIRN_SERVICE_SIGNING_KEY_FILE", "")
        if not signing_key:
            raise ConfigurationError(
                "CAIRN_SERVICE_SIGNING_KEY_FILE is not set: the orchestrator signs a per-run actor "
                "token with it so memory can record which run wrote what"
            )
        return cls(
            database_url=database_url,
            agents_dir=Path(env.get("CAIRN_AGENTS_DIR") or REPO_ROOT / "agents"),
            gateway_addr=env.get("CAIRN_GATEWAY_ADDR") or "127.0.0.1:50051",
            retrieval_addr=_optional_address(env.get("CAIRN_RETRIEVAL_ADDR") or "127.0.0.1:50052"),
            memory_addr=_optional_address(env.get("CAIRN_MEMORY_ADDR") or "127.0.0.1:50053"),
            signing_key_file=Path(signing_key),
            jwt_issuer=env.get("CAIRN_JWT_ISSUER", DEFAULT_ISSUER),
            jwt_audience=env.get("CAIRN_JWT_AUDIENCE", DEFAULT_AUDIENCE),
            stream_poll_seconds=positive_number("CAIRN_STREAM_POLL_SECONDS", 0.2, env=env),
            max_completion_tokens=int(
                positive_number("CAIRN_MAX_COMPLETION_TOKENS", 1024, env=env)
            ),
            memory_ttl_days=positive_number("CAIRN_MEMORY_TTL_DAYS", 90.0, env=env),
            confirmation_ttl_seconds=positive_number(
                "CAIRN_CONFIRMATION_TTL_SECONDS", DEFAULT_CONFIRMATION_TTL_SECONDS, env=env
            ),
            lease_seconds=positive_number(
                "CAIRN_RUN_LEASE_SECONDS", DEFAULT_LEASE_SECONDS, env=env
            ),
            test_write_tool=env.get("CAIRN_TEST_WRITE_TOOL", "").strip() == "1",
            tool_list_timeout_seconds=positive_number(
                "CAIRN_TOOL_LIST_TIMEOUT_SECONDS", 5.0, env=env
            ),
            tool_list_retry_seconds=positive_number("CAIRN_TOOL_LIST_RETRY_SECONDS", 5.0, env=env),
        )


def _optional_address(value: str) -> str | None:
    return None if value.strip().lower() == NOT_CONFIGURED else value.strip()


class OrchestratorApp:
    name = "orchestrator"

    def __init__(self, config: OrchestratorConfig) -> None:
        # The store keeps nothing in a session (row locks and transaction-scoped
        # advisory locks only), so a release sends nothing: one round trip a statement.
        self._db = Database(
            url=config.database_url, schema=SCHEMA, migrations=migrations(), reset="transaction"
        )
        store = PostgresRunStore(self._db, lease_seconds=config.lease_seconds)
        # Upkeep (leases, recovery, expiry) runs a few times per lease.
        self._upkeep_seconds = max(config.lease_seconds / 3, 0.2)
        self._upkeep: asyncio.Task[None] | None = None
        self._gateway = GatewayClient(config.gateway_addr)
        self._retrieval = RetrievalClient(config.retrieval_addr) if config.retrieval_addr else None
        self._memory = MemoryClient(config.memory_addr) if config.memory_addr else None

        clock = SystemClock()
        registry = ToolRegistry()
        registry.register(search_knowledge_tool(self._retrieval))
        for tool in memory_tools(
            self._memory, clock=clock, ttl=timedelta(days=config.memory_ttl_days)
        ):
            registry.register(tool)
        if config.test_write_tool:
            registry.register(append_note_tool(self._db))
        catalog = load_agent_specs(config.agents_dir, known_tools=registry.names())

        try:
            issuer = TokenIssuer.from_file(
                config.signing_key_file, issuer=config.jwt_issuer, audience=config.jwt_audience
            )
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigurationError(
                f"CAIRN_SERVICE_SIGNING_KEY_FILE={str(config.signing_key_file)!r} is not a "
                f"readable PEM private key ({type(exc).__name__}); point it at the key whose "
                "public half the other services trust"
            ) from exc

        def mint_actor_token(run_id: str, agent: str) -> str:
            return issuer.actor_token(service="orchestrator", run_id=run_id, agent=agent)

        # What a tool source gets beside the caller's token: cairn's per-run actor
        # token for an audience no cairn service accepts (TOOL_AUDIENCE).
        tool_issuer = TokenIssuer(
            private_key=issuer.private_key, issuer=issuer.issuer, audience=TOOL_AUDIENCE
        )

        def mint_tool_token(run_id: str, agent: str) -> str:
            return tool_issuer.actor_token(
                service="orchestrator", run_id=run_id or "tools/list", agent=agent
            )

        def connect(declared: DeclaredSource) -> ToolSource:
            if declared.transport == "grpc":
                return GrpcToolSource(declared.name, declared.address, mint_token=mint_tool_token)
            return McpToolSource(declared.name, declared.address, mint_token=mint_tool_token)

        self._tool_sources = ToolSources(
            catalog.tool_sources,
            connect=connect,
            registry=registry,
            list_deadline_seconds=config.tool_list_timeout_seconds,
            retry_seconds=config.tool_list_retry_seconds,
        )

        loop = RunLoop(
            store=store,
            gateway=self._gateway,
            retrieval=self._retrieval,
            memory=self._memory,
            registry=registry,
            mint_actor_token=mint_actor_token,
            settings=LoopSettings(
                max_completion_tokens=config.max_completion_tokens,
                confirmation_ttl_seconds=config.confirmation_ttl_seconds,
            ),
            conversation=ConversationArchiver(self._memory),
            confirmations=store,
        )
        self._loop = loop
        self.orchestrator = Orchestrator(
            catalog=catalog,
            loop=loop,
            store=store,
            confirmations=store,
            copies=store,
            stream_poll_seconds=config.stream_poll_seconds,
            confirmation_ttl_seconds=config.confirmation_ttl_seconds,
        )
        log.info(
            "orchestrator.configured",
            agents=catalog.names(),
            gateway=config.gateway_addr,
            retrieval=config.retrieval_addr or NOT_CONFIGURED,
            memory=config.memory_addr or NOT_CONFIGURED,
            lease_owner=store.owner,
            test_write_tool=config.test_write_tool,
            tool_sources={s.name: f"{s.transport} {s.address}" for s in catalog.tool_sources},
        )

    @classmethod
    def from_env(cls) -> OrchestratorApp:
        return cls(OrchestratorConfig.from_env())

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(
            OrchestratorServicer(self.orchestrator), server
        )
        return [SERVICE_NAME]

    async def start(self) -> None:
        """Nothing to wait for: the database connects on the first readiness check.
        The upkeep starts at once and recovers runs an earlier process left behind
        as soon as the database answers. Tool sources are listed first (bounded), so
        an orchestrator that reports SERVING offers the tools of every source that
        answered."""
        await self._tool_sources.start()
        self._upkeep = asyncio.create_task(self._keep_up())

    async def _keep_up(self) -> None:
        while True:
            if await self._db.ready():
                break
            await asyncio.sleep(self._upkeep_seconds)
        while True:
            try:
                await self.orchestrator.keep_up()
            except Exception:
                log.exception("orchestrator.upkeep_failed")
            await asyncio.sleep(self._upkeep_seconds)

    async def ready(self) -> bool:
        return await self._db.ready()

    async def stop(self) -> None:
        if self._upkeep is not None:
            self._upkeep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._upkeep
        await self._loop.stop()
        await self._tool_sources.close()
        await self._gateway.close()
        if self._retrieval is not None:
            await self._retrieval.close()
        if self._memory is not None:
            await self._memory.close()
        await self._db.close()
