"""Which runs this process is working on, and how each comes to rest.

A run is a task of its own: a caller who hangs up does not stop it half way
(`own`), and the process renews the lease of every run it is driving
(`active_run_ids`). Whatever ends a run's work, the run is left at rest with the
true reason (`guarded`): cancelled by a person, FAILED with what went wrong, or,
when the store itself stopped answering, kept active until it answers again and
the reason can be written (`settle_unsettled`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any

import structlog
from opentelemetry.trace import Span, Status, StatusCode

from cairn_libs.errors import CairnError
from cairn_orchestrator.cancellation import CancelWatch
from cairn_orchestrator.domain import Run, RunState, StepRecord
from cairn_orchestrator.errors import RunCancelled, RunTakenOver, StoreUnavailable
from cairn_orchestrator.events import RunSignals
from cairn_orchestrator.ports import ConfirmationStore, RunStore
from cairn_orchestrator.recording import StepRecorder
from cairn_orchestrator.run_scope import RunScope

log = structlog.get_logger(__name__)


class RunLifecycle:
    def __init__(
        self,
        *,
        store: RunStore,
        confirmations: ConfirmationStore | None,
        recorder: StepRecorder,
        signals: RunSignals,
        cancel_poll_seconds: float,
    ) -> None:
        self._store = store
        self._confirmations = confirmations
        self._recorder = recorder
        self._signals = signals
        self._active: set[str] = set()
        # Runs whose store failed under them, with the true reason they ended; kept
        # active (leases renewed) until the store answers and the reason is written.
        self._unsettled: dict[str, tuple[RunScope, str]] = {}
        self._tasks: set[asyncio.Task[Run]] = set()
        self.cancels = CancelWatch(
            confirmations, poll_seconds=cancel_poll_seconds, working=lambda: bool(self._active)
        )

    def active_run_ids(self) -> tuple[str, ...]:
        """The runs this process is driving right now (their leases are renewed)."""
        return tuple(self._active)

    async def stop(self) -> None:
        """Stop driving: cancel the runs in flight and give up their leases, so the
        recovery sweep (of this or another process) deals with them at once."""
        await self.abandon()
        # Writes still in flight land before the leases are given up (a step write
        # extends its run's lease).
        await self._recorder.drain()
        await self.cancels.stop()
        if self._confirmations is not None:
            try:
                await self._confirmations.release_leases()
            except StoreUnavailable:
                log.warning("runs.leases_not_released")

    async def abandon(self) -> None:
        """Cancel the runs in flight and do nothing else: no lease given up, nothing
        written after (what a process that is killed leaves behind)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def activate(self, run_id: str) -> None:
        """This process works on the run now: renew its lease, watch for a cancel."""
        self._active.add(run_id)
        self.cancels.watch(run_id)

    def release(self, run_id: str) -> None:
        self.cancels.forget(run_id)
        self._recorder.forget(run_id)
        if run_id not in self._unsettled:
            self._active.discard(run_id)

    async def settle_unsettled(self) -> list[str]:
        """End, with their true reason, the runs whose store failed under them; a run
        the store still cannot take waits for the next round. Returns the runs ended."""
        ended = []
        for run_id, (scope, reason) in list(self._unsettled.items()):
            try:
                await self._recorder.finish(scope, RunState.FAILED, None, reason=reason)
            except RunTakenOver:
                log.warning("run.unsettled_taken_over", run_id=run_id)
            except StoreUnavailable:
                continue
            del self._unsettled[run_id]
            self._active.discard(run_id)
            self._signals.changed(run_id)
            ended.append(run_id)
        return ended

    async def own(self, work: Coroutine[Any, Any, Run]) -> Run:
        """Drive a run as its own task; the request awaits it, but cancelling the
        request (a caller who hangs up) does not cancel the run."""
        return await asyncio.shield(self.spawn(work))

    def spawn(self, work: Coroutine[Any, Any, Run]) -> asyncio.Task[Run]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_observe)
        return task

    async def guarded(self, scope: RunScope, span: Span, work: Awaitable[Run]) -> Run:
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
            finished = await self._recorder.finish(
                scope,
                RunState.FAILED,
                None,
                reason=f"the orchestrator failed unexpectedly ({type(exc).__name__})",
            )
        span.set_attribute("cairn.run_state", finished.state.value)
        if finished.state not in (RunState.COMPLETED, RunState.CONFIRMATION_PENDING):
            span.set_status(Status(StatusCode.ERROR, finished.state.value))
        return finished

    async def _wind_up_cancelled(self, scope: RunScope, cancelled: RunCancelled) -> Run:
        """A person cancelled the run while this process worked on it: add its last
        steps (the call cut short), give up the lease, and answer with the run."""
        confirmations = self._confirmations
        run_id = scope.run.run_id
        # Steps whose write was still waiting or refused because of the cancel come
        # first, in the order they happened.
        earlier: tuple[StepRecord, ...] = ()
        try:
            await self._recorder.written(scope)
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
        self._signals.changed(run_id)
        run = await self._store.get_run(org_id=scope.run.org_id, run_id=run_id, user_id=None)
        return run if run is not None else scope.run


def _observe(task: asyncio.Task[Run]) -> None:
    """Retrieve a run task's exception even when its request stopped waiting; a
    refusal (CairnError) is the request's answer, anything else is worth a line."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None and not isinstance(error, CairnError):
        log.warning("run.task_ended_with_error", error=type(error).__name__)
