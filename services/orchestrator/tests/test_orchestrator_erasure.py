"""The eraser behind ForgetCopies (I9): every copy of an erased text goes, wherever
and however a stored run holds it, and nothing else is touched."""

from __future__ import annotations

import json

from hypothesis import assume, given
from hypothesis import strategies as st

from cairn_orchestrator.erasure import TOMBSTONE, Eraser

_words = st.text(
    alphabet=st.characters(categories=("L", "N", "Zs", "P")), min_size=3, max_size=60
).filter(lambda t: t.strip() and t[0].isalnum() and t[-1].isalnum())


@given(_words, st.text(max_size=40), st.text(max_size=40))
def test_a_copy_is_erased_raw_and_inside_json_inside_json(
    erased: str, before: str, after: str
) -> None:
    # Elsewhere the text may sit inside a longer word, which is not a copy of it.
    assume(erased not in before and erased not in after and TOMBSTONE not in before + after)
    # A key is a copy too and would be erased with it; these are the ones read back.
    assume(erased not in ("messages", "content", "text"))
    quoted = f"{before} {erased} {after}"
    # A tool message is JSON text inside the run's stored JSON.
    stored = {"messages": [{"content": json.dumps({"text": quoted}, ensure_ascii=True)}]}
    scrubbed = Eraser([erased]).value(stored)
    inner = json.loads(scrubbed["messages"][0]["content"])["text"]
    assert erased not in inner.replace(TOMBSTONE, "")
    assert TOMBSTONE in inner


def test_a_key_that_is_the_erased_text_is_erased_like_any_other_copy() -> None:
    assert Eraser(["messages"]).value({"messages": ["kept"]}) == {TOMBSTONE: ["kept"]}


def test_a_short_value_is_erased_as_a_word_never_inside_another() -> None:
    eraser = Eraser(["en"])
    assert eraser.text("preferred_language: en") == f"preferred_language: {TOMBSTONE}"
    assert eraser.text("She often writes in English.") == "She often writes in English."


def test_text_without_a_copy_comes_back_unchanged() -> None:
    stored = {"answer": "Leave is 16 weeks.", "steps": [1, 2.5, None, True]}
    assert Eraser(["Dana prefers tea."]).value(stored) == stored
    assert Eraser([]).value(stored) == stored
