"""Real fakes beside the ports: in-memory stand-ins for the gateway, retrieval,
memory, the run store and the clock, so the loop runs without a network.

They keep what they were asked (so a test can check which credentials and
sources reached them) and answer from a script. Used by the tests; nothing in
the service imports this module.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

from cairn_libs.clock import FakeClock
from cairn_libs.identity import Principal
from cairn_orchestrator.domain import (
    ENGLISH,
    AgentSpec,
    ArchivedBlock,
    Budgets,
    CallCredentials,
    ChatMessage,
    Citation,
    ClaimTypeName,
    ConversationTurn,
    KnowledgeChunk,
    LoopState,
    MemorySubject,
    ModelReply,
    ModelRequest,
    PageCursor,
    ProfileFact,
    RecalledMemory,
    RecallOutcome,
    RememberOutcome,
    Run,
    RunLanguage,
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


@dataclass
class HeldReply:
    """A model call that never answers by itself: it says when it started and
    whether it was cancelled (as a gRPC call is cancelled with its task)."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def hold(self) -> NoReturn:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("an event nobody sets was set")


Reply = ModelReply | DependencyFailed | HeldReply | Callable[[ModelRequest], ModelReply]


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
        if isinstance(reply, HeldReply):
            await reply.hold()
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
    """The memory service's contract in lists: recall, the writes the memory tools
    make, and the block archive. `failure` fails every call; `archive_failure`
    only Archive. Writes are recorded with the credentials they carried."""

    memories: Sequence[RecalledMemory] = ()
    failure: DependencyFailed | None = None
    calls: list[tuple[str, int, CallCredentials]] = field(default_factory=list)
    profile: Sequence[ProfileFact] = ()
    recall_subjects: list[MemorySubject | None] = field(default_factory=list)
    writes: list[tuple[str, dict[str, Any], CallCredentials]] = field(default_factory=list)
    blocks: dict[str, ArchivedBlock] = field(default_factory=dict)
    archive_failure: DependencyFailed | None = None
    ttl: timedelta = timedelta(days=90)
    now: datetime = datetime(2025, 1, 1, tzinfo=UTC)

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
        self.calls.append((query, k, credentials))
        self.recall_subjects.append(subject)
        if self.failure is not None:
            raise self.failure
        held = [
            m
            for m in self.memories
            if subject is None or (m.subject_kind, m.subject_id) == (subject.kind, subject.id)
        ]
        profile = tuple(self.profile) if include_profile else ()
        return RecallOutcome(
            memories=tuple(held[:k]), mode="SEMANTIC", mode_reason="", profile=profile
        )

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
        arguments = {
            "text": text,
            "subject": subject,
            "claim_type": claim_type,
            "tags": list(tags),
            "importance": importance,
        }
        self.writes.append(("remember", arguments, credentials))
        if self.failure is not None:
            raise self.failure
        kept = RecalledMemory(
            memory_id=f"mem-{len(self.writes)}",
            text=text,
            subject_kind=subject.kind,
            subject_id=subject.id,
            author_kind="MODEL",
            author_id="handbook",
            run_id=credentials.actor_token.removeprefix("actor-token-for-"),
            created_at=self.now,
            expires_at=self.now + self.ttl,
            claim_type=claim_type,
            state="ACTIVE",
        )
        return RememberOutcome(memory=kept, already_held=False)

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
        arguments = {
            "subject": subject,
            "key": key,
            "value": value,
            "previous_value": previous_value,
        }
        self.writes.append(("update_profile", arguments, credentials))
        if self.failure is not None:
            raise self.failure
        earlier = tuple(
            f.value for f in self.profile if f.key == key and f.subject_id == subject.id
        )
        return ProfileFact(
            subject_kind=subject.kind,
            subject_id=subject.id,
            key=key,
            value=value,
            author_kind="MODEL",
            author_id="handbook",
            run_id=credentials.actor_token.removeprefix("actor-token-for-"),
            created_at=self.now,
            expires_at=self.now + self.ttl,
            earlier_values=earlier,
        )

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
        failure = self.archive_failure or self.failure
        if failure is not None:
            raise failure
        block_id = f"r{len(self.blocks) + 1}"
        self.blocks[block_id] = ArchivedBlock(
            block_id=block_id,
            label=label,
            role=role,
            content=content,
            conversation_id=conversation_id,
            created_at=self.now,
            subjects=tuple(subjects),
        )
        self.writes.append(("archive", {"block_id": block_id, "label": label}, credentials))
        return block_id

    async def recall_block(
        self, *, block_id: str, credentials: CallCredentials, deadline_seconds: float
    ) -> ArchivedBlock:
        if self.failure is not None:
            raise self.failure
        block = self.blocks.get("r" + block_id.strip().lower().removeprefix("r"))
        if block is None:
            raise DependencyFailed("memory", "PERMISSION_DENIED", "not found or not permitted")
        return block

    async def search_blocks(
        self, *, query: str, limit: int, credentials: CallCredentials, deadline_seconds: float
    ) -> list[ArchivedBlock]:
        if self.failure is not None:
            raise self.failure
        words = query.lower().split()
        found = [
            b
            for b in self.blocks.values()
            if any(w in (b.label + " " + b.content).lower() for w in words)
        ]
        return found[:limit]


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
        root_span_id: str = "",
        language: RunLanguage = ENGLISH,
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
            language=language.language,
            language_fallback=language.fallback,
        )
        self.runs[run_id] = _StoredRun(run)
        return run

    async def record_step(
        self, *, org_id: str, run_id: str, step: StepRecord, loop_state: LoopState | None
    ) -> Step:
        stored = self.runs[run_id]
        assert stored.run.org_id == org_id
        saved = step.at(len(stored.steps) + 1)
        stored.steps.append(saved)
        if loop_state is not None:
            stored.loop_state = loop_state
        return saved

    async def record_steps(
        self,
        *,
        org_id: str,
        run_id: str,
        steps: Sequence[StepRecord],
        loop_state: LoopState | None,
    ) -> list[Step]:
        saved = [
            await self.record_step(org_id=org_id, run_id=run_id, step=step, loop_state=None)
            for step in steps
        ]
        if loop_state is not None:
            self.runs[run_id].loop_state = loop_state
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
        steps: Sequence[StepRecord] = (),
    ) -> Run:
        await self.record_steps(org_id=org_id, run_id=run_id, steps=steps, loop_state=None)
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
        self,
        *,
        org_id: str,
        user_id: str | None,
        limit: int,
        after: PageCursor | None,
        state: RunState | None = None,
    ) -> list[Run]:
        runs = [
            s.run
            for s in self.runs.values()
            if s.run.org_id == org_id
            and (user_id is None or s.run.user_id == user_id)
            and (state is None or s.run.state is state)
        ]
        runs.sort(key=lambda r: (r.created_at, r.run_id), reverse=True)
        if after is not None:
            runs = [r for r in runs if (r.created_at, r.run_id) < (after.created_at, after.run_id)]
        return runs[:limit]

    async def conversation_subjects(
        self, *, org_id: str, conversation_id: str
    ) -> tuple[MemorySubject, ...]:
        found = {
            MemorySubject(kind=c.subject_kind, id=c.subject_id)  # type: ignore[arg-type]
            for stored in self.runs.values()
            if stored.run.org_id == org_id and stored.run.conversation_id == conversation_id
            for step in stored.steps
            for c in step.copies
        }
        return tuple(sorted(found, key=lambda s: (s.kind, s.id)))

    async def list_steps(self, *, org_id: str, run_id: str, after_seq: int = 0) -> list[Step]:
        stored = self.runs.get(run_id)
        if stored is None or stored.run.org_id != org_id:
            return []
        return [s for s in stored.steps if s.seq > after_seq]


ALICE = Principal(org_id="org-a", user_id="alice", roles=("employee",))
