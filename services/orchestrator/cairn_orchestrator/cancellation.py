"""How a person's cancel reaches a run this process is working on.

CancelRun here sets the run's event at once; a cancel made through another
replica is found by one poll of the store per process (`cancelled_runs`), only
while runs are in flight. A model call or the reads in flight are cut short
(`unless_cancelled`); the writes after would be refused by the store anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, TypeVar

import structlog

from cairn_orchestrator.errors import RunCancelled, StoreUnavailable
from cairn_orchestrator.ports import ConfirmationStore
from cairn_orchestrator.run_scope import RunScope

T = TypeVar("T")

log = structlog.get_logger(__name__)


class CancelWatch:
    def __init__(
        self,
        confirmations: ConfirmationStore | None,
        *,
        poll_seconds: float,
        working: Callable[[], bool],
    ) -> None:
        self._confirmations = confirmations
        self._poll_seconds = poll_seconds
        # Whether this process still works on any run (the watcher stops when not).
        self._working = working
        # Done when a person cancels a run this process is working on (CancelRun here,
        # or on another replica, which the watcher finds in the run's state). A
        # future, not an Event: the work in flight is raced against it directly,
        # without a waiter task per model call, read and tool turn.
        self._cancels: dict[str, asyncio.Future[None]] = {}
        self._watcher: asyncio.Task[None] | None = None

    def watch(self, run_id: str) -> None:
        if run_id not in self._cancels:
            self._cancels[run_id] = asyncio.get_running_loop().create_future()
        if self._confirmations is not None and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.create_task(self._watch_cancels(self._confirmations))

    def forget(self, run_id: str) -> None:
        self._cancels.pop(run_id, None)

    def cancelled(self, run_id: str) -> None:
        """A person cancelled the run: if this process works on it, cut its model call
        (and the reads in flight) short; the writes after would be refused anyway."""
        cancel = self._cancels.get(run_id)
        if cancel is not None and not cancel.done():
            cancel.set_result(None)

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)

    async def _watch_cancels(self, confirmations: ConfirmationStore) -> None:
        """While this process works on runs, ask the store every few hundred ms which
        of them a person cancelled, on whichever replica they asked. One indexed
        query per process, not per run; it runs only while runs are in flight."""
        while self._working():
            await asyncio.sleep(self._poll_seconds)
            watched = [r for r, cancel in self._cancels.items() if not cancel.done()]
            try:
                found = await confirmations.cancelled_runs(watched)
            except StoreUnavailable:
                continue
            for run_id in found:
                log.info("run.cancel_noticed", run_id=run_id)
                self.cancelled(run_id)

    async def unless_cancelled(self, scope: RunScope, work: Awaitable[T]) -> T:
        """Await `work`, unless the run is cancelled first: then `work` is cancelled
        (a gRPC call in flight is cancelled with it) and RunCancelled raised."""
        cancel = self._cancels.get(scope.run.run_id)
        task = asyncio.ensure_future(work)
        if cancel is None:
            return await task
        try:
            racing: set[asyncio.Future[Any]] = {task, cancel}
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        with suppress(asyncio.CancelledError, Exception):
            await task
        raise RunCancelled(scope.run.run_id)
