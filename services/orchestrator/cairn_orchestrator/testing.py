"""Real fakes beside the ports: in-memory stand-ins for the gateway, retrieval,
memory, the run store and the clock, so the loop runs without a network.

They keep what they were asked (so a test can check which credentials and
sources reached them) and answer from a script. Used by the tests; nothing in
the service imports this module.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from cairn_libs.identity import Principal
from cairn_orchestrator.domain import (
    AgentSpec,
    Budgets,
    CallCredentials,
    ChatMessage,
    Citation,
    ConversationTurn,
    KnowledgeChunk,
    LoopState,
    ModelReply,
    ModelRequest,
    PageCursor,
    RecalledMemory,
    RecallOutcome,
    Run,
    RunState,
    RunUsage,
    SearchOutcome,
    Step,
    StepRecord,
    TokenUsage,
    ToolCallRequest,
)
from cairn_orchestrator.errors import DependencyFailed


def handbook_spec(**changes: object) -> AgentSpec:
    spec = AgentSpec(
        name="handbook",
        description="Answers from the handbook.",
        tier="balanced",
        system_prompt="You answer from the handbook.",
        tools=("search_knowledge",),
        sources=("handbook",),
        budgets=Budgets(tokens=20_000, model_calls=6, wall_seconds=60),
        reads_memory=True,
    )
    return replace(spec, **changes)  # type: ignore[arg-type]


def chunk(n: int, *, source: str = "handbook", text: str = "") -> KnowledgeChunk:
    return KnowledgeChunk(
        document_id=f"doc-{n}",
        chunk_id=f"doc-{n}#0",
        source=source,
        title=f"Policy {n}",
        char_start=0,
        char_end=100,
        text=text or f"Policy {n} says something useful.",
    )


def memory(n: int) -> RecalledMemory:
    return RecalledMemory(
        memory_id=f"m{n}",
        text=f"Prefers short answers ({n}).",
        subject_kind="USER",
        subject_id="alice",
        author_kind="PERSON",
        author_id="alice",
        run_id="",
        created_at=datetime(2024, 1, 1, tzinfo=UTC),
        expires_at=datetime(2099, 1, 1, tzinfo=UTC),
        state="ACTIVE",
        claim_type="USER_STATEMENT",
    )


def answer(text: str, *, tokens: int = 100) -> ModelReply:
    return ModelReply(
        message=ChatMessage(role="assistant", content=text),
        finish_reason="stop",
        usage=TokenUsage(prompt_tokens=tokens - 10, completion_tokens=10, total_tokens=tokens),
        provider="scripted",
        model="scripted-model",
    )


def tool_calls(*calls: tuple[str, str], tokens: int = 100) -> ModelReply:
    return ModelReply(
        message=ChatMessage(
            role="assistant",
            content="",
            tool_calls=tuple(
                ToolCallRequest(id=f"call-{i}", name=name, arguments_json=args)
                for i, (name, args) in enumerate(calls)
            ),
        ),
        finish_reason="tool_calls",
        usage=TokenUsage(prompt_tokens=tokens - 10, completion_tokens=10, total_tokens=tokens),
        provider="scripted",
        model="scripted-model",
    )


class FakeClock:
    def __init__(self) -> None:
        self.moment = datetime(2025, 1, 1, tzinfo=UTC)

    def now(self) -> datetime:
        return self.moment

    def advance(self, seconds: float) -> None:
        self.moment += timedelta(seconds=seconds)


Reply = ModelReply | DependencyFailed | Callable[[ModelRequest], ModelReply]


@dataclass
class ScriptedGateway:
    replies: list[Reply]
    requests: list[ModelRequest] = field(default_factory=list)
    credentials: list[CallCredentials] = field(default_factory=list)
    on_call: Callable[[], None] | None = None

    async def chat(
        self, request: ModelRequest, credentials: CallCredentials, *, deadline_seconds: float
    ) -> ModelReply:
        self.requests.append(request)
        self.credentials.append(credentials)
        if self.on_call is not None:
            self.on_call()
        reply = self.replies.pop(0)
        if isinstance(reply, DependencyFailed):
            raise reply
        if callable(reply):
            return reply(request)
        return reply


@dataclass
class SearchCall:
    query: str
    sources: tuple[str, ...]
    k: int
    credentials: CallCredentials


@dataclass
class FakeRetrieval:
    results: Sequence[KnowledgeChunk] = ()
    failure: DependencyFailed | None = None
    later_results: Sequence[KnowledgeChunk] | None = None
    calls: list[SearchCall] = field(default_factory=list)

    async def search(
        self,
        *,
        query: str,
        sources: Sequence[str],
        k: int,
        credentials: CallCredentials,
        deadline_seconds: float,
    ) -> SearchOutcome:
        self.calls.append(SearchCall(query, tuple(sources), k, credentials))
        if self.failure is not None:
            raise self.failure
        found = self.results
        if len(self.calls) > 1 and self.later_results is not None:
            found = self.later_results
        return SearchOutcome(results=tuple(found[:k]), mode="HYBRID", mode_reason="")


@dataclass
class FakeMemory:
    memories: Sequence[RecalledMemory] = ()
    failure: DependencyFailed | None = None
    calls: list[tuple[str, int, CallCredentials]] = field(default_factory=list)

    async def recall(
        self, *, query: str, k: int, credentials: CallCredentials, deadline_seconds: float
    ) -> RecallOutcome:
        self.calls.append((query, k, credentials))
        if self.failure is not None:
            raise self.failure
        return RecallOutcome(memories=tuple(self.memories[:k]), mode="SEMANTIC", mode_reason="")


@dataclass
class _StoredRun:
    run: Run
    steps: list[Step] = field(default_factory=list)
    loop_state: LoopState | None = None


class MemoryRunStore:
    """The RunStore contract in a dict, narrowing by org and owner like PostgreSQL."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self.runs: dict[str, _StoredRun] = {}
        self._ticks = itertools.count()

    async def create_run(
        self,
        *,
        run_id: str,
        org_id: str,
        user_id: str,
        agent: str,
        input: str,
        conversation_id: str,
        earlier_turns: Sequence[ConversationTurn],
        trace_id: str,
    ) -> Run:
        now = self._clock.now() + timedelta(microseconds=next(self._ticks))
        run = Run(
            run_id=run_id,
            org_id=org_id,
            user_id=user_id,
            agent=agent,
            state=RunState.RUNNING,
            input=input,
            conversation_id=conversation_id,
            trace_id=trace_id,
            created_at=now,
            updated_at=now,
        )
        self.runs[run_id] = _StoredRun(run)
        return run

    async def record_step(
        self, *, org_id: str, run_id: str, step: StepRecord, loop_state: LoopState | None
    ) -> Step:
        stored = self.runs[run_id]
        assert stored.run.org_id == org_id
        saved = Step(
            seq=len(stored.steps) + 1,
            kind=step.kind,
            name=step.name,
            span_id=step.span_id,
            started_at=step.started_at,
            finished_at=step.finished_at,
            detail=step.detail,
            error=step.error,
        )
        stored.steps.append(saved)
        if loop_state is not None:
            stored.loop_state = loop_state
        return saved

    async def finish_run(
        self,
        *,
        org_id: str,
        run_id: str,
        state: RunState,
        loop_state: LoopState | None,
        usage: RunUsage,
        answer: str = "",
        citations: Sequence[Citation] = (),
        reason: str = "",
    ) -> Run:
        stored = self.runs[run_id]
        assert stored.run.org_id == org_id
        stored.run = replace(
            stored.run,
            state=state,
            usage=usage,
            answer=answer,
            citations=tuple(citations),
            reason=reason,
            updated_at=self._clock.now(),
        )
        if loop_state is not None:
            stored.loop_state = loop_state
        return stored.run

    async def get_run(self, *, org_id: str, run_id: str, user_id: str | None) -> Run | None:
        stored = self.runs.get(run_id)
        if stored is None or stored.run.org_id != org_id:
            return None
        if user_id is not None and stored.run.user_id != user_id:
            return None
        return stored.run

    async def list_runs(
        self, *, org_id: str, user_id: str | None, limit: int, after: PageCursor | None
    ) -> list[Run]:
        runs = [
            s.run
            for s in self.runs.values()
            if s.run.org_id == org_id and (user_id is None or s.run.user_id == user_id)
        ]
        runs.sort(key=lambda r: (r.created_at, r.run_id), reverse=True)
        if after is not None:
            runs = [r for r in runs if (r.created_at, r.run_id) < (after.created_at, after.run_id)]
        return runs[:limit]

    async def list_steps(self, *, org_id: str, run_id: str, after_seq: int = 0) -> list[Step]:
        stored = self.runs.get(run_id)
        if stored is None or stored.run.org_id != org_id:
            return []
        return [s for s in stored.steps if s.seq > after_seq]


ALICE = Principal(org_id="org-a", user_id="alice", roles=("employee",))
