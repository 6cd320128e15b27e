"""What the use cases (search, ingest, repair) need from storage, as Protocols:
the PostgreSQL adapters in `cairn_retrieval.postgres` are one implementation,
and a use case names only the port it reads or writes through.

The ports carry no decisions: an adapter answers what is stored (a version, a
document, counts), and the use case decides what that means for the caller
(an absent document and a forbidden one become the same denial in `domain`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from cairn_libs.acl import AclPredicate
from cairn_retrieval import bm25 as okapi
from cairn_retrieval.domain import (
    ChunkRecord,
    PreparedDocument,
    Published,
    SourceCounts,
    StoredDocument,
    StoredVector,
    StoredVersion,
)


class SearchReads(Protocol):
    """The keyword half of a search and the join of every candidate back to the
    ready chunks the predicate admits."""

    async def bm25(
        self, predicate: AclPredicate, terms: Sequence[str], *, limit: int
    ) -> tuple[list[tuple[str, float]], okapi.SearchTrace]: ...

    async def visible_chunks(
        self,
        predicate: AclPredicate,
        chunk_ids: Sequence[str],
        *,
        query_vector: Sequence[float] | None,
        model_id: str,
    ) -> tuple[dict[str, ChunkRecord], dict[str, float]]: ...


class DocumentSession(Protocol):
    """One document's writes while its lock is held."""

    @property
    def org_id(self) -> str: ...

    @property
    def document_id(self) -> str: ...

    async def current(self) -> StoredVersion: ...

    async def discard_pending(self) -> None: ...

    async def write_pending(
        self, prepared: PreparedDocument, *, vectors: Sequence[Sequence[float]] | None
    ) -> None: ...

    async def publish(
        self, prepared: PreparedDocument, *, embedding_model: str, vector_store: str
    ) -> Published: ...

    async def ready_chunks(self) -> list[tuple[str, str]]: ...

    async def record_vectors(
        self,
        chunk_ids: Sequence[str],
        vectors: Sequence[Sequence[float]],
        *,
        embedding_model: str,
        vector_store: str,
    ) -> None: ...

    async def delete(self) -> int: ...


class DocumentWrites(Protocol):
    def document_session(
        self, org_id: str, document_id: str
    ) -> AbstractAsyncContextManager[DocumentSession]:
        """The document's lock, held until the session ends."""
        ...


class DocumentReads(Protocol):
    async def document(self, org_id: str, document_id: str) -> StoredDocument | None: ...

    async def index_versions(self) -> list[tuple[str, str, str, str, str]]:
        """(org, document id, source, analyzer, chunking) of every document."""
        ...


class VectorLedger(Protocol):
    """PostgreSQL's record of the vector collections: the model each holds, the
    store id written to at a location, and the vectors written there."""

    async def claim_collection(
        self, collection: str, *, model_id: str, dimensions: int
    ) -> tuple[str, int]: ...

    async def recorded_store(self, location: str) -> str | None: ...

    async def record_store(self, location: str, store_id: str) -> None: ...

    async def expected_points(self, location: str, *, model_id: str) -> int: ...

    async def stored_vectors(
        self, location: str, *, model_id: str, after_chunk_no: int, limit: int
    ) -> list[StoredVector]: ...

    async def move_documents(self, location: str, *, identity: str) -> int: ...


class CorpusCounts(Protocol):
    async def counts_by_source(self, org_id: str, *, model_id: str) -> list[SourceCounts]: ...
