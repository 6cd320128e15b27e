"""A run's opening I/O: what it reads before its first model call.

    read memory ─┐
                 ├─ prepare the turn (phases.prepare_turn)
    retrieve ────┤
    conversation ┘

Recall and the knowledge prefetch read for the caller and need nothing from each
other or from the run's row, so they start at once, while the row is written;
the conversation is archived (a write to memory) only once the run exists. A
failure of memory or retrieval is recorded as data and the run goes on (I3, I11).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from cairn_orchestrator.cancellation import CancelWatch
from cairn_orchestrator.conversation import ConversationArchiver
from cairn_orchestrator.conversation_window import plan_conversation, window_lines
from cairn_orchestrator.domain import (
    ConversationTurn,
    ErrorValue,
    LabelBook,
    LabelledChunk,
    LoopState,
    MemoryReadDetail,
    RecalledMemory,
    RetrievalDetail,
    StepKind,
    StepRecord,
)
from cairn_orchestrator.errors import DependencyFailed
from cairn_orchestrator.memory_tools import memory_copies
from cairn_orchestrator.phases import prepare_turn
from cairn_orchestrator.ports import KnowledgeSearch, MemoryRecall, RunStore
from cairn_orchestrator.recording import StepRecorder
from cairn_orchestrator.remote import PrefetchedSearch, RunSearches
from cairn_orchestrator.run_scope import RunClock, RunScope

# What recall and the prefetch found, each with its step (None: not asked for).
OpeningReads = tuple[
    tuple[StepRecord | None, tuple[RecalledMemory, ...]],
    tuple[StepRecord | None, tuple[LabelledChunk, ...]],
]


class Opening:
    def __init__(
        self,
        *,
        store: RunStore,
        retrieval: KnowledgeSearch | None,
        memory: MemoryRecall | None,
        conversation: ConversationArchiver,
        recorder: StepRecorder,
        cancels: CancelWatch,
        clock: RunClock,
        memory_k: int,
        retrieval_k: int,
    ) -> None:
        self._store = store
        self._retrieval = retrieval
        self._memory = memory
        self._conversation = conversation
        self._recorder = recorder
        self._cancels = cancels
        self._clock = clock
        self._memory_k = memory_k
        self._retrieval_k = retrieval_k

    async def reads(
        self, scope: RunScope, question: str, book: LabelBook, searches: RunSearches
    ) -> OpeningReads:
        """Recall and prefetch need nothing from each other: they run at once."""
        memory_read, knowledge_read = await asyncio.gather(
            self._read_memory(scope, question),
            self._prefetch_knowledge(scope, question, book, searches),
        )
        return memory_read, knowledge_read

    async def open(
        self,
        scope: RunScope,
        reads: asyncio.Task[OpeningReads],
        *,
        question: str,
        earlier: Sequence[ConversationTurn],
    ) -> LoopState:
        # The conversation is archived (a write to memory) only once the run exists;
        # the steps are recorded in a fixed order: memory, retrieval, conversation.
        (
            ((memory_step, memories), (knowledge_step, knowledge)),
            (conversation_step, window),
        ) = await self._cancels.unless_cancelled(
            scope, asyncio.gather(reads, self._compact_conversation(scope, earlier))
        )
        state = prepare_turn(
            spec=scope.spec,
            question=question,
            now=self._clock.now(),
            memories=memories,
            knowledge=knowledge,
            earlier=earlier,
            conversation=window,
        )
        opening = [r for r in (memory_step, knowledge_step, conversation_step) if r is not None]
        await self._recorder.record_many(scope, opening, state)
        return state

    async def _read_memory(
        self, scope: RunScope, question: str
    ) -> tuple[StepRecord | None, tuple[RecalledMemory, ...]]:
        if not scope.spec.reads_memory:
            return None, ()
        k = self._memory_k
        with self._recorder.step(
            scope,
            StepKind.MEMORY_READ,
            "memory",
            span_name="recall_memory",
            attributes={"gen_ai.operation.name": "recall_memory"},
        ) as step:
            detail = MemoryReadDetail(k=k)
            memories: tuple[RecalledMemory, ...] = ()
            error: ErrorValue | None = None
            if self._memory is None:
                error = ErrorValue("memory.not_configured", "this deployment keeps no memories")
            else:
                try:
                    outcome = await self._memory.recall(
                        query=question,
                        k=k,
                        credentials=scope.credentials,
                        deadline_seconds=self._clock.timeout(scope),
                    )
                except DependencyFailed as exc:
                    error = ErrorValue(f"memory.{exc.status_code.lower()}", exc.message)
                else:
                    memories = outcome.memories
                    detail = replace(detail, mode=outcome.mode, mode_reason=outcome.mode_reason)
            detail = replace(detail, memory_ids=tuple(m.memory_id for m in memories))
            step.mark(error)
        # The prompt's memory block copies these texts about people (I9).
        return replace(step.record(detail, error), copies=memory_copies(memories)), memories

    async def _compact_conversation(
        self, scope: RunScope, earlier: Sequence[ConversationTurn]
    ) -> tuple[StepRecord | None, tuple[str, ...]]:
        """The conversation window; turns too large to travel whole are archived
        first and named by reference (conversation_window.py decides, the archiver in conversation.py calls)."""
        plan = plan_conversation(earlier)
        if not plan.to_archive:
            return None, window_lines(plan, {})
        with self._recorder.step(
            scope,
            StepKind.CONVERSATION_ARCHIVE,
            "conversation",
            span_name="archive_conversation",
            attributes={"gen_ai.operation.name": "archive_conversation"},
        ) as step:
            conversation_id = scope.run.conversation_id or scope.run.run_id
            subjects = await self._store.conversation_subjects(
                org_id=scope.run.org_id, conversation_id=conversation_id
            )
            compacted = await self._conversation.compact(
                plan,
                org_id=scope.principal.org_id,
                user_id=scope.principal.user_id,
                # A run without a conversation still archives into one of its own.
                conversation_id=conversation_id,
                credentials=scope.credentials,
                deadline_seconds=self._clock.timeout(scope),
                # The block is about whomever the conversation's runs read about.
                subjects=subjects,
            )
            step.mark(compacted.error)
        record = step.record(compacted.detail, compacted.error)
        return replace(record, copies=compacted.copies), compacted.lines

    async def _prefetch_knowledge(
        self, scope: RunScope, question: str, book: LabelBook, searches: RunSearches
    ) -> tuple[StepRecord | None, tuple[LabelledChunk, ...]]:
        sources = scope.spec.sources
        if not sources:
            return None, ()  # I7: no sources, no knowledge, no call.
        k = self._retrieval_k
        with self._recorder.step(
            scope,
            StepKind.RETRIEVAL,
            "retrieval",
            span_name="retrieve",
            attributes={"gen_ai.operation.name": "retrieve"},
        ) as step:
            detail = RetrievalDetail(k=k, sources=tuple(sources))
            labelled: tuple[LabelledChunk, ...] = ()
            error: ErrorValue | None = None
            if self._retrieval is None:
                error = ErrorValue(
                    "retrieval.not_configured", "this deployment has no retrieval service"
                )
            else:
                try:
                    outcome = await self._retrieval.search(
                        query=question,
                        sources=sources,
                        k=k,
                        credentials=scope.credentials,
                        deadline_seconds=self._clock.timeout(scope),
                    )
                except DependencyFailed as exc:
                    error = ErrorValue(f"retrieval.{exc.status_code.lower()}", exc.message)
                else:
                    searches.prefetched = PrefetchedSearch(
                        query=question,
                        sources=tuple(sources),
                        k=k,
                        credentials=scope.credentials,
                        outcome=outcome,
                    )
                    labelled = tuple(book.label(chunk) for chunk in outcome.results)
                    detail = replace(detail, mode=outcome.mode, mode_reason=outcome.mode_reason)
            detail = replace(detail, results=labelled)
            step.mark(error)
        return step.record(detail, error), labelled
