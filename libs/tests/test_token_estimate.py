"""The token estimate is characters / 4, rounded up, the same everywhere it is used."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cairn_libs.token_estimate import CHARS_PER_TOKEN, estimate_tokens, tokens_for_chars


@pytest.mark.parametrize(
    ("chars", "tokens"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (401, 101)]
)
def test_a_count_of_characters_is_a_quarter_as_many_tokens_rounded_up(
    chars: int, tokens: int
) -> None:
    assert CHARS_PER_TOKEN == 4
    assert tokens_for_chars(chars) == tokens


@given(st.text(max_size=300))
def test_a_text_is_estimated_by_its_length(text: str) -> None:
    tokens = estimate_tokens(text)
    assert tokens == tokens_for_chars(len(text))
    assert (tokens - 1) * CHARS_PER_TOKEN < len(text) <= tokens * CHARS_PER_TOKEN or text == ""


def test_a_negative_count_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="-3"):
        tokens_for_chars(-3)
