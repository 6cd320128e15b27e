"""The agent loop's I/O: one run, from the caller's question to a run at rest.

This module only sequences calls and records what happened; every decision is a
pure function in `phases.py`. A run goes:

    read memory ─┐
                 ├─ prepare the turn ─ call the model ─┬─ answer ─ resolve citations ─ COMPLETED
    retrieve ────┘          ▲                          └─ tools ─ execute ─┐
                            └──────────────────────────────────────────────┘

Each step runs under its own span (children of `invoke_agent {agent}`) and is
stored with that span's id. Failures of memory, retrieval and tools are recorded
as data and the run goes on (I3, I11); a failed model call ends the run FAILED
with the reason. After every step the loop state is persisted, so `_drive` can be
entered again from any phase: that is how a confirmed write will resume a run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from cairn_libs.identity import Principal
from cairn_libs.telemetry import bound_run, span_id_hex, trace_id_hex
from cairn_orchestrator.domain import (
    AgentSpec,
    CallCredentials,
    Citation,
    ConversationTurn,
    ErrorValue,
    JSONValue,
    KnowledgeChunk,
    LabelBook,
    LabelledChunk,
    LoopState,
    ModelReply,
    ModelRequest,
    RecalledMemory,
    Run,
    RunState,
    StepKind,
    StepRecord,
    new_run_id,
)
from cairn_orchestrator.errors import DependencyFailed, StoreUnavailable
from cairn_orchestrator.phases import (
    DEFAULT_MAX_COMPLETION_TOKENS,
    FinalAnswer,
    PlannedCall,
    RunToolCalls,
    StopRun,
    after_model_reply,
    after_tool_calls,
    budget_exhaustion,
    model_request,
    plan_after_reply,
    plan_tool_call,
    prepare_turn,
    remaining_tokens,
    resolve_citations,
    wall_time_exhaustion,
)
from cairn_orchestrator.ports import (
    Clock,
    KnowledgeSearch,
    MemoryRecall,
    ModelGateway,
    RunStore,
    SystemClock,
)
from cairn_orchestrator.tools import ToolCallOutcome, ToolContext, ToolRegistry, dispatch, refused

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)

ActorTokenMinter = Callable[[str, str], str]
"""(run_id, agent) -> the orchestrator's per-run service credential."""


@dataclass(frozen=True, slots=True)
class Caller:
    """The verified caller and their own token, passed on to every call (I1)."""

    principal: Principal
    token: str


@dataclass(frozen=True, slots=True)
class LoopSettings:
    memory_k: int = 5
    retrieval_k: int = 4
    max_completion_tokens: int = DEFAULT_MAX_COMPLETION_TOKENS
    dependency_timeout_seconds: float = 15.0
    model_timeout_seconds: float = 120.0


@dataclass(frozen=True, slots=True)
class _RunScope:
    """What every step of one run shares."""

    run: Run
    spec: AgentSpec
    principal: Principal
    credentials: CallCredentials
    started: datetime


