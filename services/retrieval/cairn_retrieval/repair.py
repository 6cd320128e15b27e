"""Is the vector collection the one PostgreSQL wrote its vectors to, and how to
rebuild it, or remake stale documents, from what PostgreSQL already holds.

Every collection carries an id made with it (Qdrant collection metadata; the
Edge shard's id file), and PostgreSQL records the id of the store it wrote to at
each location (`vector_stores`). A server collection lost with its volume and
made again on start-up, an Edge shard deleted and made again, or another
collection put in its place all show as a different id (or none): dense search
then stops, each answer keyword-only with the reason, until
`python -m cairn_retrieval reindex vectors` (cairn_retrieval.reindex) rebuilds
the collection. Searching
it anyway would pass off a partial dense list as a whole one.

The rebuild reads each ready chunk's vector from `chunks.embedding` (the column
dense scores are already recomputed from) and upserts it with its payload: no
text is embedded again. Collections made before ids were recorded are adopted
when they hold at least as many points as PostgreSQL wrote there.

`reindex documents` remakes every document whose terms or chunks were made by
another analyzer or chunking than the service now uses (documents.analyzer,
documents.chunking), from the text the document table keeps: re-chunked,
re-stemmed, and embedded again (new chunks need new vectors). It is the upgrade
path for indexes stored before stemming, titles and token-counted chunks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import structlog

from cairn_retrieval.domain import IncomingDocument, Outcome, acl_from_keys
from cairn_retrieval.errors import VectorStoreUnavailable
from cairn_retrieval.ingest import Ingestor
from cairn_retrieval.ports import DocumentReads, VectorLedger
from cairn_retrieval.vectors import VectorPoint, VectorStore

log = structlog.get_logger(__name__)

REBUILD_BATCH = 512


class VectorStoreHealth:
    """Whether dense search may use the collection; checked by the readiness loop
    and cached between checks, so a search costs no query for it."""

    def __init__(self, *, ledger: VectorLedger, vectors: VectorStore, model_id: str) -> None:
        self._ledger = ledger
        self._vectors = vectors
        self._model_id = model_id
        self._problem: str | None = None
        self._checked = False

    async def problem(self) -> str | None:
        """Why the collection needs repair, or None."""
        if not self._checked:
            await self.check()
        return self._problem

    async def check(self) -> str | None:
        """Compare the collection's id with the one PostgreSQL recorded. An
        unreachable store is not judged (search already says it is unreachable)."""
        if not self._model_id:
            self._checked = True
            return None
        location = self._vectors.location()
        try:
            actual = await self._vectors.store_id()
            recorded = await self._ledger.recorded_store(location)
            problem = None
            if recorded is None:
                problem = await self._adopt(location, actual)
            elif recorded != actual:
                problem = (
                    f"the vector collection {location!r} has store id {actual!r}, but "
                    f"PostgreSQL wrote its vectors to store {recorded!r}: it was wiped and "
                    "made again, or replaced"
                )
        except VectorStoreUnavailable:
            return self._problem
        if problem != self._problem:
            if problem is None:
                log.info("retrieval.vector_store_repaired", location=location)
            else:
                log.warning("retrieval.vector_store_needs_repair", detail=problem)
        self._problem, self._checked = problem, True
        return problem

    async def _adopt(self, location: str, actual: str) -> str | None:
        expected = await self._ledger.expected_points(location, model_id=self._model_id)
        held = await self._vectors.count()
        if not actual:
            if held == 0 and expected == 0:
                return None
            return (
                f"the vector collection {location!r} carries no cairn store id and holds "
                f"{held} points (PostgreSQL wrote {expected} there): it was not made by "
                "this cairn, or by one too old to tell"
            )
        if held < expected:
            return (
                f"the vector collection {location!r} holds {held} points where PostgreSQL "
                f"wrote {expected}: it lost points"
            )
        await self._ledger.record_store(location, actual)
        return None


@dataclass(frozen=True, slots=True)
class Rebuilt:
    points: int
    documents: int
    store_id: str


async def rebuild_vectors(
    ledger: VectorLedger, vectors: VectorStore, *, model_id: str, dimensions: int
) -> Rebuilt:
    """Drop and remake the collection, then fill it with PostgreSQL's vectors of
    `model_id` that were written to this location (a deployment that points at
    another location ingests into it, or rebuilds that one). A rebuild cut short leaves an id PostgreSQL has not recorded, so
    the collection still reads as needing repair until a rebuild completes."""
    await vectors.recreate()
    store_id = await vectors.store_id()
    points = 0
    after = 0
    while True:
        batch = await ledger.stored_vectors(
            vectors.location(), model_id=model_id, after_chunk_no=after, limit=REBUILD_BATCH
        )
        if not batch:
            break
        by_org: dict[str, list[VectorPoint]] = {}
        for stored in batch:
            by_org.setdefault(stored.org_id, []).append(
                VectorPoint(
                    chunk_id=stored.chunk_id,
                    document_id=stored.document_id,
                    source=stored.source,
                    acl=stored.acl,
                    vector=stored.vector,
                )
            )
        for org_id, org_points in by_org.items():
            await vectors.upsert(org_id, org_points)
        points += len(batch)
        after = batch[-1].chunk_no
    documents = await ledger.move_documents(vectors.location(), identity=vectors.identity())
    await ledger.claim_collection(vectors.identity(), model_id=model_id, dimensions=dimensions)
    await ledger.record_store(vectors.location(), store_id)
    return Rebuilt(points=points, documents=documents, store_id=store_id)


async def remake_stale_documents(ingestor: Ingestor, reads: DocumentReads) -> dict[str, int]:
    """Ingest again, from its stored text, each document made by another analyzer
    or chunking; the outcomes counted."""
    counts: dict[str, int] = {}
    for org_id, document_id in await ingestor.stale_documents():
        stored = await reads.document(org_id, document_id)
        if stored is None:
            continue
        result = await ingestor.ingest_one(
            org_id,
            IncomingDocument(
                document_id=stored.document_id,
                source=stored.source,
                title=stored.title,
                text=stored.text,
                acl=acl_from_keys(stored.acl_keys),
                metadata=stored.metadata,
            ),
        )
        if result.outcome is Outcome.FAILED:
            print(f"  {document_id}: {result.error}", file=sys.stderr)
        counts[result.outcome.value] = counts.get(result.outcome.value, 0) + 1
    return counts
