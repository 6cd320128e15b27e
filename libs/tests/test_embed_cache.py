"""The embedding cache embeds each text once, answers exactly what the model would,
stays within its bound, and keeps no text."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from cairn_libs.embed_cache import CachedEmbedder, cached
from cairn_libs.errors import ConfigurationError


class CountingEmbedder:
    """A deterministic stand-in that records every text it was asked to embed."""

    model_id = "counting"
    dimensions = 3

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.asked.extend(texts)
        return [[float(len(t)), float(sum(map(ord, t)) % 97), 1.0] for t in texts]


async def test_a_text_asked_again_is_answered_from_the_cache_with_the_same_vector() -> None:
    inner = CountingEmbedder()
    embedder = CachedEmbedder(inner, entries=8)

    first = await embedder.embed(["bonus policy", "leave"])
    again = await embedder.embed(["leave", "bonus policy", "leave", "new"])

    assert again == [first[1], first[0], first[1], (await inner.embed(["new"]))[0]]
    assert inner.asked == ["bonus policy", "leave", "new", "new"]
    assert (embedder.hits, embedder.misses) == (3, 3)


async def test_a_text_repeated_within_one_call_is_embedded_once() -> None:
    inner = CountingEmbedder()
    vectors = await CachedEmbedder(inner, entries=8).embed(["a", "b", "a"])
    assert inner.asked == ["a", "b"]
    assert vectors[0] == vectors[2]


async def test_the_least_recently_used_vector_leaves_first_and_the_bound_holds() -> None:
    inner = CountingEmbedder()
    embedder = CachedEmbedder(inner, entries=2)
    await embedder.embed(["one", "two"])
    await embedder.embed(["one"])  # "two" is now the least recently used
    await embedder.embed(["three"])
    inner.asked.clear()

    await embedder.embed(["one", "three", "two"])

    assert inner.asked == ["two"]


async def test_a_batch_larger_than_the_cache_is_still_answered_whole() -> None:
    inner = CountingEmbedder()
    texts = [f"text {i}" for i in range(5)]
    assert await CachedEmbedder(inner, entries=2).embed(texts) == await inner.embed(texts)


async def test_the_cache_keeps_vectors_and_digests_never_the_text() -> None:
    embedder = CachedEmbedder(CountingEmbedder(), entries=4)
    await embedder.embed(["Tom's private note about his health"])
    # Everything the cache object holds, keys included, rendered: no trace of the text.
    assert "private note" not in repr(vars(embedder))
    assert embedder.misses == 1


def test_the_size_setting_is_refused_unless_a_positive_whole_number() -> None:
    with pytest.raises(ConfigurationError, match="CAIRN_EMBED_CACHE_ENTRIES='-1'"):
        cached(CountingEmbedder(), env={"CAIRN_EMBED_CACHE_ENTRIES": "-1"})
    assert cached(None, env={}) is None
    inner = CountingEmbedder()
    assert cached(inner, env={"CAIRN_EMBED_CACHE_ENTRIES": "0"}) is inner
    assert isinstance(cached(inner, env={}), CachedEmbedder)
