"""One search: the caller's ACL predicate, BM25 candidates from PostgreSQL and
dense candidates from Qdrant under that same predicate, fused with RRF.

The I/O is here and nothing else: the predicate comes from cairn_libs.acl, and
pool size, ranking, fusion and the mode are decided by pure functions in
`domain`. Both candidate lists are joined back to the ready chunks the
predicate admits in PostgreSQL before ranking, so a vector whose chunk is
pending, replaced or deleted is never served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
from opentelemetry import trace

from cairn_libs.acl import AclPredicate
from cairn_libs.embedding import Embedder
from cairn_libs.errors import InvalidInput
from cairn_libs.identity import Principal
from cairn_retrieval.domain import (
    DenseStatus,
    SearchMode,
    SearchOutcome,
    assemble_results,
    candidate_pool,
    decide_mode,
    fuse_rrf,
    rank,
    refuse_dense_only,
    resolve_k,
    validate_query,
)
from cairn_retrieval.embedders import EmbeddingSpace
from cairn_retrieval.errors import BadSearch, VectorStoreUnavailable
from cairn_retrieval.ports import SearchReads
from cairn_retrieval.repair import VectorStoreHealth
from cairn_retrieval.tokens import SourceAnalyzers
from cairn_retrieval.vectors import VectorStore

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)


async def _nothing_keyword() -> list[tuple[str, float]]:
    return []


async def _nothing_dense() -> tuple[DenseStatus, list[float] | None, list[str]]:
    # Not asked for: the status is never read as a failure (decide_mode).
    return DenseStatus.AVAILABLE, None, []


class Searcher:
    def __init__(
        self,
        *,
        chunks: SearchReads,
        vectors: VectorStore,
        embedder: Embedder | None,
        space: EmbeddingSpace,
        analyzers: SourceAnalyzers | None = None,
        health: VectorStoreHealth | None = None,
    ) -> None:
        self._chunks = chunks
        self._vectors = vectors
        self._embedder = embedder
        self._space = space
        self._analyzers = analyzers or SourceAnalyzers()
        self._health = health

    async def search(
        self,
        principal: Principal,
        *,
        query: str,
        sources: Sequence[str],
        k: int,
        mode: SearchMode = SearchMode.HYBRID,
    ) -> SearchOutcome:
        """`mode` is the mode asked for: HYBRID falls back to keyword-only when
        the dense half cannot run; KEYWORD_ONLY and DENSE_ONLY run one half."""
        try:
            predicate = AclPredicate.for_caller(principal, sources)
        except InvalidInput as exc:
            raise BadSearch(exc.message) from exc
        k = resolve_k(k)
        validate_query(query)
        terms = self._analyzers.query_terms(query, predicate.sources)
        pool = candidate_pool(k)
        if mode is SearchMode.DENSE_ONLY and self._embedder is None:
            refusal = refuse_dense_only(DenseStatus.NO_EMBEDDER)
            assert refusal is not None
            raise refusal

        # The two halves do not depend on each other: BM25 runs in PostgreSQL while
        # the query is embedded and Qdrant scans, here in worker threads.
        keyword_hits, (dense_status, query_vector, dense_ids) = await asyncio.gather(
            self._keyword_candidates(predicate, terms, limit=pool)
            if mode is not SearchMode.DENSE_ONLY
            else _nothing_keyword(),
            self.dense_candidates(query, predicate, limit=pool)
            if mode is not SearchMode.KEYWORD_ONLY
            else _nothing_dense(),
        )
        if mode is SearchMode.DENSE_ONLY:
            refusal = refuse_dense_only(dense_status)
            if refusal is not None:
                raise refusal
        ran, reason = decide_mode(dense=dense_status, has_query_terms=bool(terms), requested=mode)

        records, similarity = await self._chunks.visible_chunks(
            predicate,
            sorted({cid for cid, _ in keyword_hits} | set(dense_ids)),
            query_vector=query_vector,
            model_id=self._embedder.model_id if self._embedder is not None else "",
        )
        keyword = rank(h for h in keyword_hits if h[0] in records)
        dense = rank((cid, similarity[cid]) for cid in dense_ids if cid in similarity)
        fused = fuse_rrf(keyword, dense, limit=k)
        results = assemble_results(fused, records)
        log.info(
            "search.done",
            mode=ran.value,
            requested=mode.value,
            sources=list(predicate.sources),
            k=k,
            keyword_candidates=len(keyword),
            dense_candidates=len(dense),
            results=len(results),
        )
        return SearchOutcome(results=results, mode=ran, mode_reason=reason)

    async def _keyword_candidates(
        self, predicate: AclPredicate, terms: Sequence[str], *, limit: int
    ) -> list[tuple[str, float]]:
        with tracer.start_as_current_span("retrieval.keyword") as span:
            keyword_hits, trace = await self._chunks.bm25(predicate, terms, limit=limit)
            span.set_attribute("cairn.candidates", len(keyword_hits))
            span.set_attribute("cairn.bm25.passes", trace.passes)
            span.set_attribute("cairn.bm25.pruned", trace.pruned)
        return keyword_hits

    async def dense_candidates(
        self, query: str, predicate: AclPredicate, *, limit: int
    ) -> tuple[DenseStatus, list[float] | None, list[str]]:
        """Qdrant's dense candidates under the predicate, with the query vector.

        Qdrant chooses the candidates; their scores are recomputed in
        PostgreSQL, pair by pair, because Qdrant's batched float32 scoring can
        move in the last bits when unrelated points are added (I2)."""
        if self._embedder is None:
            return DenseStatus.NO_EMBEDDER, None, []
        mismatch = await self._space.mismatch()
        if mismatch is not None:
            log.warning("search.model_mismatch", detail=mismatch)
            return DenseStatus.MODEL_MISMATCH, None, []
        if self._health is not None and await self._health.problem() is not None:
            return DenseStatus.VECTOR_STORE_NEEDS_REPAIR, None, []
        with tracer.start_as_current_span("retrieval.dense") as span:
            try:
                (vector,) = await self._embedder.embed([query])
            except Exception as exc:
                log.warning("search.embed_failed", error=type(exc).__name__)
                return DenseStatus.EMBEDDER_FAILED, None, []
            try:
                hits = await self._vectors.search(vector, predicate, limit=limit)
            except VectorStoreUnavailable:
                span.set_attribute("cairn.degraded", "vector_store_unreachable")
                return DenseStatus.VECTOR_STORE_UNREACHABLE, None, []
            span.set_attribute("cairn.candidates", len(hits))
            return DenseStatus.AVAILABLE, vector, [cid for cid, _ in hits]
