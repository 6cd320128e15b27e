"""How many tokens a text is, before any model has counted it: characters / 4.

A deliberately simple bound used where the real count is not known yet (a prompt
before it is sent, a window being planned, a reply a vendor reported no usage
for). Running each model's tokenizer was rejected: the services do not know which
model answers until the gateway routes, and the gateway records the real usage.
"""

from __future__ import annotations

import math
from typing import Final

CHARS_PER_TOKEN: Final = 4


def tokens_for_chars(chars: int) -> int:
    """ceil(chars / 4): zero characters are zero tokens."""
    if chars < 0:
        raise ValueError(f"a character count is never negative, got {chars!r}")
    return math.ceil(chars / CHARS_PER_TOKEN)


def estimate_tokens(text: str) -> int:
    """The estimate for one text."""
    return tokens_for_chars(len(text))
