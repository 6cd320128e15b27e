"""The gateway, retrieval and memory services, reached over gRPC through their
generated stubs, with protos converted to domain values at this door.

Every call carries the caller's own token for authorization and the run's actor
token for provenance (DESIGN §5, I1). Any gRPC failure becomes DependencyFailed
naming the service and status, so the loop can record it as data (I11).
Channels are opened lazily, inside the running event loop, on first use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime

import grpc
from google.protobuf import timestamp_pb2

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_orchestrator.domain import (
    CallCredentials,
    ChatMessage,
    KnowledgeChunk,
    ModelAttempt,
    ModelReply,
    ModelRequest,
    RecalledMemory,
    RecallOutcome,
    SearchOutcome,
    TokenUsage,
    ToolCallRequest,
)
from cairn_orchestrator.errors import DependencyFailed

_TIERS = {
    "fast": gateway_pb2.TIER_FAST,
    "balanced": gateway_pb2.TIER_BALANCED,
    "deep": gateway_pb2.TIER_DEEP,
}
_ROLES_OUT = {
    "system": gateway_pb2.MESSAGE_ROLE_SYSTEM,
    "user": gateway_pb2.MESSAGE_ROLE_USER,
    "assistant": gateway_pb2.MESSAGE_ROLE_ASSISTANT,
    "tool": gateway_pb2.MESSAGE_ROLE_TOOL,
}


class _LazyChannel:
    def __init__(self, target: str) -> None:
        self.target = target
        self._channel: grpc.aio.Channel | None = None

    def get(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = channel(self.target)
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None


def _metadata(credentials: CallCredentials) -> tuple[tuple[str, str], ...]:
    return call_metadata(credentials.caller_token, actor_token=credentials.actor_token)


def _failure(service: str, exc: grpc.aio.AioRpcError) -> DependencyFailed:
    return DependencyFailed(service, exc.code().name, exc.details() or "")


def _enum_name(name: str, prefix: str) -> str:
    return name.removeprefix(prefix)


def _moment(message_has: bool, value: timestamp_pb2.Timestamp) -> datetime | None:
    return value.ToDatetime(tzinfo=UTC) if message_has else None


# ---------------------------------------------------------------- gateway


def chat_request_to_proto(request: ModelRequest) -> gateway_pb2.ChatRequest:
    return gateway_pb2.ChatRequest(
        messages=[
            gateway_pb2.Message(
                role=_ROLES_OUT[m.role],
                content=m.content,
                tool_calls=[
                    gateway_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json)
                    for c in m.tool_calls
                ],
                tool_call_id=m.tool_call_id,
                name=m.name,
            )
            for m in request.messages
        ],
        tools=[
            gateway_pb2.ToolDefinition(
                name=t.name,
                description=t.description,
                parameters_json_schema=json.dumps(t.parameters, separators=(",", ":")),
            )
            for t in request.tools
        ],
        tier=_TIERS[request.tier],
        max_tokens=request.max_tokens,
        run_id=request.run_id,
        remaining_budget_tokens=request.remaining_budget_tokens,
        pinned_provider=request.pinned_provider,
    )


def chat_reply_from_proto(response: gateway_pb2.ChatResponse) -> ModelReply:
    message = response.message
    return ModelReply(
        message=ChatMessage(
            role="assistant",
            content=message.content,
            tool_calls=tuple(
                ToolCallRequest(id=c.id, name=c.name, arguments_json=c.arguments_json)
                for c in message.tool_calls
            ),
        ),
        finish_reason=response.finish_reason,
        usage=TokenUsage(
            prompt_tokens=response.usage.prompt_tokens,
            completion_tokens=response.usage.completion_tokens,
            total_tokens=response.usage.total_tokens,
        ),
        provider=response.provider,
        model=response.model,
        attempts=tuple(
            ModelAttempt(
                provider=a.provider,
                model=a.model,
                outcome=_enum_name(gateway_pb2.AttemptOutcome.Name(a.outcome), "ATTEMPT_OUTCOME_"),
                http_status=a.http_status,
                latency_ms=round(a.latency.seconds * 1000 + a.latency.nanos / 1e6, 3),
                detail=a.detail,
            )
            for a in response.attempts
        ),
    )


class GatewayClient:
    def __init__(self, target: str) -> None:
        self._channel = _LazyChannel(target)

    async def chat(
        self, request: ModelRequest, credentials: CallCredentials, *, deadline_seconds: float
    ) -> ModelReply:
        stub = gateway_pb2_grpc.GatewayServiceStub(self._channel.get())
        try:
            response = await stub.Chat(
                chat_request_to_proto(request),
                metadata=_metadata(credentials),
                timeout=deadline_seconds,
            )
        except grpc.aio.AioRpcError as exc:
            raise _failure("gateway", exc) from exc
        return chat_reply_from_proto(response)

    async def close(self) -> None:
        await self._channel.close()


# ---------------------------------------------------------------- retrieval


def search_outcome_from_proto(response: retrieval_pb2.SearchResponse) -> SearchOutcome:
    return SearchOutcome(
        results=tuple(
            KnowledgeChunk(
                document_id=r.document_id,
                chunk_id=r.chunk_id,
                source=r.source,
                title=r.title,
                char_start=r.char_start,
                char_end=r.char_end,
                text=r.text,
                bm25_score=r.bm25_score,
                dense_score=r.dense_score,
                fused_score=r.fused_score,
            )
            for r in response.results
        ),
        mode=_enum_name(retrieval_pb2.SearchMode.Name(response.mode), "SEARCH_MODE_"),
        mode_reason=response.mode_reason,
    )


class RetrievalClient:
    def __init__(self, target: str) -> None:
        self._channel = _LazyChannel(target)

    async def search(
        self,
        *,
        query: str,
        sources: Sequence[str],
        k: int,
        credentials: CallCredentials,
        deadline_seconds: float,
    ) -> SearchOutcome:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(self._channel.get())
        try:
            response = await stub.Search(
                retrieval_pb2.SearchRequest(query=query, sources=list(sources), k=k),
                metadata=_metadata(credentials),
                timeout=deadline_seconds,
            )
        except grpc.aio.AioRpcError as exc:
            raise _failure("retrieval", exc) from exc
        return search_outcome_from_proto(response)

    async def close(self) -> None:
        await self._channel.close()


# ---------------------------------------------------------------- memory


def recall_outcome_from_proto(response: memory_pb2.RecallResponse) -> RecallOutcome:
    memories = []
    for m in response.memories:
        provenance = m.provenance
        memories.append(
            RecalledMemory(
                memory_id=m.memory_id,
                text=m.text,
                subject_kind=_enum_name(
                    memory_pb2.SubjectKind.Name(m.subject.kind), "SUBJECT_KIND_"
                ),
                subject_id=m.subject.id,
                author_kind=_enum_name(
                    memory_pb2.AuthorKind.Name(provenance.author_kind), "AUTHOR_KIND_"
                ),
                author_id=provenance.author_id,
                run_id=provenance.run_id,
                created_at=_moment(provenance.HasField("created_at"), provenance.created_at),
                expires_at=_moment(provenance.HasField("expires_at"), provenance.expires_at),
                score=m.score,
                claim_type=_enum_name(memory_pb2.ClaimType.Name(m.claim_type), "CLAIM_TYPE_"),
                state=_enum_name(memory_pb2.MemoryState.Name(m.state), "MEMORY_STATE_"),
                valid_from=_moment(m.HasField("valid_from"), m.valid_from),
                valid_until=_moment(m.HasField("valid_until"), m.valid_until),
            )
        )
    return RecallOutcome(
        memories=tuple(memories),
        mode=_enum_name(memory_pb2.RecallMode.Name(response.mode), "RECALL_MODE_"),
        mode_reason=response.mode_reason,
    )


class MemoryClient:
    def __init__(self, target: str) -> None:
        self._channel = _LazyChannel(target)

    async def recall(
        self, *, query: str, k: int, credentials: CallCredentials, deadline_seconds: float
    ) -> RecallOutcome:
        stub = memory_pb2_grpc.MemoryServiceStub(self._channel.get())
        try:
            response = await stub.Recall(
                memory_pb2.RecallRequest(query=query, k=k),
                metadata=_metadata(credentials),
                timeout=deadline_seconds,
            )
        except grpc.aio.AioRpcError as exc:
            raise _failure("memory", exc) from exc
        return recall_outcome_from_proto(response)

    async def close(self) -> None:
        await self._channel.close()
