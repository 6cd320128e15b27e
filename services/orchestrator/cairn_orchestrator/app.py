"""Wiring: configuration from the environment, the adapters, the tool registry,
the agent specs, and the gRPC servicer, as a cairn_libs.server.ServiceApp.

Readiness is the database alone (reachable and migrated). Gateway, retrieval and
memory are not required to be up: a run without them degrades and says so in its
trajectory (I11), which is better than an orchestrator that refuses to start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn_libs.db import Database
from cairn_libs.identity import DEFAULT_AUDIENCE, DEFAULT_ISSUER, TokenIssuer
from cairn_orchestrator.knowledge_tool import search_knowledge_tool
from cairn_orchestrator.loop import LoopSettings, RunLoop
from cairn_orchestrator.orchestrator import Orchestrator
from cairn_orchestrator.postgres import SCHEMA, PostgresRunStore, migrations
from cairn_orchestrator.remote import GatewayClient, MemoryClient, RetrievalClient
from cairn_orchestrator.servicer import OrchestratorServicer
from cairn_orchestrator.specs import load_agent_specs
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

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OrchestratorConfig:
        env = os.environ if env is None else env
        database_url = env.get("DATABASE_URL", "")
        if not database_url:
            raise RuntimeError("DATABASE_URL is not set: point it at a PostgreSQL with pgvector")
        signing_key = env.get("CAIRN_SERVICE_SIGNING_KEY_FILE", "")
        if not signing_key:
            raise RuntimeError(
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
            stream_poll_seconds=_positive_float(env, "CAIRN_STREAM_POLL_SECONDS", 0.2),
            max_completion_tokens=int(_positive_float(env, "CAIRN_MAX_COMPLETION_TOKENS", 1024)),
        )


def _optional_address(value: str) -> str | None:
    return None if value.strip().lower() == NOT_CONFIGURED else value.strip()


def _positive_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise RuntimeError(f"{name}={raw!r} is not a number") from exc
    if value <= 0:
        raise RuntimeError(f"{name}={raw!r} must be positive")
    return value


class OrchestratorApp:
    name = "orchestrator"

    def __init__(self, config: OrchestratorConfig) -> None:
        self._db = Database(url=config.database_url, schema=SCHEMA, migrations=migrations())
        store = PostgresRunStore(self._db)
        self._gateway = GatewayClient(config.gateway_addr)
        self._retrieval = RetrievalClient(config.retrieval_addr) if config.retrieval_addr else None
        self._memory = MemoryClient(config.memory_addr) if config.memory_addr else None

        registry = ToolRegistry()
        registry.register(search_knowledge_tool(self._retrieval))
        catalog = load_agent_specs(config.agents_dir, known_tools=registry.names())

        issuer = TokenIssuer.from_file(
            config.signing_key_file, issuer=config.jwt_issuer, audience=config.jwt_audience
        )

        def mint_actor_token(run_id: str, agent: str) -> str:
            return issuer.actor_token(service="orchestrator", run_id=run_id, agent=agent)

        loop = RunLoop(
            store=store,
            gateway=self._gateway,
            retrieval=self._retrieval,
            memory=self._memory,
            registry=registry,
            mint_actor_token=mint_actor_token,
            settings=LoopSettings(max_completion_tokens=config.max_completion_tokens),
        )
        self.orchestrator = Orchestrator(
            catalog=catalog, loop=loop, store=store, stream_poll_seconds=config.stream_poll_seconds
        )
        log.info(
            "orchestrator.configured",
            agents=catalog.names(),
            gateway=config.gateway_addr,
            retrieval=config.retrieval_addr or NOT_CONFIGURED,
            memory=config.memory_addr or NOT_CONFIGURED,
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
        """Nothing to wait for: the database connects on the first readiness check."""

    async def ready(self) -> bool:
        return await self._db.ready()

    async def stop(self) -> None:
        await self._gateway.close()
        if self._retrieval is not None:
            await self._retrieval.close()
        if self._memory is not None:
            await self._memory.close()
        await self._db.close()
