"""Retries and cooldowns in a real gateway process, against fake vendors over HTTP.

Cooldowns live in the gateway process for its whole life, so each test uses its
own pair of providers (its own names, pointing at the alpha and beta fakes) and
asks for the model only that pair serves: no test inherits another's cooldown.
Every provider here retries twice with a short backoff, and cools down for 30 s
after two failures in a row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn_libs.stack import ServiceProcess, serving
from services.gateway.tests.gateway_support import ALPHA_KEY, FakeVendor, Vendors, user
from services.gateway.tests.test_gateway_process_calls import (
    outcomes,
    retry_delay_seconds,
    rpc_error,
    tool_history,
)

Metadata = tuple[tuple[str, str], ...]
pb = gateway_pb2

PAIRS = ("retry", "toolwait", "limited", "failing", "longest", "deadline")
BACKOFF_SECONDS = 0.05
COOLDOWN_SECONDS = 30


@pytest.fixture(scope="module")
def retry_gateway(
    vendors: Vendors, service_env: dict[str, str], session_logs: Path
) -> Iterator[ServiceProcess]:
    settings = (
        f"    timeout_seconds: 2\n    max_retries: 2\n    retry_backoff_seconds: {BACKOFF_SECONDS}\n"
        "    retry_max_wait_seconds: 2\n    cooldown_after_failures: 2\n"
        f"    cooldown_seconds: {COOLDOWN_SECONDS}\n    cooldown_max_seconds: 60\n"
    )
    lines = ["providers:"]
    for pair in PAIRS:
        lines.append(
            f"  - name: {pair}-a\n    base_url: {vendors.alpha.url}/v1\n"
            f"    api_key_env: CAIRN_TEST_ALPHA_KEY\n{settings}    models: {{fast: m-{pair}}}"
        )
        lines.append(
            f"  - name: {pair}-b\n    base_url: {vendors.beta.url}/v1\n{settings}"
            f"    models: {{fast: m-{pair}}}"
        )
    config = session_logs / "retries.yaml"
    config.write_text("\n".join(lines) + "\n")
    env = {**service_env, "CAIRN_GATEWAY_CONFIG": str(config), "CAIRN_TEST_ALPHA_KEY": ALPHA_KEY}
    with serving("gateway", env=env, log_dir=session_logs, suffix="-retries") as proc:
        yield proc


@pytest.fixture(scope="module")
def retry_stub(retry_gateway: ServiceProcess) -> Iterator[gateway_pb2_grpc.GatewayServiceStub]:
    with grpc.insecure_channel(retry_gateway.address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def ask(pair: str, *, tools: bool = False) -> gateway_pb2.ChatRequest:
    messages = tool_history() if tools else [user("Which offices close in August?")]
    return pb.ChatRequest(messages=messages, model=f"m-{pair}")


def arrival_gaps(vendor: FakeVendor) -> list[float]:
    times = [r["received_at"] for r in vendor.requests()]
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


def test_a_transient_server_error_is_retried_on_the_same_provider_after_a_backoff(
    retry_stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script(
        {"action": "status", "status": 500}, {"action": "answer", "content": "Ok."}
    )

    response = retry_stub.Chat(ask("retry"), metadata=metadata, timeout=10)

    assert (response.provider, response.message.content) == ("retry-a", "Ok.")
    assert outcomes(response) == [
        ("retry-a", "ATTEMPT_OUTCOME_SERVER_ERROR", 500),
        ("retry-a", "ATTEMPT_OUTCOME_OK", 200),
    ]
    (gap,) = arrival_gaps(vendors.alpha)
    assert gap >= BACKOFF_SECONDS / 2
    assert vendors.beta.requests() == []


def test_tool_calls_in_the_history_wait_out_a_short_retry_after_on_their_own_provider(
    retry_stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script(
        {"action": "status", "status": 429, "retry_after_ms": 300},
        {"action": "answer", "content": "Page 4."},
    )

    response = retry_stub.Chat(ask("toolwait", tools=True), metadata=metadata, timeout=10)

    assert (response.provider, response.message.content) == ("toolwait-a", "Page 4.")
    assert outcomes(response) == [
        ("toolwait-a", "ATTEMPT_OUTCOME_RATE_LIMITED", 429),
        ("toolwait-a", "ATTEMPT_OUTCOME_OK", 200),
    ]
    (gap,) = arrival_gaps(vendors.alpha)
    assert gap >= 0.3
    assert vendors.beta.requests() == []


def test_a_rate_limit_fails_over_at_once_and_the_provider_is_skipped_until_its_retry_after(
    retry_stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script({"action": "status", "status": 429, "retry_after": 2})

    started = time.monotonic()
    first = retry_stub.Chat(ask("limited"), metadata=metadata, timeout=10)
    waited = time.monotonic() - started
    second = retry_stub.Chat(ask("limited"), metadata=metadata, timeout=10)

    assert outcomes(first) == [
        ("limited-a", "ATTEMPT_OUTCOME_RATE_LIMITED", 429),
        ("limited-b", "ATTEMPT_OUTCOME_OK", 200),
    ]
    assert waited < 2
    assert outcomes(second) == [
        ("limited-a", "ATTEMPT_OUTCOME_SKIPPED_COOLDOWN", 0),
        ("limited-b", "ATTEMPT_OUTCOME_OK", 200),
    ]
    assert "Retry-After" in second.attempts[0].detail
    assert len(vendors.alpha.requests()) == 1


def test_a_provider_that_keeps_failing_cools_down_and_is_skipped_without_a_request(
    retry_stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script(*[{"action": "status", "status": 502}] * 5)

    first = retry_stub.Chat(ask("failing"), metadata=metadata, timeout=10)
    second = retry_stub.Chat(ask("failing"), metadata=metadata, timeout=10)
    pinned = rpc_error(
        lambda: retry_stub.Chat(
            pb.ChatRequest(messages=tool_history(), model="m-failing", pinned_provider="failing-a"),
            metadata=metadata,
            timeout=10,
        )
    )

    # Two failures in a row start the cooldown, so the second retry is a skip.
    assert outcomes(first) == [
        ("failing-a", "ATTEMPT_OUTCOME_SERVER_ERROR", 502),
        ("failing-a", "ATTEMPT_OUTCOME_SERVER_ERROR", 502),
        ("failing-a", "ATTEMPT_OUTCOME_SKIPPED_COOLDOWN", 0),
        ("failing-b", "ATTEMPT_OUTCOME_OK", 200),
    ]
    assert outcomes(second) == [
        ("failing-a", "ATTEMPT_OUTCOME_SKIPPED_COOLDOWN", 0),
        ("failing-b", "ATTEMPT_OUTCOME_OK", 200),
    ]
    assert "failed repeatedly" in second.attempts[0].detail
    assert len(vendors.alpha.requests()) == 2
    # A conversation that may only go to the cooling provider is told when to come back.
    assert pinned.code() == grpc.StatusCode.UNAVAILABLE
    delay = retry_delay_seconds(pinned)
    assert delay is not None and 20 < delay <= COOLDOWN_SECONDS


def test_a_short_retry_after_arriving_after_a_long_one_keeps_the_long_cooldown(
    retry_stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    # The first call's 429 (Retry-After 0.2 s) comes back after the second call's
    # (Retry-After 60 s) because the vendor holds it for 0.4 s.
    vendors.alpha.script(
        {"action": "status", "status": 429, "retry_after_ms": 200, "after_seconds": 0.4},
        {"action": "status", "status": 429, "retry_after": 60},
    )
    slow: list[gateway_pb2.ChatResponse] = []
    first = threading.Thread(
        target=lambda: slow.append(retry_stub.Chat(ask("longest"), metadata=metadata, timeout=10))
    )
    first.start()
    _wait_until(lambda: len(vendors.alpha.requests()) == 1)
    fast = retry_stub.Chat(ask("longest"), metadata=metadata, timeout=10)
    first.join(timeout=10)
    time.sleep(0.3)  # the short Retry-After has run out; the long one has not

    later = retry_stub.Chat(ask("longest"), metadata=metadata, timeout=10)

    assert outcomes(fast)[0] == ("longest-a", "ATTEMPT_OUTCOME_RATE_LIMITED", 429)
    assert outcomes(slow[0])[0] == ("longest-a", "ATTEMPT_OUTCOME_RATE_LIMITED", 429)
    assert outcomes(later) == [
        ("longest-a", "ATTEMPT_OUTCOME_SKIPPED_COOLDOWN", 0),
        ("longest-b", "ATTEMPT_OUTCOME_OK", 200),
    ]
    assert len(vendors.alpha.requests()) == 2


def test_no_retry_is_begun_that_would_outlast_the_callers_deadline(
    retry_stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    # Retry-After 1.5 s is within the provider's patience, but not within the
    # caller's one-second deadline: the caller hears so at once, with the retry time.
    vendors.alpha.script({"action": "status", "status": 429, "retry_after_ms": 1500})

    started = time.monotonic()
    error = rpc_error(
        lambda: retry_stub.Chat(ask("deadline", tools=True), metadata=metadata, timeout=1.0)
    )

    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_delay_seconds(error) == 1.5
    assert time.monotonic() - started < 1.0
    assert len(vendors.alpha.requests()) == 1


def _wait_until(condition: Callable[[], bool], *, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.01)
