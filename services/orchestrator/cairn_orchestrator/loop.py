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
entered again from any phase. That write goes on behind the run (the next step
does not need it): writes stay in order, and ending the run, asking a person or
carrying out a write first waits for them (`_record_many`, `_written`).

Writes (I4). Reads the model asks for in a turn run first, concurrently; each
write of that turn then waits for its person: the run stops at
CONFIRMATION_PENDING with the write's card and its state persisted. A person's
ResolveConfirmation continues it from that state (`resolve`): an approval hands
the write to its target once (the confirmation token is its idempotency key),
records the result with the state after it, and drives on; a denial reaches the
model as a tool message. No earlier model or tool call is made again.

A run is a task of its own: a caller who hangs up does not stop it half way, and
the process renews the lease of every run it is driving (`active_run_ids`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
)

from cairn_libs.errors import CairnError
from cairn_libs.identity import Principal
from cairn_libs.telemetry import bound_run, span_id_hex, trace_id_hex
from cairn_orchestrator.confirmations import (
    DEFAULT_CONFIRMATION_TTL_SECONDS,
    AlreadyDecided,
    Claim,
    Expire,
    ProposalRefused,
    Refuse,
    Reject,
    Resolver,
    after_resolved_write,
    looks_like_token,
    new_confirmation_token,
    propose_write,
    split_planned,
)
from cairn_orchestrator.conversation import ConversationArchiver, plan_conversation, window_lines
from cairn_orchestrator.domain import (
    ENGLISH,
    AgentSpec,
    CallCredentials,
    Citation,
    Confirmation,
    ConfirmationState,
    ConversationTurn,
    Decision,
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
    RunLanguage,
    RunState,
    StepKind,
    StepRecord,
    StepStart,
    new_run_id,
    unstorable_in_reply,
)
from cairn_orchestrator.errors import (
    ConfirmationClosed,
    DependencyFailed,
    RunCancelled,
    RunNotVisible,
    RunTakenOver,
    StoreUnavailable,
)
from cairn_orchestrator.events import RunSignals
from cairn_orchestrator.failover import RerunTurn, after_refused_call
from cairn_orchestrator.memory_tools import memory_copies
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
    ConfirmationStore,
    KnowledgeSearch,
    MemoryRecall,
    ModelGateway,
    RunStore,
    SystemClock,
)
from cairn_orchestrator.remote import (
    PrefetchedSearch,
    RunSearches,
    reused_searches,
    run_searches,
)
from cairn_orchestrator.tools import ToolCallOutcome, ToolContext, ToolRegistry, dispatch, refused

T = TypeVar("T")

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)

ActorTokenMinter = Callable[[str, str], str]
"""(run_id, agent) -> the orchestrator's per-run service credential."""


@dataclass(frozen=True, slots=True)
class Caller:
    """The verified caller and their own token, passed on to every call (I1).
    `is_person` is False when the call carries an actor token (a service acting)."""

    principal: Principal
    token: str
    is_person: bool = True


@dataclass(frozen=True, slots=True)
class LoopSettings:
    memory_k: int = 5
    retrieval_k: int = 4
    max_completion_tokens: int = DEFAULT_MAX_COMPLETION_TOKENS
    dependency_timeout_seconds: float = 15.0
    model_timeout_seconds: float = 120.0
    confirmation_ttl_seconds: float = DEFAULT_CONFIRMATION_TTL_SECONDS
    # A second approval of a write already being carried out waits this long for
    # the run to come to rest, so both callers see the same outcome.
    settle_seconds: float = 30.0
    settle_poll_seconds: float = 0.2
    # How often a process working on runs asks the store whether a person cancelled
    # one of them (through any replica): the most a cancelled model call runs on.
    cancel_poll_seconds: float = 0.25


