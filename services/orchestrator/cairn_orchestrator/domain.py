"""The orchestrator's nouns: agent specs, runs, steps, messages, knowledge, and the
state a run carries from one phase of the loop to the next.

Plain frozen dataclasses with their JSON forms. Proto objects never reach this
module; the servicer and the remote adapters convert at their doors. The JSON
forms exist because a run's state is persisted after every step (so a later
confirmation can resume the run from where it stopped, with nothing replayed).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal, Self, TypeAlias, cast

JSONValue: TypeAlias = Any
"""A value json.dumps accepts; kept as Any because JSON is recursive."""

Tier = Literal["fast", "balanced", "deep"]
TIERS: tuple[Tier, ...] = ("fast", "balanced", "deep")
Role = Literal["system", "user", "assistant", "tool"]
TurnRole = Literal["user", "assistant"]
Phase = Literal["call_model", "execute_tools", "confirm_writes", "finished"]
PHASES: tuple[Phase, ...] = ("call_model", "execute_tools", "confirm_writes", "finished")
Decision = Literal["approve", "deny"]
CardLanguage = Literal["en", "zh-Hans"]
CARD_LANGUAGES: tuple[CardLanguage, ...] = ("en", "zh-Hans")

ADMIN_ROLE = "admin"


class RunState(StrEnum):
    RUNNING = "RUNNING"
    CONFIRMATION_PENDING = "CONFIRMATION_PENDING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    CANCELLED = "CANCELLED"

    @property
    def at_rest(self) -> bool:
        """True once nothing will happen to the run without a person acting."""
        return self is not RunState.RUNNING

    @property
    def terminal(self) -> bool:
        """True once nothing will ever happen to the run again."""
        return self not in (RunState.RUNNING, RunState.CONFIRMATION_PENDING)


class StepKind(StrEnum):
    MODEL_CALL = "MODEL_CALL"
    TOOL_CALL = "TOOL_CALL"
    RETRIEVAL = "RETRIEVAL"
    MEMORY_READ = "MEMORY_READ"
    CONFIRMATION_REQUESTED = "CONFIRMATION_REQUESTED"
    CONFIRMATION_RESOLVED = "CONFIRMATION_RESOLVED"
    CONVERSATION_ARCHIVE = "CONVERSATION_ARCHIVE"


_SCALARS: dict[str, Callable[[Any], Any]] = {"str": str, "int": int, "float": float, "bool": bool}


class JsonRecord:
    """A flat record (str, int, float and bool fields) stored as the JSON object of
    its fields. Read back, each value is coerced to its field's type; a field with
    a default may be missing (a row written before the field existed), one without
    must be there. One definition, so a new field cannot be written but not read."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(cast(Any, self))}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Self:
        arguments: dict[str, Any] = {}
        for f in fields(cast(Any, cls)):
            found = value[f.name] if f.name in value or f.default is MISSING else f.default
            arguments[f.name] = _SCALARS[str(f.type)](found)
        return cls(**arguments)


@dataclass(frozen=True, slots=True)
class Budgets:
    tokens: int
    model_calls: int
    wall_seconds: int


@dataclass(frozen=True, slots=True)
class AgentSpec:
    name: str
    description: str
    tier: Tier
    system_prompt: str
    tools: tuple[str, ...]
    sources: tuple[str, ...]
    budgets: Budgets
    reads_memory: bool
    file: str = ""


@dataclass(frozen=True, slots=True)
class ErrorValue(JsonRecord):
    """A failure as data (I3): what the loop records and what the model reads."""

    code: str
    message: str


@dataclass(frozen=True, slots=True)
class CallCredentials:
    """What every outgoing call carries: the caller's own token (authorization, I1)
    and the run's actor token (provenance only)."""

    caller_token: str
    actor_token: str


