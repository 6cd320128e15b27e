"""Which text may be kept: one sentence, and nothing that looks like a secret.

Pure functions over strings. Sentence counting is a small rule set (terminator,
whitespace, a capital, digit or opening quote next, and not after a known
abbreviation or an initial) rather than an NLP model: the rule is the contract a
caller can predict, and a miss only ever errs towards accepting a short text.

Secret detection names the kind of secret it saw and never returns the matched
text, so a refusal cannot echo the secret into logs or error messages.
"""

from __future__ import annotations

import re
from typing import Final

_TERMINATOR = re.compile(
    r"[.!?\u2026]+[\"'\u201d\u2019)\]]*\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9\u00c0-\u00dd])"
)
_ABBREVIATIONS: Final = frozenset(
    {
        "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e",
        "inc", "ltd", "co", "corp", "no", "nr", "approx", "dept", "est", "fig", "ca",
        "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov",
        "dec", "mon", "tue", "wed", "thu", "fri", "sat", "sun", "a.m", "p.m", "u.s",
        "u.k", "e.u", "ph.d", "cf", "al", "ave", "blvd", "mt", "gen", "gov", "rev",
    }
)  # fmt: skip


def sentence_count(text: str) -> int:
    """How many sentences `text` holds under cairn's rule (0 for blank text)."""
    stripped = text.strip()
    if not stripped:
        return 0
    count = 1
    for match in _TERMINATOR.finditer(stripped):
        if match.group().startswith(".") and _ends_with_abbreviation(stripped[: match.start()]):
            continue
        count += 1
    return count


def _ends_with_abbreviation(before: str) -> bool:
    words = before.split()
    if not words:
        return False
    word = words[-1].lstrip("\"'(\u201c\u2018[").lower()
    if len(word) == 1 and word.isalpha():
        return True  # an initial, as in "J. Smith"
    return word in _ABBREVIATIONS


# (what the caller is told it looked like, pattern). Ordered most specific first.
_SECRET_PATTERNS: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("an API key", re.compile(r"(?<![A-Za-z0-9])sk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_]{16,}")),
    ("an AWS access key", re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA)[0-9A-Z]{16}(?![A-Z0-9])")),
    (
        "a GitHub token",
        re.compile(r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
    ),
    ("a Slack token", re.compile(r"(?<![A-Za-z0-9])xox[abposr]-[A-Za-z0-9-]{10,}")),
    ("a Google API key", re.compile(r"(?<![A-Za-z0-9])AIza[0-9A-Za-z_-]{30,}")),
    (
        "a JSON Web Token",
        re.compile(r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"),
    ),
    ("a bearer token", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{20,}=*")),
    (
        "a password",
        re.compile(
            r"(?i)\b(?:password|passwd|pwd|passphrase|passcode|api[_ -]?key|secret[_ -]?key|access[_ -]?token|auth[_ -]?token)\b\s*[:=]\s*\S+"
        ),
    ),
    (
        "a one-time code",
        re.compile(
            r"(?i)\b(?:code|otp|one[- ]time|verification|2fa|mfa|pin)\b\D{0,24}(?<!\d)\d{6,8}(?!\d)"
            r"|(?<!\d)\d{6,8}(?!\d)\D{0,24}\b(?:code|otp|one[- ]time|verification|2fa|mfa|pin)\b"
        ),
    ),
)


def secret_kind(text: str) -> str | None:
    """The kind of secret `text` appears to contain ("an API key", ...), or None."""
    for kind, pattern in _SECRET_PATTERNS:
        if pattern.search(text):
            return kind
    return None
