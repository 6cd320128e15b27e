"""The shared clock: the system clock tells UTC time, the fake one moves only when told."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from cairn_libs.clock import FAKE_CLOCK_START, Clock, FakeClock, SystemClock


def test_the_system_clock_reads_the_current_time_in_utc() -> None:
    clock: Clock = SystemClock()
    before = datetime.now(UTC)
    read = clock.now()
    assert read.utcoffset() == timedelta(0)
    assert before <= read <= datetime.now(UTC)


def test_a_fake_clock_stands_still_until_advanced_by_a_timedelta_or_seconds() -> None:
    clock = FakeClock(datetime(2032, 1, 1, tzinfo=UTC))
    assert clock.now() == clock.now() == datetime(2032, 1, 1, tzinfo=UTC)
    clock.advance(timedelta(days=2))
    assert clock.now() == datetime(2032, 1, 3, tzinfo=UTC)
    clock.advance(1.5)
    assert clock.now() == datetime(2032, 1, 3, 0, 0, 1, 500_000, tzinfo=UTC)
    assert clock.moment == clock.now()


def test_a_fake_clock_without_a_start_begins_at_the_same_fixed_moment_every_run() -> None:
    assert FakeClock().now() == FAKE_CLOCK_START == datetime(2025, 1, 1, tzinfo=UTC)


def test_a_fake_clock_can_be_set_to_any_aware_moment() -> None:
    clock = FakeClock()
    later = datetime(2030, 6, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    clock.set(later)
    assert clock.now() == later


@pytest.mark.parametrize("naive", [datetime(2032, 1, 1), datetime(2025, 1, 1, 12)])
def test_a_fake_clock_refuses_a_naive_time_naming_it(naive: datetime) -> None:
    with pytest.raises(ValueError, match="timezone-aware") as refused:
        FakeClock(naive)
    assert repr(naive) in str(refused.value)
    clock = FakeClock()
    with pytest.raises(ValueError, match="timezone-aware"):
        clock.set(naive)
    assert clock.now() == FAKE_CLOCK_START
