"""Wiring: environment -> configuration -> providers, ledger, router -> servicer.

The only module that reads the environment. Provider keys are read here once,
from the variables the configuration names, and handed to the provider that
uses them; the start-up log says which variable each provider reads and whether
it is set, never its value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import structlog

from cairn.gateway.v1 import gateway_pb2_grpc
from cairn_gateway.config import (
    DEFAULT_OFFLINE_URL,
    TIERS,
    GatewayConfig,
    check_base_url,
    offline_default,
    parse_config,
)
from cairn_gateway.domain import UnusableProvider
from cairn_gateway.embeddings import Embeddings
from cairn_gateway.errors import ConfigInvalid, CooldownsUnavailable
from cairn_gateway.openai_compatible import OpenAICompatibleProvider
from cairn_gateway.postgres import PostgresCooldowns, PostgresLedger
from cairn_gateway.provider import ChatProvider, api_key_for
from cairn_gateway.router import Router
from cairn_gateway.servicer import SERVICE_NAME, GatewayServicer
from cairn_libs.db import Database, database_url, load_migrations
from cairn_libs.embedding import embedder_from_env
from cairn_libs.settings import positive_number

log = structlog.get_logger(__name__)
# The one line that says which configuration is running must reach the log at every
# CAIRN_LOG_LEVEL: an operator who raised the level to quiet per-call lines still needs
# to know, after an incident, what the gateway ran with. Logged as a warning it would
# be a false alarm on every start (and still vanish at ERROR), so it goes through a
# logger without the level filter; the line's own level still says "info".
_startup_log = structlog.wrap_logger(
    None, wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET)
)

MIGRATIONS = Path(__file__).parent / "migrations"
SCHEMA = "gateway"
COOLDOWN_SYNC_ENV = "CAIRN_GATEWAY_COOLDOWN_SYNC_SECONDS"
DEFAULT_COOLDOWN_SYNC_SECONDS = 0.5


def load_config(env: Mapping[str, str]) -> GatewayConfig:
    path = env.get("CAIRN_GATEWAY_CONFIG", "").strip()
    if not path:
        # Checked like a provider's base_url: a wrong one would leave the demo SERVING
        # with every call failing.
        offline_url = env.get("CAIRN_OFFLINE_MODEL_URL", "").strip() or DEFAULT_OFFLINE_URL
        return offline_default(check_base_url(offline_url, where="CAIRN_OFFLINE_MODEL_URL"))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigInvalid(
            f"CAIRN_GATEWAY_CONFIG={path!r} cannot be read ({exc.strerror}); point it at a "
            "provider file like services/gateway/providers.example.yaml, or unset it for "
            "the offline demo model"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigInvalid(
            f"CAIRN_GATEWAY_CONFIG={path!r} is not UTF-8 text (byte {exc.start} is not); "
            "save the provider file as UTF-8 YAML"
        ) from exc
    return parse_config(text, source=path)


def gateway_database(url: str) -> Database:
    """The gateway's schema. Nothing the gateway does lives in a session (its advisory
    locks are transaction-scoped, its settings SET LOCAL), so a connection going back
    to the pool costs no round trip of its own (the "transaction" reset)."""
    return Database(
        url=url, schema=SCHEMA, migrations=load_migrations(MIGRATIONS), reset="transaction"
    )


def build_providers(
    config: GatewayConfig, env: Mapping[str, str]
) -> tuple[list[ChatProvider], list[UnusableProvider]]:
    """The usable providers, and those left out with the reason."""
    providers: list[ChatProvider] = []
    unusable: list[UnusableProvider] = []
    for provider_config in config.providers:
        key = api_key_for(provider_config, env)
        if key is None:
            unusable.append(
                UnusableProvider(
                    provider_config,
                    f"its key variable {provider_config.api_key_env} is not set",
                )
            )
            continue
        providers.append(OpenAICompatibleProvider(provider_config, api_key=key))
    return providers, unusable


def config_summary(
    config: GatewayConfig, unusable: Sequence[UnusableProvider], env: Mapping[str, str]
) -> dict[str, object]:
    """What the start-up line says: where the file came from, the providers in
    failover order, which tiers each usable one serves, and which key variables are
    set. Never a key's value: only whether its variable holds one."""
    left_out = {u.config.name: u.reason for u in unusable}
    usable = [p for p in config.providers if p.name not in left_out]
    return {
        "source": config.source,
        "providers": [p.name for p in config.providers],
        "usable": [p.name for p in usable],
        "unusable": left_out,
        "tiers": {
            tier: [p.name for p in usable if p.model_for(tier) is not None] for tier in TIERS
        },
        "keys_set": {
            p.api_key_env: bool(env.get(p.api_key_env, "").strip())
            for p in config.providers
            if p.api_key_env
        },
        "offline_demo": any(p.offline_demo for p in usable),
    }


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
        self._providers, self._unusable = build_providers(config, env)
        self._summary = config_summary(config, self._unusable, env)
        # How soon a cooldown another replica began is seen here.
        self._cooldown_sync_seconds = positive_number(
            COOLDOWN_SYNC_ENV, DEFAULT_COOLDOWN_SYNC_SECONDS, env=env, error=ConfigInvalid
        )
        self._cooldown_sync: asyncio.Task[None] | None = None
        self._router = Router(
            self._providers,
            ledger=PostgresLedger(db),
            shared_cooldowns=PostgresCooldowns(db),
            trace_content=env.get("CAIRN_TRACE_CONTENT", "").strip().lower()
            in ("1", "true", "yes"),
            unusable=self._unusable,
        )
        self._embeddings = Embeddings(
            self._providers,
            local_embedder=embedder_from_env,
            unusable=self._unusable,
            default_model=next(
                (p.embedding_model for p in config.providers if p.embedding_model), ""
            ),
        )

    @classmethod
    def from_env(cls) -> GatewayApp:
        env = dict(os.environ)
        return cls(
            config=load_config(env),
            env=env,
            db=gateway_database(database_url()),
        )

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
            GatewayServicer(self._router, self._embeddings), server
        )
        return [SERVICE_NAME]

    async def start(self) -> None:
        _startup_log.info("gateway.config_loaded", **self._summary)
        left_out = {u.config.name: u.reason for u in self._unusable}
        for provider in self._config.providers:
            reason = left_out.get(provider.name)
            # An unusable provider is a warning: at WARNING level it must still show.
            emit = log.info if reason is None else log.warning
            emit(
                "gateway.provider",
                provider=provider.name,
                preset=provider.preset or None,
                base_url=provider.base_url,
                models=dict(provider.models),
                embedding_model=provider.embedding_model or None,
                key_variable=provider.api_key_env or None,
                usable=reason is None,
                reason=reason,
                offline_demo=provider.offline_demo,
            )
        if not self._providers:
            log.error(
                "gateway.no_usable_provider",
                unusable=left_out,
                consequence="every Chat is FAILED_PRECONDITION and health is NOT_SERVING",
            )
        self._cooldown_sync = asyncio.create_task(self._sync_cooldowns())

    async def _sync_cooldowns(self) -> None:
        """Adopt other replicas' cooldowns, every CAIRN_GATEWAY_COOLDOWN_SYNC_SECONDS;
        one line when the shared ones become unreachable and one when they are back."""
        reachable = True
        while True:
            if await self._db.ready():
                try:
                    await self._router.adopt_shared_cooldowns()
                except CooldownsUnavailable as exc:
                    if reachable:
                        log.warning("provider.cooldowns_unshared", error=str(exc))
                    reachable = False
                else:
                    if not reachable:
                        log.info("provider.cooldowns_shared_again")
                    reachable = True
            await asyncio.sleep(self._cooldown_sync_seconds)

    async def ready(self) -> bool:
        # A provider being down is degradation reported per call (I11), not
        # unreadiness; a gateway that can use no provider at all is not ready: every
        # chat it took would fail, and only a configuration change can fix it.
        if not self._providers:
            return False
        return await self._db.ready()

    async def stop(self) -> None:
        if self._cooldown_sync is not None:
            self._cooldown_sync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._cooldown_sync
        for provider in self._providers:
            await provider.aclose()
        await self._db.close()
