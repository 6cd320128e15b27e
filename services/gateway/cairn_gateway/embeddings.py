"""Texts to vectors: through a provider's /embeddings when one is configured with an
`embedding_model`, otherwise the local ONNX embedder shipped with cairn.

There is no failover between embedding models: vectors from two models do not live
in one space, so silently switching would corrupt every index built with them.
The local embedder is loaded on first use, off the event loop, so start-up stays
fast and a gateway that never embeds never pays for the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cairn_gateway.domain import UnusableProvider
from cairn_gateway.errors import ChatRequestInvalid, NoProviderConfigured, NoUsableProvider
from cairn_gateway.provider import ChatProvider
from cairn_libs.embedding import LOCAL_MODEL_ID, Embedder

LOCAL_PROVIDER = "local"
MAX_TEXTS = 2048


@dataclass(frozen=True, slots=True)
class EmbedResult:
    provider: str
    model: str
    vectors: list[list[float]]
    dimensions: int


class Embeddings:
    def __init__(
        self,
        providers: Sequence[ChatProvider],
        *,
        local_embedder: Callable[[], Embedder | None],
        unusable: Sequence[UnusableProvider] = (),
        default_model: str = "",
    ) -> None:
        self._providers = [p for p in providers if p.config.embedding_model]
        self._unusable = [u for u in unusable if u.config.embedding_model]
        # The deployment's default is the first provider in the file with an
        # embedding model, usable or not: if its key is unset, falling back to the
        # next one (or the local model) would fill an index with another model's vectors.
        self._default_model = default_model or LOCAL_MODEL_ID
        self._local_factory = local_embedder
        self._local: Embedder | None = None
        self._local_loaded = False
        self._lock = asyncio.Lock()

    @property
    def default_model(self) -> str:
        return self._default_model

    async def embed(self, texts: Sequence[str], *, model: str = "") -> EmbedResult:
        if len(texts) > MAX_TEXTS:
            raise ChatRequestInvalid(
                f"{len(texts)} texts in one call; send at most {MAX_TEXTS} per call"
            )
        wanted = model or self.default_model
        for provider in self._providers:
            if provider.config.embedding_model == wanted:
                vectors = await provider.embed(texts, model=wanted) if texts else []
                return EmbedResult(
                    provider.config.name, wanted, vectors, len(vectors[0]) if vectors else 0
                )
        blocked = [u for u in self._unusable if u.config.embedding_model == wanted]
        if blocked:
            reasons = "; ".join(f"{u.config.name!r}: {u.reason}" for u in blocked)
            raise NoUsableProvider(
                f"embedding model {wanted!r} is served only by provider(s) this gateway "
                f"cannot use: {reasons}; the deployment must fix that"
            )
        if wanted != LOCAL_MODEL_ID:
            known = [p.config.embedding_model for p in self._providers] + [LOCAL_MODEL_ID]
            raise ChatRequestInvalid(
                f"embedding model {wanted!r} is not configured; available: {', '.join(known)} "
                "(or leave model empty for the deployment's default)"
            )
        embedder = await self._local_embedder()
        vectors = await embedder.embed(texts) if texts else []
        return EmbedResult(LOCAL_PROVIDER, embedder.model_id, vectors, embedder.dimensions)

    async def _local_embedder(self) -> Embedder:
        async with self._lock:
            if not self._local_loaded:
                self._local = await asyncio.to_thread(self._local_factory)
                self._local_loaded = True
        if self._local is None:
            raise NoProviderConfigured(
                "no embedder is configured: CAIRN_EMBEDDER=none and no provider has an "
                "embedding_model; set CAIRN_EMBEDDER=local or configure one"
            )
        return self._local
