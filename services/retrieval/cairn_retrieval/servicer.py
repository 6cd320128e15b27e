"""The gRPC door of RetrievalService: proto in, domain values through, proto out.

Identity comes from the bootstrap's interceptor (`current_identity()`), never
from a request field; errors are raised as CairnError subclasses and mapped to
status codes by the interceptor.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs import door
from cairn_libs.server import current_identity
from cairn_retrieval.domain import (
    CorpusStats,
    DocumentAcl,
    DocumentResult,
    DocumentView,
    IncomingDocument,
    IngestProgress,
    Outcome,
    RefusedDocument,
    SearchMode,
    SearchOutcome,
)
from cairn_retrieval.ingest import Ingestor
from cairn_retrieval.search import Searcher

SERVICE_NAME = retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"].full_name
INGEST_METHOD = f"/{SERVICE_NAME}/IngestDocuments"

_OUTCOME_TO_PROTO = {
    Outcome.INGESTED: retrieval_pb2.DOCUMENT_OUTCOME_INGESTED,
    Outcome.UNCHANGED: retrieval_pb2.DOCUMENT_OUTCOME_UNCHANGED,
    Outcome.REPLACED: retrieval_pb2.DOCUMENT_OUTCOME_REPLACED,
    Outcome.FAILED: retrieval_pb2.DOCUMENT_OUTCOME_FAILED,
}
_MODE_TO_PROTO = {
    SearchMode.HYBRID: retrieval_pb2.SEARCH_MODE_HYBRID,
    SearchMode.KEYWORD_ONLY: retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY,
    SearchMode.DENSE_ONLY: retrieval_pb2.SEARCH_MODE_DENSE_ONLY,
}
# UNSPECIFIED asks for the default, hybrid; the door has refused any other number.
_MODE_FROM_PROTO = {
    retrieval_pb2.SEARCH_MODE_UNSPECIFIED: SearchMode.HYBRID,
    **{number: mode for mode, number in _MODE_TO_PROTO.items()},
}


def document_from_proto(message: retrieval_pb2.Document) -> IncomingDocument:
    metadata: dict[str, Any] = (
        json_format.MessageToDict(message.metadata) if message.HasField("metadata") else {}
    )
    return IncomingDocument(
        document_id=message.document_id,
        source=message.source,
        title=message.title,
        text=message.text,
        acl=DocumentAcl(
            users=tuple(message.acl.users),
            roles=tuple(message.acl.roles),
            groups=tuple(message.acl.groups),
        ),
        metadata=metadata,
    )


def documents_from_proto(
    messages: Sequence[retrieval_pb2.Document],
) -> list[IncomingDocument | RefusedDocument]:
    """Each document, or its refusal by the door: the bootstrap leaves `documents`
    of IngestDocuments to us so that one bad document fails alone."""
    documents: list[IncomingDocument | RefusedDocument] = []
    for index, message in enumerate(messages):
        refused = door.first_violation(message, path=f"documents[{index}]")
        if refused is not None:
            documents.append(RefusedDocument(message.document_id, refused.message))
        else:
            documents.append(document_from_proto(message))
    return documents


def result_to_proto(result: DocumentResult) -> retrieval_pb2.DocumentResult:
    return retrieval_pb2.DocumentResult(
        document_id=result.document_id,
        outcome=_OUTCOME_TO_PROTO[result.outcome],
        chunks=result.chunks,
        embedded_chunks=result.embedded_chunks,
        error=result.error,
    )


def progress_to_proto(progress: IngestProgress) -> retrieval_pb2.IngestDocumentsResponse:
    return retrieval_pb2.IngestDocumentsResponse(
        documents_total=progress.documents_total,
        documents_done=progress.documents_done,
        chunks_written=progress.chunks_written,
        result=result_to_proto(progress.result),
    )


def search_to_proto(outcome: SearchOutcome) -> retrieval_pb2.SearchResponse:
    return retrieval_pb2.SearchResponse(
        results=[
            retrieval_pb2.SearchResult(
                document_id=hit.chunk.document_id,
                chunk_id=hit.chunk.chunk_id,
                source=hit.chunk.source,
                title=hit.chunk.title,
                char_start=hit.chunk.char_start,
                char_end=hit.chunk.char_end,
                text=hit.chunk.text,
                bm25_score=hit.bm25_score,
                dense_score=hit.dense_score,
                fused_score=hit.fused_score,
                keyword_rank=hit.keyword_rank,
                dense_rank=hit.dense_rank,
            )
            for hit in outcome.results
        ],
        mode=_MODE_TO_PROTO[outcome.mode],
        mode_reason=outcome.mode_reason,
    )


def document_to_proto(view: DocumentView) -> retrieval_pb2.GetDocumentResponse:
    document = view.document
    message = retrieval_pb2.Document(
        document_id=document.document_id,
        source=document.source,
        title=document.title,
        text=document.text,
    )
    if view.acl is not None:
        message.acl.CopyFrom(
            retrieval_pb2.Acl(
                users=list(view.acl.users), roles=list(view.acl.roles), groups=list(view.acl.groups)
            )
        )
    if document.metadata:
        json_format.ParseDict(dict(document.metadata), message.metadata)
    return retrieval_pb2.GetDocumentResponse(document=message)


def stats_to_proto(stats: CorpusStats) -> retrieval_pb2.StatsResponse:
    return retrieval_pb2.StatsResponse(
        sources=[
            retrieval_pb2.SourceStats(
                source=s.source,
                documents=s.documents,
                chunks=s.chunks,
                embedded_chunks=s.embedded_chunks,
            )
            for s in stats.sources
        ],
        documents=stats.documents,
        chunks=stats.chunks,
        embedded_chunks=stats.embedded_chunks,
        embedder=stats.embedder,
    )


class RetrievalServicer(retrieval_pb2_grpc.RetrievalServiceServicer):
    def __init__(self, *, ingestor: Ingestor, searcher: Searcher) -> None:
        self._ingestor = ingestor
        self._searcher = searcher

    async def IngestDocuments(
        self,
        request: retrieval_pb2.IngestDocumentsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[retrieval_pb2.IngestDocumentsResponse]:
        principal = current_identity().principal
        documents = documents_from_proto(request.documents)
        async for progress in self._ingestor.ingest(principal, documents):
            yield progress_to_proto(progress)

    async def DeleteDocument(
        self,
        request: retrieval_pb2.DeleteDocumentRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> retrieval_pb2.DeleteDocumentResponse:
        removed = await self._ingestor.delete(current_identity().principal, request.document_id)
        return retrieval_pb2.DeleteDocumentResponse(chunks_removed=removed)

    async def Search(
        self,
        request: retrieval_pb2.SearchRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> retrieval_pb2.SearchResponse:
        outcome = await self._searcher.search(
            current_identity().principal,
            query=request.query,
            sources=list(request.sources),
            k=request.k,
            mode=_MODE_FROM_PROTO[request.mode],
        )
        return search_to_proto(outcome)

    async def GetDocument(
        self,
        request: retrieval_pb2.GetDocumentRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> retrieval_pb2.GetDocumentResponse:
        view = await self._ingestor.document(current_identity().principal, request.document_id)
        return document_to_proto(view)

    async def Stats(
        self,
        request: retrieval_pb2.StatsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> retrieval_pb2.StatsResponse:
        return stats_to_proto(await self._ingestor.stats(current_identity().principal))
