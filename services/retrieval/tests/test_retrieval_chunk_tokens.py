"""Chunks sized in the embedder's own tokens: no chunk, with the title embedded
in front of it, is longer than the window the embedder sees, so no text is cut
off silently on its way to a vector."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from cairn_retrieval.chunking import (
    EMBEDDER_WINDOW,
    ChunkBudget,
    EmbedderTokens,
    EstimatedTokens,
    _minilm_tokenizer_path,
    chunk_text,
    embedded_text,
)
from cairn_retrieval.domain import IncomingDocument, prepare_document


@pytest.fixture(scope="module")
def counter() -> EmbedderTokens:
    return EmbedderTokens(name="minilm-wordpiece")


@pytest.fixture(scope="module")
def model_tokens() -> Tokenizer:
    """The tokenizer exactly as the embedder loads it, without its cut at 256."""
    tokenizer = Tokenizer.from_file(str(_minilm_tokenizer_path()))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _technical_text(seed: int, paragraphs: int = 30) -> str:
    """Prose full of identifiers, calls and numbers: about 1.8 tokens a word."""
    rng = random.Random(seed)
    words = [
        "PyObject_GetAttrString()", "os.path.join(a,", "b)", "returns", "the", "value",
        "of", "sys.maxsize", "0x7fffffff", "pg_stat_activity.wait_event_type", "see",
        "asyncio.create_subprocess_exec()", "when", "errno.EAGAIN", "is", "raised",
        "--enable-optimizations", "config.site", "libpq.so.5", "for", "UTF-8", "names.",
    ]  # fmt: skip
    return "\n\n".join(
        " ".join(rng.choice(words) for _ in range(rng.randint(20, 90))) for _ in range(paragraphs)
    )


def test_no_chunk_with_its_title_exceeds_the_embedders_window(
    counter: EmbedderTokens, model_tokens: Tokenizer
) -> None:
    budget = ChunkBudget(counter)
    title = "Python/C API: attribute access, subprocesses and the libpq protocol"
    doc = IncomingDocument("api", "docs", title, _technical_text(1))

    prepared = prepare_document("org", doc, budget=budget)

    assert len(prepared.chunks) > 5
    lengths = [len(model_tokens.encode(c.embedded_text).ids) for c in prepared.chunks]
    assert max(lengths) <= EMBEDDER_WINDOW
    # Chunks are not needlessly small either: most fill half the window or more.
    assert sorted(lengths)[len(lengths) // 2] >= EMBEDDER_WINDOW // 2
    assert all(c.embedded_text.startswith(title + "\n\n") for c in prepared.chunks)


def test_the_word_estimate_would_have_overflowed_the_window_on_the_same_text(
    model_tokens: Tokenizer,
) -> None:
    text = _technical_text(1)
    spans = chunk_text(text)
    overflowing = [
        s for s in spans if len(model_tokens.encode(text[s.char_start : s.char_end]).ids) > 256
    ]
    assert len(overflowing) > len(spans) // 2


def test_the_chunks_cover_every_word_of_the_text(counter: EmbedderTokens) -> None:
    text = _technical_text(2)
    spans = ChunkBudget(counter).spans(text, title="A title")
    covered = set()
    for span in spans:
        covered.update(range(span.char_start, span.char_end))
    assert all(i in covered for i, ch in enumerate(text) if not ch.isspace())
    assert all(a.char_start < b.char_start for a, b in zip(spans, spans[1:], strict=False))


def test_a_word_longer_than_a_chunk_is_cut_at_token_boundaries(
    counter: EmbedderTokens, model_tokens: Tokenizer
) -> None:
    # No blank in 2000 words' worth of tokens: a minified line, a long URL.
    blob = ".".join(f"seg{i}" for i in range(700))
    text = f"Before the blob. {blob} After the blob."
    assert len(model_tokens.encode(blob).ids) > 4 * EMBEDDER_WINDOW

    spans = ChunkBudget(counter).spans(text)

    assert len(spans) > 4
    assert all(
        len(model_tokens.encode(text[s.char_start : s.char_end]).ids) <= EMBEDDER_WINDOW
        for s in spans
    )
    assert "".join(text[s.char_start : s.char_end] for s in spans).count("seg699") >= 1


def test_a_long_title_gives_at_most_its_first_32_tokens_to_each_chunk(
    counter: EmbedderTokens, model_tokens: Tokenizer
) -> None:
    budget = ChunkBudget(counter)
    title = " ".join(f"word{i}" for i in range(60))
    prefix, tokens = budget.title_prefix(title)
    assert title.startswith(prefix) and prefix != title
    assert tokens == len(model_tokens.encode(prefix, add_special_tokens=False).ids) <= 32
    chunk = embedded_text(prefix, "Some text.")
    assert chunk == prefix + "\n\nSome text."


def test_without_a_known_tokenizer_chunks_are_sized_by_the_estimate() -> None:
    budget = ChunkBudget(EstimatedTokens())
    assert budget.name == "estimate/256/title32"
    assert budget.spans("A short text.") == chunk_text("A short text.", max_tokens=254)
