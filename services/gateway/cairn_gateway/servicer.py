"""The gRPC door of the gateway: proto in, domain call, proto out.

Conversion happens here and nowhere else; a proto object never goes past this
module. Malformed input (an unspecified or unknown role, a tool schema or tool-call
arguments that are not JSON, U+0000 in any text, a max_tokens or budget outside
what any model or run could use) is refused at the door with the field named, so
nothing behind it (the ledger's tables, a vendor) sees it.

A run's budget belongs to the run's own actor: the run id is the one in the
verified actor credential, never one a caller writes in the body (see `_run_id`).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import grpc

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn_gateway.config import Tier
from cairn_gateway.domain import (
    Attempt,
    ChatMessage,
    ChatRequest,
    ChatResult,
    ContentDelta,
    ModelListing,
    Outcome,
    Role,
    ToolCall,
    ToolDefinition,
    list_models,
)
from cairn_gateway.embeddings import Embeddings
from cairn_gateway.errors import ChatRequestInvalid
from cairn_gateway.router import Router
from cairn_libs.identity import ACTOR_METADATA_KEY, CallIdentity
from cairn_libs.server import current_identity

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name

_ROLES: Mapping[int, Role] = {
    gateway_pb2.MESSAGE_ROLE_SYSTEM: "system",
    gateway_pb2.MESSAGE_ROLE_USER: "user",
    gateway_pb2.MESSAGE_ROLE_ASSISTANT: "assistant",
    gateway_pb2.MESSAGE_ROLE_TOOL: "tool",
}
_ROLE_TO_PROTO: Mapping[Role, gateway_pb2.MessageRole.ValueType] = {
    role: gateway_pb2.MessageRole.ValueType(number) for number, role in _ROLES.items()
}
_TIERS: Mapping[int, Tier] = {
    gateway_pb2.TIER_FAST: "fast",
    gateway_pb2.TIER_BALANCED: "balanced",
    gateway_pb2.TIER_DEEP: "deep",
}
_TIER_TO_PROTO = {tier: number for number, tier in _TIERS.items()}
_OUTCOME_TO_PROTO: Mapping[Outcome, int] = {
    outcome: gateway_pb2.AttemptOutcome.Value(f"ATTEMPT_OUTCOME_{outcome.value}")
    for outcome in Outcome
}
# Larger than any model's output limit; a bigger max_tokens is a mistake that would
# otherwise reserve a run's whole budget and then be refused by the vendor.
MAX_OUTPUT_TOKENS = 1_000_000
# Larger than any run's budget could sensibly be; leave the budget unset for none.
MAX_BUDGET_TOKENS = 1_000_000_000_000
# The names vendors accept for a function tool.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_SCHEMA: Mapping[str, object] = {"type": "object", "properties": {}}


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, router: Router, embeddings: Embeddings) -> None:
        self._router = router
        self._embeddings = embeddings

    async def Chat(
        self, request: gateway_pb2.ChatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> gateway_pb2.ChatResponse:
        identity = current_identity()
        result = await self._router.chat(
            chat_request_from_proto(request, identity),
            org_id=identity.principal.org_id,
            time_limit=context.time_remaining(),
        )
        return chat_response_to_proto(result)

    async def ChatStream(
        self, request: gateway_pb2.ChatStreamRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[gateway_pb2.ChatStreamResponse]:
        identity = current_identity()
        chat = chat_request_from_proto(request.chat, identity)
        async for event in self._router.chat_stream(
            chat, org_id=identity.principal.org_id, time_limit=context.time_remaining()
        ):
            if isinstance(event, ContentDelta):
                yield gateway_pb2.ChatStreamResponse(content_delta=event.text)
            else:
                yield gateway_pb2.ChatStreamResponse(done=chat_response_to_proto(event))

    async def Embed(
        self, request: gateway_pb2.EmbedRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> gateway_pb2.EmbedResponse:
        current_identity()
        texts, model = embed_texts_from_proto(request)
        result = await self._embeddings.embed(texts, model=model)
        return gateway_pb2.EmbedResponse(
            embeddings=[gateway_pb2.Embedding(values=v) for v in result.vectors],
            provider=result.provider,
            model=result.model,
            dimensions=result.dimensions,
        )

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> gateway_pb2.ListModelsResponse:
        current_identity()
        return gateway_pb2.ListModelsResponse(
            models=[model_info_to_proto(m) for m in list_models(self._router.configs)]
        )


# --- from proto ------------------------------------------------------------------


def chat_request_from_proto(
    request: gateway_pb2.ChatRequest, identity: CallIdentity
) -> ChatRequest:
    if not request.messages:
        raise ChatRequestInvalid("messages is empty; send at least one message")
    if not 0 <= request.max_tokens <= MAX_OUTPUT_TOKENS:
        raise ChatRequestInvalid(
            f"max_tokens {request.max_tokens!r} is outside 0..{MAX_OUTPUT_TOKENS}; "
            "use a positive number up to the model's output limit, or 0 for the default"
        )
    if request.tier not in _TIERS and request.tier != gateway_pb2.TIER_UNSPECIFIED:
        raise ChatRequestInvalid(f"tier {request.tier!r} is not known; use FAST, BALANCED or DEEP")
    temperature = request.temperature if request.HasField("temperature") else None
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise ChatRequestInvalid(f"temperature {temperature!r} is outside 0..2")
    budget = (
        request.remaining_budget_tokens if request.HasField("remaining_budget_tokens") else None
    )
    if budget is not None and not 0 <= budget <= MAX_BUDGET_TOKENS:
        raise ChatRequestInvalid(
            f"remaining_budget_tokens {budget!r} is outside 0..{MAX_BUDGET_TOKENS}; send 0 "
            "for an exhausted budget, or leave it unset when no run budget applies"
        )
    return ChatRequest(
        messages=tuple(_message(m, where=f"messages[{i}]") for i, m in enumerate(request.messages)),
        tools=_tools(request.tools),
        tier=_TIERS.get(request.tier),
        model=_text(request.model, where="model").strip(),
        max_tokens=request.max_tokens or None,
        run_id=_run_id(_text(request.run_id, where="run_id"), identity),
        remaining_budget_tokens=budget,
        temperature=temperature,
        pinned_provider=_text(request.pinned_provider, where="pinned_provider").strip(),
    )


def _run_id(from_body: str, identity: CallIdentity) -> str:
    """The run a call's budget is counted against: the verified actor's, or none.

    Budgets are keyed by (org, run id), so a run id taken from the body would let any
    member of the org reserve against, and so exhaust, somebody else's run. Only the
    orchestrator's per-run credential (the actor token) names a run. A body run id
    without that credential is refused rather than ignored: ignoring it would leave
    the caller believing its calls count against that run. The refusal reads the same
    whether or not the run exists, and whoever's it is, so it tells nothing (I6). A
    call outside a run may still send remaining_budget_tokens: it then bounds that
    one call alone, shared with nobody.
    """
    actor = identity.actor
    if actor is None:
        if from_body:
            raise ChatRequestInvalid(
                f"run_id {from_body!r} can only be sent with the run's own acting credential "
                f"(the {ACTOR_METADATA_KEY!r} metadata the orchestrator sends); a call outside "
                "a run leaves run_id empty"
            )
        return ""
    if from_body and from_body != actor.run_id:
        raise ChatRequestInvalid(
            f"run_id {from_body!r} differs from the acting credential's run {actor.run_id!r}; "
            "leave run_id empty or send the same run"
        )
    return _text(actor.run_id, where="the acting credential's run_id")


def _text(value: str, *, where: str) -> str:
    """Text that PostgreSQL and every vendor can take: U+0000 is refused here, at the
    door, so neither the ledger's tables nor a vendor's request ever holds it."""
    if "\x00" in value:
        raise ChatRequestInvalid(
            f"{where} contains the character U+0000 (at position {value.index(chr(0))}), "
            "which cannot be stored or sent; remove it"
        )
    return value


def _message(message: gateway_pb2.Message, *, where: str) -> ChatMessage:
    role = _ROLES.get(message.role)
    if role is None:
        # The number itself, never MessageRole.Name(): an unknown number has no name.
        raise ChatRequestInvalid(
            f"{where}.role {message.role!r} is not a known role; "
            "use SYSTEM, USER, ASSISTANT or TOOL"
        )
    if message.tool_calls and role != "assistant":
        raise ChatRequestInvalid(f"{where} has tool_calls but role {role!r}; only ASSISTANT may")
    if role == "tool" and not message.tool_call_id:
        raise ChatRequestInvalid(f"{where} is a TOOL message without tool_call_id")
    calls = []
    for j, call in enumerate(message.tool_calls):
        at = f"{where}.tool_calls[{j}]"
        if not call.id or not call.name:
            raise ChatRequestInvalid(
                f"{at} needs an id and a name, got id={call.id!r} name={call.name!r}"
            )
        arguments = _text(call.arguments_json, where=f"{at}.arguments_json") or "{}"
        try:
            json.loads(arguments)
        except ValueError as exc:
            # Checked, never re-serialised: the text goes on exactly as it came.
            raise ChatRequestInvalid(
                f"{at}.arguments_json is not JSON ({exc}); send the arguments as JSON text, "
                'e.g. {"query": "..."}'
            ) from exc
        calls.append(
            ToolCall(
                id=_text(call.id, where=f"{at}.id"),
                name=_text(call.name, where=f"{at}.name"),
                arguments_json=arguments,
            )
        )
    return ChatMessage(
        role=role,
        content=_text(message.content, where=f"{where}.content"),
        tool_calls=tuple(calls),
        tool_call_id=_text(message.tool_call_id, where=f"{where}.tool_call_id"),
        name=_text(message.name, where=f"{where}.name"),
    )


def _tools(tools: Iterable[gateway_pb2.ToolDefinition]) -> tuple[ToolDefinition, ...]:
    parsed: list[ToolDefinition] = []
    for i, tool in enumerate(tools):
        if not _TOOL_NAME.match(tool.name):
            raise ChatRequestInvalid(
                f"tools[{i}].name {tool.name!r} is not a valid tool name; use 1-64 of A-Z a-z 0-9 _ -"
            )
        if any(t.name == tool.name for t in parsed):
            raise ChatRequestInvalid(f"tools[{i}].name {tool.name!r} is offered twice")
        schema: object = _EMPTY_SCHEMA
        schema_text = _text(
            tool.parameters_json_schema, where=f"tools[{i}] ({tool.name!r}).parameters_json_schema"
        )
        if schema_text.strip():
            try:
                schema = json.loads(schema_text)
            except ValueError as exc:
                raise ChatRequestInvalid(
                    f"tools[{i}] ({tool.name!r}).parameters_json_schema is not JSON: {exc}"
                ) from exc
        if not isinstance(schema, dict):
            raise ChatRequestInvalid(
                f"tools[{i}] ({tool.name!r}).parameters_json_schema must be a JSON object "
                f"(a JSON schema of the arguments), got {type(schema).__name__}"
            )
        parsed.append(
            ToolDefinition(
                name=tool.name,
                description=_text(
                    tool.description, where=f"tools[{i}] ({tool.name!r}).description"
                ),
                parameters=schema,
            )
        )
    return tuple(parsed)


def embed_texts_from_proto(request: gateway_pb2.EmbedRequest) -> tuple[list[str], str]:
    texts = [_text(t, where=f"texts[{i}]") for i, t in enumerate(request.texts)]
    return texts, _text(request.model, where="model").strip()


# --- to proto --------------------------------------------------------------------


def chat_response_to_proto(result: ChatResult) -> gateway_pb2.ChatResponse:
    completion = result.completion
    message = completion.message
    return gateway_pb2.ChatResponse(
        message=gateway_pb2.Message(
            role=_ROLE_TO_PROTO[message.role],
            content=message.content,
            tool_calls=[
                gateway_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json)
                for c in message.tool_calls
            ],
        ),
        finish_reason=completion.finish_reason,
        usage=gateway_pb2.Usage(
            prompt_tokens=completion.usage.prompt_tokens,
            completion_tokens=completion.usage.completion_tokens,
            total_tokens=completion.usage.total_tokens,
        ),
        provider=result.provider,
        model=completion.model,
        attempts=[attempt_to_proto(a) for a in result.attempts],
    )


def attempt_to_proto(attempt: Attempt) -> gateway_pb2.Attempt:
    proto = gateway_pb2.Attempt(
        provider=attempt.provider,
        model=attempt.model,
        outcome=_OUTCOME_TO_PROTO[attempt.outcome],  # type: ignore[arg-type]
        http_status=attempt.http_status,
        detail=attempt.detail,
    )
    proto.latency.FromNanoseconds(int(attempt.latency_seconds * 1e9))
    return proto


def model_info_to_proto(listing: ModelListing) -> gateway_pb2.ModelInfo:
    return gateway_pb2.ModelInfo(
        provider=listing.provider,
        model=listing.model,
        tiers=[_TIER_TO_PROTO[t] for t in listing.tiers],  # type: ignore[misc]
        offline_demo=listing.offline_demo,
    )
