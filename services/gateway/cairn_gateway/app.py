"""Wiring: environment -> configuration -> providers, ledger, router -> servicer.

The only module that reads the environment. Provider keys are read here once,
from the variables the configuration names, and handed to the provider that
uses them; the start-up log says which variable each provider reads and whether
it is set, never its value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import structlog

from cairn.gateway.v1 import gateway_pb2_grpc
from cairn_gateway.config import DEFAULT_OFFLINE_URL, GatewayConfig, offline_default, parse_config
from cairn_gateway.embeddings import Embeddings
from cairn_gateway.errors import ConfigInvalid
from cairn_gateway.postgres import PostgresLedger
from cairn_gateway.provider import ChatProvider, OpenAICompatibleProvider, api_key_for
from cairn_gateway.router import Router
from cairn_gateway.servicer import SERVICE_NAME, GatewayServicer
from cairn_libs.db import Database, database_url, load_migrations
from cairn_libs.embedding import embedder_from_env

log = structlog.get_logger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"
SCHEMA = "gateway"


def load_config(env: Mapping[str, str]) -> GatewayConfig:
    path = env.get("CAIRN_GATEWAY_CONFIG", "").strip()
    if not path:
        return offline_default(env.get("CAIRN_OFFLINE_MODEL_URL", DEFAULT_OFFLINE_URL))
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigInvalid(
            f"CAIRN_GATEWAY_CONFIG={path!r} cannot be read ({exc.strerror}); point it at a "
            "provider file like services/gateway/providers.example.yaml, or unset it for "
            "the offline demo model"
        ) from exc
    return parse_config(text, source=path)


def build_providers(
    config: GatewayConfig, env: Mapping[str, str]
) -> tuple[list[ChatProvider], dict[str, str]]:
    """The usable providers, and those left out with the reason."""
    providers: list[ChatProvider] = []
    disabled: dict[str, str] = {}
    for provider_config in config.providers:
        key = api_key_for(provider_config, env)
        if key is None:
            disabled[provider_config.name] = (
                f"its key variable {provider_config.api_key_env} is not set"
            )
            continue
        providers.append(OpenAICompatibleProvider(provider_config, api_key=key))
    return providers, disabled


class GatewayApp:
    name = "gateway"

    def __init__(
        self,
        *,
        config: GatewayConfig,
        env: Mapping[str, str],
        db: Database,
    ) -> None:
        self._config = config
        self._db = db
        self._providers, self._disabled = build_providers(config, env)
        self._router = Router(
            self._providers,
            ledger=PostgresLedger(db),
            trace_content=env.get("CAIRN_TRACE_CONTENT", "").strip().lower()
            in ("1", "true", "yes"),
            disabled=self._disabled,
        )
        self._embeddings = Embeddings(self._providers, local_embedder=embedder_from_env)

    @classmethod
    def from_env(cls) -> GatewayApp:
        env = dict(os.environ)
        return cls(
            config=load_config(env),
            env=env,
            db=Database(url=database_url(), schema=SCHEMA, migrations=load_migrations(MIGRATIONS)),
        )

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
            GatewayServicer(self._router, self._embeddings), server
        )
        return [SERVICE_NAME]

    async def start(self) -> None:
        log.info("gateway.config", source=self._config.source)
        for provider in self._config.providers:
            log.info(
                "gateway.provider",
                provider=provider.name,
                preset=provider.preset or None,
                base_url=provider.base_url,
                models=dict(provider.models),
                key_variable=provider.api_key_env or None,
                usable=provider.name not in self._disabled,
                reason=self._disabled.get(provider.name),
                offline_demo=provider.offline_demo,
            )
        if not self._providers:
            log.warning("gateway.no_usable_provider", disabled=self._disabled)

    async def ready(self) -> bool:
        # Providers being down is degradation reported per call (I11), not unreadiness.
        return await self._db.ready()

    async def stop(self) -> None:
        for provider in self._providers:
            await provider.aclose()
        await self._db.close()