# ---------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class ToolCallRequest(JsonRecord):
    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str
    tool_calls: tuple[ToolCallRequest, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "content": self.content,
            "tool_calls": [call.to_json() for call in self.tool_calls],
            "tool_call_id": self.tool_call_id,
            "name": self.name,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> ChatMessage:
        role = value["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"stored message role {role!r} is not one of system, user, assistant, tool"
            )
        return cls(
            role=role,
            content=str(value.get("content", "")),
            tool_calls=tuple(ToolCallRequest.from_json(c) for c in value.get("tool_calls", ())),
            tool_call_id=str(value.get("tool_call_id", "")),
            name=str(value.get("name", "")),
        )


@dataclass(frozen=True, slots=True)
class ConversationTurn:
    """One earlier turn as the caller's client kept it."""

    role: TurnRole
    content: str


# ---------------------------------------------------------------- model calls


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    name: str
    description: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ModelRequest:
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolDefinition, ...]
    tier: Tier
    max_tokens: int
    run_id: str
    remaining_budget_tokens: int
    # The provider that made the tool calls already in `messages` (gateway pins to it).
    pinned_provider: str = ""


@dataclass(frozen=True, slots=True)
class TokenUsage(JsonRecord):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ModelAttempt(JsonRecord):
    provider: str
    model: str
    outcome: str
    http_status: int
    latency_ms: float
    detail: str


@dataclass(frozen=True, slots=True)
class ModelReply:
    message: ChatMessage
    finish_reason: str
    usage: TokenUsage
    provider: str
    model: str
    attempts: tuple[ModelAttempt, ...] = ()


@dataclass(frozen=True, slots=True)
class RunUsage(JsonRecord):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    model_calls: int = 0

    def plus(self, usage: TokenUsage) -> RunUsage:
        """One more model call and what it cost."""
        return RunUsage(
            prompt_tokens=self.prompt_tokens + usage.prompt_tokens,
            completion_tokens=self.completion_tokens + usage.completion_tokens,
            total_tokens=self.total_tokens
            + max(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens),
            model_calls=self.model_calls + 1,
        )


# ---------------------------------------------------------------- knowledge and memory


@dataclass(frozen=True, slots=True)
class KnowledgeChunk(JsonRecord):
    document_id: str
    chunk_id: str
    source: str
    title: str
    char_start: int
    char_end: int
    text: str
    bm25_score: float = 0.0
    dense_score: float = 0.0
    fused_score: float = 0.0


@dataclass(frozen=True, slots=True)
class LabelledChunk:
    """A chunk retrieved for this caller in this run, with the label the model cites."""

    label: str
    chunk: KnowledgeChunk

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "chunk": self.chunk.to_json()}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> LabelledChunk:
        return cls(label=str(value["label"]), chunk=KnowledgeChunk.from_json(value["chunk"]))


class LabelBook:
    """Hands out S1, S2, … to the chunks a run has retrieved, in the order they
    arrive. A chunk seen again keeps its first label, so the model can cite a
    passage the same way whether it came from the prefetch or a later search."""

    def __init__(self, existing: Sequence[LabelledChunk] = ()) -> None:
        self._entries: list[LabelledChunk] = list(existing)
        self._by_chunk = {(e.chunk.document_id, e.chunk.chunk_id): e for e in self._entries}

    def label(self, chunk: KnowledgeChunk) -> LabelledChunk:
        key = (chunk.document_id, chunk.chunk_id)
        known = self._by_chunk.get(key)
        if known is not None:
            return known
        entry = LabelledChunk(label=f"S{len(self._entries) + 1}", chunk=chunk)
        self._entries.append(entry)
        self._by_chunk[key] = entry
        return entry

    @property
    def entries(self) -> tuple[LabelledChunk, ...]:
        return tuple(self._entries)


@dataclass(frozen=True, slots=True)
class SearchOutcome:
    results: tuple[KnowledgeChunk, ...]
    mode: str
    mode_reason: str


@dataclass(frozen=True, slots=True)
class RecalledMemory:
    memory_id: str
    text: str
    subject_kind: str
    subject_id: str
    author_kind: str
    author_id: str
    run_id: str
    created_at: datetime | None
    expires_at: datetime | None
    score: float = 0.0
    claim_type: str = ""
    state: str = ""
    valid_from: datetime | None = None
    valid_until: datetime | None = None


@dataclass(frozen=True, slots=True)
class RecallOutcome:
    memories: tuple[RecalledMemory, ...]
    mode: str
    mode_reason: str
    profile: tuple[ProfileFact, ...] = ()


