"""The fault matrix: every fault a vendor can throw, unary and streamed, with and
without tool calls in the history, each with the one outcome it must have.

Real processes throughout: a gateway over gRPC in front of fake vendors over HTTP,
plus a provider whose port nothing listens on (connection refused). Each provider
retries once (quickly) and cooldowns are off, so every row sees exactly its own
fault, twice where a retry is due. A fault is scripted for both tries, so a row
that expects failover also proves the retry happened and failed.

What "no clean-looking answer that is wrong" means here: an answer is only ever the
next provider's whole scripted text (never a leftover of the failed one), and a
failure is an error status, never a stream that just stops.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn_libs.stack import ServiceProcess, free_port, serving
from services.gateway.tests.gateway_support import ALPHA_KEY, Vendors, user
from services.gateway.tests.test_gateway_process_calls import (
    outcomes,
    retry_delay_seconds,
    tool_history,
)

Metadata = tuple[tuple[str, str], ...]
pb = gateway_pb2

BETA_ANSWER = "Beta answers this one, whole and unhurried."
MATRIX_TIMEOUT_SECONDS = 0.5


@pytest.fixture(scope="module")
def matrix_gateway(
    vendors: Vendors, service_env: dict[str, str], session_logs: Path
) -> Iterator[ServiceProcess]:
    resilience = (
        "    max_retries: 1\n    retry_backoff_seconds: 0.02\n"
        "    retry_max_wait_seconds: 1\n    cooldown_max_seconds: 0\n"
        f"    timeout_seconds: {MATRIX_TIMEOUT_SECONDS}\n"
    )
    config = session_logs / "matrix.yaml"
    config.write_text(
        "providers:\n"
        f"  - name: dead\n    base_url: http://127.0.0.1:{free_port()}/v1\n{resilience}"
        "    models: {fast: via-dead}\n"
        f"  - name: alpha\n    base_url: {vendors.alpha.url}/v1\n"
        f"    api_key_env: CAIRN_TEST_ALPHA_KEY\n{resilience}"
        "    models: {balanced: alpha-balanced}\n"
        f"  - name: beta\n    base_url: {vendors.beta.url}/v1\n{resilience}"
        "    models: {balanced: beta-balanced, fast: via-dead}\n"
    )
    env = {**service_env, "CAIRN_GATEWAY_CONFIG": str(config), "CAIRN_TEST_ALPHA_KEY": ALPHA_KEY}
    with serving("gateway", env=env, log_dir=session_logs, suffix="-matrix") as proc:
        yield proc


@pytest.fixture(scope="module")
def matrix_stub(matrix_gateway: ServiceProcess) -> Iterator[gateway_pb2_grpc.GatewayServiceStub]:
    with grpc.insecure_channel(matrix_gateway.address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


@dataclass(frozen=True)
class Fault:
    name: str
    # Scripted on the first provider; None means the first provider is `dead`.
    step: dict[str, Any] | None
    outcome: str
    http_status: int
    # The status a caller gets when the fault is returned rather than failed over.
    code: grpc.StatusCode
    retried: bool = True
    # Failover is allowed (no tool history) yet the call must not move on.
    never_fails_over: bool = False
    # Only when streaming: the fault comes after content reached the caller.
    after_content: bool = False


FAULTS = [
    Fault(
        "429-retry-after",
        {"action": "status", "status": 429, "retry_after": 30},
        "RATE_LIMITED",
        429,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        # A provider asking for 30 s is neither waited for nor retried.
        retried=False,
    ),
    Fault(
        "500", {"action": "status", "status": 500}, "SERVER_ERROR", 500, grpc.StatusCode.UNAVAILABLE
    ),
    Fault(
        "503", {"action": "status", "status": 503}, "SERVER_ERROR", 503, grpc.StatusCode.UNAVAILABLE
    ),
    Fault("hang", {"action": "hang", "seconds": 30}, "TIMEOUT", 0, grpc.StatusCode.UNAVAILABLE),
    Fault("refused", None, "CONNECTION_ERROR", 0, grpc.StatusCode.UNAVAILABLE),
    Fault(
        "cut-before-content",
        {"action": "cut_stream", "after_chunks": 0},
        "STREAM_CUT",
        200,
        grpc.StatusCode.UNAVAILABLE,
    ),
    Fault(
        "cut-after-2-chunks",
        {"action": "cut_stream", "after_chunks": 2},
        "STREAM_CUT",
        200,
        grpc.StatusCode.UNAVAILABLE,
        after_content=True,
    ),
    Fault(
        "malformed", {"action": "malformed"}, "MALFORMED_RESPONSE", 200, grpc.StatusCode.UNAVAILABLE
    ),
    Fault(
        "400",
        {"action": "status", "status": 400, "message": "Invalid value for 'temperature'."},
        "CLIENT_ERROR",
        400,
        grpc.StatusCode.INVALID_ARGUMENT,
        retried=False,
        never_fails_over=True,
    ),
    Fault(
        "401",
        {"action": "status", "status": 401},
        "CLIENT_ERROR",
        401,
        grpc.StatusCode.FAILED_PRECONDITION,
        retried=False,
        never_fails_over=True,
    ),
]


@dataclass
class Ended:
    """How a call ended: the streamed deltas, the final response (a unary call's
    response counts as its `done`), or the error status."""

    deltas: list[str]
    done: gateway_pb2.ChatResponse | None
    error: grpc.RpcError | None


def call(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    request: gateway_pb2.ChatRequest,
    metadata: Metadata,
    *,
    stream: bool,
) -> Ended:
    deltas: list[str] = []
    done = None
    try:
        if not stream:
            return Ended([], stub.Chat(request, metadata=metadata, timeout=15), None)
        for event in stub.ChatStream(
            pb.ChatStreamRequest(chat=request), metadata=metadata, timeout=15
        ):
            if event.HasField("done"):
                done = event.done
            else:
                deltas.append(event.content_delta)
    except grpc.RpcError as exc:
        return Ended(deltas, done, exc)
    return Ended(deltas, done, None)


@pytest.mark.parametrize("with_tools", [False, True], ids=["plain", "tool-history"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_each_fault_ends_in_the_next_providers_answer_or_the_original_error(
    matrix_stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    fault: Fault,
    stream: bool,
    with_tools: bool,
) -> None:
    first = "dead" if fault.step is None else "alpha"
    if fault.step is not None:
        vendors.alpha.script(fault.step, fault.step)
    vendors.beta.script({"action": "answer", "content": BETA_ANSWER})
    messages = tool_history() if with_tools else [user("What changed in the leave policy?")]
    request = pb.ChatRequest(
        messages=messages,
        tier=pb.TIER_FAST if first == "dead" else pb.TIER_BALANCED,
    )

    result = call(matrix_stub, request, metadata, stream=stream)

    after_content = fault.after_content and stream
    tries = 2 if fault.retried and not after_content else 1
    failed_attempts = [(first, f"ATTEMPT_OUTCOME_{fault.outcome}", fault.http_status)] * tries
    if first == "alpha":
        assert len(vendors.alpha.requests()) == tries
    if not (with_tools or after_content or fault.never_fails_over):
        # Answered by the next provider, and only by it: nothing of the failed one.
        assert result.error is None
        response = result.done
        assert response is not None
        assert response.message.content == BETA_ANSWER
        assert (response.provider, response.finish_reason) == ("beta", "stop")
        assert outcomes(response) == [*failed_attempts, ("beta", "ATTEMPT_OUTCOME_OK", 200)]
        if stream:
            assert "".join(result.deltas) == BETA_ANSWER
        assert len(vendors.beta.requests()) == 1
        return
    # The original error, with its status; never a clean finish.
    assert result.error is not None, "a failure must end in an error status"
    assert result.done is None
    assert result.error.code() == fault.code
    details = result.error.details() or ""
    assert f"'{first}'" in details
    # The retry is reported too: the error lists the attempt made before the last.
    assert ("earlier attempts: " in details) is (tries == 2)
    assert vendors.beta.requests() == []
    if fault.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert retry_delay_seconds(result.error) == 30.0
    if after_content:
        assert result.deltas, "content reached the caller before the cut"
        assert "cut after content was sent" in details
    else:
        assert result.deltas == []


def test_the_matrix_covers_every_fault_the_issue_names() -> None:
    names = {f.name for f in FAULTS}

    assert {"429-retry-after", "500", "503", "hang", "refused", "malformed", "400", "401"} <= names
    assert any(f.after_content for f in FAULTS) and any(
        f.step and f.step["action"] == "cut_stream" and not f.after_content for f in FAULTS
    )
