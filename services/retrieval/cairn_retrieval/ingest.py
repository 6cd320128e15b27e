"""Writing, replacing and deleting documents across both stores, so that a chunk
one store has and the other lacks is never served as if whole.

A new version is written to PostgreSQL as 'pending' (invisible to search), its
vectors are upserted to Qdrant, and then one transaction removes the old
version and makes the new one 'ready'. Search serves only 'ready' chunks and
joins dense hits back to them, so a failure at any step leaves the old
version served intact; leftovers are discarded on the next write of that id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import structlog
from opentelemetry import trace

from cairn_libs.embedding import Embedder
from cairn_libs.errors import Denied
from cairn_libs.identity import Principal
from cairn_retrieval.chunking import ChunkBudget, embedded_text
from cairn_retrieval.domain import (
    DEFAULT_BUDGET,
    CorpusStats,
    DocumentResult,
    DocumentView,
    IncomingDocument,
    IngestProgress,
    Outcome,
    PreparedDocument,
    RefusedDocument,
    check_batch_size,
    check_document_id,
    is_unchanged,
    may_manage,
    prepare_document,
    view_document,
)
from cairn_retrieval.embedders import EmbeddingSpace
from cairn_retrieval.errors import (
    BadDocument,
    DocumentNotVisible,
    EmbedderFailed,
    VectorStoreUnavailable,
)
from cairn_retrieval.ports import CorpusCounts, DocumentReads, DocumentSession, DocumentWrites
from cairn_retrieval.tokens import SourceAnalyzers
from cairn_retrieval.vectors import VectorPoint, VectorStore

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)


class Ingestor:
    def __init__(
        self,
        *,
        writes: DocumentWrites,
        reads: DocumentReads,
        counts: CorpusCounts,
        vectors: VectorStore,
        embedder: Embedder | None,
        space: EmbeddingSpace,
        analyzers: SourceAnalyzers | None = None,
        budget: ChunkBudget = DEFAULT_BUDGET,
    ) -> None:
        self._writes = writes
        self._reads = reads
        self._counts = counts
        self._vectors = vectors
        self._embedder = embedder
        self._space = space
        self._analyzers = analyzers or SourceAnalyzers()
        self._budget = budget

    async def ingest(
        self, principal: Principal, documents: Sequence[IncomingDocument | RefusedDocument]
    ) -> AsyncIterator[IngestProgress]:
        """One progress report per document, in request order."""
        if not may_manage(principal):
            raise Denied()
        check_batch_size(len(documents))
        await self._space.check()
        chunks_written = 0
        for done, document in enumerate(documents, start=1):
            if isinstance(document, RefusedDocument):
                log.info("ingest.rejected", document_id=document.document_id, error=document.reason)
                result = DocumentResult(document.document_id, Outcome.FAILED, error=document.reason)
            else:
                result = await self.ingest_one(principal.org_id, document)
            if result.outcome in (Outcome.INGESTED, Outcome.REPLACED):
                chunks_written += result.chunks
            yield IngestProgress(
                documents_total=len(documents),
                documents_done=done,
                chunks_written=chunks_written,
                result=result,
            )

    async def ingest_one(self, org_id: str, document: IncomingDocument) -> DocumentResult:
        with tracer.start_as_current_span("retrieval.ingest_document") as span:
            span.set_attribute("cairn.document_id", document.document_id)
            try:
                prepared = prepare_document(
                    org_id,
                    document,
                    analyzer=self._analyzers.for_source(document.source),
                    budget=self._budget,
                )
            except BadDocument as exc:
                log.info("ingest.rejected", document_id=document.document_id, error=exc.message)
                return DocumentResult(document.document_id, Outcome.FAILED, error=exc.message)
            span.set_attribute("cairn.chunks", len(prepared.chunks))
            async with self._writes.document_session(org_id, document.document_id) as session:
                result = await self._write(session, prepared)
            span.set_attribute("cairn.outcome", result.outcome.value)
            log.info(
                "ingest.document",
                document_id=document.document_id,
                source=document.source,
                outcome=result.outcome.value,
                chunks=result.chunks,
                embedded_chunks=result.embedded_chunks,
            )
            return result

    async def _write(self, session: DocumentSession, prepared: PreparedDocument) -> DocumentResult:
        document_id = prepared.document.document_id
        stored = await session.current()
        if stored.pending_chunk_ids:
            await self._forget_vectors(session.org_id, stored.pending_chunk_ids)
            await session.discard_pending()
        model_id = self._embedder.model_id if self._embedder is not None else ""
        if (
            stored.content_hash == prepared.content_hash
            and stored.analyzer == prepared.analyzer
            and stored.chunking == prepared.chunking
        ):
            if is_unchanged(
                stored_embedding_model=stored.embedding_model,
                stored_vector_store=stored.vector_store,
                ready_chunks=stored.ready_chunks,
                embedded_chunks=stored.embedded_chunks,
                embedder_model=model_id,
                vector_store=self._vectors.identity(),
            ):
                return DocumentResult(
                    document_id,
                    Outcome.UNCHANGED,
                    chunks=stored.ready_chunks,
                    embedded_chunks=stored.embedded_chunks,
                )
            return await self._embed_in_place(session, prepared)

        vectors: list[list[float]] | None = None
        if self._embedder is not None:
            try:
                vectors = await self._embed([c.embedded_text for c in prepared.chunks])
            except EmbedderFailed as exc:
                log.warning("ingest.embed_failed", document_id=document_id, error=exc.message)
                return DocumentResult(
                    document_id,
                    Outcome.FAILED,
                    error=f"{exc.message}; the document was not changed",
                )

        await session.write_pending(prepared, vectors=vectors)
        if vectors is not None:
            points = [
                VectorPoint(
                    chunk_id=c.chunk_id,
                    document_id=document_id,
                    source=prepared.document.source,
                    acl=prepared.acl_keys,
                    vector=v,
                )
                for c, v in zip(prepared.chunks, vectors, strict=True)
            ]
            try:
                await self._vectors.upsert(prepared.org_id, points)
            except VectorStoreUnavailable:
                await self._forget_vectors(prepared.org_id, [c.chunk_id for c in prepared.chunks])
                await session.discard_pending()
                return _vector_store_failed(document_id)

        published = await session.publish(
            prepared,
            embedding_model=model_id if vectors is not None else "",
            vector_store=self._vectors.identity() if vectors is not None else "",
        )
        await self._forget_vectors(prepared.org_id, published.removed_embedded_chunk_ids)
        count = len(prepared.chunks)
        return DocumentResult(
            document_id,
            Outcome.REPLACED if stored.content_hash is not None else Outcome.INGESTED,
            chunks=count,
            embedded_chunks=count if vectors is not None else 0,
        )

    async def _embed_in_place(
        self, session: DocumentSession, prepared: PreparedDocument
    ) -> DocumentResult:
        """Same content, but its vectors are missing or from another model: embed
        the stored chunks (their ids and texts, whatever chunking made them),
        upsert the points, then record the vectors in one transaction. Until
        that transaction commits PostgreSQL holds no vector of this model for
        them, so no dense score is computed from a half-written state."""
        assert self._embedder is not None
        document_id = prepared.document.document_id
        stored_chunks = await session.ready_chunks()
        title_prefix, _ = self._budget.title_prefix(prepared.document.title)
        try:
            vectors = await self._embed(
                [embedded_text(title_prefix, text) for _, text in stored_chunks]
            )
        except EmbedderFailed as exc:
            log.warning("ingest.embed_failed", document_id=document_id, error=exc.message)
            return DocumentResult(
                document_id, Outcome.FAILED, error=f"{exc.message}; the document was not changed"
            )
        points = [
            VectorPoint(
                chunk_id=chunk_id,
                document_id=document_id,
                source=prepared.document.source,
                acl=prepared.acl_keys,
                vector=v,
            )
            for (chunk_id, _), v in zip(stored_chunks, vectors, strict=True)
        ]
        try:
            await self._vectors.upsert(prepared.org_id, points)
        except VectorStoreUnavailable:
            return _vector_store_failed(document_id)
        await session.record_vectors(
            [chunk_id for chunk_id, _ in stored_chunks],
            vectors,
            embedding_model=self._embedder.model_id,
            vector_store=self._vectors.identity(),
        )
        return DocumentResult(
            document_id,
            Outcome.REPLACED,
            chunks=len(stored_chunks),
            embedded_chunks=len(stored_chunks),
        )

    async def _embed(self, texts: Sequence[str]) -> list[list[float]]:
        assert self._embedder is not None
        with tracer.start_as_current_span("retrieval.embed") as span:
            span.set_attribute("cairn.texts", len(texts))
            try:
                vectors = await self._embedder.embed(texts)
            except EmbedderFailed:
                raise
            except Exception as exc:
                # The embedder is a third-party runtime (onnxruntime, or a provider).
                raise EmbedderFailed(f"the embedder failed ({type(exc).__name__})") from exc
        if len(vectors) != len(texts):
            raise EmbedderFailed(
                f"the embedder returned {len(vectors)!r} vectors for {len(texts)} texts"
            )
        return vectors

    async def _forget_vectors(self, org_id: str, chunk_ids: Sequence[str]) -> None:
        """Best effort: a vector left behind is never served, since dense hits are
        joined back to ready chunks in PostgreSQL; it only wastes space."""
        if not chunk_ids:
            return
        try:
            await self._vectors.delete_chunks(org_id, chunk_ids)
        except VectorStoreUnavailable:
            log.warning("ingest.orphaned_vectors", count=len(chunk_ids))

    async def delete(self, principal: Principal, document_id: str) -> int:
        """Remove a document from both stores; the number of chunks removed."""
        if not may_manage(principal):
            raise Denied()
        check_document_id(document_id, purpose="delete")
        org_id = principal.org_id
        async with self._writes.document_session(org_id, document_id) as session:
            stored = await session.current()
            if not stored.exists:
                raise Denied()
            # Vectors first: if Qdrant is down the call fails with nothing changed,
            # and a retry finds the document still there to delete.
            try:
                await self._vectors.delete_document(org_id, document_id)
            except VectorStoreUnavailable as exc:
                if stored.embedded_chunks or stored.pending_chunk_ids:
                    raise VectorStoreUnavailable(
                        f"document {document_id!r} has vectors and the vector store is "
                        "unreachable; nothing was deleted, retry when it is back"
                    ) from exc
                log.warning("delete.vector_store_skipped", document_id=document_id)
            removed = await session.delete()
        log.info("delete.document", document_id=document_id, chunks_removed=removed)
        return removed

    async def document(self, principal: Principal, document_id: str) -> DocumentView:
        """The document as the caller may see it; DocumentNotVisible, the same for a
        document that does not exist and one the caller may not read."""
        check_document_id(document_id, purpose="read")
        view = view_document(principal, await self._reads.document(principal.org_id, document_id))
        if view is None:
            raise DocumentNotVisible()
        return view

    async def stale_documents(self) -> list[tuple[str, str]]:
        """(org id, document id) of every document whose terms or chunks were made
        by another analyzer or chunking than this service's."""
        return [
            (org_id, document_id)
            for org_id, document_id, source, analyzer, chunking in (
                await self._reads.index_versions()
            )
            if analyzer != self._analyzers.for_source(source).name or chunking != self._budget.name
        ]

    async def stats(self, principal: Principal) -> CorpusStats:
        if not may_manage(principal):
            raise Denied()
        sources = await self._counts.counts_by_source(
            principal.org_id,
            model_id=self._embedder.model_id if self._embedder is not None else "",
        )
        return CorpusStats(
            sources=tuple(sources),
            embedder=self._embedder.model_id if self._embedder is not None else "",
        )


def _vector_store_failed(document_id: str) -> DocumentResult:
    return DocumentResult(
        document_id,
        Outcome.FAILED,
        error="the vector store is unreachable; the document was not changed, "
        "ingest it again when the vector store is back",
    )
