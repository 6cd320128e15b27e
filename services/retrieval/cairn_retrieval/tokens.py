"""Which terms a text holds, for BM25: one pure function used for documents and
queries alike, so the two can never disagree about what a word is.

Lowercase (Unicode casefold after NFKC), runs of Unicode letters and digits, a
small English stopword list, no stemming. A stemmer would raise recall on
English but silently mangle names, code identifiers and other languages; the
dense half of hybrid search already covers morphology.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

# Letters and digits of any script; underscore and punctuation split words.
_WORD = re.compile(r"[^\W_]+")

# Longer runs are base64 blobs, hashes or minified code: noise for BM25 and a
# cost for the postings table.
MAX_TERM_CHARS = 64

STOPWORDS: frozenset[str] = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "from", "has",
    "have", "he", "her", "his", "i", "if", "in", "into", "is", "it", "its", "of",
    "on", "or", "our", "she", "so", "that", "the", "their", "them", "then", "there",
    "these", "they", "this", "to", "was", "we", "were", "what", "when", "where",
    "which", "who", "will", "with", "you", "your",
})  # fmt: skip


def tokenize(text: str) -> list[str]:
    """The terms of `text`, in order, repeats kept."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return [
        term
        for term in _WORD.findall(folded)
        if term not in STOPWORDS and len(term) <= MAX_TERM_CHARS
    ]


def term_frequencies(text: str) -> Counter[str]:
    return Counter(tokenize(text))


def query_terms(query: str) -> list[str]:
    """Distinct terms of a query, sorted: a repeated query word counts once."""
    return sorted(set(tokenize(query)))
