"""Where a document is cut into chunks: contiguous spans of the original text, so
a chunk is always `text[char_start:char_end]` and a citation points at exactly
what the model read.

Size is counted in estimated model tokens, per word: max(1.3, len(word) / 4).
Prose averages about 1.3 word-piece tokens per word, and long words (URLs,
identifiers) about one token per four characters, so the larger of the two
keeps a chunk under the embedder's 256-token window without running the
tokenizer here. A chunk grows to at most `max_tokens` (256) and is then cut at
the last paragraph end that leaves it at least `min_tokens` (128); failing
that at the last sentence end; failing that mid-paragraph. The next chunk
starts about `overlap_tokens` (32) earlier, moved forward to a sentence start
when one is in reach, so a fact on a boundary is whole in at least one chunk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_MAX_TOKENS = 256.0
DEFAULT_MIN_TOKENS = 128.0
DEFAULT_OVERLAP_TOKENS = 32.0

_WORD = re.compile(r"\S+")
_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n")
_SENTENCE_END = re.compile(r"[.!?\u2026][\"'\u201d\u2019)\]]*$")


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    ordinal: int
    char_start: int
    char_end: int


def estimated_tokens(word: str) -> float:
    return max(1.3, len(word) / 4)


def _word_spans(text: str, *, max_word_chars: int) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for match in _WORD.finditer(text):
        start, end = match.span()
        # A run with no spaces longer than a whole chunk (base64, minified code)
        # is cut into pieces so no single "word" overflows a chunk.
        while end - start > max_word_chars:
            spans.append((start, start + max_word_chars))
            start += max_word_chars
        spans.append((start, end))
    return spans


def chunk_text(
    text: str,
    *,
    max_tokens: float = DEFAULT_MAX_TOKENS,
    min_tokens: float = DEFAULT_MIN_TOKENS,
    overlap_tokens: float = DEFAULT_OVERLAP_TOKENS,
) -> list[ChunkSpan]:
    """The chunk spans of `text`, in order; none when it holds no word."""
    if not 0 <= overlap_tokens < min_tokens <= max_tokens:
        raise ValueError(
            f"need 0 <= overlap_tokens < min_tokens <= max_tokens, got "
            f"{overlap_tokens!r}, {min_tokens!r}, {max_tokens!r}"
        )
    words = _word_spans(text, max_word_chars=int(max_tokens * 4))
    n = len(words)
    if n == 0:
        return []
    weights = [estimated_tokens(text[s:e]) for s, e in words]
    paragraph_end = [
        i == n - 1 or bool(_PARAGRAPH_BREAK.search(text, words[i][1], words[i + 1][0]))
        for i in range(n)
    ]
    sentence_end = [
        paragraph_end[i] or bool(_SENTENCE_END.search(text[words[i][0] : words[i][1]]))
        for i in range(n)
    ]

    spans: list[ChunkSpan] = []
    start = 0
    while True:
        end = start
        total = 0.0
        while end < n and total + weights[end] <= max_tokens:
            total += weights[end]
            end += 1
        end = max(end, start + 1)
        cut = (
            n
            if end >= n
            else _best_cut(start, end, weights, paragraph_end, sentence_end, min_tokens)
        )
        spans.append(ChunkSpan(len(spans), words[start][0], words[cut - 1][1]))
        if cut >= n:
            return spans
        start = _overlap_start(start, cut, weights, sentence_end, overlap_tokens)


def _best_cut(
    start: int,
    end: int,
    weights: list[float],
    paragraph_end: list[bool],
    sentence_end: list[bool],
    min_tokens: float,
) -> int:
    """Exclusive word index to end the chunk at, within (start, end]."""
    cumulative = 0.0
    eligible: list[int] = []
    for j in range(start, end):
        cumulative += weights[j]
        if cumulative >= min_tokens:
            eligible.append(j + 1)
    for boundary in (paragraph_end, sentence_end):
        for cut in reversed(eligible):
            if boundary[cut - 1]:
                return cut
    return end


def _overlap_start(
    start: int, cut: int, weights: list[float], sentence_end: list[bool], overlap_tokens: float
) -> int:
    back = cut
    carried = 0.0
    while back > start + 1 and carried + weights[back - 1] <= overlap_tokens:
        back -= 1
        carried += weights[back]
    for j in range(back, cut):
        if sentence_end[j - 1]:
            return j
    return back