SubjectKindName = Literal["WORKSPACE", "USER", "CANDIDATE", "EMPLOYEE", "CUSTOMER"]
SUBJECT_KINDS: tuple[SubjectKindName, ...] = (
    "WORKSPACE",
    "USER",
    "CANDIDATE",
    "EMPLOYEE",
    "CUSTOMER",
)
ClaimTypeName = Literal["UNKNOWN", "USER_STATEMENT", "INFERENCE"]


@dataclass(frozen=True, slots=True)
class MemorySubject:
    """Whom (or what) a memory is about; `id` is empty only for the workspace."""

    kind: SubjectKindName
    id: str = ""

    @property
    def is_person(self) -> bool:
        return self.kind != "WORKSPACE"


@dataclass(frozen=True, slots=True)
class RememberOutcome:
    memory: RecalledMemory
    already_held: bool


@dataclass(frozen=True, slots=True)
class ProfileFact:
    """A stable keyed fact about a subject, as the memory service holds it now."""

    subject_kind: str
    subject_id: str
    key: str
    value: str
    author_kind: str
    author_id: str
    run_id: str
    created_at: datetime | None
    expires_at: datetime | None
    readable: bool = True
    earlier_values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ArchivedBlock:
    """A verbatim conversation block kept in the memory service's archive."""

    block_id: str
    label: str
    role: str
    content: str
    conversation_id: str
    created_at: datetime | None
    readable: bool = True
    # Whom it is about, as the archive says; an erasure of any of them reaches it.
    subjects: tuple[MemorySubject, ...] = ()


# ---------------------------------------------------------------- runs and steps


@dataclass(frozen=True, slots=True)
class Citation(JsonRecord):
    label: str
    document_id: str
    chunk_id: str
    source: str
    title: str
    char_start: int
    char_end: int


@dataclass(frozen=True, slots=True)
class Run:
    run_id: str
    org_id: str
    user_id: str
    agent: str
    state: RunState
    input: str
    conversation_id: str
    trace_id: str
    created_at: datetime
    updated_at: datetime
    answer: str = ""
    citations: tuple[Citation, ...] = ()
    # The run's root span (invoke_agent): a resumed run's spans join the same trace.
    root_span_id: str = ""
    reason: str = ""
    usage: RunUsage = field(default_factory=RunUsage)
    # Set while the run waits at CONFIRMATION_PENDING: what the person is asked.
    pending_confirmation: PendingConfirmation | None = None
    # The language cards are written in ("en" or "zh-Hans"), and whether the person
    # asked for one cairn has no text in (so cards fell back to English).
    language: CardLanguage = "en"
    language_fallback: bool = False
    # Set when a person stopped the run (CancelRun): their user id.
    cancelled_by: str = ""