class RunLoop:
    def __init__(
        self,
        *,
        store: RunStore,
        gateway: ModelGateway,
        retrieval: KnowledgeSearch | None,
        memory: MemoryRecall | None,
        registry: ToolRegistry,
        mint_actor_token: ActorTokenMinter,
        clock: Clock | None = None,
        settings: LoopSettings | None = None,
    ) -> None:
        self._store = store
        self._gateway = gateway
        self._retrieval = retrieval
        self._memory = memory
        self._registry = registry
        self._mint_actor_token = mint_actor_token
        self._clock: Clock = clock or SystemClock()
        self._settings = settings or LoopSettings()

    # ------------------------------------------------------------ entry

    async def start(
        self,
        *,
        spec: AgentSpec,
        caller: Caller,
        question: str,
        conversation_id: str,
        earlier: Sequence[ConversationTurn],
    ) -> Run:
        run_id = new_run_id()
        attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": spec.name,
            "cairn.run_id": run_id,
        }
        with (
            tracer.start_as_current_span(
                f"invoke_agent {spec.name}", attributes=attributes
            ) as span,
            bound_run(run_id),
        ):
            started = self._clock.now()
            run = await self._store.create_run(
                run_id=run_id,
                org_id=caller.principal.org_id,
                user_id=caller.principal.user_id,
                agent=spec.name,
                input=question,
                conversation_id=conversation_id,
                earlier_turns=earlier,
                trace_id=trace_id_hex(span),
            )
            log.info("run.started", agent=spec.name)
            scope = _RunScope(
                run=run,
                spec=spec,
                principal=caller.principal,
                credentials=CallCredentials(
                    caller_token=caller.token, actor_token=self._mint_actor_token(run_id, spec.name)
                ),
                started=started,
            )
            try:
                state = await self._open(scope, question=question, earlier=earlier)
                finished = await self._drive(scope, state)
            except StoreUnavailable:
                span.set_status(Status(StatusCode.ERROR, "run store unavailable"))
                raise
            except Exception as exc:
                log.exception("run.crashed")
                finished = await self._finish(
                    scope,
                    RunState.FAILED,
                    None,
                    reason=f"the orchestrator failed unexpectedly ({type(exc).__name__})",
                )
            span.set_attribute("cairn.run_state", finished.state.value)
            if finished.state is not RunState.COMPLETED:
                span.set_status(Status(StatusCode.ERROR, finished.state.value))
            return finished

    # ------------------------------------------------------------ opening: memory and knowledge

    async def _open(
        self, scope: _RunScope, *, question: str, earlier: Sequence[ConversationTurn]
    ) -> LoopState:
        book = LabelBook()
        (memory_step, memories), (knowledge_step, knowledge) = await asyncio.gather(
            self._read_memory(scope, question), self._prefetch_knowledge(scope, question, book)
        )
        state = prepare_turn(
            spec=scope.spec,
            question=question,
            now=self._clock.now(),
            memories=memories,
            knowledge=knowledge,
            earlier=earlier,
        )
        for record in (memory_step, knowledge_step):
            if record is not None:
                await self._record(scope, record, state)
        return state

    async def _read_memory(
        self, scope: _RunScope, question: str
    ) -> tuple[StepRecord | None, tuple[RecalledMemory, ...]]:
        if not scope.spec.reads_memory:
            return None, ()
        k = self._settings.memory_k
        with self._span("recall_memory", scope, {"gen_ai.operation.name": "recall_memory"}) as span:
            started = self._clock.now()
            detail: dict[str, JSONValue] = {"k": k}
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
                        deadline_seconds=self._timeout(scope),
                    )
                except DependencyFailed as exc:
                    error = ErrorValue(f"memory.{exc.status_code.lower()}", exc.message)
                else:
                    memories = outcome.memories
                    detail |= {"mode": outcome.mode, "mode_reason": outcome.mode_reason}
            detail |= {"count": len(memories), "memory_ids": [m.memory_id for m in memories]}
            _mark(span, error)
        return self._step(StepKind.MEMORY_READ, "memory", span, started, detail, error), memories

    async def _prefetch_knowledge(
        self, scope: _RunScope, question: str, book: LabelBook
    ) -> tuple[StepRecord | None, tuple[LabelledChunk, ...]]:
        sources = scope.spec.sources
        if not sources:
            return None, ()  # I7: no sources, no knowledge, no call.
        k = self._settings.retrieval_k
        with self._span("retrieve", scope, {"gen_ai.operation.name": "retrieve"}) as span:
            started = self._clock.now()
            detail: dict[str, JSONValue] = {"k": k, "sources": list(sources)}
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
                        deadline_seconds=self._timeout(scope),
                    )
                except DependencyFailed as exc:
                    error = ErrorValue(f"retrieval.{exc.status_code.lower()}", exc.message)
                else:
                    labelled = tuple(book.label(chunk) for chunk in outcome.results)
                    detail |= {"mode": outcome.mode, "mode_reason": outcome.mode_reason}
            detail |= {"count": len(labelled), "results": [_result_detail(e) for e in labelled]}
            _mark(span, error)
        return self._step(StepKind.RETRIEVAL, "retrieval", span, started, detail, error), labelled

    # ------------------------------------------------------------ the resumable loop

    async def _drive(self, scope: _RunScope, state: LoopState) -> Run:
        spec = scope.spec
        while True:
            if state.next_phase == "execute_tools":
                exhausted = wall_time_exhaustion(spec.budgets, elapsed_seconds=self._elapsed(scope))
                if exhausted is not None:
                    return await self._finish(
                        scope, RunState.BUDGET_EXHAUSTED, state, reason=exhausted
                    )
                planned = tuple(
                    plan_tool_call(c, spec=spec, registry=self._registry)
                    for c in state.pending_calls
                )
                state = await self._execute(scope, state, planned)
                continue

            exhausted = budget_exhaustion(
                spec.budgets, state.usage, elapsed_seconds=self._elapsed(scope)
            )
            if exhausted is not None:
                return await self._finish(scope, RunState.BUDGET_EXHAUSTED, state, reason=exhausted)
            request = model_request(
                state,
                spec=spec,
                registry=self._registry,
                run_id=scope.run.run_id,
                max_completion_tokens=self._settings.max_completion_tokens,
            )
            reply, record, failure = await self._call_model(scope, request)
            if reply is None:
                await self._record(scope, record, state)
                assert failure is not None
                # A call cut short by the run's own deadline is the budget, not the gateway.
                wall = wall_time_exhaustion(spec.budgets, elapsed_seconds=self._elapsed(scope))
                if wall is not None:
                    return await self._finish(scope, RunState.BUDGET_EXHAUSTED, state, reason=wall)
                return await self._finish(
                    scope,
                    RunState.FAILED,
                    state,
                    reason=f"the model call failed: {failure.message}",
                )
            state = after_model_reply(state, reply)
            await self._record(scope, record, state)
            decision = plan_after_reply(
                reply,
                state=state,
                spec=spec,
                registry=self._registry,
                elapsed_seconds=self._elapsed(scope),
            )
            if isinstance(decision, FinalAnswer):
                citations = resolve_citations(decision.text, state.knowledge)
                return await self._finish(
                    scope, RunState.COMPLETED, state, answer=decision.text, citations=citations
                )
            if isinstance(decision, StopRun):
                return await self._finish(scope, decision.state, state, reason=decision.reason)
            assert isinstance(decision, RunToolCalls)
            state = await self._execute(scope, state, decision.calls)

    async def _call_model(
        self, scope: _RunScope, request: ModelRequest
    ) -> tuple[ModelReply | None, StepRecord, DependencyFailed | None]:
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.max_tokens": request.max_tokens,
            "cairn.tier": request.tier,
        }
        with self._span(f"chat {request.tier}", scope, attributes) as span:
            started = self._clock.now()
            detail: dict[str, JSONValue] = {
                "tier": request.tier,
                "max_tokens": request.max_tokens,
                "remaining_budget_tokens": request.remaining_budget_tokens,
                "messages": len(request.messages),
                "tools_offered": [t.name for t in request.tools],
            }
            try:
                reply = await self._gateway.chat(
                    request,
                    scope.credentials,
                    deadline_seconds=self._timeout(
                        scope, ceiling=self._settings.model_timeout_seconds
                    ),
                )
            except DependencyFailed as exc:
                error = ErrorValue(f"gateway.{exc.status_code.lower()}", exc.message)
                _mark(span, error)
                record = self._step(
                    StepKind.MODEL_CALL, f"tier:{request.tier}", span, started, detail, error
                )
                return None, record, exc
            span.set_attributes(
                {
                    "gen_ai.provider.name": reply.provider,
                    "gen_ai.response.model": reply.model,
                    "gen_ai.response.finish_reasons": [reply.finish_reason],
                    "gen_ai.usage.input_tokens": reply.usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": reply.usage.completion_tokens,
                }
            )
            detail |= {
                "provider": reply.provider,
                "model": reply.model,
                "usage": reply.usage.to_json(),
                "attempts": [a.to_json() for a in reply.attempts],
                "finish_reason": reply.finish_reason,
                "tool_calls": [{"id": c.id, "name": c.name} for c in reply.message.tool_calls],
                "answer_chars": len(reply.message.content),
            }
        return (
            reply,
            self._step(
                StepKind.MODEL_CALL,
                reply.model or f"tier:{request.tier}",
                span,
                started,
                detail,
                None,
            ),
            None,
        )

    async def _execute(
        self, scope: _RunScope, state: LoopState, planned: Sequence[PlannedCall]
    ) -> LoopState:
        """Run the planned calls (independent reads, so concurrently) and fold the
        results back; steps are recorded in the order the model asked."""
        book = LabelBook(state.knowledge)
        context = ToolContext(
            principal=scope.principal,
            run_id=scope.run.run_id,
            agent=scope.spec.name,
            remaining_tokens=remaining_tokens(scope.spec.budgets, state.usage),
            sources=scope.spec.sources,
            credentials=scope.credentials,
            labels=book,
        )
        observed = await asyncio.gather(*(self._run_tool(scope, call, context) for call in planned))
        state = after_tool_calls(
            state, [outcome for outcome, _ in observed], knowledge=book.entries
        )
        for index, (_, record) in enumerate(observed):
            await self._record(scope, record, state if index == len(observed) - 1 else None)
        return state

    async def _run_tool(
        self, scope: _RunScope, planned: PlannedCall, context: ToolContext
    ) -> tuple[ToolCallOutcome, StepRecord]:
        call = planned.call
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id,
        }
        with self._span(f"execute_tool {call.name}", scope, attributes) as span:
            started = self._clock.now()
            if planned.refusal is not None:
                outcome = refused(call, planned.refusal)
            else:
                outcome = await dispatch(self._registry, call, context)
            _mark(span, outcome.error)
        return outcome, self._step(
            StepKind.TOOL_CALL, call.name, span, started, outcome.detail(), outcome.error
        )

    # ------------------------------------------------------------ recording

    def _span(
        self, name: str, scope: _RunScope, attributes: Mapping[str, Any]
    ) -> AbstractContextManager[Span]:
        span: AbstractContextManager[Span] = tracer.start_as_current_span(
            name, attributes={**attributes, "cairn.run_id": scope.run.run_id}
        )
        return span

    def _step(
        self,
        kind: StepKind,
        name: str,
        span: Span,
        started: datetime,
        detail: Mapping[str, JSONValue],
        error: ErrorValue | None,
    ) -> StepRecord:
        return StepRecord(
            kind=kind,
            name=name,
            span_id=span_id_hex(span),
            started_at=started,
            finished_at=self._clock.now(),
            detail=detail,
            error=error,
        )

    async def _record(self, scope: _RunScope, record: StepRecord, state: LoopState | None) -> None:
        await self._store.record_step(
            org_id=scope.run.org_id, run_id=scope.run.run_id, step=record, loop_state=state
        )
        if record.error is not None:
            log.info(
                "run.step_error", kind=record.kind.value, step=record.name, code=record.error.code
            )

    async def _finish(
        self,
        scope: _RunScope,
        outcome: RunState,
        state: LoopState | None,
        *,
        answer: str = "",
        citations: Sequence[Citation] = (),
        reason: str = "",
    ) -> Run:
        usage = state.usage if state is not None else scope.run.usage
        finished = await self._store.finish_run(
            org_id=scope.run.org_id,
            run_id=scope.run.run_id,
            state=outcome,
            loop_state=state,
            usage=usage,
            answer=answer,
            citations=citations,
            reason=reason,
        )
        log.info(
            "run.finished",
            state=outcome.value,
            model_calls=usage.model_calls,
            total_tokens=usage.total_tokens,
            citations=len(citations),
        )
        return finished

    # ------------------------------------------------------------ time

    def _elapsed(self, scope: _RunScope) -> float:
        return (self._clock.now() - scope.started).total_seconds()

    def _timeout(self, scope: _RunScope, *, ceiling: float | None = None) -> float:
        """A call may not outlive the run's wall-time budget."""
        left = scope.spec.budgets.wall_seconds - self._elapsed(scope)
        limit = ceiling if ceiling is not None else self._settings.dependency_timeout_seconds
        return max(min(limit, left), 0.5)


def _mark(span: Span, error: ErrorValue | None) -> None:
    if error is not None:
        span.set_attribute("error.type", error.code)
        span.set_status(Status(StatusCode.ERROR, error.code))


def _result_detail(entry: LabelledChunk) -> dict[str, JSONValue]:
    chunk: KnowledgeChunk = entry.chunk
    return {
        "label": entry.label,
        "document_id": chunk.document_id,
        "chunk_id": chunk.chunk_id,
        "source": chunk.source,
        "title": chunk.title,
        "char_start": chunk.char_start,
        "char_end": chunk.char_end,
        "bm25_score": chunk.bm25_score,
        "dense_score": chunk.dense_score,
        "fused_score": chunk.fused_score,
    }
