"""Cooldowns shared by gateway replicas through PostgreSQL: a provider cooled down
through one replica is skipped by the others, and no replica shortens a cooldown
another began. The SQL is tested with two adapters on separate pools; the whole
path with two real gateway processes on one database."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn_gateway.app import MIGRATIONS, SCHEMA
from cairn_gateway.config import CooldownPolicy, ProviderConfig
from cairn_gateway.domain import CooldownCause
from cairn_gateway.postgres import PostgresCooldowns
from cairn_gateway.resilience import CooldownBoard, Cooling
from cairn_libs.db import Database, load_migrations
from cairn_libs.stack import ServiceProcess, serving, wait_until
from services.gateway.tests.gateway_support import ALPHA_KEY, Vendors, user
from services.gateway.tests.test_gateway_process_calls import outcomes

Metadata = tuple[tuple[str, str], ...]


def _provider(name: str, *, max_seconds: float = 300.0) -> ProviderConfig:
    return ProviderConfig(
        name=name,
        base_url="http://127.0.0.1:9/v1",
        api_key_env="",
        models={"fast": "m"},
        cooldown=CooldownPolicy(after_failures=1, base_seconds=5, max_seconds=max_seconds),
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_replica_adopts_a_cooldown_that_ends_later_and_never_one_that_ends_sooner() -> None:
    clock = _Clock()
    board = CooldownBoard(clock)
    provider = _provider("p")

    assert board.adopt(provider, 60, CooldownCause.RATE_LIMIT)
    assert not board.adopt(provider, 5, CooldownCause.FAILURES)

    cooling = board.cooling("p")
    assert cooling is not None
    assert cooling.seconds_left == pytest.approx(60)
    assert cooling.cause is CooldownCause.RATE_LIMIT


def test_an_adopted_cooldown_is_capped_by_this_providers_own_maximum_and_off_when_it_is_off() -> (
    None
):
    board = CooldownBoard(_Clock())
    assert board.adopt(_provider("short", max_seconds=10), 60, CooldownCause.FAILURES)
    assert not board.adopt(_provider("off", max_seconds=0), 60, CooldownCause.FAILURES)

    short = board.cooling("short")
    assert short is not None and short.seconds_left == pytest.approx(10)
    assert board.cooling("off") is None


@pytest.fixture
async def two_adapters(pg_url: str) -> AsyncIterator[tuple[PostgresCooldowns, PostgresCooldowns]]:
    first = Database(url=pg_url, schema=SCHEMA, migrations=load_migrations(MIGRATIONS))
    second = Database(url=pg_url, schema=SCHEMA, migrations=load_migrations(MIGRATIONS))
    assert await first.ready() and await second.ready()
    yield PostgresCooldowns(first), PostgresCooldowns(second)
    await first.close()
    await second.close()


async def test_a_shorter_cooldown_written_by_another_replica_never_shortens_a_longer_one(
    two_adapters: tuple[PostgresCooldowns, PostgresCooldowns],
) -> None:
    one, other = two_adapters
    provider = _provider(f"p-{uuid.uuid4().hex[:8]}")

    await one.share(provider, Cooling(60, CooldownCause.RATE_LIMIT))
    await other.share(provider, Cooling(1, CooldownCause.FAILURES))
    seen = {c.provider: c for c in await other.running()}

    assert seen[provider.name].seconds_left > 55
    assert seen[provider.name].cause is CooldownCause.RATE_LIMIT
    assert seen[provider.name].base_url == provider.base_url


async def test_a_longer_cooldown_written_later_lengthens_it_with_its_own_cause(
    two_adapters: tuple[PostgresCooldowns, PostgresCooldowns],
) -> None:
    one, other = two_adapters
    provider = _provider(f"p-{uuid.uuid4().hex[:8]}")

    await one.share(provider, Cooling(1, CooldownCause.FAILURES))
    await other.share(provider, Cooling(60, CooldownCause.RATE_LIMIT))
    seen = {c.provider: c for c in await one.running()}

    assert seen[provider.name].seconds_left > 55
    assert seen[provider.name].cause is CooldownCause.RATE_LIMIT


# --- two gateway processes ---------------------------------------------------------

COOLDOWN_SECONDS = 30


@pytest.fixture(scope="module")
def two_gateways(
    vendors: Vendors, service_env: dict[str, str], session_logs: Path
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    settings = (
        "    timeout_seconds: 2\n    max_retries: 0\n    cooldown_after_failures: 1\n"
        f"    cooldown_seconds: {COOLDOWN_SECONDS}\n    cooldown_max_seconds: 60\n"
    )
    config = session_logs / "shared-cooldowns.yaml"
    config.write_text(
        "providers:\n"
        f"  - name: shared-a\n    base_url: {vendors.alpha.url}/v1\n"
        f"    api_key_env: CAIRN_TEST_ALPHA_KEY\n{settings}    models: {{fast: m-shared}}\n"
        f"  - name: shared-b\n    base_url: {vendors.beta.url}/v1\n{settings}"
        "    models: {fast: m-shared}\n"
    )
    env = {
        **service_env,
        "CAIRN_GATEWAY_CONFIG": str(config),
        "CAIRN_TEST_ALPHA_KEY": ALPHA_KEY,
        "CAIRN_GATEWAY_COOLDOWN_SYNC_SECONDS": "0.1",
    }
    with ExitStack() as stack:
        first = stack.enter_context(
            serving("gateway", env=env, log_dir=session_logs, suffix="-shared-1")
        )
        second = stack.enter_context(
            serving("gateway", env=env, log_dir=session_logs, suffix="-shared-2")
        )
        yield first, second


def test_a_provider_failing_through_one_gateway_replica_is_skipped_by_the_other(
    two_gateways: tuple[ServiceProcess, ServiceProcess], vendors: Vendors, metadata: Metadata
) -> None:
    first, second = two_gateways
    vendors.alpha.script({"action": "status", "status": 502})
    request = gateway_pb2.ChatRequest(messages=[user("Which offices close?")], model="m-shared")

    with grpc.insecure_channel(first.address) as ch:
        failed_over = gateway_pb2_grpc.GatewayServiceStub(ch).Chat(
            request, metadata=metadata, timeout=10
        )
    with grpc.insecure_channel(second.address) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)

        def skipped_on_the_other() -> gateway_pb2.ChatResponse | None:
            response = stub.Chat(request, metadata=metadata, timeout=10)
            return (
                response if outcomes(response)[0][1] == "ATTEMPT_OUTCOME_SKIPPED_COOLDOWN" else None
            )

        # The other replica learns within its sync interval; until then a call may
        # still reach alpha, which now answers (nothing more is scripted).
        started = time.monotonic()
        skipped = wait_until(skipped_on_the_other, timeout=10, interval=0.05)

    assert outcomes(failed_over) == [
        ("shared-a", "ATTEMPT_OUTCOME_SERVER_ERROR", 502),
        ("shared-b", "ATTEMPT_OUTCOME_OK", 200),
    ]
    assert outcomes(skipped) == [
        ("shared-a", "ATTEMPT_OUTCOME_SKIPPED_COOLDOWN", 0),
        ("shared-b", "ATTEMPT_OUTCOME_OK", 200),
    ]
    # The cooldown the other replica skips for is the first one's, not one of its own.
    left = re.search(
        r"cooling down for ([0-9.]+)s more: it failed repeatedly", skipped.attempts[0].detail
    )
    assert left is not None, skipped.attempts[0].detail
    assert COOLDOWN_SECONDS - 10 < float(left.group(1)) <= COOLDOWN_SECONDS
    assert time.monotonic() - started < 10
    assert len(vendors.alpha.requests()) >= 1