@dataclass(frozen=True, slots=True)
class HeldCopy:
    """A text about a subject that a step of a run copied: a recalled memory or
    fact, an archived block, a memory the agent proposed (I9)."""

    subject_kind: str
    subject_id: str
    text: str


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A finished step before the store gives it its place (seq) in the run.
    `copies` names the texts about subjects the step copied, so an erasure of the
    subject finds them (I9); they are kept beside the run, not in its detail."""

    kind: StepKind
    name: str
    span_id: str
    started_at: datetime
    finished_at: datetime
    detail: Mapping[str, JSONValue]
    error: ErrorValue | None = None
    copies: tuple[HeldCopy, ...] = field(default=(), compare=False, repr=False)

    def at(self, seq: int) -> Step:
        """This record stored at its place in the run."""
        return Step(seq=seq, **{f.name: getattr(self, f.name) for f in fields(StepRecord)})


@dataclass(frozen=True, slots=True, kw_only=True)
class Step(StepRecord):
    """A step as stored: the record, at its place in the run."""

    seq: int


# ---------------------------------------------------------------- step details
#
# What the loop says about each kind of step. Each record's `to_json` is the
# object stored as the step's detail (and drawn by the panel): keys in this order,
# optional keys only when they apply, so a stored trajectory reads as it always did.


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReadDetail:
    """A recall at the start of a run; `mode` is None when no recall answered."""

    k: int
    mode: str | None = None
    mode_reason: str = ""
    memory_ids: tuple[str, ...] = ()

    def to_json(self) -> dict[str, JSONValue]:
        detail: dict[str, JSONValue] = {"k": self.k}
        if self.mode is not None:
            detail |= {"mode": self.mode, "mode_reason": self.mode_reason}
        return detail | {"count": len(self.memory_ids), "memory_ids": list(self.memory_ids)}


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrievalDetail:
    """The knowledge prefetch; `mode` is None when no search answered."""

    k: int
    sources: tuple[str, ...]
    mode: str | None = None
    mode_reason: str = ""
    results: tuple[LabelledChunk, ...] = ()

    def to_json(self) -> dict[str, JSONValue]:
        detail: dict[str, JSONValue] = {"k": self.k, "sources": list(self.sources)}
        if self.mode is not None:
            detail |= {"mode": self.mode, "mode_reason": self.mode_reason}
        results: list[JSONValue] = [
            {
                "label": entry.label,
                "document_id": entry.chunk.document_id,
                "chunk_id": entry.chunk.chunk_id,
                "source": entry.chunk.source,
                "title": entry.chunk.title,
                "char_start": entry.chunk.char_start,
                "char_end": entry.chunk.char_end,
                "bm25_score": entry.chunk.bm25_score,
                "dense_score": entry.chunk.dense_score,
                "fused_score": entry.chunk.fused_score,
            }
            for entry in self.results
        ]
        return detail | {"count": len(self.results), "results": results}


@dataclass(frozen=True, slots=True, kw_only=True)
class ArchivedTurnDetail:
    """One large earlier turn the archiver was asked to keep."""

    turn: int
    role: str
    chars: int
    block_id: str  # "" when it could not be archived
    already_archived: bool

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "turn": self.turn,
            "role": self.role,
            "chars": self.chars,
            "block_id": self.block_id,
            "already_archived": self.already_archived,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationArchiveDetail:
    """The conversation window a run opened with, and the turns archived for it."""

    conversation_id: str
    turns: int
    window_turns: int
    evicted_turns: int
    clipped_turns: int
    window_tokens: int
    archived: tuple[ArchivedTurnDetail, ...]
    cited_block_ids: tuple[str, ...]
    note: str = ""
    failed_turns: tuple[int, ...] = ()

    def to_json(self) -> dict[str, JSONValue]:
        detail: dict[str, JSONValue] = {
            "conversation_id": self.conversation_id,
            "turns": self.turns,
            "window_turns": self.window_turns,
            "evicted_turns": self.evicted_turns,
            "clipped_turns": self.clipped_turns,
            "window_tokens": self.window_tokens,
            "archived": [turn.to_json() for turn in self.archived],
            "cited_block_ids": list(self.cited_block_ids),
        }
        if self.note:
            detail["note"] = self.note
        if self.failed_turns:
            detail["failed_turns"] = list(self.failed_turns)
        return detail


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCallDetail:
    """A model call: what was asked, and (when it answered) who answered what.
    `rerun`: why the turn is asked again after this call was refused."""

    tier: str
    max_tokens: int
    remaining_budget_tokens: int
    messages: int
    tools_offered: tuple[str, ...]
    reply: ModelReply | None = None
    rerun: str | None = None

    def to_json(self) -> dict[str, JSONValue]:
        detail: dict[str, JSONValue] = {
            "tier": self.tier,
            "max_tokens": self.max_tokens,
            "remaining_budget_tokens": self.remaining_budget_tokens,
            "messages": self.messages,
            "tools_offered": list(self.tools_offered),
        }
        reply = self.reply
        if reply is not None:
            detail |= {
                "provider": reply.provider,
                "model": reply.model,
                "usage": reply.usage.to_json(),
                "attempts": [a.to_json() for a in reply.attempts],
                "finish_reason": reply.finish_reason,
                "tool_calls": [{"id": c.id, "name": c.name} for c in reply.message.tool_calls],
                "answer_chars": len(reply.message.content),
            }
        if self.rerun is not None:
            detail["rerun"] = self.rerun
        return detail


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallDetail:
    """A tool call and its result. `result` is kept only for a call that did not
    fail; `confirmed`/`attempt` for a write carried out after its approval;
    `reused_prefetch` when a search was answered from the run's prefetch."""

    tool_call_id: str
    arguments: JSONValue  # the parsed arguments, or the raw JSON when it did not parse
    truncated: bool
    result_bytes: int
    failed: bool
    result: JSONValue = None
    labels: tuple[str, ...] = ()
    source: str = ""
    transport: str = ""
    reused_prefetch: bool = False
    attempt: int | None = None  # set: confirmed, the attempt that carried it out

    def to_json(self) -> dict[str, JSONValue]:
        detail: dict[str, JSONValue] = {
            "tool_call_id": self.tool_call_id,
            "arguments": self.arguments,
            "truncated": self.truncated,
            "result_bytes": self.result_bytes,
        }
        if not self.failed:
            detail["result"] = self.result
        if self.labels:
            detail["labels"] = list(self.labels)
        if self.source:
            detail["source"] = self.source
            detail["transport"] = self.transport
        if self.reused_prefetch:
            detail["reused_prefetch"] = True
        if self.attempt is not None:
            detail |= {"confirmed": True, "attempt": self.attempt}
        return detail


