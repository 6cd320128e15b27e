"""When to try a provider again, and when to leave it alone for a while.

Two decisions, both pure so they can be property-tested:
- after a failed attempt, whether to retry the same provider and after how long
  (`after_attempt`), built on the failover rule of `domain.next_step`;
- how a provider's health moves with each outcome (`health_after`): failures in a
  row, cooldowns that grow and are capped, and a cooldown end that only ever moves
  later, so a short Retry-After arriving after a long one never shortens it.

A retry stays on the same provider, so it is allowed where failover is not: with
tool calls in the history (the provider that made them sees them again). It is
never allowed for an error that would fail the same way again (400, 401, 403) or
once a stream has sent content. A provider that rate-limits a call, or asks for a
wait with Retry-After, is not waited for while another provider can take it at once.

`CooldownBoard` keeps the health per provider for this process, and every
replica's cooldowns meet in PostgreSQL (`SharedCooldowns`, postgres.py): a replica
that begins or lengthens a cooldown writes its end there at once, and each replica
reads the running ones every CAIRN_GATEWAY_COOLDOWN_SYNC_SECONDS and adopts any
that ends later than its own (`CooldownBoard.adopt`). So a provider that is down is
skipped by every replica, not rediscovered by each at the cost of a few failed
calls, and the end only ever moves later, across replicas as within one: the
database keeps GREATEST of the ends it is sent. Reading the table on every call was
rejected: it would put a database round trip before every model call, where the
periodic read costs one query per interval per replica. Only the end and its cause
are shared; the count of failures in a row stays each replica's own, as it
describes what that replica saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from cairn_gateway.config import CooldownPolicy, ProviderConfig, RetryPolicy
from cairn_gateway.domain import (
    RETRYABLE,
    Attempt,
    CooldownCause,
    NextStep,
    Outcome,
    RequestShape,
    next_step,
)

# Failures worth another try at the same provider, and that say something about the
# provider's state. A cooldown skip and a ceiling refusal are this gateway's own
# decisions: asking again at once would change nothing.
SAME_PROVIDER_RETRYABLE: frozenset[Outcome] = RETRYABLE - {
    Outcome.SKIPPED_COOLDOWN,
    Outcome.REFUSED_CEILING,
}
# Doubling stops here; beyond it every wait is at its cap anyway.
_MAX_DOUBLINGS = 30
# A cooldown with less than this left is over: a call that waited out a Retry-After
# must not be skipped by the cooldown that same Retry-After began.
COOLDOWN_TOLERANCE_SECONDS = 0.005
# A shared cooldown read back within this of the one held is the same one (the
# read's round trip moves its end by a few milliseconds).
ADOPT_TOLERANCE_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class Decision:
    step: NextStep
    delay_seconds: float = 0.0


def retry_delay(
    retry_number: int, *, retry_after: float | None, policy: RetryPolicy, jitter: float
) -> float:
    """Seconds to wait before retry `retry_number` (1 for the first): exponential
    backoff with equal jitter (between half and all of the step), and never less than
    the provider's Retry-After, spread by up to a tenth so callers told the same time
    do not all come back at once. `jitter` is a number in [0, 1)."""
    step = policy.backoff_seconds * 2.0 ** min(retry_number - 1, _MAX_DOUBLINGS)
    backoff = min(step, policy.max_wait_seconds) * (0.5 + jitter / 2)
    if retry_after is None:
        return backoff
    return max(retry_after * (1 + jitter / 10), backoff)


def after_attempt(
    attempt: Attempt,
    shape: RequestShape,
    *,
    retries_done: int,
    policy: RetryPolicy,
    time_left: float | None,
    failover_possible: bool,
    jitter: float,
) -> Decision:
    """After one attempt: answer, retry this provider (after a wait), fail over, or
    return the error. `time_left` is what remains of the caller's deadline (None: no
    deadline); `failover_possible` says whether another provider could take the call
    now."""
    step = next_step(attempt.outcome, shape)
    if (
        step is NextStep.ANSWER
        or shape.content_sent
        or attempt.outcome not in SAME_PROVIDER_RETRYABLE
    ):
        return Decision(step)
    asked_to_wait = (
        attempt.outcome is Outcome.RATE_LIMITED or attempt.retry_after_seconds is not None
    )
    if asked_to_wait and step is NextStep.FAIL_OVER and failover_possible:
        return Decision(step)
    if retries_done >= policy.max_retries:
        return Decision(step)
    retry_after = attempt.retry_after_seconds
    if retry_after is not None and retry_after > policy.max_wait_seconds:
        return Decision(step)
    delay = retry_delay(retries_done + 1, retry_after=retry_after, policy=policy, jitter=jitter)
    if time_left is not None and delay >= time_left:
        return Decision(step)
    return Decision(NextStep.RETRY, delay)


# --- cooldowns -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProviderHealth:
    failures_in_a_row: int = 0
    # Cooldowns begun since the last success; each is twice as long as the one before.
    cooldowns_in_a_row: int = 0
    # On the clock `health_after` is given (monotonic seconds); only ever moves later.
    cooling_until: float = 0.0
    cause: CooldownCause | None = None

    def cooling_for(self, now: float) -> float:
        return max(0.0, self.cooling_until - now)


def cooldown_length(nth: int, policy: CooldownPolicy) -> float:
    """The nth cooldown in a row (1 for the first): the base doubled, capped."""
    return min(policy.max_seconds, policy.base_seconds * 2.0 ** min(nth - 1, _MAX_DOUBLINGS))


def health_after(
    health: ProviderHealth,
    outcome: Outcome,
    *,
    now: float,
    retry_after: float | None,
    policy: CooldownPolicy,
) -> ProviderHealth:
    """A provider's health once an attempt against it ended with `outcome` at `now`.

    A success clears the count of failures and of cooldowns but does not lift a
    cooldown already running (a vendor's Retry-After is an instruction, and calls
    sent before the cooldown began may still come back fine). A retryable failure
    counts; `after_failures` of them in a row start a cooldown, and once a cooldown
    has run out without a success since, the first failure (the probe) starts the
    next, twice as long. Failures that arrive while a cooldown runs (calls sent
    before it began) count but do not start another. A Retry-After cools the
    provider for that long. Whatever happens, `cooling_until` never moves earlier.
    """
    if outcome is Outcome.OK:
        return replace(health, failures_in_a_row=0, cooldowns_in_a_row=0)
    if outcome not in SAME_PROVIDER_RETRYABLE:
        return health
    failures = health.failures_in_a_row + 1
    if policy.max_seconds <= 0:
        return replace(health, failures_in_a_row=failures)
    until, cause = health.cooling_until, health.cause
    if retry_after is not None and now + min(retry_after, policy.max_seconds) > until:
        until, cause = now + min(retry_after, policy.max_seconds), CooldownCause.RATE_LIMIT
    cooldowns = health.cooldowns_in_a_row
    threshold = 1 if cooldowns else policy.after_failures
    if health.cooling_until <= now and failures >= threshold:
        cooldowns += 1
        failures = 0
        ends = now + cooldown_length(cooldowns, policy)
        if ends > until:
            until, cause = ends, CooldownCause.FAILURES
    return ProviderHealth(failures, cooldowns, until, cause)


@dataclass(frozen=True, slots=True)
class Cooling:
    seconds_left: float
    cause: CooldownCause | None


class CooldownBoard:
    """Each provider's health in this process; a single event loop, so no lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._health: dict[str, ProviderHealth] = {}

    def cooling(self, provider: str) -> Cooling | None:
        """The cooldown running for this provider, or None."""
        health = self._health.get(provider)
        if health is None:
            return None
        left = health.cooling_for(self._clock())
        return Cooling(left, health.cause) if left > COOLDOWN_TOLERANCE_SECONDS else None

    def record(
        self, provider: ProviderConfig, outcome: Outcome, *, retry_after: float | None
    ) -> Cooling | None:
        """Take one attempt's outcome into account; return the cooldown if this
        outcome began or lengthened one."""
        before = self._health.get(provider.name, ProviderHealth())
        if outcome is Outcome.OK and before == ProviderHealth():
            return None  # the common case, kept free of allocation
        now = self._clock()
        after = health_after(
            before, outcome, now=now, retry_after=retry_after, policy=provider.cooldown
        )
        self._health[provider.name] = after
        if after.cooling_until > before.cooling_until and after.cooling_for(now) > 0:
            return Cooling(after.cooling_for(now), after.cause)
        return None

    def adopt(
        self, provider: ProviderConfig, seconds_left: float, cause: CooldownCause | None
    ) -> bool:
        """Take on a cooldown another replica began, if it ends later than the one
        held here; True when it did. Never longer than this provider's own cap, none
        for a provider configured without cooldowns; the failure counts stay."""
        if provider.cooldown.max_seconds <= 0:
            return False
        now = self._clock()
        until = now + min(seconds_left, provider.cooldown.max_seconds)
        before = self._health.get(provider.name, ProviderHealth())
        if until <= before.cooling_until + ADOPT_TOLERANCE_SECONDS:
            return False
        self._health[provider.name] = replace(before, cooling_until=until, cause=cause)
        return True


@dataclass(frozen=True, slots=True)
class SharedCooling:
    """A cooldown as every replica sees it: its provider (name and base URL), what
    is left, and why."""

    provider: str
    base_url: str
    seconds_left: float
    cause: CooldownCause | None


class SharedCooldowns(Protocol):
    async def share(self, provider: ProviderConfig, cooling: Cooling) -> None:
        """Make this cooldown every replica's; an end already later is kept."""
        ...

    async def running(self) -> Sequence[SharedCooling]:
        """The cooldowns still running, whichever replica began them."""
        ...


class UnsharedCooldowns:
    """One gateway alone (tests, a gateway without a database): nothing to share."""

    async def share(self, provider: ProviderConfig, cooling: Cooling) -> None:
        return None

    async def running(self) -> Sequence[SharedCooling]:
        return ()
