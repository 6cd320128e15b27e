"""What time it is, behind a Protocol, so expiry and validity are testable.

Every timestamp the service stores or compares comes from a Clock and is sent to
PostgreSQL as a parameter; SQL `now()` is never used, so a fake clock moves the
whole service through time.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware (UTC)."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: datetime) -> None:
        if start.tzinfo is None:
            raise ValueError(f"FakeClock needs a timezone-aware start, got {start!r}")
        self._now = start

    def now(self) -> datetime:
        return self._now

    def advance(self, delta: timedelta) -> None:
        self._now += delta

    def set(self, moment: datetime) -> None:
        if moment.tzinfo is None:
            raise ValueError(f"FakeClock needs a timezone-aware time, got {moment!r}")
        self._now = moment
