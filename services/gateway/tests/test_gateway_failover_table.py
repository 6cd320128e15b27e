"""The failover decision as a table: every attempt outcome, with and without tool
calls in the history, before and after content reached the caller; and the error a
caller gets for each returned failure."""

from __future__ import annotations

import grpc
import pytest

from cairn_gateway.domain import (
    Attempt,
    CooldownCause,
    NextStep,
    Outcome,
    RequestShape,
    all_failed_error,
    error_for_attempt,
    next_step,
    outcome_for_status,
)
from cairn_gateway.errors import (
    CallExceedsCeiling,
    ProviderCredentialRejected,
    ProviderRateLimited,
    ProviderRejectedRequest,
    ProviderUnavailable,
    StreamCut,
)

A, F, R = NextStep.ANSWER, NextStep.FAIL_OVER, NextStep.RETURN_ERROR

# outcome: (plain, tool history, content sent, tool history and content sent)
TABLE: dict[Outcome, tuple[NextStep, NextStep, NextStep, NextStep]] = {
    Outcome.OK: (A, A, A, A),
    Outcome.RATE_LIMITED: (F, R, R, R),
    Outcome.SERVER_ERROR: (F, R, R, R),
    Outcome.TIMEOUT: (F, R, R, R),
    Outcome.CONNECTION_ERROR: (F, R, R, R),
    Outcome.MALFORMED_RESPONSE: (F, R, R, R),
    Outcome.STREAM_CUT: (F, R, R, R),
    Outcome.SKIPPED_COOLDOWN: (F, R, R, R),
    Outcome.REFUSED_CEILING: (F, R, R, R),
    Outcome.CLIENT_ERROR: (R, R, R, R),
}
SHAPES = (
    RequestShape(has_tool_history=False, content_sent=False),
    RequestShape(has_tool_history=True, content_sent=False),
    RequestShape(has_tool_history=False, content_sent=True),
    RequestShape(has_tool_history=True, content_sent=True),
)


def test_the_table_covers_every_outcome() -> None:
    assert set(TABLE) == set(Outcome)


@pytest.mark.parametrize("outcome", list(Outcome), ids=lambda o: o.value)
@pytest.mark.parametrize("shape_index", range(4), ids=["plain", "tools", "sent", "tools+sent"])
def test_next_step_follows_the_table(outcome: Outcome, shape_index: int) -> None:
    assert next_step(outcome, SHAPES[shape_index]) is TABLE[outcome][shape_index]


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (400, Outcome.CLIENT_ERROR),
        (401, Outcome.CLIENT_ERROR),
        (403, Outcome.CLIENT_ERROR),
        (404, Outcome.CLIENT_ERROR),
        (413, Outcome.CLIENT_ERROR),
        (422, Outcome.CLIENT_ERROR),
        (408, Outcome.TIMEOUT),
        (429, Outcome.RATE_LIMITED),
        (500, Outcome.SERVER_ERROR),
        (502, Outcome.SERVER_ERROR),
        (503, Outcome.SERVER_ERROR),
        (529, Outcome.SERVER_ERROR),
    ],
)
def test_http_statuses_map_to_outcomes(status: int, outcome: Outcome) -> None:
    assert outcome_for_status(status) is outcome


