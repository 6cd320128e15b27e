"""A text is embedded once per service, not once per caller that asks.

One run asks for the same question's vector several times (the knowledge prefetch,
then the model's own search_knowledge call with the same query; a recall and a
later recall). `CachedEmbedder` keeps the last `entries` vectors, least recently
used out first, keyed by the model and the SHA-256 of the text: the text itself is
not kept, so the cache holds no copy of what a person wrote (an erased memory's
words are not in it), only vectors, as float32 (1.5 KB each for MiniLM).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np

from cairn_libs.embedding import Embedder
from cairn_libs.settings import positive_whole_number

DEFAULT_ENTRIES: Final = 2048


class CachedEmbedder:
    def __init__(self, inner: Embedder, *, entries: int = DEFAULT_ENTRIES) -> None:
        if entries <= 0:
            raise ValueError(f"a cache needs at least one entry, got {entries!r}")
        self.model_id = inner.model_id
        self.dimensions = inner.dimensions
        self._inner = inner
        self._entries = entries
        self._vectors: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def _key(self, text: str) -> bytes:
        return hashlib.sha256(f"{self.model_id}\x00{text}".encode()).digest()

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        keys = [self._key(text) for text in texts]
        found: dict[bytes, np.ndarray] = {}
        wanted: dict[bytes, str] = {}
        for key, text in zip(keys, texts, strict=True):
            vector = self._vectors.get(key)
            if vector is not None:
                self._vectors.move_to_end(key)
                found[key] = vector
            elif key not in wanted:
                wanted[key] = text
        self.hits += len(texts) - len(wanted)
        self.misses += len(wanted)
        if wanted:
            made = await self._inner.embed(list(wanted.values()))
            for key, values in zip(wanted, made, strict=True):
                found[key] = np.asarray(values, dtype=np.float32)
                self._vectors[key] = found[key]
                self._vectors.move_to_end(key)
            while len(self._vectors) > self._entries:
                self._vectors.popitem(last=False)
        return [found[key].tolist() for key in keys]


def cached(inner: Embedder | None, *, env: Mapping[str, str] | None = None) -> Embedder | None:
    """`inner` behind a cache of CAIRN_EMBED_CACHE_ENTRIES vectors (default 2048;
    0 turns the cache off, e.g. for a benchmark that measures the model itself)."""
    if inner is None:
        return None
    values = os.environ if env is None else env
    if values.get("CAIRN_EMBED_CACHE_ENTRIES", "").strip() == "0":
        return inner
    entries = positive_whole_number("CAIRN_EMBED_CACHE_ENTRIES", DEFAULT_ENTRIES, env=env)
    return CachedEmbedder(inner, entries=entries)
