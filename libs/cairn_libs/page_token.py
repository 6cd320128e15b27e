"""The opaque form of a listing's next_page_token, shared by every service that pages.

A token is urlsafe base64 (no padding) over a compact JSON object of short string
fields. It is opaque to callers, so a service may change what it puts inside, but
it decodes only what `encode_page_token` could have made: a token is accepted only
when its fields encode back to exactly the same text, which refuses bad base64,
stray padding, bad UTF-8, duplicate keys, spaced JSON, other JSON shapes and
anything too long with one exception, UnreadablePageToken. The same fields in
another order are accepted (they name the same place in the listing). What the fields mean (a time, an
id, the filter the token was issued under) is each service's to check, and each
says in its own words what a caller should pass instead.

Signing was considered and rejected: a token only says where a listing resumes,
and every query it feeds is narrowed by the caller's identity anyway.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Collection, Mapping
from typing import Final

# Generous for a time, an id and a filter name, small enough that a token is never
# a way to push a large value into a service.
MAX_PAGE_TOKEN_CHARS: Final = 512


class UnreadablePageToken(ValueError):
    """The text is not a page token encode_page_token made (with these fields)."""


def encode_page_token(fields: Mapping[str, str]) -> str:
    """The token for these fields, in the order given; refused (ValueError) when it
    would be longer than decode_page_token accepts."""
    for key, value in fields.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"page token fields are str to str, got {key!r}: {value!r}")
    token = _encoded(fields)
    if len(token) > MAX_PAGE_TOKEN_CHARS:
        raise ValueError(
            f"page token fields {dict(fields)!r} encode to {len(token)} characters; "
            f"at most {MAX_PAGE_TOKEN_CHARS} decode"
        )
    return token


def _encoded(fields: Mapping[str, str]) -> str:
    raw = json.dumps(dict(fields), separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_page_token(token: str, *, fields: Collection[str]) -> dict[str, str]:
    """The fields `token` carries; exactly the names in `fields`, each a string.
    Raises UnreadablePageToken for anything encode_page_token did not make."""
    if len(token) > MAX_PAGE_TOKEN_CHARS:
        raise UnreadablePageToken(f"longer than {MAX_PAGE_TOKEN_CHARS} characters")
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=True)
        value = json.loads(raw.decode())
    except (binascii.Error, UnicodeError, ValueError, RecursionError) as exc:
        raise UnreadablePageToken("not base64 over a JSON object") from exc
    if not isinstance(value, dict) or set(value) != set(fields):
        raise UnreadablePageToken(f"not an object of the fields {sorted(fields)!r}")
    if not all(isinstance(v, str) for v in value.values()):
        raise UnreadablePageToken("a field is not a string")
    # The strongest check of all: only what we would have written is ours.
    if _encoded(value) != token:
        raise UnreadablePageToken("not in the form encode_page_token writes")
    return value
