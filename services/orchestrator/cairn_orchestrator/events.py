"""How StreamRun learns, in this process, that a run did something.

The loop announces each step as it starts (a STEP_STARTED has no row yet: only
the span id ties it to its STEP_FINISHED) and signals "look again" whenever it
wrote something. Followers in this process wake on those signals and read the
recorded steps from the store, so the store stays the one source of truth and
the order of STEP_FINISHED events is the order of seq.

Why not PostgreSQL LISTEN/NOTIFY: a run is driven by the process that serves
its caller's request, so its followers are usually in that same process, and
NOTIFY takes a database-wide lock at every commit that sends one, which a step
written on every model and tool call would pay at full load. A follower whose
run is driven by another replica falls back to reading the store at a short
interval: it sees every finished step, only later, and no STEP_STARTED.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from cairn_orchestrator.domain import StepStart

Signal = StepStart | None
"""A step that started, or None: something was recorded, read the store again."""

_QUEUE_LIMIT = 256


class RunSignals:
    def __init__(self) -> None:
        self._followers: dict[str, set[asyncio.Queue[Signal]]] = {}

    @contextmanager
    def follow(self, run_id: str) -> Iterator[asyncio.Queue[Signal]]:
        queue: asyncio.Queue[Signal] = asyncio.Queue(maxsize=_QUEUE_LIMIT)
        self._followers.setdefault(run_id, set()).add(queue)
        try:
            yield queue
        finally:
            followers = self._followers.get(run_id)
            if followers is not None:
                followers.discard(queue)
                if not followers:
                    del self._followers[run_id]

    def started(self, run_id: str, step: StepStart) -> None:
        self._send(run_id, step)

    def changed(self, run_id: str) -> None:
        self._send(run_id, None)

    def _send(self, run_id: str, signal: Signal) -> None:
        for queue in self._followers.get(run_id, ()):
            # A follower this far behind re-reads the store on its next wake-up; it
            # loses at most some STEP_STARTED announcements.
            with suppress(asyncio.QueueFull):
                queue.put_nowait(signal)