def attempt(outcome: Outcome, **fields: object) -> Attempt:
    return Attempt(provider="groq", model="llama", outcome=outcome, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("returned", "error_type", "code"),
    [
        (
            attempt(Outcome.RATE_LIMITED, http_status=429, retry_after_seconds=4),
            ProviderRateLimited,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (
            attempt(Outcome.REFUSED_CEILING, retry_after_seconds=3),
            ProviderRateLimited,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (attempt(Outcome.REFUSED_CEILING), CallExceedsCeiling, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (
            attempt(Outcome.SERVER_ERROR, http_status=500),
            ProviderUnavailable,
            grpc.StatusCode.UNAVAILABLE,
        ),
        (attempt(Outcome.TIMEOUT), ProviderUnavailable, grpc.StatusCode.UNAVAILABLE),
        (attempt(Outcome.CONNECTION_ERROR), ProviderUnavailable, grpc.StatusCode.UNAVAILABLE),
        (attempt(Outcome.MALFORMED_RESPONSE), ProviderUnavailable, grpc.StatusCode.UNAVAILABLE),
        (attempt(Outcome.STREAM_CUT), ProviderUnavailable, grpc.StatusCode.UNAVAILABLE),
        (
            attempt(Outcome.CLIENT_ERROR, http_status=400),
            ProviderRejectedRequest,
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            attempt(Outcome.CLIENT_ERROR, http_status=404),
            ProviderRejectedRequest,
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            attempt(Outcome.CLIENT_ERROR, http_status=401),
            ProviderCredentialRejected,
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            attempt(Outcome.CLIENT_ERROR, http_status=403),
            ProviderCredentialRejected,
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
    ],
    ids=lambda v: v.outcome.value if isinstance(v, Attempt) else "",
)
def test_a_returned_failure_becomes_the_error_with_the_right_status(
    returned: Attempt, error_type: type[Exception], code: grpc.StatusCode
) -> None:
    error = error_for_attempt(returned)

    assert type(error) is error_type
    assert error.code == code
    assert "'groq'" in error.message


def test_a_rate_limit_carries_the_providers_retry_after_or_a_default() -> None:
    assert (
        error_for_attempt(attempt(Outcome.RATE_LIMITED, retry_after_seconds=4)).retry_after_seconds
        == 4
    )
    assert error_for_attempt(attempt(Outcome.RATE_LIMITED)).retry_after_seconds == 1.0
    assert error_for_attempt(attempt(Outcome.SERVER_ERROR)).retry_after_seconds is None


@pytest.mark.parametrize("outcome", sorted(set(Outcome) - {Outcome.OK}, key=str))
def test_any_failure_after_content_was_sent_is_a_stream_cut(outcome: Outcome) -> None:
    error = error_for_attempt(attempt(outcome), content_sent=True)

    assert type(error) is StreamCut
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "stream from provider 'groq' cut after content was sent" in error.message


def test_a_returned_error_lists_the_attempts_failed_over_before_it() -> None:
    earlier = [attempt(Outcome.SERVER_ERROR, http_status=502, detail="bad gateway")]

    error = error_for_attempt(attempt(Outcome.CLIENT_ERROR, http_status=400), earlier=earlier)

    assert type(error) is ProviderRejectedRequest
    assert "earlier attempts: groq [llama]: SERVER_ERROR HTTP 502 (bad gateway)" in error.message


def test_all_failed_lists_every_attempt_and_is_unavailable_unless_all_were_rate_limited() -> None:
    mixed = [
        attempt(Outcome.RATE_LIMITED, http_status=429, retry_after_seconds=2),
        attempt(Outcome.TIMEOUT, detail="no answer within 30s"),
    ]
    limited = [
        attempt(Outcome.RATE_LIMITED, http_status=429, retry_after_seconds=9),
        attempt(Outcome.REFUSED_CEILING, retry_after_seconds=5),
    ]

    mixed_error, limited_error = all_failed_error(mixed), all_failed_error(limited)

    assert mixed_error.code == grpc.StatusCode.UNAVAILABLE
    assert "RATE_LIMITED HTTP 429" in mixed_error.message
    assert "TIMEOUT (no answer within 30s)" in mixed_error.message
    assert limited_error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert limited_error.retry_after_seconds == 5


def test_a_skip_for_a_cooldown_says_when_to_come_back_and_why() -> None:
    rate = attempt(
        Outcome.SKIPPED_COOLDOWN, retry_after_seconds=41.5, cooldown_cause=CooldownCause.RATE_LIMIT
    )
    failing = attempt(
        Outcome.SKIPPED_COOLDOWN, retry_after_seconds=12, cooldown_cause=CooldownCause.FAILURES
    )

    rate_error, failing_error = error_for_attempt(rate), error_for_attempt(failing)

    assert (rate_error.code, rate_error.retry_after_seconds) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        41.5,
    )
    assert (failing_error.code, failing_error.retry_after_seconds) == (
        grpc.StatusCode.UNAVAILABLE,
        12,
    )
    assert all_failed_error([rate, attempt(Outcome.RATE_LIMITED, retry_after_seconds=60)]).code == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert all_failed_error([failing, rate]).retry_after_seconds == 12


def test_a_call_too_big_for_every_providers_ceiling_is_not_told_to_retry() -> None:
    error = all_failed_error([attempt(Outcome.REFUSED_CEILING), attempt(Outcome.REFUSED_CEILING)])

    assert type(error) is CallExceedsCeiling and error.retry_after_seconds is None
