"""The gateway as a real process, over real gRPC, in front of fake vendors that
speak OpenAI chat-completions over real HTTP and fail on command."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import ServiceProcess, wait_until
from services.gateway.tests.gateway_support import (
    ALPHA_KEY,
    SpanCollector,
    Vendors,
    acting_metadata,
    chat_request,
    new_run_id,
    user,
)

Metadata = tuple[tuple[str, str], ...]
Acting = Callable[[str], Metadata]
pb = gateway_pb2


def rpc_error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def retry_delay_seconds(error: grpc.RpcError) -> float | None:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return float(info.retry_delay.ToNanoseconds()) / 1e9
    return None


def outcomes(response: gateway_pb2.ChatResponse) -> list[tuple[str, str, int]]:
    return [
        (a.provider, pb.AttemptOutcome.Name(a.outcome), a.http_status) for a in response.attempts
    ]


# --- plain answers ---------------------------------------------------------------


def test_plain_answer_reports_provider_model_usage_and_attempts(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script({"action": "answer", "content": "Paris."})

    response = stub.Chat(chat_request(), metadata=metadata, timeout=10)

    assert response.message.content == "Paris."
    assert response.message.role == pb.MESSAGE_ROLE_ASSISTANT
    assert response.finish_reason == "stop"
    assert (response.provider, response.model) == ("alpha", "alpha-balanced")
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens > 0
    assert response.usage.total_tokens == (
        response.usage.prompt_tokens + response.usage.completion_tokens
    )
    assert outcomes(response) == [("alpha", "ATTEMPT_OUTCOME_OK", 200)]
    assert response.attempts[0].model == "alpha-balanced"
    assert response.attempts[0].latency.ToNanoseconds() > 0
    sent = vendors.alpha.requests()
    assert len(sent) == 1 and sent[0]["authorization_present"]


def test_an_explicit_model_wins_over_the_tier(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    response = stub.Chat(
        chat_request(tier=pb.TIER_FAST, model="shared-deep"), metadata=metadata, timeout=10
    )

    assert (response.provider, response.model) == ("gamma", "shared-deep")
    assert vendors.alpha.requests() == [] and vendors.beta.requests() == []
    assert vendors.gamma.requests()[0]["body"]["model"] == "shared-deep"


def test_an_unconfigured_model_is_refused_with_the_configured_ones_named(
    stub: gateway_pb2_grpc.GatewayServiceStub, metadata: Metadata
) -> None:
    error = rpc_error(lambda: stub.Chat(chat_request(model="gpt-9"), metadata=metadata, timeout=10))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'gpt-9'" in error.details() and "alpha-balanced" in error.details()


def test_reasoning_effort_follows_the_tier_only_where_the_provider_supports_it(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script({"action": "status", "status": 503})

    stub.Chat(chat_request(tier=pb.TIER_DEEP, max_tokens=77), metadata=metadata, timeout=10)

    (to_alpha,) = vendors.alpha.requests()
    (to_beta,) = vendors.beta.requests()
    assert to_alpha["body"]["reasoning_effort"] == "high"
    assert to_alpha["body"]["max_tokens"] == 77
    assert "reasoning_effort" not in to_beta["body"]
    assert to_beta["body"]["model"] == "beta-deep"


def test_max_tokens_defaults_to_1024(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    stub.Chat(chat_request(tier=pb.TIER_FAST), metadata=metadata, timeout=10)

    (sent,) = vendors.alpha.requests()
    assert sent["body"]["max_tokens"] == 1024
    assert sent["body"]["reasoning_effort"] == "low"


# --- tools -----------------------------------------------------------------------

SEARCH_SCHEMA = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "k": {"type": "integer", "minimum": 1}},
    "required": ["query"],
    "additionalProperties": False,
}


def test_tool_definitions_and_the_models_tool_call_pass_through_intact(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script(
        {"action": "tool_call", "name": "search", "arguments": {"query": "tarifs été", "k": 3}}
    )
    request = chat_request(
        "Find the summer prices",
        tools=[
            pb.ToolDefinition(
                name="search",
                description="Search the handbook.",
                parameters_json_schema=json.dumps(SEARCH_SCHEMA),
            )
        ],
    )

    response = stub.Chat(request, metadata=metadata, timeout=10)

    (call,) = response.message.tool_calls
    assert call.name == "search"
    assert call.arguments_json == '{"query":"tarifs été","k":3}'
    assert call.id
    assert response.finish_reason == "tool_calls"
    (sent,) = vendors.alpha.requests()
    assert sent["body"]["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": "Search the handbook.",
                "parameters": SEARCH_SCHEMA,
            },
        }
    ]


def tool_history(question: str = "Find the summer prices") -> list[gateway_pb2.Message]:
    return [
        pb.Message(role=pb.MESSAGE_ROLE_SYSTEM, content="You answer from the handbook."),
        user(question),
        pb.Message(
            role=pb.MESSAGE_ROLE_ASSISTANT,
            tool_calls=[
                pb.ToolCall(id="call_abc123", name="search", arguments_json='{"query": "summer"}')
            ],
        ),
        pb.Message(
            role=pb.MESSAGE_ROLE_TOOL, tool_call_id="call_abc123", content='{"hits": ["p. 4"]}'
        ),
    ]


def test_a_conversation_with_tool_calls_reaches_the_provider_intact(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script({"action": "answer", "content": "Page 4 lists them."})

    response = stub.Chat(
        pb.ChatRequest(messages=tool_history(), tier=pb.TIER_BALANCED),
        metadata=metadata,
        timeout=10,
    )

    assert response.message.content == "Page 4 lists them."
    (sent,) = vendors.alpha.requests()
    assert sent["body"]["messages"][2:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"query": "summer"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"hits": ["p. 4"]}', "tool_call_id": "call_abc123"},
    ]


# --- failover --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "outcome", "http_status"),
    [
        (
            {"action": "status", "status": 429, "retry_after": 2},
            "ATTEMPT_OUTCOME_RATE_LIMITED",
            429,
        ),
        ({"action": "status", "status": 500}, "ATTEMPT_OUTCOME_SERVER_ERROR", 500),
        ({"action": "status", "status": 503}, "ATTEMPT_OUTCOME_SERVER_ERROR", 503),
        ({"action": "hang", "seconds": 30}, "ATTEMPT_OUTCOME_TIMEOUT", 0),
        ({"action": "malformed"}, "ATTEMPT_OUTCOME_MALFORMED_RESPONSE", 200),
    ],
    ids=["429", "500", "503", "hang", "malformed"],
)
def test_a_retryable_fault_fails_over_to_the_next_provider(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    fault: dict[str, Any],
    outcome: str,
    http_status: int,
) -> None:
    vendors.alpha.script(fault)
    vendors.beta.script({"action": "answer", "content": "From beta."})

    response = stub.Chat(chat_request(), metadata=metadata, timeout=10)

    assert response.message.content == "From beta."
    assert (response.provider, response.model) == ("beta", "beta-balanced")
    assert outcomes(response) == [
        ("alpha", outcome, http_status),
        ("beta", "ATTEMPT_OUTCOME_OK", 200),
    ]
    assert ALPHA_KEY not in response.attempts[0].detail
    assert len(vendors.beta.requests()) == 1


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, grpc.StatusCode.INVALID_ARGUMENT),
        (404, grpc.StatusCode.INVALID_ARGUMENT),
        (401, grpc.StatusCode.FAILED_PRECONDITION),
        (403, grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_a_client_error_is_returned_as_is_without_failover(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    status: int,
    code: grpc.StatusCode,
) -> None:
    vendors.alpha.script(
        {"action": "status", "status": status, "message": "Invalid value for 'messages'."}
    )

    error = rpc_error(lambda: stub.Chat(chat_request(), metadata=metadata, timeout=10))

    assert error.code() == code
    assert f"HTTP {status}" in error.details() and "'alpha'" in error.details()
    if status in (400, 404):
        assert "Invalid value for 'messages'." in error.details()
    assert vendors.beta.requests() == [] and vendors.gamma.requests() == []


def test_a_rate_limit_with_tool_calls_in_the_history_is_returned_with_retry_info(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script({"action": "status", "status": 429, "retry_after": 2})

    error = rpc_error(
        lambda: stub.Chat(
            pb.ChatRequest(messages=tool_history(), tier=pb.TIER_BALANCED),
            metadata=metadata,
            timeout=10,
        )
    )

    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_delay_seconds(error) == 2.0
    assert vendors.beta.requests() == []


@pytest.mark.parametrize(
    "fault",
    [
        {"action": "status", "status": 500},
        {"action": "hang", "seconds": 30},
        {"action": "malformed"},
    ],
    ids=["500", "hang", "malformed"],
)
def test_an_outage_with_tool_calls_in_the_history_is_unavailable_without_failover(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    fault: dict[str, Any],
) -> None:
    vendors.alpha.script(fault)

    error = rpc_error(
        lambda: stub.Chat(
            pb.ChatRequest(messages=tool_history(), tier=pb.TIER_BALANCED),
            metadata=metadata,
            timeout=10,
        )
    )

    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "'alpha'" in error.details()
    assert vendors.beta.requests() == []


def test_when_every_provider_fails_the_error_lists_each_attempt(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script({"action": "status", "status": 502})
    vendors.beta.script({"action": "status", "status": 429})
    vendors.gamma.script({"action": "malformed"})

    error = rpc_error(lambda: stub.Chat(chat_request(), metadata=metadata, timeout=10))

    assert error.code() == grpc.StatusCode.UNAVAILABLE
    details = error.details()
    assert "all 3 provider attempt(s) failed" in details
    assert "alpha [alpha-balanced]: SERVER_ERROR HTTP 502" in details
    assert "beta [beta-balanced]: RATE_LIMITED HTTP 429" in details
    assert "gamma [gamma-balanced]: MALFORMED_RESPONSE" in details
    assert ALPHA_KEY not in details


def test_when_every_provider_is_rate_limited_the_caller_gets_resource_exhausted(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    for vendor, seconds in ((vendors.alpha, 7), (vendors.beta, 3), (vendors.gamma, 5)):
        vendor.script({"action": "status", "status": 429, "retry_after": seconds})

    error = rpc_error(lambda: stub.Chat(chat_request(), metadata=metadata, timeout=10))

    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_delay_seconds(error) == 3.0


# --- streaming -------------------------------------------------------------------


def stream_events(
    stub: gateway_pb2_grpc.GatewayServiceStub, request: gateway_pb2.ChatRequest, metadata: Metadata
) -> tuple[list[str], gateway_pb2.ChatResponse | None, grpc.RpcError | None]:
    deltas: list[str] = []
    done = None
    try:
        for event in stub.ChatStream(
            pb.ChatStreamRequest(chat=request), metadata=metadata, timeout=10
        ):
            if event.HasField("done"):
                done = event.done
            else:
                deltas.append(event.content_delta)
    except grpc.RpcError as exc:
        return deltas, done, exc
    return deltas, done, None


def test_streamed_deltas_assemble_to_the_answer_and_end_with_done(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    answer = "Paris is the capital of France, on the Seine, with about two million people."
    vendors.alpha.script({"action": "answer", "content": answer})

    deltas, done, error = stream_events(stub, chat_request(), metadata)

    assert error is None
    assert len(deltas) > 1 and "".join(deltas) == answer
    assert done is not None and done.message.content == answer
    assert (done.provider, done.model, done.finish_reason) == ("alpha", "alpha-balanced", "stop")
    assert done.usage.completion_tokens > 0
    assert outcomes(done) == [("alpha", "ATTEMPT_OUTCOME_OK", 200)]
    (sent,) = vendors.alpha.requests()
    assert sent["body"]["stream"] is True


def test_a_streamed_tool_call_is_assembled_in_done(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script(
        {"action": "tool_call", "name": "search", "arguments": {"query": "summer prices", "k": 10}}
    )

    deltas, done, error = stream_events(
        stub,
        chat_request(
            tools=[
                pb.ToolDefinition(name="search", parameters_json_schema=json.dumps(SEARCH_SCHEMA))
            ]
        ),
        metadata,
    )

    assert error is None and deltas == []
    assert done is not None and done.finish_reason == "tool_calls"
    (call,) = done.message.tool_calls
    assert (call.name, call.arguments_json) == ("search", '{"query":"summer prices","k":10}')


@pytest.mark.parametrize(
    ("fault", "outcome"),
    [
        ({"action": "status", "status": 429}, "ATTEMPT_OUTCOME_RATE_LIMITED"),
        ({"action": "cut_stream", "after_chunks": 0}, "ATTEMPT_OUTCOME_STREAM_CUT"),
        ({"action": "malformed"}, "ATTEMPT_OUTCOME_MALFORMED_RESPONSE"),
        ({"action": "hang", "seconds": 30}, "ATTEMPT_OUTCOME_TIMEOUT"),
    ],
    ids=["429", "cut-before-content", "malformed", "hang"],
)
def test_a_stream_fails_over_while_no_content_was_sent(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    fault: dict[str, Any],
    outcome: str,
) -> None:
    vendors.alpha.script(fault)
    vendors.beta.script({"action": "answer", "content": "From beta, streamed."})

    deltas, done, error = stream_events(stub, chat_request(), metadata)

    assert error is None
    assert "".join(deltas) == "From beta, streamed."
    assert done is not None and done.provider == "beta"
    assert [a[:2] for a in outcomes(done)] == [("alpha", outcome), ("beta", "ATTEMPT_OUTCOME_OK")]


def test_a_stream_cut_after_content_ends_with_an_error_not_a_clean_finish(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    vendors.alpha.script({"action": "cut_stream", "after_chunks": 2})
    vendors.beta.script({"action": "answer", "content": "From beta."})

    deltas, done, error = stream_events(stub, chat_request(), metadata)

    assert deltas, "some content arrived before the cut"
    assert done is None
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert "stream from provider 'alpha' cut after content was sent" in error.details()
    assert vendors.beta.requests() == []


@pytest.mark.parametrize(
    ("fault", "code"),
    [
        ({"action": "status", "status": 429, "retry_after": 3}, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ({"action": "status", "status": 502}, grpc.StatusCode.UNAVAILABLE),
        ({"action": "cut_stream", "after_chunks": 0}, grpc.StatusCode.UNAVAILABLE),
        ({"action": "malformed"}, grpc.StatusCode.UNAVAILABLE),
    ],
    ids=["429", "502", "cut-before-content", "malformed"],
)
def test_a_stream_with_tool_calls_in_the_history_returns_the_fault_without_failover(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    fault: dict[str, Any],
    code: grpc.StatusCode,
) -> None:
    vendors.alpha.script(fault)

    deltas, done, error = stream_events(
        stub, pb.ChatRequest(messages=tool_history(), tier=pb.TIER_BALANCED), metadata
    )

    assert deltas == [] and done is None
    assert error is not None and error.code() == code
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert retry_delay_seconds(error) == 3.0
    assert vendors.beta.requests() == []


# --- a conversation pinned to the provider that made its tool calls ----------------


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_conversation_holding_tool_calls_goes_only_to_the_provider_that_made_them(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    stream: bool,
) -> None:
    vendors.beta.script({"action": "answer", "content": "Beta continues its own tool call."})
    request = pb.ChatRequest(messages=tool_history(), tier=pb.TIER_BALANCED, pinned_provider="beta")

    if stream:
        deltas, done, error = stream_events(stub, request, metadata)
        assert error is None and "".join(deltas) == "Beta continues its own tool call."
    else:
        done = stub.Chat(request, metadata=metadata, timeout=10)

    assert done is not None and done.provider == "beta"
    assert done.message.content == "Beta continues its own tool call."
    assert outcomes(done) == [("beta", "ATTEMPT_OUTCOME_OK", 200)]
    assert vendors.alpha.requests() == []  # first in failover order, yet never asked
    (sent,) = vendors.beta.requests()
    assert sent["body"]["messages"][2]["tool_calls"][0]["id"] == "call_abc123"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_pinned_provider_that_fails_is_not_replaced_by_another(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    stream: bool,
) -> None:
    vendors.beta.script({"action": "status", "status": 503})
    request = pb.ChatRequest(messages=tool_history(), tier=pb.TIER_BALANCED, pinned_provider="beta")

    if stream:
        deltas, done, error = stream_events(stub, request, metadata)
        assert deltas == [] and done is None
    else:
        error = rpc_error(lambda: stub.Chat(request, metadata=metadata, timeout=10))

    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert "'beta'" in error.details()
    assert vendors.alpha.requests() == [] and vendors.gamma.requests() == []


def test_a_pin_to_a_provider_that_does_not_serve_the_tier_is_refused_before_sending(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    request = pb.ChatRequest(messages=tool_history(), tier=pb.TIER_FAST, pinned_provider="gamma")

    error = rpc_error(lambda: stub.Chat(request, metadata=metadata, timeout=10))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pinned_provider 'gamma'" in error.details()
    assert all(v.requests() == [] for v in vendors.all())


def test_a_pin_without_tool_calls_in_the_history_leaves_failover_in_order(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    response = stub.Chat(chat_request(pinned_provider="beta"), metadata=metadata, timeout=10)

    assert response.provider == "alpha"


def test_a_lone_surrogate_a_vendor_escaped_reaches_the_caller_as_a_replacement_character(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    """`"\\ud800"` is legal JSON but no UTF-8 text: passed on as is, it failed the
    gRPC response after the vendor had answered (INTERNAL)."""
    steps = {
        "steps": [
            {"action": "answer", "content": "broken \ud800 text"},
            {"action": "tool_call", "name": "search", "arguments": '{"q": "\udfff"}'},
        ]
    }
    # httpx cannot encode the script (it writes UTF-8); json.dumps escapes it.
    vendors.alpha.control.post(
        "/_control/script",
        content=json.dumps(steps).encode(),
        headers={"content-type": "application/json"},
    ).raise_for_status()

    answered = stub.Chat(chat_request(), metadata=metadata, timeout=10)
    called = stub.Chat(chat_request(), metadata=metadata, timeout=10)

    assert answered.message.content == "broken \ufffd text"
    assert called.message.tool_calls[0].arguments_json == '{"q": "\ufffd"}'


# --- budgets ---------------------------------------------------------------------


def test_a_call_that_cannot_fit_the_run_budget_is_refused_before_anything_is_sent(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, acting: Acting
) -> None:
    run_id = new_run_id()
    metadata = acting(run_id)
    request = chat_request(run_id=run_id, remaining_budget_tokens=500)  # needs ~1030

    error = rpc_error(lambda: stub.Chat(request, metadata=metadata, timeout=10))
    stream_error = rpc_error(
        lambda: list(
            stub.ChatStream(pb.ChatStreamRequest(chat=request), metadata=metadata, timeout=10)
        )
    )

    for refused in (error, stream_error):
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "500 tokens left" in refused.details()
        assert retry_delay_seconds(refused) is None
    assert all(v.requests() == [] for v in vendors.all())


def test_a_call_that_fits_the_run_budget_is_sent(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, acting: Acting
) -> None:
    run_id = new_run_id()
    request = chat_request(run_id=run_id, remaining_budget_tokens=200, max_tokens=100)

    response = stub.Chat(request, metadata=acting(run_id), timeout=10)

    assert response.provider == "alpha"


def test_concurrent_calls_of_one_run_cannot_together_pass_its_budget(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, acting: Acting
) -> None:
    # Each call needs max_tokens 100 + a few prompt tokens; 250 holds two at a time.
    vendors.alpha.script(*[{"action": "hang", "seconds": 0.5}] * 6)
    run_id = new_run_id()
    metadata = acting(run_id)
    request = chat_request("hi", run_id=run_id, remaining_budget_tokens=250, max_tokens=100)

    def call(_: int) -> str:
        try:
            stub.Chat(request, metadata=metadata, timeout=10)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(call, range(6)))

    sent = len(vendors.alpha.requests()) + len(vendors.beta.requests())
    assert sent <= 2
    assert results.count("OK") == sent >= 1
    assert results.count("RESOURCE_EXHAUSTED") == 6 - sent
    # Finished calls gave their reservations back.
    assert stub.Chat(request, metadata=metadata, timeout=10).provider == "alpha"


def test_a_member_cannot_reserve_against_or_exhaust_another_members_run(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    acting: Acting,
    issuer: TokenIssuer,
    new_org: str,
) -> None:
    """A run's budget is keyed by (org, run id). Bob, in Ada's org, names her run with
    a huge reservation: he must be refused before anything is reserved or sent, with
    his own token alone and with the acting credential of a run of his own, and the
    refusal must say nothing about her run. Her run's budget is then untouched."""
    ada_run = new_run_id()
    bob_alone = call_metadata(issuer.caller_token(org_id=new_org, user_id="bob", roles=["member"]))
    bob_in_his_run = acting_metadata(issuer, org_id=new_org, user_id="bob", run_id=new_run_id())
    hostile = chat_request("hi", run_id=ada_run, remaining_budget_tokens=10**9, max_tokens=900_000)

    refusals = [
        rpc_error(lambda m=m: stub.Chat(hostile, metadata=m, timeout=10))
        for m in (bob_alone, bob_in_his_run)
    ]
    streamed = rpc_error(
        lambda: list(
            stub.ChatStream(pb.ChatStreamRequest(chat=hostile), metadata=bob_alone, timeout=10)
        )
    )

    for refused in (*refusals, streamed):
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"run_id {ada_run!r}" in refused.details()
        assert "tokens left" not in refused.details() and "reserved" not in refused.details()
    assert all(v.requests() == [] for v in vendors.all())
    # Ada's run still has its whole budget: a call needing nearly all of it fits.
    ada = chat_request("hi", run_id=ada_run, remaining_budget_tokens=1002, max_tokens=1000)
    assert stub.Chat(ada, metadata=acting(ada_run), timeout=10).provider == "alpha"


