"""How a run's steps are recorded: each under its own span, stored in order, behind
the run.

A step's span is a child of `invoke_agent {agent}`; its start is announced to
StreamRun followers at once, and the finished step is stored with the span's id.
After every step the loop state is persisted with it, so the drive loop can be
entered again from any phase. That write goes on behind the run (the next step
does not need it): writes of a run stay in order, and ending the run, asking a
person or carrying out a write first waits for them (`record_many`, `written`).

A run has at most one step write in flight. Steps recorded while it is in flight
wait together and go in the next statement, with only the latest state (the
state after them all); those still waiting when the run ends go in the statement
that ends it. So a run whose steps come faster than its store answers pays one
round trip, and one serialised state, per wait, not per step: a chain of writes
each waiting for the one before was the tail of a run (its model calls were
done, its answer waited for three statements in series).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from cairn_libs.telemetry import span_id_hex
from cairn_orchestrator.domain import (
    Citation,
    ErrorValue,
    LoopState,
    Run,
    RunState,
    StepDetail,
    StepKind,
    StepRecord,
    StepStart,
)
from cairn_orchestrator.errors import RunCancelled
from cairn_orchestrator.events import RunSignals
from cairn_orchestrator.ports import RunStore
from cairn_orchestrator.run_scope import RunClock, RunScope

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)


@dataclass(frozen=True, slots=True)
class OpenStep:
    """A step whose span was opened: what its record is made of."""

    kind: StepKind
    name: str
    span: Span
    started: datetime
    clock: RunClock

    def record(
        self,
        detail: StepDetail,
        error: ErrorValue | None,
        *,
        kind: StepKind | None = None,
        name: str | None = None,
    ) -> StepRecord:
        """The finished step; `kind` and `name` when they turned out other than
        announced (a proposal refused as a tool call, the model that answered)."""
        return StepRecord(
            kind=kind or self.kind,
            name=name or self.name,
            span_id=span_id_hex(self.span),
            started_at=self.started,
            finished_at=self.clock.now(),
            detail=detail.to_json(),
            error=error,
        )

    def mark(self, error: ErrorValue | None) -> None:
        """Mark the step's span failed with the error's code."""
        if error is not None:
            self.span.set_attribute("error.type", error.code)
            self.span.set_status(Status(StatusCode.ERROR, error.code))


@dataclass(slots=True)
class _RunWrites:
    """A run's steps not yet stored: those waiting for the next statement, the
    state after them, and the task writing them (None: nothing in flight)."""

    waiting: list[StepRecord] = field(default_factory=list)
    state: LoopState | None = None
    writer: asyncio.Task[None] | None = None

    def take(self) -> tuple[tuple[StepRecord, ...], LoopState | None]:
        taken = (tuple(self.waiting), self.state)
        self.waiting, self.state = [], None
        return taken


class StepRecorder:
    def __init__(self, *, store: RunStore, signals: RunSignals, clock: RunClock) -> None:
        self._store = store
        self._signals = signals
        self._clock = clock
        self._writes: dict[str, _RunWrites] = {}
        self._write_tasks: set[asyncio.Task[None]] = set()

    @contextmanager
    def step(
        self,
        scope: RunScope,
        kind: StepKind,
        name: str,
        *,
        span_name: str,
        attributes: Mapping[str, Any],
    ) -> Iterator[OpenStep]:
        """Open a step's span, a child of the run's, and announce the step to StreamRun
        followers at once; `name` is the step's name as far as it is known yet."""
        with tracer.start_as_current_span(
            span_name, attributes={**attributes, "cairn.run_id": scope.run.run_id}
        ) as span:
            started = self._clock.now()
            self._signals.started(
                scope.run.run_id,
                StepStart(kind=kind, name=name, span_id=span_id_hex(span), started_at=started),
            )
            yield OpenStep(kind=kind, name=name, span=span, started=started, clock=self._clock)

    async def record(self, scope: RunScope, record: StepRecord, state: LoopState | None) -> None:
        await self.record_many(scope, (record,), state)

    async def record_many(
        self, scope: RunScope, records: Sequence[StepRecord], state: LoopState | None
    ) -> None:
        """Steps that finished together (with the state after them), to be stored.

        The write goes on behind the run: the next step does not need it stored to
        begin (the model call does not read the memory step's row), so it starts at
        once. Writes of a run stay in order (one statement in flight at a time; the
        steps recorded meanwhile go together in the next), and whatever must see
        them stored (ending the run, asking a person, carrying out a write) waits
        for them first (`written`), which is also where a failed write (store
        away, run taken over or cancelled) stops the run."""
        if not records:
            return
        writes = self._writes.setdefault(scope.run.run_id, _RunWrites())
        writes.waiting.extend(records)
        if state is not None:
            writes.state = state
        if writes.writer is None:
            writer = asyncio.create_task(self._write_waiting(scope, writes))
            writes.writer = writer
            self._write_tasks.add(writer)
            writer.add_done_callback(self._write_tasks.discard)

    async def _write_waiting(self, scope: RunScope, writes: _RunWrites) -> None:
        """Store what waits, one statement at a time, until nothing does. A failed
        statement stops the writing: what waits then is never stored past the gap."""
        while writes.waiting:
            records, state = writes.take()
            try:
                await self._store.record_steps(
                    org_id=scope.run.org_id,
                    run_id=scope.run.run_id,
                    steps=records,
                    loop_state=state,
                )
            except RunCancelled as exc:
                # Not stored because a person cancelled the run: they are its last steps.
                raise RunCancelled(scope.run.run_id, steps=(*exc.steps, *records)) from None
            self._signals.changed(scope.run.run_id)
            _log_step_errors(records)
        writes.writer = None

    async def written(self, scope: RunScope) -> None:
        """Wait until every step recorded so far is stored; raise what stopped it."""
        writes = self._writes.pop(scope.run.run_id, None)
        if writes is not None and writes.writer is not None:
            await _stored_before(scope, writes.writer, writes.waiting)

    async def _unsent(self, scope: RunScope) -> tuple[tuple[StepRecord, ...], LoopState | None]:
        """Take the steps (and state) still waiting for a statement, once the one in
        flight has landed: they go in the statement that ends the run instead."""
        writes = self._writes.pop(scope.run.run_id, None)
        if writes is None:
            return (), None
        waiting, state = writes.take()
        if writes.writer is not None:
            await _stored_before(scope, writes.writer, waiting)
        return waiting, state

    def forget(self, run_id: str) -> None:
        """The run is no longer driven here."""
        writes = self._writes.pop(run_id, None)
        if writes is not None and writes.writer is not None:
            # A run that ended by an error with a write still in flight: the write
            # finishes (or fails) on its own; its outcome is observed, not lost.
            writes.writer.add_done_callback(_observe_write)

    async def drain(self) -> None:
        """Let every write in flight land (a step write extends its run's lease)."""
        await asyncio.gather(*self._write_tasks, return_exceptions=True)

    async def finish(
        self,
        scope: RunScope,
        outcome: RunState,
        state: LoopState | None,
        *,
        answer: str = "",
        citations: Sequence[Citation] = (),
        reason: str = "",
        steps: Sequence[StepRecord] = (),
    ) -> Run:
        """End the run; `steps` that ended it are written in the same statement,
        after the steps recorded before them that were still waiting for one."""
        unsent, unsent_state = await self._unsent(scope)
        usage = state.usage if state is not None else scope.run.usage
        try:
            finished = await self._store.finish_run(
                org_id=scope.run.org_id,
                run_id=scope.run.run_id,
                state=outcome,
                loop_state=state if state is not None else unsent_state,
                usage=usage,
                answer=answer,
                citations=citations,
                reason=reason,
                steps=(*unsent, *steps),
            )
        except RunCancelled as exc:
            raise RunCancelled(scope.run.run_id, steps=(*exc.steps, *unsent)) from None
        self._signals.changed(scope.run.run_id)
        _log_step_errors((*unsent, *steps))
        log.info(
            "run.finished",
            state=outcome.value,
            model_calls=usage.model_calls,
            total_tokens=usage.total_tokens,
            citations=len(citations),
        )
        return finished


async def _stored_before(
    scope: RunScope, writer: asyncio.Task[None], after: Sequence[StepRecord]
) -> None:
    """Wait for the run's write in flight; when a cancel refused it, `after` (steps
    that were to follow it) are among the run's last steps too."""
    try:
        await writer
    except RunCancelled as exc:
        raise RunCancelled(scope.run.run_id, steps=(*exc.steps, *after)) from None


def _observe_write(task: asyncio.Task[None]) -> None:
    """A step write nobody waited for any more (its run ended by an error first)."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        log.warning("run.steps_not_recorded", error=type(error).__name__)


def _log_step_errors(records: Sequence[StepRecord]) -> None:
    for record in records:
        if record.error is not None:
            log.info(
                "run.step_error", kind=record.kind.value, step=record.name, code=record.error.code
            )
