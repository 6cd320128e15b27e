"""Which embedder retrieval uses, and the rule that keeps one model per collection.

`CAIRN_RETRIEVAL_EMBEDDER` chooses: `local` (the ONNX model in this process),
`none`, or `gateway` (the gateway's `Embed`, called with the caller's own
token, so the gateway accounts the work to whoever asked for it). Unset, the
common `CAIRN_EMBEDDER` decides between local and none.

Vectors of two models are not comparable, and a collection mixing them answers
nonsense without an error. So the gateway embedder is pinned to one model
(`CAIRN_RETRIEVAL_EMBED_MODEL`) and checks every answer against it, and each
collection records, in PostgreSQL, the model whose vectors it holds: a
retrieval service configured with another model refuses to ingest into it and
searches it keyword-only, saying why.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import grpc

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.embedding import LOCAL_DIMENSIONS, LOCAL_MODEL_ID, Embedder, embedder_from_env
from cairn_libs.server import current_caller_token
from cairn_retrieval.errors import ConfigInvalid, EmbedderFailed, EmbeddingModelMismatch
from cairn_retrieval.ports import VectorLedger
from cairn_retrieval.vectors import VectorStore

GATEWAY_BATCH = 64


class GatewayEmbedder:
    """The gateway's `Embed` behind the Embedder protocol, pinned to one model."""

    def __init__(
        self,
        *,
        address: str,
        model_id: str,
        dimensions: int,
        timeout_seconds: float = 60,
        batch_size: int = GATEWAY_BATCH,
    ) -> None:
        self.model_id = model_id
        self.dimensions = dimensions
        self._address = address
        self._timeout = timeout_seconds
        self._batch_size = batch_size
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> gateway_pb2_grpc.GatewayServiceAsyncStub:
        if self._channel is None:
            self._channel = channel(self._address)
        return gateway_pb2_grpc.GatewayServiceStub(self._channel)  # type: ignore[return-value]

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        token = current_caller_token()
        if not token:
            raise EmbedderFailed("the gateway embedder needs the caller's token; none is set")
        stub = self._stub()
        vectors: list[list[float]] = []
        for start in range(0, len(texts), self._batch_size):
            batch = list(texts[start : start + self._batch_size])
            try:
                answer = await stub.Embed(
                    gateway_pb2.EmbedRequest(texts=batch, model=self.model_id),
                    metadata=call_metadata(token),
                    timeout=self._timeout,
                )
            except grpc.aio.AioRpcError as exc:
                raise EmbedderFailed(
                    f"the gateway at {self._address} refused Embed: "
                    f"{exc.code().name}: {exc.details()}"
                ) from exc
            if answer.model != self.model_id or answer.dimensions != self.dimensions:
                raise EmbedderFailed(
                    f"the gateway embedded with model {answer.model!r} ({answer.dimensions} "
                    f"dimensions), not {self.model_id!r} ({self.dimensions}) as "
                    "CAIRN_RETRIEVAL_EMBED_MODEL says; vectors of two models are never mixed"
                )
            if len(answer.embeddings) != len(batch):
                raise EmbedderFailed(
                    f"the gateway returned {len(answer.embeddings)} vectors for {len(batch)} texts"
                )
            vectors.extend(list(e.values) for e in answer.embeddings)
        return vectors

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None


def retrieval_embedder_from_env() -> Embedder | None:
    choice = os.environ.get("CAIRN_RETRIEVAL_EMBEDDER", "").strip().lower()
    if not choice:
        return embedder_from_env()
    if choice in ("none", "off"):
        return None
    if choice == "local":
        from cairn_libs.embedding import LocalOnnxEmbedder

        return LocalOnnxEmbedder()
    if choice == "gateway":
        address = os.environ.get("CAIRN_GATEWAY_ADDR", "").strip()
        if not address:
            raise ConfigInvalid(
                "CAIRN_RETRIEVAL_EMBEDDER=gateway needs CAIRN_GATEWAY_ADDR (host:port of the gateway)"
            )
        dimensions = os.environ.get("CAIRN_RETRIEVAL_EMBED_DIMENSIONS", str(LOCAL_DIMENSIONS))
        if not dimensions.isdigit() or int(dimensions) <= 0:
            raise ConfigInvalid(
                f"CAIRN_RETRIEVAL_EMBED_DIMENSIONS={dimensions!r} is not a positive integer"
            )
        return GatewayEmbedder(
            address=address,
            model_id=os.environ.get("CAIRN_RETRIEVAL_EMBED_MODEL", "").strip() or LOCAL_MODEL_ID,
            dimensions=int(dimensions),
        )
    raise ConfigInvalid(
        f"CAIRN_RETRIEVAL_EMBEDDER={choice!r} is not known; use 'local', 'gateway' or 'none'"
    )


class EmbeddingSpace:
    """Whether the configured embedder's vectors may go into the collection: the
    first embedder to use a collection claims it for its model."""

    def __init__(
        self, *, ledger: VectorLedger, vectors: VectorStore, embedder: Embedder | None
    ) -> None:
        self._ledger = ledger
        self._vectors = vectors
        self._embedder = embedder
        self._mismatch: str | None = None
        self._claimed = False

    async def mismatch(self) -> str | None:
        """Why this embedder may not use the collection, or None when it may."""
        if self._embedder is None:
            return None
        if not self._claimed:
            where = self._vectors.identity()
            model_id, dimensions = await self._ledger.claim_collection(
                where, model_id=self._embedder.model_id, dimensions=self._embedder.dimensions
            )
            if model_id != self._embedder.model_id or dimensions != self._embedder.dimensions:
                self._mismatch = (
                    f"the vector collection {where!r} holds vectors of model {model_id!r} "
                    f"({dimensions} dimensions) and the configured embedder is "
                    f"{self._embedder.model_id!r} ({self._embedder.dimensions}); vectors of two "
                    "models are never mixed: point CAIRN_QDRANT_COLLECTION at a new collection "
                    "and ingest again, or configure the model the collection holds"
                )
            self._claimed = True
        return self._mismatch

    async def check(self) -> None:
        reason = await self.mismatch()
        if reason is not None:
            raise EmbeddingModelMismatch(reason)