@dataclass(frozen=True, slots=True)
class ConfirmationRequestedDetail:
    """A write waiting for its person: the store writes its card and expiry into the
    step (`requested_detail`), so the loop has nothing to add."""

    def to_json(self) -> dict[str, JSONValue]:
        return {}


StepDetail = (
    MemoryReadDetail
    | RetrievalDetail
    | ConversationArchiveDetail
    | ModelCallDetail
    | ToolCallDetail
    | ConfirmationRequestedDetail
)


@dataclass(frozen=True, slots=True)
class CardDetail:
    label: str
    value: str


@dataclass(frozen=True, slots=True)
class ConfirmationCard:
    """What a person reads before approving a write."""

    summary: str
    details: tuple[CardDetail, ...] = ()
    warnings: tuple[str, ...] = ()
    # BCP 47 tag of the language the card is written in ("en" or "zh-Hans"), and
    # whether it fell back to English because the tool has no text in the asked one.
    language: str = "en"
    language_fallback: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "details": [{"label": d.label, "value": d.value} for d in self.details],
            "warnings": list(self.warnings),
            "language": self.language,
            "language_fallback": self.language_fallback,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> ConfirmationCard:
        return cls(
            summary=str(value["summary"]),
            details=tuple(
                CardDetail(label=str(d["label"]), value=str(d["value"]))
                for d in value.get("details", ())
            ),
            warnings=tuple(str(w) for w in value.get("warnings", ())),
            language=str(value.get("language", "en")),
            language_fallback=bool(value.get("language_fallback", False)),
        )


class ConfirmationState(StrEnum):
    """A proposed write's life: PENDING until a person decides, then either DENIED,
    or APPROVED -> EXECUTING (the write was handed to its target) -> EXECUTED (its
    result is recorded). EXPIRED: nobody decided in time. ABANDONED: the run ended
    before the write could finish (the reason is on the run)."""

    PENDING = "PENDING"
    APPROVED = "APPROVED"
    EXECUTING = "EXECUTING"
    EXECUTED = "EXECUTED"
    DENIED = "DENIED"
    EXPIRED = "EXPIRED"
    ABANDONED = "ABANDONED"


@dataclass(frozen=True, slots=True)
class PendingConfirmation:
    """A confirmation as the panel lists it."""

    confirmation_token: str
    run_id: str
    tool_name: str
    card: ConfirmationCard
    created_at: datetime
    expires_at: datetime
    user_id: str = ""
    state: ConfirmationState = ConfirmationState.PENDING


@dataclass(frozen=True, slots=True)
class Confirmation:
    """A proposed write and everything decided about it, as stored."""

    token: str
    org_id: str
    run_id: str
    # The run's owner: the only person who may resolve it.
    user_id: str
    call: ToolCallRequest
    card: ConfirmationCard
    state: ConfirmationState
    created_at: datetime
    expires_at: datetime
    resolved_by: str = ""
    resolved_at: datetime | None = None
    decision: Decision | None = None
    note: str = ""
    # Set when the orchestrator stopped after the approval and before the run ended.
    interrupted_at: datetime | None = None
    executions: int = 0
    # The dispatcher's outcome of the write (ToolCallOutcome.detail()), once recorded.
    result: Mapping[str, JSONValue] | None = None

    @property
    def tool_name(self) -> str:
        return self.call.name


