"""Which copies of an erased subject's text the orchestrator holds, and how they go.

A run copies what it reads and proposes about people: recalled memories and profile
facts (in the prompt, the MEMORY_READ step and recall results), archived blocks, and
the text of a `remember` or `update_profile` it proposes (in the assistant message,
the confirmation's arguments and card, and the write's result). Each such step names
its copies (`HeldCopy`: subject and text), and the store keeps them beside the run.

When the memory service's Forget erases a subject, it calls ForgetCopies; every copy
the runs of that org hold of those texts is replaced by the tombstone, wherever it
sits: run input, answer and reason, stored loop state, step details and errors,
confirmation arguments, card, result and note. Matching is on the text itself, in
each string and in JSON-escaped strings inside strings (a tool message is JSON text
inside the stored JSON), and only at word boundaries, so a short fact value ("en")
erases the value and never the middle of a word ("often").

Why search by text rather than keep only references: the model may quote a memory
in its answer or carry it into a later tool call, and a person reading the run must
not find the erased sentence there either. What cannot be found is a paraphrase: a
model that rewords a memory leaves words the orchestrator cannot tell from its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

TOMBSTONE: Final = "[erased]"
# Texts at least this long are also searched for in runs that did not record them
# (a later turn's input or earlier_turns carrying an answer that quoted one).
ORG_WIDE_MIN_CHARS: Final = 16


def _escaped_forms(text: str) -> set[str]:
    """The text as it appears raw, JSON-escaped once and twice (both with and
    without non-ASCII escaped): every way a stored run can hold it."""
    forms = {text}
    for _ in range(2):
        for current in list(forms):
            forms.add(json.dumps(current, ensure_ascii=False)[1:-1])
            forms.add(json.dumps(current, ensure_ascii=True)[1:-1])
    return forms


def search_forms(texts: Iterable[str]) -> list[str]:
    """What a database search for the texts looks for (substring candidates)."""
    found: set[str] = set()
    for text in texts:
        if text.strip():
            found.update(_escaped_forms(text))
    return sorted(found)


class Eraser:
    """Replaces every copy of the given texts with the tombstone, in any JSON value."""

    def __init__(self, texts: Sequence[str]) -> None:
        forms = search_forms(texts)
        if not forms:
            self._pattern: re.Pattern[str] | None = None
            return
        alternatives = "|".join(
            (r"(?<!\w)" if form[0].isalnum() or form[0] == "_" else "")
            + re.escape(form)
            + (r"(?!\w)" if form[-1].isalnum() or form[-1] == "_" else "")
            for form in sorted(forms, key=len, reverse=True)
        )
        self._pattern = re.compile(alternatives)

    def text(self, value: str) -> str:
        if self._pattern is None:
            return value
        return self._pattern.sub(TOMBSTONE, value)

    def value(self, value: Any) -> Any:
        """The same JSON value with every copy erased (keys included)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(str(k)): self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(item) for item in value]
        return value


@dataclass(frozen=True, slots=True)
class ErasedCopies:
    """What ForgetCopies did: runs that held a copy, writes abandoned unapproved."""

    runs: int
    confirmations_abandoned: int
