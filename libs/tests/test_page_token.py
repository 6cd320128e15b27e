"""A page token decodes to exactly the fields it was made from, and nothing that
encode_page_token did not make decodes at all (one exception, never another)."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cairn_libs.page_token import (
    MAX_PAGE_TOKEN_CHARS,
    UnreadablePageToken,
    decode_page_token,
    encode_page_token,
)

FIELDS = ("c", "r", "s")
# Short enough that even fields of escaped astral characters fit the bound.
short_text = st.text(max_size=8)


@given(st.fixed_dictionaries({"c": short_text, "r": short_text, "s": short_text}))
def test_a_token_decodes_to_the_fields_it_was_made_from(fields: dict[str, str]) -> None:
    token = encode_page_token(fields)
    assert token.isascii() and "=" not in token and "+" not in token and "/" not in token
    assert decode_page_token(token, fields=FIELDS) == fields


@given(st.text(max_size=200))
def test_any_other_text_is_refused_with_the_one_exception(text: str) -> None:
    try:
        decoded = decode_page_token(text, fields=FIELDS)
    except UnreadablePageToken:
        return
    # Whatever decodes is something encode_page_token makes, unchanged.
    assert set(decoded) == set(FIELDS)
    assert encode_page_token(decoded) == text


def test_the_orchestrators_token_form_is_unchanged() -> None:
    # Tokens handed out before the move keep working.
    raw = b'{"c":"2025-01-01T00:00:00+00:00","r":"run_1","s":""}'
    token = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    fields = {"c": "2025-01-01T00:00:00+00:00", "r": "run_1", "s": ""}
    assert encode_page_token(fields) == token
    assert decode_page_token(token, fields=FIELDS) == fields


def _raw(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("!!!!", "not base64"),
        ("abc", "not base64"),  # a length no base64 text has
        (base64.urlsafe_b64encode(b'{"c":"","r":"","s":""}').decode(), "form"),  # padded
        ("_w", "not base64"),  # base64 of a byte that is not UTF-8
        (base64.urlsafe_b64encode(b"\xff\xfe").decode().rstrip("="), "not base64"),
        (_raw('["c","r","s"]'), "fields"),
        (_raw('{"c":"","r":""}'), "fields"),
        (_raw('{"c":"","r":"","s":"","x":""}'), "fields"),
        (_raw('{"c":"","r":"","s":1}'), "not a string"),
        (_raw('{"c": "", "r": "", "s": ""}'), "form"),
        (_raw('{"s":"","r":"","c":""}'), None),
        (_raw('{"c":"","c":"","r":"","s":""}'), "form"),
        ("A" * (MAX_PAGE_TOKEN_CHARS + 1), "longer than"),
        ("dG9rZW4é", "not base64"),
    ],
)
def test_a_token_it_did_not_make_is_refused(token: str, why: str | None) -> None:
    if why is None:
        # The same fields in another order are another token, and decode as such.
        assert decode_page_token(token, fields=FIELDS) == {"s": "", "r": "", "c": ""}
        return
    with pytest.raises(UnreadablePageToken, match=why):
        decode_page_token(token, fields=FIELDS)


def test_fields_too_long_to_decode_are_never_encoded() -> None:
    with pytest.raises(ValueError, match="at most 512 decode"):
        encode_page_token({"c": "x" * MAX_PAGE_TOKEN_CHARS, "r": "", "s": ""})


def test_a_field_that_is_not_a_string_cannot_be_encoded() -> None:
    with pytest.raises(TypeError, match="str to str"):
        encode_page_token({"c": 1})  # type: ignore[dict-item]


def test_the_same_fields_in_another_order_name_the_same_place_and_are_read() -> None:
    raw = json.dumps({"r": "run-1", "c": "2025-01-01T00:00:00+00:00"}, separators=(",", ":"))
    token = base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")
    assert decode_page_token(token, fields=("c", "r")) == {
        "c": "2025-01-01T00:00:00+00:00",
        "r": "run-1",
    }
