"""What the gateway refuses at its door, before the router, the ledger or a vendor
sees anything: text PostgreSQL cannot hold, enum numbers the schema does not define,
JSON that is not JSON, and limits no model or run could use. Each refusal is
INVALID_ARGUMENT naming the field; none is INTERNAL."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn_gateway.errors import ChatRequestInvalid
from cairn_gateway.servicer import (
    MAX_BUDGET_TOKENS,
    MAX_OUTPUT_TOKENS,
    chat_request_from_proto,
    embed_texts_from_proto,
)
from cairn_libs.identity import CallIdentity, Principal
from services.gateway.tests.gateway_support import Vendors, chat_request, user

pb = gateway_pb2
Metadata = tuple[tuple[str, str], ...]
NOBODY_ACTING = CallIdentity(principal=Principal(org_id="org-1", user_id="ada"))


def with_tool_history(arguments_json: str = "{}", **fields: object) -> pb.ChatRequest:
    return pb.ChatRequest(
        messages=[
            user("find it"),
            pb.Message(
                role=pb.MESSAGE_ROLE_ASSISTANT,
                tool_calls=[pb.ToolCall(id="call-1", name="search", arguments_json=arguments_json)],
            ),
            pb.Message(role=pb.MESSAGE_ROLE_TOOL, tool_call_id="call-1", content="[]"),
        ],
        tier=pb.TIER_BALANCED,
        **fields,  # type: ignore[arg-type]
    )


def with_tool(**tool: str) -> pb.ChatRequest:
    tool.setdefault("name", "search")
    return pb.ChatRequest(
        messages=[user("hi")], tools=[pb.ToolDefinition(**tool)], tier=pb.TIER_BALANCED
    )


NUL = "a\x00b"
# Every text field of a chat request that reaches a vendor or the ledger, with the
# name the refusal must give it.
NUL_CASES: list[tuple[str, Callable[[], pb.ChatRequest]]] = [
    ("messages[0].content", lambda: chat_request(NUL)),
    (
        "messages[0].name",
        lambda: pb.ChatRequest(
            messages=[pb.Message(role=pb.MESSAGE_ROLE_USER, content="x", name=NUL)]
        ),
    ),
    ("messages[1].tool_calls[0].arguments_json", lambda: with_tool_history('{"q": "a\x00"}')),
    (
        "messages[1].tool_call_id",
        lambda: pb.ChatRequest(
            messages=[user("x"), pb.Message(role=pb.MESSAGE_ROLE_TOOL, tool_call_id=NUL)]
        ),
    ),
    ("model", lambda: chat_request(model=NUL)),
    ("pinned_provider", lambda: chat_request(pinned_provider=NUL)),
    ("run_id", lambda: chat_request(run_id=NUL)),
    ("tools[0] ('search').description", lambda: with_tool(description=NUL)),
    ("tools[0] ('search').parameters_json_schema", lambda: with_tool(parameters_json_schema=NUL)),
]


@pytest.mark.parametrize(("field", "build"), NUL_CASES, ids=[c[0] for c in NUL_CASES])
def test_u0000_in_any_text_is_refused_naming_the_field(
    field: str, build: Callable[[], pb.ChatRequest]
) -> None:
    with pytest.raises(ChatRequestInvalid) as refused:
        chat_request_from_proto(build(), NOBODY_ACTING)

    assert refused.value.message.startswith(f"{field} contains the character U+0000")


def test_u0000_in_a_text_to_embed_is_refused_naming_it() -> None:
    with pytest.raises(ChatRequestInvalid, match=r"^texts\[1\] contains the character U\+0000"):
        embed_texts_from_proto(pb.EmbedRequest(texts=["fine", NUL]))


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        (
            pb.ChatRequest(messages=[pb.Message(role=99, content="x")]),  # type: ignore[arg-type]
            "messages[0].role 99 is not a known role",
        ),
        (chat_request(tier=42), "tier 42 is not known"),  # type: ignore[arg-type]
        (
            with_tool_history("{not json"),
            "messages[1].tool_calls[0].arguments_json is not JSON",
        ),
        (with_tool(parameters_json_schema="{"), "parameters_json_schema is not JSON"),
        (with_tool(parameters_json_schema="[1]"), "must be a JSON object"),
        (chat_request(max_tokens=2**31 - 1), f"outside 0..{MAX_OUTPUT_TOKENS}"),
        (chat_request(max_tokens=-1), "max_tokens -1 is outside"),
        (chat_request(remaining_budget_tokens=2**62), f"outside 0..{MAX_BUDGET_TOKENS}"),
        (chat_request(remaining_budget_tokens=-5), "remaining_budget_tokens -5 is outside"),
        (chat_request(temperature=float("nan")), "temperature nan is outside"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_malformed_request_is_refused_naming_the_field(
    request_: pb.ChatRequest, names: str
) -> None:
    with pytest.raises(ChatRequestInvalid) as refused:
        chat_request_from_proto(request_, NOBODY_ACTING)

    assert names in refused.value.message


# --- over real gRPC: the code a caller sees, and that nothing reached a vendor -------


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        (
            pb.ChatRequest(messages=[pb.Message(role=77, content="x")]),  # type: ignore[arg-type]
            "role",
        ),
        (chat_request(NUL), "content"),
        (with_tool_history("{not json"), "arguments_json"),
        (chat_request(max_tokens=2**31 - 1), "max_tokens"),
        (chat_request(remaining_budget_tokens=2**62), "remaining_budget_tokens"),
    ],
    ids=["unknown role", "NUL content", "arguments not JSON", "giant max_tokens", "giant budget"],
)
def test_a_caller_sees_invalid_argument_and_no_vendor_is_called(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    vendors: Vendors,
    metadata: Metadata,
    request_: pb.ChatRequest,
    names: str,
) -> None:
    with pytest.raises(grpc.RpcError) as unary:
        stub.Chat(request_, metadata=metadata, timeout=10)
    with pytest.raises(grpc.RpcError) as streamed:
        list(stub.ChatStream(pb.ChatStreamRequest(chat=request_), metadata=metadata, timeout=10))

    for refused in (unary.value, streamed.value):
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert names in (refused.details() or "")
    assert all(v.requests() == [] for v in vendors.all())


def test_nul_in_a_text_to_embed_is_invalid_argument_over_grpc(
    stub: gateway_pb2_grpc.GatewayServiceStub, vendors: Vendors, metadata: Metadata
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(texts=[NUL], model="gamma-embed"), metadata=metadata, timeout=10)

    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert vendors.gamma.requests("/v1/embeddings") == []