@dataclass(frozen=True, slots=True)
class ConfirmationProposal:
    """What the loop asks the store to keep when a write is proposed. The store
    sets the expiry from its own clock (`ttl_seconds` from now), the same clock
    every orchestrator process judges expiry and leases by."""

    token: str
    call: ToolCallRequest
    card: ConfirmationCard
    ttl_seconds: float
    # What the proposed write would keep about people (I9: erased with them).
    copies: tuple[HeldCopy, ...] = ()


@dataclass(frozen=True, slots=True)
class Trajectory:
    run_id: str
    trace_id: str
    steps: tuple[Step, ...]


class RunEventKind(StrEnum):
    STEP_STARTED = "STEP_STARTED"
    STEP_FINISHED = "STEP_FINISHED"
    CONFIRMATION_PENDING = "CONFIRMATION_PENDING"
    ANSWER = "ANSWER"
    RUN_FINISHED = "RUN_FINISHED"


@dataclass(frozen=True, slots=True)
class StepStart:
    """A step as it begins: not yet numbered (seq comes when it is recorded); the
    span id is what matches it to its STEP_FINISHED."""

    kind: StepKind
    name: str
    span_id: str
    started_at: datetime


@dataclass(frozen=True, slots=True)
class RunEvent:
    kind: RunEventKind
    step: Step | None = None
    run: Run | None = None
    answer_delta: str = ""
    started: StepStart | None = None


@dataclass(frozen=True, slots=True)
class PageCursor:
    """Where the next page of ListRuns starts: after this (created_at, run_id), in
    the listing narrowed to `state` (None: every state). A cursor belongs to its
    filter: the same position means another run under another filter."""

    created_at: datetime
    run_id: str
    state: RunState | None = None


# ---------------------------------------------------------------- the loop's state


@dataclass(frozen=True, slots=True)
class LoopState:
    """Everything the loop needs to continue a run from its next phase.

    Persisted with every step, so resuming after a confirmation (or a restart)
    starts from `next_phase` with these messages, and replays nothing."""

    messages: tuple[ChatMessage, ...]
    knowledge: tuple[LabelledChunk, ...]
    usage: RunUsage
    next_phase: Phase
    pending_calls: tuple[ToolCallRequest, ...] = ()
    # Who answered the last model call: a turn holding its tool calls must go back to it.
    last_provider: str = ""
    # Seconds the run has been working (a wait for a person does not count against
    # the wall-time budget), as of the moment this state was written.
    active_seconds: float = 0.0
    # How many leading messages are the prepared turn (system prompt, user message):
    # a re-run of the turn starts again from exactly these.
    opening: int = 2
    # A write was proposed in this run: it is never replayed on another provider (I4).
    carried_confirmation: bool = False
    # The turn was already re-run once after a provider refused to continue it.
    reran_turn: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "messages": [m.to_json() for m in self.messages],
            "knowledge": [k.to_json() for k in self.knowledge],
            "usage": self.usage.to_json(),
            "next_phase": self.next_phase,
            "pending_calls": [c.to_json() for c in self.pending_calls],
            "last_provider": self.last_provider,
            "active_seconds": self.active_seconds,
            "opening": self.opening,
            "carried_confirmation": self.carried_confirmation,
            "reran_turn": self.reran_turn,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> LoopState:
        phase = value["next_phase"]
        if phase not in PHASES:
            raise ValueError(f"stored next_phase {phase!r} is not a phase of the loop")
        return cls(
            messages=tuple(ChatMessage.from_json(m) for m in value["messages"]),
            knowledge=tuple(LabelledChunk.from_json(k) for k in value["knowledge"]),
            usage=RunUsage.from_json(value["usage"]),
            next_phase=phase,
            pending_calls=tuple(
                ToolCallRequest.from_json(c) for c in value.get("pending_calls", ())
            ),
            last_provider=str(value.get("last_provider", "")),
            active_seconds=float(value.get("active_seconds", 0.0)),
            opening=int(value.get("opening", 2)),
            carried_confirmation=bool(value.get("carried_confirmation", False)),
            reran_turn=bool(value.get("reran_turn", False)),
        )


