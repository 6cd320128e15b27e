"""Retries and cooldowns, the pure parts: properties that hold for every sequence of
outcomes, Retry-After values and moments, and the examples the issue names."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cairn_gateway.config import CooldownPolicy, ProviderConfig, RetryPolicy
from cairn_gateway.domain import (
    Attempt,
    CooldownCause,
    NextStep,
    Outcome,
    RequestShape,
)
from cairn_gateway.resilience import (
    SAME_PROVIDER_RETRYABLE,
    CooldownBoard,
    ProviderHealth,
    after_attempt,
    cooldown_length,
    health_after,
    retry_delay,
)

POLICY = RetryPolicy(max_retries=2, backoff_seconds=0.5, max_wait_seconds=8.0)
COOLING = CooldownPolicy(after_failures=3, base_seconds=5.0, max_seconds=300.0)
PLAIN = RequestShape()
TOOLS = RequestShape(has_tool_history=True)
SENT = RequestShape(content_sent=True)

outcomes = st.sampled_from(list(Outcome))
retry_afters = st.one_of(st.none(), st.floats(0, 400, allow_nan=False))
jitters = st.floats(0, 1, exclude_max=True, allow_nan=False)
shapes = st.builds(RequestShape, has_tool_history=st.booleans(), content_sent=st.booleans())
retry_policies = st.builds(
    RetryPolicy,
    max_retries=st.integers(0, 6),
    backoff_seconds=st.floats(0.001, 5, allow_nan=False),
    max_wait_seconds=st.floats(0, 30, allow_nan=False),
)
cooldown_policies = st.builds(
    CooldownPolicy,
    after_failures=st.integers(1, 6),
    base_seconds=st.floats(0.01, 60, allow_nan=False),
    max_seconds=st.one_of(st.just(0.0), st.floats(0.01, 600, allow_nan=False)),
)


def failed(outcome: Outcome, *, status: int = 0, retry_after: float | None = None) -> Attempt:
    return Attempt(
        provider="p",
        model="m",
        outcome=outcome,
        http_status=status,
        retry_after_seconds=retry_after,
    )


def decide(
    attempt: Attempt,
    shape: RequestShape = PLAIN,
    *,
    retries_done: int = 0,
    policy: RetryPolicy = POLICY,
    time_left: float | None = None,
    failover_possible: bool = True,
    jitter: float = 0.5,
) -> tuple[NextStep, float]:
    decision = after_attempt(
        attempt,
        shape,
        retries_done=retries_done,
        policy=policy,
        time_left=time_left,
        failover_possible=failover_possible,
        jitter=jitter,
    )
    return decision.step, decision.delay_seconds


# --- retries ---------------------------------------------------------------------


def test_a_server_error_is_retried_on_the_same_provider_before_failing_over() -> None:
    step, delay = decide(failed(Outcome.SERVER_ERROR, status=500))

    assert step is NextStep.RETRY
    assert 0.25 <= delay < 0.5


def test_after_its_retries_a_provider_is_failed_over_or_its_error_returned() -> None:
    attempt = failed(Outcome.SERVER_ERROR, status=503)

    assert decide(attempt, retries_done=2)[0] is NextStep.FAIL_OVER
    assert decide(attempt, TOOLS, retries_done=2)[0] is NextStep.RETURN_ERROR


def test_a_conversation_with_tool_calls_is_retried_on_its_own_provider() -> None:
    assert decide(failed(Outcome.TIMEOUT), TOOLS)[0] is NextStep.RETRY


def test_a_rate_limit_fails_over_at_once_when_another_provider_can_answer() -> None:
    limited = failed(Outcome.RATE_LIMITED, status=429, retry_after=2)

    assert decide(limited)[0] is NextStep.FAIL_OVER
    step, delay = decide(limited, failover_possible=False)
    assert step is NextStep.RETRY and delay >= 2


def test_an_overloaded_provider_that_names_a_wait_is_not_waited_for_either() -> None:
    overloaded = failed(Outcome.SERVER_ERROR, status=503, retry_after=1)

    assert decide(overloaded)[0] is NextStep.FAIL_OVER
    assert decide(overloaded, TOOLS)[0] is NextStep.RETRY
    assert decide(failed(Outcome.SERVER_ERROR, status=503))[0] is NextStep.RETRY


def test_a_retry_after_longer_than_the_longest_wait_is_not_waited_for() -> None:
    limited = failed(Outcome.RATE_LIMITED, status=429, retry_after=30)

    assert decide(limited, TOOLS)[0] is NextStep.RETURN_ERROR
    assert decide(limited, failover_possible=False)[0] is NextStep.FAIL_OVER


def test_no_retry_is_begun_that_the_deadline_could_not_wait_for() -> None:
    attempt = failed(Outcome.SERVER_ERROR, status=500)

    assert decide(attempt, time_left=0.1)[0] is NextStep.FAIL_OVER
    assert decide(attempt, time_left=5.0)[0] is NextStep.RETRY


@given(
    status=st.sampled_from([400, 401, 403, 404, 422]), shape=shapes, retries_done=st.integers(0, 5)
)
def test_a_client_error_is_never_retried(
    status: int, shape: RequestShape, retries_done: int
) -> None:
    step, _ = decide(failed(Outcome.CLIENT_ERROR, status=status), shape, retries_done=retries_done)

    assert step is NextStep.RETURN_ERROR


@given(outcome=outcomes, retry_after=retry_afters, policy=retry_policies, jitter=jitters)
def test_nothing_is_retried_once_a_stream_has_sent_content(
    outcome: Outcome, retry_after: float | None, policy: RetryPolicy, jitter: float
) -> None:
    step, _ = decide(failed(outcome, retry_after=retry_after), SENT, policy=policy, jitter=jitter)

    assert step in (NextStep.ANSWER, NextStep.RETURN_ERROR)


@settings(max_examples=300)
@given(
    outcomes_seen=st.lists(
        st.sampled_from(sorted(SAME_PROVIDER_RETRYABLE)), min_size=1, max_size=12
    ),
    retry_after=retry_afters,
    policy=retry_policies,
    shape=st.builds(RequestShape, has_tool_history=st.booleans()),
    failover_possible=st.booleans(),
    time_left=st.one_of(st.none(), st.floats(0, 60, allow_nan=False)),
    jitter=jitters,
)
def test_retries_are_bounded_honour_retry_after_and_fit_the_deadline(
    outcomes_seen: list[Outcome],
    retry_after: float | None,
    policy: RetryPolicy,
    shape: RequestShape,
    failover_possible: bool,
    time_left: float | None,
    jitter: float,
) -> None:
    retries = 0
    for outcome in outcomes_seen:
        step, delay = decide(
            failed(outcome, retry_after=retry_after),
            shape,
            retries_done=retries,
            policy=policy,
            time_left=time_left,
            failover_possible=failover_possible,
            jitter=jitter,
        )
        if step is not NextStep.RETRY:
            break
        retries += 1
        assert retry_after is None or delay >= retry_after
        assert retry_after is None or retry_after <= policy.max_wait_seconds
        assert time_left is None or delay < time_left
        asked_to_wait = outcome is Outcome.RATE_LIMITED or retry_after is not None
        assert not (asked_to_wait and failover_possible and not shape.has_tool_history)
    assert retries <= policy.max_retries


@given(retry_number=st.integers(1, 200), policy=retry_policies, jitter=jitters)
def test_backoff_doubles_with_jitter_and_is_capped_at_the_longest_wait(
    retry_number: int, policy: RetryPolicy, jitter: float
) -> None:
    delay = retry_delay(retry_number, retry_after=None, policy=policy, jitter=jitter)
    full = min(policy.backoff_seconds * 2.0 ** min(retry_number - 1, 30), policy.max_wait_seconds)

    assert full / 2 <= delay <= full


# --- cooldowns -------------------------------------------------------------------

events = st.lists(
    st.tuples(outcomes, st.floats(0, 120, allow_nan=False), retry_afters),
    min_size=1,
    max_size=40,
)


def replay(
    seen: list[tuple[Outcome, float, float | None]],
    policy: CooldownPolicy,
    *,
    start: float = 1000.0,
) -> list[tuple[float, ProviderHealth]]:
    """Each event is (outcome, seconds since the previous one, Retry-After)."""
    health, moment, history = ProviderHealth(), start, []
    for outcome, gap, retry_after in seen:
        moment += gap
        health = health_after(health, outcome, now=moment, retry_after=retry_after, policy=policy)
        history.append((moment, health))
    return history


@settings(max_examples=300)
@given(seen=events, policy=cooldown_policies)
def test_a_cooldown_never_ends_earlier_than_it_was_set_to(
    seen: list[tuple[Outcome, float, float | None]], policy: CooldownPolicy
) -> None:
    ends = [health.cooling_until for _, health in replay(seen, policy)]

    assert ends == sorted(ends)


@settings(max_examples=300)
@given(seen=events, policy=cooldown_policies)
def test_no_cooldown_is_longer_than_the_cap(
    seen: list[tuple[Outcome, float, float | None]], policy: CooldownPolicy
) -> None:
    for moment, health in replay(seen, policy):
        assert health.cooling_for(moment) <= policy.max_seconds + 1e-9  # float rounding


@given(seen=events, retry_after=st.floats(0, 300, allow_nan=False))
def test_a_retry_after_is_kept_whatever_comes_after_it(
    seen: list[tuple[Outcome, float, float | None]], retry_after: float
) -> None:
    limited = health_after(
        ProviderHealth(), Outcome.RATE_LIMITED, now=0.0, retry_after=retry_after, policy=COOLING
    )
    health, moment = limited, 0.0
    for outcome, gap, later_retry_after in seen:
        moment += gap
        health = health_after(
            health, outcome, now=moment, retry_after=later_retry_after, policy=COOLING
        )

    assert health.cooling_until >= retry_after


def test_a_60_second_retry_after_followed_by_a_2_second_one_keeps_the_60() -> None:
    first = health_after(
        ProviderHealth(), Outcome.RATE_LIMITED, now=100.0, retry_after=60, policy=COOLING
    )
    second = health_after(first, Outcome.RATE_LIMITED, now=100.5, retry_after=2, policy=COOLING)

    assert second.cooling_for(103.0) == 57.0
    assert second.cause is CooldownCause.RATE_LIMIT


@given(policy=cooldown_policies, outcome=st.sampled_from(sorted(SAME_PROVIDER_RETRYABLE)))
def test_n_failures_in_a_row_start_a_cooldown_and_fewer_do_not(
    policy: CooldownPolicy, outcome: Outcome
) -> None:
    health = ProviderHealth()
    for count in range(1, policy.after_failures + 1):
        health = health_after(health, outcome, now=float(count), retry_after=None, policy=policy)
        cooling = health.cooling_for(float(count)) > 0
        assert cooling is (count == policy.after_failures and policy.max_seconds > 0)


def test_a_success_between_failures_resets_the_count() -> None:
    health = ProviderHealth()
    for moment, outcome in enumerate(
        [Outcome.SERVER_ERROR, Outcome.TIMEOUT, Outcome.OK, Outcome.SERVER_ERROR, Outcome.TIMEOUT]
    ):
        health = health_after(health, outcome, now=float(moment), retry_after=None, policy=COOLING)

    assert health.cooling_for(5.0) == 0 and health.failures_in_a_row == 2


def test_each_failed_probe_after_a_cooldown_doubles_the_next_up_to_the_cap() -> None:
    health, moment, lengths = ProviderHealth(), 0.0, []
    for _ in range(3):
        health = health_after(
            health, Outcome.SERVER_ERROR, now=moment, retry_after=None, policy=COOLING
        )
    lengths.append(health.cooling_for(moment))
    for _ in range(8):
        moment = health.cooling_until  # the cooldown ran out; one probe, and it fails
        health = health_after(
            health, Outcome.SERVER_ERROR, now=moment, retry_after=None, policy=COOLING
        )
        lengths.append(health.cooling_for(moment))

    assert lengths == [5, 10, 20, 40, 80, 160, 300, 300, 300]
    assert [cooldown_length(n, COOLING) for n in (1, 2, 7)] == [5, 10, 300]


def test_failures_of_calls_sent_before_a_cooldown_do_not_lengthen_it() -> None:
    health = ProviderHealth()
    for _ in range(3):
        health = health_after(
            health, Outcome.SERVER_ERROR, now=0.0, retry_after=None, policy=COOLING
        )
    for _ in range(5):  # in flight when the cooldown began
        health = health_after(
            health, Outcome.SERVER_ERROR, now=1.0, retry_after=None, policy=COOLING
        )

    assert health.cooling_until == 5.0


@given(
    outcome=st.sampled_from(
        [Outcome.CLIENT_ERROR, Outcome.SKIPPED_COOLDOWN, Outcome.REFUSED_CEILING]
    )
)
def test_outcomes_that_say_nothing_about_the_provider_change_nothing(outcome: Outcome) -> None:
    health = ProviderHealth(failures_in_a_row=2, cooldowns_in_a_row=1, cooling_until=9.0)

    assert health_after(health, outcome, now=3.0, retry_after=30, policy=COOLING) == health


def test_cooldown_max_seconds_zero_turns_cooldowns_off() -> None:
    off = CooldownPolicy(max_seconds=0)
    health = ProviderHealth()
    for moment in range(10):
        health = health_after(health, Outcome.RATE_LIMITED, now=moment, retry_after=60, policy=off)

    assert health.cooling_for(9.0) == 0


def test_the_board_reports_a_cooldown_until_it_has_run_out() -> None:
    clock = [0.0]
    board = CooldownBoard(clock=lambda: clock[0])
    provider = ProviderConfig(name="p", base_url="http://p/v1", api_key_env="", models={})

    began = board.record(provider, Outcome.RATE_LIMITED, retry_after=2.0)
    clock[0] = 1.0
    during = board.cooling("p")
    clock[0] = 2.0

    assert began is not None and began.cause is CooldownCause.RATE_LIMIT
    assert during is not None and during.seconds_left == 1.0
    assert board.cooling("p") is None
    assert board.record(provider, Outcome.OK, retry_after=None) is None
