"""What every step of one run shares: who asked, for which agent, with which
credentials, and how much of the run's wall time is left.

The loop's modules (start, opening, drive, tool execution, approvals, resume)
each take a `RunScope` instead of reaching into one another's attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from cairn_libs.clock import Clock
from cairn_libs.identity import Principal
from cairn_orchestrator.domain import AgentSpec, CallCredentials, Run

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
class RunScope:
    """What every step of one run shares."""

    run: Run
    spec: AgentSpec
    principal: Principal
    credentials: CallCredentials
    started: datetime


class RunClock:
    """The clock, and the run's wall-time budget as seen from it."""

    def __init__(self, clock: Clock, *, dependency_timeout_seconds: float) -> None:
        self._clock = clock
        self._dependency_timeout_seconds = dependency_timeout_seconds

    def now(self) -> datetime:
        return self._clock.now()

    def elapsed(self, scope: RunScope) -> float:
        return (self._clock.now() - scope.started).total_seconds()

    def timeout(self, scope: RunScope, *, ceiling: float | None = None) -> float:
        """A call may not outlive the run's wall-time budget."""
        left = scope.spec.budgets.wall_seconds - self.elapsed(scope)
        limit = ceiling if ceiling is not None else self._dependency_timeout_seconds
        return max(min(limit, left), 0.5)