def test_a_call_outside_a_run_may_bound_itself_with_a_budget_shared_with_nobody(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    too_small = chat_request("hi", remaining_budget_tokens=50, max_tokens=100)
    fits = chat_request("hi", remaining_budget_tokens=200, max_tokens=100)

    refused = rpc_error(lambda: stub.Chat(too_small, metadata=metadata, timeout=10))

    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "this call's budget has 50 tokens left" in refused.details()
    assert stub.Chat(fits, metadata=metadata, timeout=10).provider == "alpha"


# --- identity, secrets, listing ----------------------------------------------------


def test_a_call_without_a_token_is_refused(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors
) -> None:
    error = rpc_error(lambda: stub.Chat(chat_request(), timeout=10))

    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert all(v.requests() == [] for v in vendors.all())


def test_no_api_key_appears_in_the_gateway_log(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    gateway: ServiceProcess,
) -> None:
    vendors.alpha.script(
        {"action": "status", "status": 401, "message": f"Incorrect API key provided: {ALPHA_KEY}"},
        {"action": "status", "status": 400, "message": f"bad request, key was {ALPHA_KEY}"},
        {"action": "status", "status": 500, "message": f"upstream broke for {ALPHA_KEY}"},
    )
    for _ in range(2):
        error = rpc_error(lambda: stub.Chat(chat_request(), metadata=metadata, timeout=10))
        assert ALPHA_KEY not in error.details()
    response = stub.Chat(chat_request(), metadata=metadata, timeout=10)
    assert ALPHA_KEY not in response.attempts[0].detail
    assert "[redacted]" in response.attempts[0].detail

    log = gateway.log_text()
    assert "chat.attempt" in log
    assert "CAIRN_TEST_ALPHA_KEY" in log  # the variable's name is logged, so the check is live
    assert ALPHA_KEY not in log
    assert ALPHA_KEY[:16] not in log


def test_no_prompt_or_answer_text_appears_in_logs_spans_or_errors_even_when_echoed(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    acting: Acting,
    gateway: ServiceProcess,
    span_collector: SpanCollector,
) -> None:
    # Nothing here can occur by chance in a trace id, a timestamp or a latency.
    prompt = "Draft the dismissal letter for Marguerite Okonkwo-Vasquez, payroll QX-7731"
    answer = "Dear Ms Okonkwo-Vasquez, regarding payroll QX-7731"
    run_id = new_run_id()
    metadata = acting(run_id)
    request = chat_request(prompt, run_id=run_id)
    # Vendors quote the request back in their errors; the gateway must not pass it on.
    vendors.alpha.script(
        {"action": "status", "status": 500, "message": f"failed on input: {prompt}"},
        {"action": "status", "status": 400, "message": f"Invalid content: '{prompt}'"},
        {"action": "status", "status": 503, "message": f"overloaded by '{prompt[:40]}'"},
    )
    vendors.beta.script(
        {"action": "answer", "content": answer}, {"action": "answer", "content": answer}
    )

    answered = stub.Chat(request, metadata=metadata, timeout=10)
    refused = rpc_error(lambda: stub.Chat(request, metadata=metadata, timeout=10))
    deltas, streamed, _ = stream_events(stub, request, metadata)

    assert answered.message.content == answer and "".join(deltas) == answer
    assert streamed is not None
    # The echoes did reach the gateway, and were cut out where they would have shown.
    assert "[prompt]" in answered.attempts[0].detail
    assert "[prompt]" in refused.details()
    span_collector.wait_for("chat beta-balanced", run_id=run_id)
    spans = "".join(s.raw for s in span_collector.spans())
    log = gateway.log_text()
    assert "chat.attempt" in log and run_id in log
    for place in (log, spans, refused.details(), answered.attempts[0].detail):
        assert "Okonkwo" not in place and "QX-7731" not in place
        # Not even a fragment: no run of 12 characters of the prompt, wherever it starts.
        assert not [
            prompt[i : i + 12] for i in range(len(prompt) - 11) if prompt[i : i + 12] in place
        ]


def test_models_are_listed_from_the_configuration(
    stub: gateway_pb2_grpc.GatewayServiceStub, metadata: Metadata
) -> None:
    listed = stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10).models

    by_model = {(m.provider, m.model): list(m.tiers) for m in listed}
    assert by_model[("alpha", "alpha-deep")] == [pb.TIER_DEEP]
    assert by_model[("gamma", "shared-deep")] == [pb.TIER_DEEP]
    assert ("gamma", "gamma-embed") not in by_model
    assert len(by_model) == 8
    assert not any(m.offline_demo for m in listed)


