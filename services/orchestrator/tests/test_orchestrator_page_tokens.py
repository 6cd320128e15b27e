"""ListRuns' page token is cairn_libs.page_token's encoding: the tokens issued
before it still read back, only the exact text it writes is accepted, and a token
is good only for the filter it was issued under."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest

from cairn_orchestrator.domain import PageCursor, RunState
from cairn_orchestrator.errors import BadPageToken
from cairn_orchestrator.orchestrator import decode_page_token, encode_page_token

CURSOR = PageCursor(
    created_at=datetime(2026, 1, 1, tzinfo=UTC), run_id="run_abc", state=RunState.COMPLETED
)
# What ListRuns issued for CURSOR before the shared encoding: clients may hold it.
ISSUED_BEFORE = (
    "eyJjIjoiMjAyNi0wMS0wMVQwMDowMDowMCswMDowMCIsInIiOiJydW5fYWJjIiwicyI6IkNPTVBMRVRFRCJ9"
)


def test_a_token_issued_before_the_shared_encoding_is_the_same_text_and_reads_back() -> None:
    assert encode_page_token(CURSOR) == ISSUED_BEFORE
    assert decode_page_token(ISSUED_BEFORE, state=RunState.COMPLETED) == CURSOR


def _token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


@pytest.mark.parametrize(
    "token",
    [
        ISSUED_BEFORE + "==",  # padding we never write
        _token('{"c": "2026-01-01T00:00:00+00:00", "r": "run_abc", "s": "COMPLETED"}'),
        _token('{"c":"2026-01-01T00:00:00+00:00","r":"run_abc","s":"COMPLETED","x":""}'),
        "A" * 600,
    ],
)
def test_only_the_exact_text_the_encoding_writes_is_a_page_token(token: str) -> None:
    with pytest.raises(BadPageToken, match="was not issued by ListRuns"):
        decode_page_token(token, state=RunState.COMPLETED)


def test_a_token_is_refused_under_another_filter_saying_which_it_was_asked_for() -> None:
    with pytest.raises(BadPageToken, match="for runs in every state"):
        decode_page_token(ISSUED_BEFORE)
