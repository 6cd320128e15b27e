"""Retrieval's embedded vector store: Qdrant Edge, Qdrant's own search engine
running inside this process (pip `qdrant-edge-py`), one shard per collection
folder. It is the default when no QDRANT_URL is set, because qdrant-client's
local mode checks a filter point by point in Python (about 1.6 s per search at
100k chunks) while Edge evaluates it in Rust against payload indexes.

Searches are exact, and the shard is built without an HNSW graph (m = 0).
That is a decision about I2, not about speed: an approximate graph is shared by
every org's points, so writing a document a caller cannot see could change which
visible neighbours a walk of the graph finds. An exact filtered scan scores each
visible point by itself, so the candidates are a function of the visible set.

The ACL predicate is asked as one condition on reach keys (cairn_libs.acl): an
exact scan with org, source and ACL as three conditions took 21 ms at 100k
points and 50% visible, against 9 ms for the one indexed condition.

The shard folder holds a store id made when the shard is created, and the store's
identity carries it: a shard deleted and made again is another store, so
documents whose points were in the old one are written again on re-ingest
instead of reading as unchanged (see documents.vector_store).

The engine's calls release the GIL, so each runs in a worker thread and the event
loop stays free. Writes accumulate in an appendable segment; after
OPTIMIZE_AFTER writes the shard is optimized (segments merged and made
read-only, deleted points vacuumed), which takes about a second at 100k points
without a graph, and halves the scan time against an appendable segment.
Any failure of the engine becomes VectorStoreUnavailable, as for the client.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import qdrant_edge as qe
from qdrant_client.http import models as qm

from cairn_libs.acl import (
    ORG_FIELD,
    REACH_FIELD,
    AclPredicate,
    document_reach,
)
from cairn_retrieval.domain import point_id
from cairn_retrieval.errors import VectorStoreUnavailable
from cairn_retrieval.vectors import (
    CHUNK_FIELD,
    DOCUMENT_FIELD,
    UPSERT_BATCH,
    VectorPoint,
    chunk_hits,
    point_payload,
    store_failed,
)

OPTIMIZE_AFTER = 5_000
INDEXED_FIELDS = (REACH_FIELD, ORG_FIELD, DOCUMENT_FIELD)
STORE_ID_FILE = "cairn-store-id"
# Two segments after an optimize, so an exact scan runs on both cores.
SEGMENTS = 2


def edge_filter(query_filter: qm.Filter) -> qe.Filter:
    """The same filter in Edge's classes. AclPredicate stays the one definition of
    what a caller may see; this only changes its spelling, and refuses any
    condition it does not know rather than dropping it."""

    def conditions(items: Any) -> list[qe.FieldCondition] | None:
        if items is None:
            return None
        converted = []
        for item in items if isinstance(items, list) else [items]:
            if not isinstance(item, qm.FieldCondition) or item.match is None:
                raise TypeError(f"edge_filter cannot translate {item!r}")
            match: qe.MatchValue | qe.MatchAny
            if isinstance(item.match, qm.MatchValue):
                match = qe.MatchValue(item.match.value)
            elif isinstance(item.match, qm.MatchAny):
                match = qe.MatchAny(list(item.match.any))  # type: ignore[arg-type]
            else:
                raise TypeError(f"edge_filter cannot translate {item.match!r}")
            converted.append(qe.FieldCondition(item.key, match=match))
        return converted

    if query_filter.min_should is not None:
        raise TypeError("edge_filter cannot translate min_should")
    return qe.Filter(
        must=conditions(query_filter.must),  # type: ignore[arg-type]
        should=conditions(query_filter.should),  # type: ignore[arg-type]
        must_not=conditions(query_filter.must_not),  # type: ignore[arg-type]
    )


class EdgeVectorStore:
    """One Qdrant Edge shard in `path / collection`. One process at a time may
    hold it open (its write-ahead log is locked), as with local mode's folder."""

    def __init__(self, *, path: str, collection: str, dimensions: int) -> None:
        self.collection = collection
        self.dimensions = dimensions
        self._folder = Path(path) / collection
        self._shard: qe.EdgeShard | None = None
        self._writes_since_optimize = 0
        self._optimizing = asyncio.Lock()
        self._opening = threading.Lock()
        self._id: str | None = None

    def describe(self) -> str:
        return f"edge={self._folder.parent}"

    def identity(self) -> str:
        return f"{self.location()} {self._store_id()}"

    def location(self) -> str:
        return f"{self.describe()} {self.collection}"

    async def store_id(self) -> str:
        await self.ensure_collection()
        return self._store_id()

    async def count(self) -> int:
        info = await self._call("count", lambda: self._open().info())
        return int(info.points_count)

    async def recreate(self) -> None:
        """Remove the shard's folder and make a new shard (a new store id)."""
        await self.close()

        def work() -> None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._id = None
            self._open()

        await self._call("recreate", work)

    def _store_id(self) -> str:
        """The id of the shard in the folder, made with it (before its segments);
        read once, since every ingested document asks for the identity."""
        if self._id is None:
            marker = self._folder / STORE_ID_FILE
            if not marker.exists() and not (self._folder / "segments").exists():
                self._folder.mkdir(parents=True, exist_ok=True)
                marker.write_text(uuid.uuid4().hex)
            self._id = marker.read_text().strip() if marker.exists() else "no-store-id"
        return self._id

    def _config(self) -> qe.EdgeConfig:
        return qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=self.dimensions, distance=qe.Distance.Cosine),
            hnsw_config=qe.HnswIndexConfig(m=0, ef_construct=100, full_scan_threshold=10_000),
            optimizers=qe.EdgeOptimizersConfig(default_segment_number=SEGMENTS),
        )

    def _open(self) -> qe.EdgeShard:
        if self._shard is not None:
            return self._shard
        with self._opening:
            if self._shard is None:
                self._shard = self._load_or_create()
            return self._shard

    def _load_or_create(self) -> qe.EdgeShard:
        if (self._folder / "segments").exists():
            try:
                # Given our config, load checks it against the segments on disk.
                shard = qe.EdgeShard.load(str(self._folder), self._config())
            except Exception as exc:
                if "incompatible" not in str(exc).lower():
                    raise
                raise VectorStoreUnavailable(
                    f"the shard {str(self._folder)!r} was made for other vectors than the "
                    f"embedder's {self.dimensions} dimensions ({str(exc)[:160]}); point "
                    "CAIRN_QDRANT_COLLECTION at another collection"
                ) from exc
            if REACH_FIELD not in shard.info().payload_schema:
                shard.close()
                raise VectorStoreUnavailable(
                    f"the shard {str(self._folder)!r} has no {REACH_FIELD!r} index, so it "
                    "was made by an earlier cairn; point CAIRN_QDRANT_COLLECTION at a new "
                    "collection and ingest again"
                )
        else:
            self._store_id()
            shard = qe.EdgeShard.create(str(self._folder), self._config())
            for field in INDEXED_FIELDS:
                shard.update(
                    qe.UpdateOperation.create_field_index(field, qe.PayloadSchemaType.Keyword)
                )
        return shard

    async def _call(self, operation: str, work: Any, *, log_failure: bool = True) -> Any:
        try:
            return await asyncio.to_thread(work)
        except VectorStoreUnavailable:
            raise
        except Exception as exc:
            raise store_failed(self.describe(), operation, exc, log_failure=log_failure) from exc

    async def probe(self) -> bool:
        try:
            await self._call("open", self._open, log_failure=False)
        except VectorStoreUnavailable:
            return False
        return True

    async def ensure_collection(self) -> None:
        await self._call("open", self._open)

    async def upsert(self, org_id: str, points: Sequence[VectorPoint]) -> None:
        structs = [
            qe.Point(
                point_id(org_id, p.chunk_id),
                [float(x) for x in p.vector],
                {REACH_FIELD: document_reach(org_id, p.source, p.acl), **point_payload(org_id, p)},
            )
            for p in points
        ]

        def work() -> None:
            shard = self._open()
            for start in range(0, len(structs), UPSERT_BATCH):
                shard.update(
                    qe.UpdateOperation.upsert_points(structs[start : start + UPSERT_BATCH])
                )

        await self._call("upsert", work)
        await self._wrote(len(structs))

    async def search(
        self, vector: Sequence[float], predicate: AclPredicate, *, limit: int
    ) -> list[tuple[str, float]]:
        request = qe.QueryRequest(
            limit=limit,
            query=qe.Query.Nearest([float(x) for x in vector]),
            filter=edge_filter(predicate.to_qdrant_reach_filter()),
            with_payload=[CHUNK_FIELD],
            params=qe.SearchParams(exact=True),
        )
        points = await self._call("search", lambda: self._open().query(request))
        return chunk_hits(points)

    async def delete_chunks(self, org_id: str, chunk_ids: Sequence[str]) -> None:
        if not chunk_ids:
            return
        ids: list[qe.PointId] = [point_id(org_id, c) for c in chunk_ids]
        await self._call(
            "delete_chunks", lambda: self._open().update(qe.UpdateOperation.delete_points(ids))
        )
        await self._wrote(len(ids))

    async def delete_document(self, org_id: str, document_id: str) -> None:
        selector = qe.Filter(
            must=[
                qe.FieldCondition(ORG_FIELD, match=qe.MatchValue(org_id)),
                qe.FieldCondition(DOCUMENT_FIELD, match=qe.MatchValue(document_id)),
            ]
        )
        await self._call(
            "delete_document",
            lambda: self._open().update(qe.UpdateOperation.delete_points_by_filter(selector)),
        )
        await self._wrote(1)

    async def optimize(self) -> None:
        """Merge and vacuum segments now; the bench calls it after a bulk load."""
        async with self._optimizing:
            self._writes_since_optimize = 0
            await self._call("optimize", lambda: self._open().optimize())

    async def _wrote(self, count: int) -> None:
        self._writes_since_optimize += count
        if self._writes_since_optimize >= OPTIMIZE_AFTER and not self._optimizing.locked():
            await self.optimize()

    async def close(self) -> None:
        shard, self._shard = self._shard, None
        if shard is not None:
            await asyncio.to_thread(shard.close)