# --- embeddings --------------------------------------------------------------------


def test_embed_with_the_local_model_name_uses_the_local_embedder(
    stub: gateway_pb2_grpc.GatewayServiceStub, metadata: Metadata
) -> None:
    response = stub.Embed(
        pb.EmbedRequest(
            texts=["refund policy", "holiday rota"], model="all-MiniLM-L6-v2-onnx-int8"
        ),
        metadata=metadata,
        timeout=60,
    )

    assert (response.provider, response.dimensions) == ("local", 384)
    assert [len(e.values) for e in response.embeddings] == [384, 384]
    norm = sum(v * v for v in response.embeddings[0].values)
    assert abs(norm - 1.0) < 1e-3


def test_embed_goes_to_the_provider_that_serves_the_embedding_model(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    response = stub.Embed(pb.EmbedRequest(texts=["a", "b", "c"]), metadata=metadata, timeout=10)

    assert (response.provider, response.model) == ("gamma", "gamma-embed")
    assert len(response.embeddings) == 3
    (sent,) = vendors.gamma.requests("/v1/embeddings")
    assert sent["body"] == {"model": "gamma-embed", "input": ["a", "b", "c"]}


# --- traces ----------------------------------------------------------------------


def test_each_attempt_is_a_chat_span_with_genai_attributes_and_no_prompt_or_key(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    acting: Acting,
    span_collector: SpanCollector,
) -> None:
    prompt = "Summarise the disciplinary file of employee QZXW-4471 for the board"
    answer = "The file for QZXW holds two warnings"
    run_id = new_run_id()
    vendors.alpha.script({"action": "status", "status": 500})
    vendors.beta.script({"action": "answer", "content": answer})

    stub.Chat(
        chat_request(prompt, tier=pb.TIER_FAST, run_id=run_id), metadata=acting(run_id), timeout=10
    )

    (failed,) = span_collector.wait_for("chat alpha-fast", run_id=run_id)
    (answered,) = span_collector.wait_for("chat beta-fast", run_id=run_id)
    assert failed.attributes["gen_ai.operation.name"] == "chat"
    assert failed.attributes["gen_ai.provider.name"] == "alpha"
    assert failed.attributes["error.type"] == "SERVER_ERROR"
    assert failed.attributes["http.response.status_code"] == 500
    assert answered.attributes["gen_ai.provider.name"] == "beta"
    assert answered.attributes["gen_ai.request.model"] == "beta-fast"
    assert answered.attributes["gen_ai.response.model"] == "beta-fast"
    assert answered.attributes["gen_ai.usage.input_tokens"] == math.ceil(len(prompt) / 4)
    assert answered.attributes["gen_ai.usage.output_tokens"] == math.ceil(len(answer) / 4)
    assert answered.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    everything = "".join(s.raw for s in span_collector.spans())
    assert "QZXW" not in everything and "disciplinary" not in everything
    assert ALPHA_KEY not in everything


def test_a_refused_call_has_a_server_span_with_the_rpc_attributes_and_its_status(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    metadata: Metadata,
    span_collector: SpanCollector,
) -> None:
    refused = rpc_error(
        lambda: stub.Chat(
            pb.ChatRequest(max_tokens=-7, messages=[user("hi")]), metadata=metadata, timeout=10
        )
    )
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT

    def refused_chat_spans() -> list[Any]:
        return [
            s
            for s in span_collector.spans()
            if s.name == "/cairn.gateway.v1.GatewayService/Chat"
            and s.attributes.get("rpc.grpc.status_code")
            == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        ]

    try:
        spans = wait_until(lambda: refused_chat_spans() or None, timeout=10)
    except TimeoutError:
        pytest.fail(f"no refused Chat server span; got {[s.name for s in span_collector.spans()]}")
    span = spans[-1]
    assert "SPAN_KIND_SERVER" in span.raw
    assert span.attributes["rpc.system"] == "grpc"
    assert span.attributes["rpc.service"] == "cairn.gateway.v1.GatewayService"
    assert span.attributes["rpc.method"] == "Chat"
    assert span.attributes["net.peer.name"] == "localhost"
    # INVALID_ARGUMENT is the caller's doing: the span is not marked as an error.
    assert span.status_code == 0