# What recall and the prefetch found, each with its step (None: not asked for).
_OpeningReads = tuple[
    tuple[StepRecord | None, tuple[RecalledMemory, ...]],
    tuple[StepRecord | None, tuple[LabelledChunk, ...]],
]


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
        conversation: ConversationArchiver | None = None,
        confirmations: ConfirmationStore | None = None,
        signals: RunSignals | None = None,
    ) -> None:
        self._conversation = conversation or ConversationArchiver(None)
        self._store = store
        self._gateway = gateway
        self._retrieval = retrieval
        self._memory = memory
        self._registry = registry
        self._mint_actor_token = mint_actor_token
        self._clock: Clock = clock or SystemClock()
        self._settings = settings or LoopSettings()
        # Without a confirmation store no person can be asked, so writes are refused.
        self._confirmations = confirmations
        self.signals = signals or RunSignals()
        self._active: set[str] = set()
        # Runs whose store failed under them, with the true reason they ended; kept
        # active (leases renewed) until the store answers and the reason is written.
        self._unsettled: dict[str, tuple[_RunScope, str]] = {}
        self._tasks: set[asyncio.Task[Run]] = set()
        # Set when a person cancels a run this process is working on (CancelRun here,
        # or on another replica, which the watcher finds in the run's state).
        self._cancels: dict[str, asyncio.Event] = {}
        self._watcher: asyncio.Task[None] | None = None
        # Per run, the last step write in flight (each waits for the one before it).
        self._writes: dict[str, asyncio.Task[None]] = {}
        self._write_tasks: set[asyncio.Task[None]] = set()

    def active_run_ids(self) -> tuple[str, ...]:
        """The runs this process is driving right now (their leases are renewed)."""
        return tuple(self._active)

    async def stop(self) -> None:
        """Stop driving: cancel the runs in flight and give up their leases, so the
        recovery sweep (of this or another process) deals with them at once."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Writes still in flight land before the leases are given up (a step write
        # extends its run's lease).
        await asyncio.gather(*self._write_tasks, return_exceptions=True)
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self._confirmations is not None:
            try:
                await self._confirmations.release_leases()
            except StoreUnavailable:
                log.warning("runs.leases_not_released")

    def _activate(self, run_id: str) -> None:
        """This process works on the run now: renew its lease, watch for a cancel."""
        self._active.add(run_id)
        self._cancels.setdefault(run_id, asyncio.Event())
        if self._confirmations is not None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.create_task(self._watch_cancels(self._confirmations))

    def _release(self, run_id: str) -> None:
        self._cancels.pop(run_id, None)
        write = self._writes.pop(run_id, None)
        if write is not None:
            # A run that ended by an error with a write still in flight: the write
            # finishes (or fails) on its own; its outcome is observed, not lost.
            write.add_done_callback(_observe_write)
        if run_id not in self._unsettled:
            self._active.discard(run_id)

    def cancelled(self, run_id: str) -> None:
        """A person cancelled the run: if this process works on it, cut its model call
        (and the reads in flight) short; the writes after would be refused anyway."""
        event = self._cancels.get(run_id)
        if event is not None:
            event.set()

    async def _watch_cancels(self, confirmations: ConfirmationStore) -> None:
        """While this process works on runs, ask the store every few hundred ms which
        of them a person cancelled, on whichever replica they asked. One indexed
        query per process, not per run; it runs only while runs are in flight."""
        while self._active:
            await asyncio.sleep(self._settings.cancel_poll_seconds)
            watched = [r for r, e in self._cancels.items() if not e.is_set()]
            try:
                found = await confirmations.cancelled_runs(watched)
            except StoreUnavailable:
                continue
            for run_id in found:
                log.info("run.cancel_noticed", run_id=run_id)
                self.cancelled(run_id)

    async def _unless_cancelled(self, scope: _RunScope, work: Awaitable[T]) -> T:
        """Await `work`, unless the run is cancelled first: then `work` is cancelled
        (a gRPC call in flight is cancelled with it) and RunCancelled raised."""
        event = self._cancels.get(scope.run.run_id)
        task = asyncio.ensure_future(work)
        if event is None:
            return await task
        waiter = asyncio.create_task(event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with suppress(asyncio.CancelledError, Exception):
            await task
        raise RunCancelled(scope.run.run_id)

    async def settle_unsettled(self) -> list[str]:
        """End, with their true reason, the runs whose store failed under them; a run
        the store still cannot take waits for the next round. Returns the runs ended."""
        ended = []
        for run_id, (scope, reason) in list(self._unsettled.items()):
            try:
                await self._finish(scope, RunState.FAILED, None, reason=reason)
            except RunTakenOver:
                log.warning("run.unsettled_taken_over", run_id=run_id)
            except StoreUnavailable:
                continue
            del self._unsettled[run_id]
            self._active.discard(run_id)
            self.signals.changed(run_id)
            ended.append(run_id)
        return ended

    async def _own(self, work: Coroutine[Any, Any, Run]) -> Run:
        """Drive a run as its own task; the request awaits it, but cancelling the
        request (a caller who hangs up) does not cancel the run."""
        return await asyncio.shield(self._spawn(work))

    def _spawn(self, work: Coroutine[Any, Any, Run]) -> asyncio.Task[Run]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_observe)
        return task

    # ------------------------------------------------------------ entry

    async def start(
        self,
        *,
        spec: AgentSpec,
        caller: Caller,
        question: str,
        conversation_id: str,
        earlier: Sequence[ConversationTurn],
        language: RunLanguage = ENGLISH,
        return_when_started: bool = False,
    ) -> Run:
        """The run as it ends or waits for a person; with `return_when_started`, as
        soon as its row exists (RUNNING), while its own task drives it on."""
        created: asyncio.Future[Run] | None = (
            asyncio.get_running_loop().create_future() if return_when_started else None
        )
        work = self._start(
            spec=spec,
            caller=caller,
            question=question,
            conversation_id=conversation_id,
            earlier=earlier,
            language=language,
            created=created,
        )
        if created is None:
            return await self._own(work)
        task = self._spawn(work)
        await asyncio.wait({task, created}, return_when=asyncio.FIRST_COMPLETED)
        if created.done():
            return created.result()
        return await task  # refused, or failed, before the run existed

    async def _start(
        self,
        *,
        spec: AgentSpec,
        caller: Caller,
        question: str,
        conversation_id: str,
        earlier: Sequence[ConversationTurn],
        language: RunLanguage = ENGLISH,
        created: asyncio.Future[Run] | None = None,
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
            credentials = CallCredentials(
                caller_token=caller.token, actor_token=self._mint_actor_token(run_id, spec.name)
            )
            # Recall and the prefetch read for the caller and need nothing from the
            # run's row: they start now, while it is written (a read, never a write,
            # so a run the store refuses has changed nothing).
            reading = _RunScope(
                run=Run(
                    run_id=run_id,
                    org_id=caller.principal.org_id,
                    user_id=caller.principal.user_id,
                    agent=spec.name,
                    state=RunState.RUNNING,
                    input=question,
                    conversation_id=conversation_id,
                    trace_id=trace_id_hex(span),
                    created_at=started,
                    updated_at=started,
                    root_span_id=span_id_hex(span),
                    language=language.language,
                    language_fallback=language.fallback,
                ),
                spec=spec,
                principal=caller.principal,
                credentials=credentials,
                started=started,
            )
            # Shared with the retrieval door for the rest of this run (this task and
            # the tasks it starts): a search_knowledge call with the question reuses
            # the prefetch.
            searches = RunSearches()
            run_searches.set(searches)
            book = LabelBook()
            reads = asyncio.create_task(self._opening_reads(reading, question, book, searches))
            try:
                run = await self._store.create_run(
                    run_id=run_id,
                    org_id=caller.principal.org_id,
                    user_id=caller.principal.user_id,
                    agent=spec.name,
                    input=question,
                    conversation_id=conversation_id,
                    earlier_turns=earlier,
                    trace_id=trace_id_hex(span),
                    root_span_id=span_id_hex(span),
                    language=language,
                )
            except BaseException:
                reads.cancel()
                await asyncio.gather(reads, return_exceptions=True)
                raise
            log.info("run.started", agent=spec.name)
            scope = replace(reading, run=run)
            self._activate(run_id)
            if created is not None and not created.done():
                created.set_result(run)
            try:
                return await self._guarded(
                    scope,
                    span,
                    self._open_and_drive(scope, reads, question=question, earlier=earlier),
                )
            finally:
                self._release(run_id)

    async def _open_and_drive(
        self,
        scope: _RunScope,
        reads: asyncio.Task[_OpeningReads],
        *,
        question: str,
        earlier: Sequence[ConversationTurn],
    ) -> Run:
        state = await self._open(scope, reads, question=question, earlier=earlier)
        # A re-run of the turn starts again from exactly these messages.
        return await self._drive(scope, replace(state, opening=len(state.messages)))

    async def _guarded(self, scope: _RunScope, span: Span, work: Awaitable[Run]) -> Run:
        """Await the run's work, and turn anything unexpected into a FAILED run with
        the reason rather than a run silently left RUNNING."""
        try:
            finished = await work
        except RunCancelled as exc:
            span.set_attribute("cairn.run_state", RunState.CANCELLED.value)
            return await self._wind_up_cancelled(scope, exc)
        except RunTakenOver:
            span.set_status(Status(StatusCode.ERROR, "run taken over"))
            raise
        except StoreUnavailable as exc:
            span.set_status(Status(StatusCode.ERROR, "run store unavailable"))
            # Without this, the run would sit RUNNING until its lease ran out and then
            # be ended as if this process had stopped, which is not what happened.
            self._unsettled[scope.run.run_id] = (
                scope,
                f"the run store (PostgreSQL) stopped answering while this run was working "
                f"({exc.message}); the run was ended when it answered again; everything "
                "recorded up to then is in its trajectory",
            )
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
        if finished.state not in (RunState.COMPLETED, RunState.CONFIRMATION_PENDING):
            span.set_status(Status(StatusCode.ERROR, finished.state.value))
        return finished

    async def _wind_up_cancelled(self, scope: _RunScope, cancelled: RunCancelled) -> Run:
        """A person cancelled the run while this process worked on it: add its last
        steps (the call cut short), give up the lease, and answer with the run."""
        confirmations = self._confirmations
        run_id = scope.run.run_id
        # Steps whose write was still waiting or refused because of the cancel come
        # first, in the order they happened.
        earlier: tuple[StepRecord, ...] = ()
        try:
            await self._written(scope)
        except RunCancelled as exc:
            earlier = exc.steps
        except (RunTakenOver, StoreUnavailable):
            pass
        steps = (*earlier, *cancelled.steps)
        log.info("run.cancelled", steps=len(steps))
        if confirmations is not None:
            try:
                await confirmations.record_cancelled(
                    org_id=scope.run.org_id, run_id=run_id, steps=steps
                )
            except StoreUnavailable:
                log.warning("run.cancelled_steps_not_recorded")
        self.signals.changed(run_id)
        run = await self._store.get_run(org_id=scope.run.org_id, run_id=run_id, user_id=None)
        return run if run is not None else scope.run

    # ------------------------------------------------------------ a person resolves a write

    async def resolve(
        self,
        *,
        caller: Caller,
        token: str,
        decision: Decision,
        note: str,
        spec_for: Callable[[str], AgentSpec | None],
    ) -> Run:
        """Approve or deny a proposed write, then continue its run from its recorded
        state; the run is at rest again when this returns."""
        return await self._own(
            self._resolve(
                caller=caller, token=token, decision=decision, note=note, spec_for=spec_for
            )
        )

    async def _resolve(
        self,
        *,
        caller: Caller,
        token: str,
        decision: Decision,
        note: str,
        spec_for: Callable[[str], AgentSpec | None],
    ) -> Run:
        confirmations = self._confirmations
        if confirmations is None or not looks_like_token(token):
            raise RunNotVisible()
        resolver = Resolver(
            org_id=caller.principal.org_id,
            user_id=caller.principal.user_id,
            is_person=caller.is_person,
        )
        with tracer.start_as_current_span(
            "resolve_confirmation", attributes={"cairn.decision": decision}
        ) as span:
            record = await confirmations.resolve_confirmation(
                org_id=caller.principal.org_id,
                token=token,
                resolver=resolver,
                decision=decision,
                note=note,
                span_id=span_id_hex(span),
                started_at=self._clock.now(),
            )
            link = Link(span.get_span_context())
        outcome = record.resolution
        if isinstance(outcome, Refuse):
            raise RunNotVisible()
        assert record.run is not None and record.confirmation is not None
        run = record.run
        if isinstance(outcome, Expire):
            self.signals.changed(run.run_id)
            log.info("confirmation.expired", run_id=run.run_id)
            raise ConfirmationClosed(outcome.reason)
        if isinstance(outcome, Reject):
            raise ConfirmationClosed(outcome.message)
        if isinstance(outcome, AlreadyDecided):
            return await self._settled(run)
        assert isinstance(outcome, Claim) and record.loop_state is not None
        self.signals.changed(run.run_id)
        return await self._continue(
            run, record.confirmation, outcome, record.loop_state, caller, spec_for(run.agent), link
        )

    async def _continue(
        self,
        run: Run,
        confirmation: Confirmation,
        claim: Claim,
        state: LoopState,
        caller: Caller,
        spec: AgentSpec | None,
        link: Link,
    ) -> Run:
        attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": run.agent,
            "cairn.run_id": run.run_id,
            "cairn.resumed": True,
        }
        # The resumed part joins the run's own trace (one run, one trace), linked to
        # the request of the person who resolved it.
        with (
            tracer.start_as_current_span(
                f"invoke_agent {run.agent}",
                context=_run_trace_context(run),
                links=[link],
                attributes=attributes,
            ) as span,
            bound_run(run.run_id),
        ):
            log.info(
                "run.resumed",
                decision=claim.decision,
                after_interruption=claim.resumed,
                tool=confirmation.tool_name,
            )
            if spec is None:
                return await self._store.finish_run(
                    org_id=run.org_id,
                    run_id=run.run_id,
                    state=RunState.FAILED,
                    loop_state=state,
                    usage=state.usage,
                    reason=f"agent {run.agent!r} is no longer loaded by this orchestrator, so "
                    "the run could not continue; the write did not run",
                )
            scope = _RunScope(
                run=run,
                spec=spec,
                principal=caller.principal,
                credentials=CallCredentials(
                    caller_token=caller.token,
                    actor_token=self._mint_actor_token(run.run_id, spec.name),
                ),
                # Time spent waiting for the person does not count against the budget.
                started=self._clock.now() - timedelta(seconds=state.active_seconds),
            )
            self._activate(run.run_id)
            try:
                return await self._guarded(
                    scope, span, self._carry_out_and_drive(scope, state, confirmation, claim)
                )
            finally:
                self._release(run.run_id)

    async def _carry_out_and_drive(
        self, scope: _RunScope, state: LoopState, confirmation: Confirmation, claim: Claim
    ) -> Run:
        if claim.decision == "approve":
            state = await self._carry_out(scope, state, confirmation)
        return await self._drive(scope, state)

    async def _carry_out(
        self, scope: _RunScope, state: LoopState, confirmation: Confirmation
    ) -> LoopState:
        """Hand the approved write to its target, once: the store marks it EXECUTING
        first (a crash from here on leaves a trace of it) and records the result
        with the state after it in one transaction. A write already EXECUTED (a
        crash after it was recorded) is not run again; `state` already holds it."""
        confirmations = self._confirmations
        assert confirmations is not None
        call = confirmation.call
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id,
            "cairn.confirmed": True,
        }
        with self._span(f"execute_tool {call.name}", scope, attributes) as span:
            started = self._clock.now()
            await self._written(scope)
            begun = await confirmations.begin_write(
                org_id=scope.run.org_id, run_id=scope.run.run_id, token=confirmation.token
            )
            if begun.state is ConfirmationState.EXECUTED:
                return state
            context = self._context(scope, state, confirmation_token=confirmation.token)
            outcome = await dispatch(self._registry, call, context)
            _mark(span, outcome.error)
        detail = {**outcome.detail(), "confirmed": True, "attempt": begun.executions}
        after = after_resolved_write(state, outcome)
        cancelled = await confirmations.record_write(
            org_id=scope.run.org_id,
            run_id=scope.run.run_id,
            token=confirmation.token,
            result=outcome.detail(),
            step=replace(
                self._step(StepKind.TOOL_CALL, call.name, span, started, detail, outcome.error),
                copies=outcome.copies,
            ),
            loop_state=after,
        )
        self.signals.changed(scope.run.run_id)
        log.info("confirmation.executed", tool=call.name, attempt=begun.executions)
        if cancelled:
            raise RunCancelled(scope.run.run_id)
        return after

    async def _settled(self, run: Run) -> Run:
        """A run another request is driving, once it is at rest (or as it stands
        when the wait runs out)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.settle_seconds
        with self.signals.follow(run.run_id) as wake:
            while not run.state.at_rest and loop.time() < deadline:
                with suppress(TimeoutError):
                    await asyncio.wait_for(wake.get(), timeout=self._settings.settle_poll_seconds)
                current = await self._store.get_run(
                    org_id=run.org_id, run_id=run.run_id, user_id=None
                )
                if current is None:
                    break
                run = current
        return run

    # ------------------------------------------------------------ opening: memory and knowledge

    async def _opening_reads(
        self, scope: _RunScope, question: str, book: LabelBook, searches: RunSearches
    ) -> _OpeningReads:
        """Recall and prefetch need nothing from each other: they run at once."""
        memory_read, knowledge_read = await asyncio.gather(
            self._read_memory(scope, question),
            self._prefetch_knowledge(scope, question, book, searches),
        )
        return memory_read, knowledge_read

    async def _open(
        self,
        scope: _RunScope,
        reads: asyncio.Task[_OpeningReads],
        *,
        question: str,
        earlier: Sequence[ConversationTurn],
    ) -> LoopState:
        # The conversation is archived (a write to memory) only once the run exists;
        # the steps are recorded in a fixed order: memory, retrieval, conversation.
        (
            ((memory_step, memories), (knowledge_step, knowledge)),
            (conversation_step, window),
        ) = await self._unless_cancelled(
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
        await self._record_many(scope, opening, state)
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
        record = self._step(StepKind.MEMORY_READ, "memory", span, started, detail, error)
        # The prompt's memory block copies these texts about people (I9).
        return replace(record, copies=memory_copies(memories)), memories

    async def _compact_conversation(
        self, scope: _RunScope, earlier: Sequence[ConversationTurn]
    ) -> tuple[StepRecord | None, tuple[str, ...]]:
        """The conversation window; turns too large to travel whole are archived
        first and named by reference (conversation.py decides, this only calls)."""
        plan = plan_conversation(earlier)
        if not plan.to_archive:
            return None, window_lines(plan, {})
        with self._span(
            "archive_conversation", scope, {"gen_ai.operation.name": "archive_conversation"}
        ) as span:
            started = self._clock.now()
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
                deadline_seconds=self._timeout(scope),
                # The block is about whomever the conversation's runs read about.
                subjects=subjects,
            )
            _mark(span, compacted.error)
        record = self._step(
            StepKind.CONVERSATION_ARCHIVE,
            "conversation",
            span,
            started,
            compacted.detail,
            compacted.error,
        )
        return replace(record, copies=compacted.copies), compacted.lines

    async def _prefetch_knowledge(
        self, scope: _RunScope, question: str, book: LabelBook, searches: RunSearches
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
                    searches.prefetched = PrefetchedSearch(
                        query=question,
                        sources=tuple(sources),
                        k=k,
                        credentials=scope.credentials,
                        outcome=outcome,
                    )
                    labelled = tuple(book.label(chunk) for chunk in outcome.results)
                    detail |= {"mode": outcome.mode, "mode_reason": outcome.mode_reason}
            detail |= {"count": len(labelled), "results": [_result_detail(e) for e in labelled]}
            _mark(span, error)
        return self._step(StepKind.RETRIEVAL, "retrieval", span, started, detail, error), labelled

    # ------------------------------------------------------------ the resumable loop

    async def _drive(self, scope: _RunScope, state: LoopState) -> Run:
        spec = scope.spec
        confirmable = self._confirmations is not None
        while True:
            if state.next_phase == "confirm_writes":
                proposed = await self._propose(scope, state)
                if isinstance(proposed, Run):
                    return proposed
                state = proposed
                continue
            if state.next_phase == "execute_tools":
                exhausted = wall_time_exhaustion(spec.budgets, elapsed_seconds=self._elapsed(scope))
                if exhausted is not None:
                    return await self._finish(
                        scope, RunState.BUDGET_EXHAUSTED, state, reason=exhausted
                    )
                planned = tuple(
                    plan_tool_call(c, spec=spec, registry=self._registry, confirmable=confirmable)
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
                assert failure is not None
                # A call cut short by the run's own deadline is the budget, not the gateway.
                wall = wall_time_exhaustion(spec.budgets, elapsed_seconds=self._elapsed(scope))
                refusal = (
                    None
                    if wall is not None
                    else after_refused_call(state, request.messages, failure)
                )
                if isinstance(refusal, RerunTurn):
                    state = refusal.state
                    await self._record(
                        scope,
                        replace(record, detail={**record.detail, "rerun": refusal.note}),
                        state,
                    )
                    log.info("run.turn_rerun", provider=request.pinned_provider)
                    continue
                ended = (record,)
                if wall is not None:
                    return await self._finish(
                        scope, RunState.BUDGET_EXHAUSTED, state, reason=wall, steps=ended
                    )
                if isinstance(refusal, StopRun):
                    return await self._finish(
                        scope, refusal.state, state, reason=refusal.reason, steps=ended
                    )
                return await self._finish(
                    scope,
                    RunState.FAILED,
                    state,
                    reason=f"the model call failed: {failure.message}",
                    steps=ended,
                )
            unstorable = unstorable_in_reply(reply)
            if unstorable is not None:
                # The reply cannot be kept, so it is not acted on either: the run ends
                # with the true reason instead of failing to store its own state.
                error = ErrorValue(
                    "gateway.unstorable_text",
                    f"the model's reply held U+0000 in {unstorable}, which cannot be stored",
                )
                failed = replace(record, error=error)
                return await self._finish(
                    scope,
                    RunState.FAILED,
                    state,
                    reason=f"{error.message}; the reply was not used",
                    steps=(failed,),
                )
            state = after_model_reply(state, reply)
            decision = plan_after_reply(
                reply,
                state=state,
                spec=spec,
                registry=self._registry,
                elapsed_seconds=self._elapsed(scope),
                confirmable=confirmable,
            )
            if isinstance(decision, FinalAnswer):
                citations = resolve_citations(decision.text, state.knowledge)
                return await self._finish(
                    scope,
                    RunState.COMPLETED,
                    state,
                    answer=decision.text,
                    citations=citations,
                    steps=(record,),
                )
            if isinstance(decision, StopRun):
                return await self._finish(
                    scope, decision.state, state, reason=decision.reason, steps=(record,)
                )
            assert isinstance(decision, RunToolCalls)
            await self._record(scope, record, state)
            state = await self._execute(scope, state, decision.calls)

    async def _propose(self, scope: _RunScope, state: LoopState) -> Run | LoopState:
        """Ask the person about the next write of the turn: validate its arguments,
        render its card, and park the run at CONFIRMATION_PENDING with its state.
        Arguments that fail validation go back to the model without asking anyone."""
        confirmations = self._confirmations
        assert confirmations is not None, "writes are only planned where a person can be asked"
        call = state.pending_calls[0]
        attributes = {
            "gen_ai.operation.name": "request_confirmation",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id,
        }
        with self._span(f"request_confirmation {call.name}", scope, attributes) as span:
            started = self._clock.now()
            proposal = propose_write(
                call,
                registry=self._registry,
                context=self._context(scope, state),
                ttl_seconds=self._settings.confirmation_ttl_seconds,
                token=new_confirmation_token(),
                language_fallback=scope.run.language_fallback,
            )
            if isinstance(proposal, ProposalRefused):
                _mark(span, proposal.outcome.error)
        if isinstance(proposal, ProposalRefused):
            outcome = proposal.outcome
            # Nobody was asked, so the run did not carry a confirmation for this one.
            state = replace(
                after_resolved_write(state, outcome),
                carried_confirmation=state.carried_confirmation,
            )
            record = self._step(
                StepKind.TOOL_CALL, call.name, span, started, outcome.detail(), outcome.error
            )
            await self._record(scope, record, state)
            return state
        await self._written(scope)
        at_rest = replace(state, carried_confirmation=True, active_seconds=self._elapsed(scope))
        step = replace(
            self._step(StepKind.CONFIRMATION_REQUESTED, call.name, span, started, {}, None),
            copies=proposal.copies,
        )
        run = await confirmations.request_confirmation(
            org_id=scope.run.org_id,
            run_id=scope.run.run_id,
            user_id=scope.run.user_id,
            proposal=proposal,
            step=step,
            loop_state=at_rest,
        )
        self.signals.changed(run.run_id)
        log.info("run.waiting_for_confirmation", tool=call.name)
        return run

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
                reply = await self._unless_cancelled(
                    scope,
                    self._gateway.chat(
                        request,
                        scope.credentials,
                        deadline_seconds=self._timeout(
                            scope, ceiling=self._settings.model_timeout_seconds
                        ),
                    ),
                )
            except RunCancelled as exc:
                error = ErrorValue(
                    "run.cancelled",
                    "a person cancelled the run while the model was answering; the call was "
                    "cancelled and its answer, if any, was not used",
                )
                _mark(span, error)
                record = self._step(
                    StepKind.MODEL_CALL, f"tier:{request.tier}", span, started, detail, error
                )
                raise RunCancelled(exc.run_id, steps=(record,)) from None
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
        """Run the calls that may run now (reads, and refusals answered as data;
        independent, so concurrently) and fold their results back. Writes of the
        same turn wait for a person afterwards, in the order the model asked.
        Steps are recorded in the order the model asked."""
        now_calls, writes = split_planned(planned)
        book = LabelBook(state.knowledge)
        context = self._context(scope, state, labels=book)
        observed = await self._unless_cancelled(
            scope, asyncio.gather(*(self._run_tool(scope, call, context) for call in now_calls))
        )
        state = after_tool_calls(
            state, [outcome for outcome, _ in observed], knowledge=book.entries
        )
        if writes:
            state = replace(state, pending_calls=writes, next_phase="confirm_writes")
        await self._record_many(scope, [record for _, record in observed], state)
        return state

    def _context(
        self,
        scope: _RunScope,
        state: LoopState,
        *,
        labels: LabelBook | None = None,
        confirmation_token: str | None = None,
    ) -> ToolContext:
        return ToolContext(
            principal=scope.principal,
            run_id=scope.run.run_id,
            agent=scope.spec.name,
            remaining_tokens=remaining_tokens(scope.spec.budgets, state.usage),
            sources=scope.spec.sources,
            credentials=scope.credentials,
            labels=labels if labels is not None else LabelBook(state.knowledge),
            confirmation_token=confirmation_token,
            run_calls=tuple(c for m in state.messages for c in m.tool_calls),
            language=scope.run.language,
        )

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
            # Searches this call had answered from the run's prefetch (remote.py).
            reused: list[str] = []
            marked = reused_searches.set(reused)
            try:
                if planned.refusal is not None:
                    outcome = refused(call, planned.refusal)
                else:
                    outcome = await dispatch(self._registry, call, context)
            finally:
                reused_searches.reset(marked)
            _mark(span, outcome.error)
            detail = outcome.detail()
            if reused:
                span.set_attribute("cairn.reused_prefetch", True)
                detail = {**detail, "reused_prefetch": True}
        record = self._step(StepKind.TOOL_CALL, call.name, span, started, detail, outcome.error)
        return outcome, replace(record, copies=outcome.copies)

    # ------------------------------------------------------------ recording

    def _span(
        self, name: str, scope: _RunScope, attributes: Mapping[str, Any]
    ) -> AbstractContextManager[Span]:
        return self._announced_span(name, scope, attributes)

    @contextmanager
    def _announced_span(
        self, name: str, scope: _RunScope, attributes: Mapping[str, Any]
    ) -> Iterator[Span]:
        """A step's span; its start is announced to StreamRun followers at once."""
        with tracer.start_as_current_span(
            name, attributes={**attributes, "cairn.run_id": scope.run.run_id}
        ) as span:
            announced = _announced_step(attributes)
            if announced is not None:
                kind, step_name = announced
                self.signals.started(
                    scope.run.run_id,
                    StepStart(
                        kind=kind,
                        name=step_name,
                        span_id=span_id_hex(span),
                        started_at=self._clock.now(),
                    ),
                )
            yield span

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
        await self._record_many(scope, (record,), state)

    async def _record_many(
        self, scope: _RunScope, records: Sequence[StepRecord], state: LoopState | None
    ) -> None:
        """Steps that finished together, in one write (with the state after them).

        The write goes on behind the run: the next step does not need it stored to
        begin (the model call does not read the memory step's row), so it starts at
        once. Writes of a run stay in order (each waits for the one before it), and
        whatever must see them stored (ending the run, asking a person, carrying out
        a write) waits for them first (`_written`), which is also where a failed
        write (store away, run taken over or cancelled) stops the run."""
        if not records:
            return
        run_id = scope.run.run_id
        previous = self._writes.get(run_id)
        write = asyncio.create_task(self._write_after(previous, scope, tuple(records), state))
        self._writes[run_id] = write
        self._write_tasks.add(write)
        write.add_done_callback(self._write_tasks.discard)

    async def _write_after(
        self,
        previous: asyncio.Task[None] | None,
        scope: _RunScope,
        records: tuple[StepRecord, ...],
        state: LoopState | None,
    ) -> None:
        try:
            if previous is not None:
                await previous
            await self._store.record_steps(
                org_id=scope.run.org_id, run_id=scope.run.run_id, steps=records, loop_state=state
            )
        except RunCancelled as exc:
            # Not stored because a person cancelled the run: they are its last steps.
            raise RunCancelled(scope.run.run_id, steps=(*exc.steps, *records)) from None
        self.signals.changed(scope.run.run_id)
        _log_step_errors(records)

    async def _written(self, scope: _RunScope) -> None:
        """Wait until every step recorded so far is stored; raise what stopped it."""
        write = self._writes.pop(scope.run.run_id, None)
        if write is not None:
            await write

    async def _finish(
        self,
        scope: _RunScope,
        outcome: RunState,
        state: LoopState | None,
        *,
        answer: str = "",
        citations: Sequence[Citation] = (),
        reason: str = "",
        steps: Sequence[StepRecord] = (),
    ) -> Run:
        """End the run; `steps` that ended it are written in the same statement."""
        await self._written(scope)
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
            steps=steps,
        )
        self.signals.changed(scope.run.run_id)
        _log_step_errors(steps)
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


_ANNOUNCED: dict[str, tuple[StepKind, str]] = {
    "recall_memory": (StepKind.MEMORY_READ, "memory"),
    "retrieve": (StepKind.RETRIEVAL, "retrieval"),
    "archive_conversation": (StepKind.CONVERSATION_ARCHIVE, "conversation"),
}


def _announced_step(attributes: Mapping[str, Any]) -> tuple[StepKind, str] | None:
    """The kind and provisional name of the step a span covers, from its attributes."""
    operation = attributes.get("gen_ai.operation.name")
    if operation == "chat":
        return StepKind.MODEL_CALL, f"tier:{attributes.get('cairn.tier', '')}"
    if operation == "execute_tool":
        return StepKind.TOOL_CALL, str(attributes.get("gen_ai.tool.name", ""))
    if operation == "request_confirmation":
        return StepKind.CONFIRMATION_REQUESTED, str(attributes.get("gen_ai.tool.name", ""))
    return _ANNOUNCED.get(str(operation))


def _run_trace_context(run: Run) -> otel_context.Context | None:
    """The context of the run's root span, so a resumed run's spans join its trace."""
    try:
        trace_id, span_id = int(run.trace_id, 16), int(run.root_span_id, 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    root = SpanContext(
        trace_id=trace_id,
        span_id=span_id,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(root))


def _observe_write(task: asyncio.Task[None]) -> None:
    """A step write nobody waited for any more (its run ended by an error first)."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        log.warning("run.steps_not_recorded", error=type(error).__name__)


def _observe(task: asyncio.Task[Run]) -> None:
    """Retrieve a run task's exception even when its request stopped waiting; a
    refusal (CairnError) is the request's answer, anything else is worth a line."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None and not isinstance(error, CairnError):
        log.warning("run.task_ended_with_error", error=type(error).__name__)


def _log_step_errors(records: Sequence[StepRecord]) -> None:
    for record in records:
        if record.error is not None:
            log.info(
                "run.step_error", kind=record.kind.value, step=record.name, code=record.error.code
            )


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
