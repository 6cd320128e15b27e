"""What time it is, behind a Protocol, so expiry, validity and leases are testable.

Every service that stores or compares a timestamp takes a Clock and sends the time
to PostgreSQL as a parameter (SQL `now()` is never used for a decision), so a
FakeClock moves the whole service through time. One definition for every service:
each used to carry its own copy of these three classes.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Final, Protocol

# Where a FakeClock starts unless told otherwise: a fixed moment, so a test's
# timestamps are the same on every run.
FAKE_CLOCK_START: Final = datetime(2025, 1, 1, tzinfo=UTC)


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware (UTC)."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class FakeClock:
    """A clock that only moves when told to: `advance` by a timedelta or a number of
    seconds, or `set` to a moment. `moment` is the time it reads."""

    def __init__(self, start: datetime = FAKE_CLOCK_START) -> None:
        self.moment = _aware(start)

    def now(self) -> datetime:
        return self.moment

    def advance(self, by: timedelta | float) -> None:
        if not isinstance(by, timedelta):
            by = timedelta(seconds=by)
        self.moment += by

    def set(self, moment: datetime) -> None:
        self.moment = _aware(moment)


def _aware(moment: datetime) -> datetime:
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"FakeClock needs a timezone-aware time, got {moment!r}")
    return moment
