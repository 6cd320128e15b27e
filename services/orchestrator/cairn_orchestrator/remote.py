"""The gateway, retrieval and memory services, reached over gRPC through their
generated stubs, with protos converted to domain values at this door.

Every call carries the caller's own token for authorization and the run's actor
token for provenance (DESIGN §5, I1). Any gRPC failure becomes DependencyFailed
naming the service and status, so the loop can record it as data (I11).
Channels are opened lazily, inside the running event loop, on first use.

No repeated work in a run: the loop shares the run's knowledge prefetch with this
door (`run_searches`, a context variable the run's task sets), and a search with
the same query, sources and credentials, for no more results, is answered from it
instead of reaching retrieval again; the call that was is marked in
`reused_searches`, so its step can say so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import grpc
from google.protobuf import timestamp_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_orchestrator.domain import (
    SUBJECT_KINDS,
    ArchivedBlock,
    CallCredentials,
    ChatMessage,
    ClaimTypeName,
    KnowledgeChunk,
    MemorySubject,
    ModelAttempt,
    ModelReply,
    ModelRequest,
    ProfileFact,
    RecalledMemory,
    RecallOutcome,
    RememberOutcome,
    SearchOutcome,
    SubjectKindName,
    TokenUsage,
    ToolCallRequest,
)
from cairn_orchestrator.errors import DependencyFailed

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")

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


async def _call(
    service: str,
    rpc: grpc.aio.UnaryUnaryMultiCallable[_Request, _Response],
    request: _Request,
    credentials: CallCredentials,
    deadline_seconds: float,
) -> _Response:
    """One unary call carrying the caller's and the run's tokens; any gRPC failure
    becomes DependencyFailed naming the service and status (I11)."""
    try:
        return await rpc(request, metadata=_metadata(credentials), timeout=deadline_seconds)
    except grpc.aio.AioRpcError as exc:
        raise _failure(service, exc) from exc


def _failure(service: str, exc: grpc.aio.AioRpcError) -> DependencyFailed:
    return DependencyFailed(
        service, exc.code().name, exc.details() or "", reason=_error_reason(exc)
    )


def _error_reason(exc: grpc.aio.AioRpcError) -> str:
    """The google.rpc ErrorInfo reason a cairn service attaches to every refusal; it
    tells apart refusals that share a status code (a rate limit, a run's budget)."""
    # The stubs type this as the sync API's tuple; at run time it is aio Metadata,
    # which iterates as (key, value) pairs too.
    trailing: Any = exc.trailing_metadata()
    for key, value in trailing or ():
        if key != "grpc-status-details-bin" or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except DecodeError:
            return ""
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return str(info.reason)
    return ""


def _enum_name(enum: Any, value: int, prefix: str) -> str:
    """An enum value a peer sent, by name; a number this build does not know (a
    newer peer) reads as UNKNOWN_<n> instead of failing the whole reply."""
    try:
        name: str = enum.Name(value)
    except ValueError:
        return f"UNKNOWN_{value}"
    return name.removeprefix(prefix)


def _history_arguments(arguments_json: str) -> str:
    """A tool call's arguments as the next request repeats them. Arguments a model
    left unparseable (a call cut off at max_tokens) were already answered as
    tool.invalid_input; sent back as they were, the gateway would refuse the whole
    request. The trajectory keeps the original text."""
    try:
        json.loads(arguments_json)
    except ValueError:
        return "{}"
    return arguments_json


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
                    gateway_pb2.ToolCall(
                        id=c.id, name=c.name, arguments_json=_history_arguments(c.arguments_json)
                    )
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
                outcome=_enum_name(gateway_pb2.AttemptOutcome, a.outcome, "ATTEMPT_OUTCOME_"),
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
        response = await _call(
            "gateway", stub.Chat, chat_request_to_proto(request), credentials, deadline_seconds
        )
        return chat_reply_from_proto(response)

    async def close(self) -> None:
        await self._channel.close()


# ---------------------------------------------------------------- retrieval


@dataclass(frozen=True, slots=True)
class PrefetchedSearch:
    """A search a run has already made (its knowledge prefetch) and what it found."""

    query: str
    sources: tuple[str, ...]
    k: int
    credentials: CallCredentials
    outcome: SearchOutcome

    def answer(
        self, *, query: str, sources: Sequence[str], k: int, credentials: CallCredentials
    ) -> SearchOutcome | None:
        """The same search again (same query, sources and caller, I1/I7), for at most
        as many results, is answered from this one; anything else is None."""
        if (
            query != self.query
            or tuple(sources) != self.sources
            or k > self.k
            or credentials != self.credentials
        ):
            return None
        return replace(self.outcome, results=self.outcome.results[:k])


@dataclass(slots=True)
class RunSearches:
    """The searches one run shares with this door; the loop fills in the prefetch."""

    prefetched: PrefetchedSearch | None = None


run_searches: ContextVar[RunSearches | None] = ContextVar("cairn_run_searches", default=None)
# Set by the loop around one tool call; a search answered from the prefetch adds its query.
reused_searches: ContextVar[list[str] | None] = ContextVar("cairn_reused_searches", default=None)


def _reused(
    *, query: str, sources: Sequence[str], k: int, credentials: CallCredentials
) -> SearchOutcome | None:
    searches = run_searches.get()
    if searches is None or searches.prefetched is None:
        return None
    outcome = searches.prefetched.answer(query=query, sources=sources, k=k, credentials=credentials)
    if outcome is not None:
        marks = reused_searches.get()
        if marks is not None:
            marks.append(query)
    return outcome


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
        mode=_enum_name(retrieval_pb2.SearchMode, response.mode, "SEARCH_MODE_"),
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
        reused = _reused(query=query, sources=sources, k=k, credentials=credentials)
        if reused is not None:
            return reused
        stub = retrieval_pb2_grpc.RetrievalServiceStub(self._channel.get())
        response = await _call(
            "retrieval",
            stub.Search,
            retrieval_pb2.SearchRequest(query=query, sources=list(sources), k=k),
            credentials,
            deadline_seconds,
        )
        return search_outcome_from_proto(response)

    async def close(self) -> None:
        await self._channel.close()


# ---------------------------------------------------------------- memory


def memory_from_proto(m: memory_pb2.Memory) -> RecalledMemory:
    provenance = m.provenance
    return RecalledMemory(
        memory_id=m.memory_id,
        text=m.text,
        subject_kind=_enum_name(memory_pb2.SubjectKind, m.subject.kind, "SUBJECT_KIND_"),
        subject_id=m.subject.id,
        author_kind=_enum_name(memory_pb2.AuthorKind, provenance.author_kind, "AUTHOR_KIND_"),
        author_id=provenance.author_id,
        run_id=provenance.run_id,
        created_at=_moment(provenance.HasField("created_at"), provenance.created_at),
        expires_at=_moment(provenance.HasField("expires_at"), provenance.expires_at),
        score=m.score,
        claim_type=_enum_name(memory_pb2.ClaimType, m.claim_type, "CLAIM_TYPE_"),
        state=_enum_name(memory_pb2.MemoryState, m.state, "MEMORY_STATE_"),
        valid_from=_moment(m.HasField("valid_from"), m.valid_from),
        valid_until=_moment(m.HasField("valid_until"), m.valid_until),
    )


def profile_fact_from_proto(fact: memory_pb2.ProfileFact) -> ProfileFact:
    provenance = fact.provenance
    return ProfileFact(
        subject_kind=_enum_name(memory_pb2.SubjectKind, fact.subject.kind, "SUBJECT_KIND_"),
        subject_id=fact.subject.id,
        key=fact.fact_key,
        value=fact.value,
        author_kind=_enum_name(memory_pb2.AuthorKind, provenance.author_kind, "AUTHOR_KIND_"),
        author_id=provenance.author_id,
        run_id=provenance.run_id,
        created_at=_moment(provenance.HasField("created_at"), provenance.created_at),
        expires_at=_moment(provenance.HasField("expires_at"), provenance.expires_at),
        readable=fact.readable,
        earlier_values=tuple(v.value for v in fact.history if v.readable),
    )


def recall_outcome_from_proto(response: memory_pb2.RecallResponse) -> RecallOutcome:
    return RecallOutcome(
        memories=tuple(memory_from_proto(m) for m in response.memories),
        mode=_enum_name(memory_pb2.RecallMode, response.mode, "RECALL_MODE_"),
        mode_reason=response.mode_reason,
        profile=tuple(profile_fact_from_proto(f) for f in response.profile),
    )


def subject_to_proto(subject: MemorySubject) -> memory_pb2.Subject:
    return memory_pb2.Subject(
        kind=memory_pb2.SubjectKind.Value(f"SUBJECT_KIND_{subject.kind}"), id=subject.id
    )


def block_from_proto(block: memory_pb2.Block) -> ArchivedBlock:
    return ArchivedBlock(
        block_id=block.block_id,
        label=block.label,
        role=block.role,
        content=block.content,
        conversation_id=block.conversation_id,
        created_at=_moment(block.HasField("created_at"), block.created_at),
        readable=block.readable and not block.erased,
        subjects=tuple(subject_from_proto(about) for about in block.subjects),
    )


def subject_from_proto(subject: memory_pb2.Subject) -> MemorySubject:
    name = _enum_name(memory_pb2.SubjectKind, subject.kind, "SUBJECT_KIND_")
    kind: SubjectKindName = next((k for k in SUBJECT_KINDS if k == name), "WORKSPACE")
    return MemorySubject(kind=kind, id=subject.id)


class MemoryClient:
    """The memory service: recall for the turn, and everything the memory tools do.
    Every call carries the caller's token (whose memories) and the run's actor token
    (so what the run writes is recorded as an agent's, in this run)."""

    def __init__(self, target: str) -> None:
        self._channel = _LazyChannel(target)

    def _stub(self) -> memory_pb2_grpc.MemoryServiceAsyncStub:
        return memory_pb2_grpc.MemoryServiceStub(self._channel.get())

    async def recall(
        self,
        *,
        query: str,
        k: int,
        credentials: CallCredentials,
        deadline_seconds: float,
        subject: MemorySubject | None = None,
        include_profile: bool = False,
    ) -> RecallOutcome:
        request = memory_pb2.RecallRequest(query=query, k=k, include_profile=include_profile)
        if subject is not None:
            request.subject.CopyFrom(subject_to_proto(subject))
        response = await _call(
            "memory", self._stub().Recall, request, credentials, deadline_seconds
        )
        return recall_outcome_from_proto(response)

    async def remember(
        self,
        *,
        text: str,
        subject: MemorySubject,
        claim_type: ClaimTypeName,
        tags: Sequence[str],
        importance: int,
        credentials: CallCredentials,
        deadline_seconds: float,
    ) -> RememberOutcome:
        request = memory_pb2.RememberRequest(
            text=text,
            subject=subject_to_proto(subject),
            tags=list(tags),
            importance=importance,
            claim_type=memory_pb2.ClaimType.Value(f"CLAIM_TYPE_{claim_type}"),
        )
        response = await _call(
            "memory", self._stub().Remember, request, credentials, deadline_seconds
        )
        return RememberOutcome(
            memory=memory_from_proto(response.memory), already_held=response.already_held
        )

    async def update_profile(
        self,
        *,
        subject: MemorySubject,
        key: str,
        value: str,
        previous_value: str | None,
        credentials: CallCredentials,
        deadline_seconds: float,
    ) -> ProfileFact:
        request = memory_pb2.UpdateProfileRequest(
            subject=subject_to_proto(subject), fact_key=key, value=value
        )
        if previous_value is not None:
            request.previous_value = previous_value
        response = await _call(
            "memory", self._stub().UpdateProfile, request, credentials, deadline_seconds
        )
        return profile_fact_from_proto(response.fact)

    async def archive(
        self,
        *,
        label: str,
        role: str,
        content: str,
        conversation_id: str,
        credentials: CallCredentials,
        deadline_seconds: float,
        subjects: Sequence[MemorySubject] = (),
    ) -> str:
        request = memory_pb2.ArchiveRequest(
            label=label,
            role=role,
            content=content,
            conversation_id=conversation_id,
            subjects=[subject_to_proto(about) for about in subjects],
        )
        response = await _call(
            "memory", self._stub().Archive, request, credentials, deadline_seconds
        )
        block_id: str = response.block_id
        return block_id

    async def recall_block(
        self, *, block_id: str, credentials: CallCredentials, deadline_seconds: float
    ) -> ArchivedBlock:
        response = await _call(
            "memory",
            self._stub().RecallBlock,
            memory_pb2.RecallBlockRequest(block_id=block_id),
            credentials,
            deadline_seconds,
        )
        return block_from_proto(response.block)

    async def search_blocks(
        self, *, query: str, limit: int, credentials: CallCredentials, deadline_seconds: float
    ) -> list[ArchivedBlock]:
        response = await _call(
            "memory",
            self._stub().SearchBlocks,
            memory_pb2.SearchBlocksRequest(query=query, limit=limit),
            credentials,
            deadline_seconds,
        )
        return [block_from_proto(b) for b in response.blocks]

    async def close(self) -> None:
        await self._channel.close()