# ---------------------------------------------------------------- the person's language

MAX_LANGUAGE_TAG_CHARS = 35
# RFC 5646's shape, loosely: a 2-8 letter primary subtag, then subtags of 1-8
# letters or digits, joined by hyphens. Enough to refuse what is not a tag at all
# (an underscore form, spaces, a sentence) without a registry of every subtag.
_LANGUAGE_TAG = re.compile(r"[A-Za-z]{2,8}(?:-[A-Za-z0-9]{1,8})*")
# Chinese written in simplified characters: the script said, or a region that uses it.
_SIMPLIFIED_REGIONS = frozenset({"cn", "sg"})


@dataclass(frozen=True, slots=True)
class RunLanguage:
    """The language a run's cards are written in, from the person's preferred one.
    `fallback` when they asked for a language cairn has no text in (English then)."""

    language: CardLanguage
    fallback: bool = False


ENGLISH = RunLanguage("en")


def card_language(tag: str) -> RunLanguage:
    """Normalise a BCP 47 tag to a language cairn writes cards in.

    en, en-*, or nothing: English. zh, zh-CN, zh-SG, zh-Hans and zh-Hans-*:
    Simplified Chinese. Any other well-formed tag (fr, zh-Hant, zh-TW): English,
    marked as a fallback so the person can see it. Raises ValueError, naming the
    value, for what is not a language tag at all."""
    if not tag:
        return RunLanguage("en")
    if len(tag) > MAX_LANGUAGE_TAG_CHARS or not _LANGUAGE_TAG.fullmatch(tag):
        shown = tag if len(tag) <= 64 else tag[:64] + "…"
        raise ValueError(
            f"language {shown!r} is not a BCP 47 language tag; use one like 'en', "
            f"'zh-Hans' or 'zh-CN' (letters and digits in hyphen-separated subtags, at most "
            f"{MAX_LANGUAGE_TAG_CHARS} characters), or leave it empty for English"
        )
    subtags = tag.lower().split("-")
    primary, rest = subtags[0], subtags[1:]
    if primary == "en":
        return RunLanguage("en")
    simplified = (
        not rest or rest[0] == "hans" or (rest[0] in _SIMPLIFIED_REGIONS and len(rest) == 1)
    )
    if primary == "zh" and simplified:
        return RunLanguage("zh-Hans")
    return RunLanguage("en", fallback=True)


def new_run_id() -> str:
    return f"run_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- text PostgreSQL cannot keep

UNSTORABLE_CHARACTER = "\x00"


def unstorable_at(value: JSONValue, *, path: str = "") -> str | None:
    """Where in `value` text PostgreSQL cannot keep (U+0000) first appears, as a path
    like `arguments.query` or `[2]`; None when every string (and key) can be stored.

    One rule for everything a run keeps: a caller's text with U+0000 is refused at the
    door; when a model or a tool produces it, the run records that as error data
    (a refused tool call, a failed model call) rather than failing to store its
    state and leaving the run RUNNING until its lease ends.
    """
    if isinstance(value, str):
        return path or "(the text)" if UNSTORABLE_CHARACTER in value else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if UNSTORABLE_CHARACTER in str(key):
                return where
            found = unstorable_at(item, path=where)
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = unstorable_at(item, path=f"{path}[{index}]")
            if found is not None:
                return found
    return None


def unstorable_in_reply(reply: ModelReply) -> str | None:
    """Which part of a model's reply holds U+0000, if any."""
    if UNSTORABLE_CHARACTER in reply.message.content:
        return "its answer"
    for call in reply.message.tool_calls:
        if UNSTORABLE_CHARACTER in call.name or UNSTORABLE_CHARACTER in call.id:
            return "a tool call's name or id"
        # Escaped in the JSON (\u0000) it can be kept as text; the dispatcher refuses
        # the call once the arguments are parsed. Raw, it cannot be kept at all.
        if UNSTORABLE_CHARACTER in call.arguments_json:
            return f"the arguments of its {call.name!r} call"
    return None
