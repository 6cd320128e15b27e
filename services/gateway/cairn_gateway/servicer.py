"""The gRPC door of the gateway: proto in, domain call, proto out.

Conversion happens here and nowhere else; a proto object never goes past this
module. Malformed input (an unspecified role, a tool schema that is not a JSON
object) is refused at the door with the bad value named.
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
from cairn_libs.identity import CallIdentity
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
        result = await self._embeddings.embed(list(request.texts), model=request.model)
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
    if request.max_tokens < 0:
        raise ChatRequestInvalid(
            f"max_tokens {request.max_tokens!r} is negative; use a positive number, or 0 for the default"
        )
    if request.tier not in _TIERS and request.tier != gateway_pb2.TIER_UNSPECIFIED:
        raise ChatRequestInvalid(f"tier {request.tier!r} is not known; use FAST, BALANCED or DEEP")
    temperature = request.temperature if request.HasField("temperature") else None
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise ChatRequestInvalid(f"temperature {temperature!r} is outside 0..2")
    budget = (
        request.remaining_budget_tokens if request.HasField("remaining_budget_tokens") else None
    )
    if budget is not None and budget < 0:
        raise ChatRequestInvalid(
            f"remaining_budget_tokens {budget!r} is negative; send 0 for an exhausted budget"
        )
    return ChatRequest(
        messages=tuple(_message(m, where=f"messages[{i}]") for i, m in enumerate(request.messages)),
        tools=_tools(request.tools),
        tier=_TIERS.get(request.tier),
        model=request.model.strip(),
        max_tokens=request.max_tokens or None,
        run_id=_run_id(request.run_id, identity),
        remaining_budget_tokens=budget,
        temperature=temperature,
        pinned_provider=request.pinned_provider.strip(),
    )


def _run_id(from_body: str, identity: CallIdentity) -> str:
    actor = identity.actor
    if actor is None:
        return from_body
    if from_body and from_body != actor.run_id:
        raise ChatRequestInvalid(
            f"run_id {from_body!r} differs from the acting credential's run {actor.run_id!r}; "
            "leave run_id empty or send the same run"
        )
    return actor.run_id


def _message(message: gateway_pb2.Message, *, where: str) -> ChatMessage:
    role = _ROLES.get(message.role)
    if role is None:
        raise ChatRequestInvalid(
            f"{where}.role {message.role!r} is not set; use SYSTEM, USER, ASSISTANT or TOOL"
        )
    if message.tool_calls and role != "assistant":
        raise ChatRequestInvalid(f"{where} has tool_calls but role {role!r}; only ASSISTANT may")
    if role == "tool" and not message.tool_call_id:
        raise ChatRequestInvalid(f"{where} is a TOOL message without tool_call_id")
    calls = []
    for j, call in enumerate(message.tool_calls):
        if not call.id or not call.name:
            raise ChatRequestInvalid(
                f"{where}.tool_calls[{j}] needs an id and a name, got id={call.id!r} name={call.name!r}"
            )
        calls.append(
            ToolCall(id=call.id, name=call.name, arguments_json=call.arguments_json or "{}")
        )
    return ChatMessage(
        role=role,
        content=message.content,
        tool_calls=tuple(calls),
        tool_call_id=message.tool_call_id,
        name=message.name,
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
        if tool.parameters_json_schema.strip():
            try:
                schema = json.loads(tool.parameters_json_schema)
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
            ToolDefinition(name=tool.name, description=tool.description, parameters=schema)
        )
    return tuple(parsed)


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
