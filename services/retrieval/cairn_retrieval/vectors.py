"""Retrieval's vector store: one Qdrant collection of chunk vectors, searched with
the caller's ACL predicate as the query filter, so the filter narrows the
candidates during the search rather than trimming a top-k afterwards.

The VectorStore protocol, and its qdrant-client implementation: a Qdrant server
when QDRANT_URL is set, or local mode (`path=`, the same client API, exact
search) with CAIRN_QDRANT_ENGINE=local. The embedded default is the Qdrant Edge
store in edge_store.py. Any failure of a store is translated into
VectorStoreUnavailable, which search turns into keyword-only results with the
reason stated (I11).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from qdrant_client import AsyncQdrantClient
from qdrant_client.http import models as qm

from cairn_libs.acl import ACL_FIELD, ORG_FIELD, SOURCE_FIELD, AclPredicate
from cairn_retrieval.domain import point_id
from cairn_retrieval.errors import VectorStoreUnavailable

log = structlog.get_logger(__name__)

STORE_ID_KEY = "cairn_store_id"
DOCUMENT_FIELD = "document_id"
CHUNK_FIELD = "chunk_id"
UPSERT_BATCH = 256


@dataclass(frozen=True, slots=True)
class VectorPoint:
    chunk_id: str
    document_id: str
    source: str
    acl: tuple[str, ...]
    vector: Sequence[float]


class VectorStore(Protocol):
    def identity(self) -> str:
        """Where the collection lives and its name: one vector space."""
        ...

    def location(self) -> str:
        """Where the collection lives and its name, without the id of the store
        made there: a collection made again at a location is another store."""
        ...

    async def store_id(self) -> str:
        """The id made with the collection ('' for one made without: by an
        earlier cairn, or by something else)."""
        ...

    async def count(self) -> int:
        """Points in the collection, of every org."""
        ...

    async def recreate(self) -> None:
        """Drop the collection and make it again, empty, with a new store id."""
        ...

    async def ensure_collection(self) -> None: ...

    async def probe(self) -> bool: ...

    async def upsert(self, org_id: str, points: Sequence[VectorPoint]) -> None: ...

    async def search(
        self, vector: Sequence[float], predicate: AclPredicate, *, limit: int
    ) -> list[tuple[str, float]]: ...

    async def delete_chunks(self, org_id: str, chunk_ids: Sequence[str]) -> None: ...

    async def delete_document(self, org_id: str, document_id: str) -> None: ...

    async def close(self) -> None: ...


class QdrantVectorStore:
    """Exactly one of `path` (local mode), `location` (":memory:") or `url` (server)."""

    def __init__(
        self,
        *,
        collection: str,
        dimensions: int,
        path: str | None = None,
        location: str | None = None,
        url: str | None = None,
        api_key: str | None = None,
        timeout_seconds: int = 5,
        replication_factor: int | None = None,
        client: Callable[..., AsyncQdrantClient] = AsyncQdrantClient,
    ) -> None:
        """`client` makes the qdrant-client connection (keyword arguments as
        AsyncQdrantClient's); a test passes a recorder of what is asked of a server."""
        if sum(x is not None for x in (path, location, url)) != 1:
            raise ValueError("give exactly one of path, location or url")
        self.collection = collection
        self.dimensions = dimensions
        self._path = path
        self._location = location
        self._url = url
        self._api_key = api_key
        self._timeout = timeout_seconds
        # A Qdrant cluster keeps this many copies of each shard of the collection it
        # creates (None: the server's default); a collection that exists keeps its own.
        self._replication_factor = replication_factor
        self._new_client = client
        self._client: AsyncQdrantClient | None = None
        self._collection_ready = False
        self._store_id = ""

    @property
    def is_server(self) -> bool:
        return self._url is not None

    def describe(self) -> str:
        return f"url={self._url}" if self._url else f"path={self._path or self._location}"

    def identity(self) -> str:
        return f"{self.describe()} {self.collection}"

    def location(self) -> str:
        return self.identity()

    async def store_id(self) -> str:
        await self.ensure_collection()
        return self._store_id

    async def count(self) -> int:
        await self.ensure_collection()
        try:
            return int((await self._connect().count(self.collection, exact=True)).count)
        except Exception as exc:
            raise self._unavailable("count", exc) from exc

    async def recreate(self) -> None:
        try:
            await self._connect().delete_collection(self.collection)
        except Exception as exc:
            raise self._unavailable("recreate", exc) from exc
        self._collection_ready = False
        await self.ensure_collection()

    def _connect(self) -> AsyncQdrantClient:
        if self._client is None:
            if self._url is not None:
                self._client = self._new_client(
                    url=self._url, api_key=self._api_key, timeout=self._timeout
                )
            elif self._path is not None:
                self._client = self._new_client(path=self._path)
            else:
                self._client = self._new_client(location=self._location)
        return self._client

    async def probe(self) -> bool:
        """Whether the collection is usable now; for the readiness loop, so a store
        that stays down is logged once per change rather than once per check."""
        try:
            await self._ensure(log_failure=False)
        except VectorStoreUnavailable:
            return False
        return True

    async def ensure_collection(self) -> None:
        """Create the collection (cosine, `dimensions`) if it is missing."""
        await self._ensure(log_failure=True)

    async def _ensure(self, *, log_failure: bool) -> None:
        if self._collection_ready:
            return
        try:
            client = self._connect()
            if not await client.collection_exists(self.collection):
                await client.create_collection(
                    self.collection,
                    vectors_config=qm.VectorParams(
                        size=self.dimensions, distance=qm.Distance.COSINE
                    ),
                    replication_factor=self._replication_factor if self.is_server else None,
                    metadata={STORE_ID_KEY: uuid.uuid4().hex},
                )
                if self.is_server:
                    # Payload indexes matter to a server's filtered HNSW search;
                    # local mode is exact and ignores them.
                    for field in (ORG_FIELD, SOURCE_FIELD, ACL_FIELD, DOCUMENT_FIELD):
                        await client.create_payload_index(
                            self.collection, field, field_schema=qm.PayloadSchemaType.KEYWORD
                        )
            info = await client.get_collection(self.collection)
        except Exception as exc:
            raise self._unavailable("ensure_collection", exc, log_failure=log_failure) from exc
        vectors = info.config.params.vectors
        size = vectors.size if isinstance(vectors, qm.VectorParams) else None
        if size != self.dimensions:
            raise VectorStoreUnavailable(
                f"collection {self.collection!r} holds vectors of size {size!r}; the embedder "
                f"makes {self.dimensions}, so point CAIRN_QDRANT_COLLECTION at another collection"
            )
        marker = (info.config.metadata or {}).get(STORE_ID_KEY)
        self._store_id = marker if isinstance(marker, str) else ""
        self._collection_ready = True

    async def upsert(self, org_id: str, points: Sequence[VectorPoint]) -> None:
        await self.ensure_collection()
        client = self._connect()
        structs = [
            qm.PointStruct(
                id=point_id(org_id, p.chunk_id),
                vector=list(p.vector),
                payload=point_payload(org_id, p),
            )
            for p in points
        ]
        try:
            for start in range(0, len(structs), UPSERT_BATCH):
                await client.upsert(
                    self.collection, points=structs[start : start + UPSERT_BATCH], wait=True
                )
        except Exception as exc:
            raise self._unavailable("upsert", exc) from exc

    async def search(
        self, vector: Sequence[float], predicate: AclPredicate, *, limit: int
    ) -> list[tuple[str, float]]:
        await self.ensure_collection()
        client = self._connect()
        try:
            response = await client.query_points(
                self.collection,
                query=list(vector),
                query_filter=predicate.to_qdrant_filter(),
                # Exact on a server too: an HNSW walk over every org's points could
                # find other visible neighbours after an invisible write (I2).
                search_params=qm.SearchParams(exact=True),
                limit=limit,
                with_payload=[CHUNK_FIELD],
            )
        except Exception as exc:
            raise self._unavailable("search", exc) from exc
        return chunk_hits(response.points)

    async def delete_chunks(self, org_id: str, chunk_ids: Sequence[str]) -> None:
        if not chunk_ids:
            return
        await self.ensure_collection()
        client = self._connect()
        try:
            await client.delete(
                self.collection,
                points_selector=qm.PointIdsList(points=[point_id(org_id, c) for c in chunk_ids]),
                wait=True,
            )
        except Exception as exc:
            raise self._unavailable("delete_chunks", exc) from exc

    async def delete_document(self, org_id: str, document_id: str) -> None:
        await self.ensure_collection()
        client = self._connect()
        selector = qm.FilterSelector(
            filter=qm.Filter(
                must=[
                    qm.FieldCondition(key=ORG_FIELD, match=qm.MatchValue(value=org_id)),
                    qm.FieldCondition(key=DOCUMENT_FIELD, match=qm.MatchValue(value=document_id)),
                ]
            )
        )
        try:
            await client.delete(self.collection, points_selector=selector, wait=True)
        except Exception as exc:
            raise self._unavailable("delete_document", exc) from exc

    async def close(self) -> None:
        if self._client is not None:
            try:
                await self._client.close()
            finally:
                self._client = None
                self._collection_ready = False

    def _unavailable(
        self, operation: str, exc: Exception, *, log_failure: bool = True
    ) -> VectorStoreUnavailable:
        # A failed call may mean a server lost the collection; check again next time.
        self._collection_ready = False
        return store_failed(self.describe(), operation, exc, log_failure=log_failure)


class _Scored(Protocol):
    @property
    def payload(self) -> Mapping[str, Any] | None: ...

    @property
    def score(self) -> float: ...


def chunk_hits(points: Iterable[_Scored]) -> list[tuple[str, float]]:
    """(chunk id, score) of the scored points, in the engine's order."""
    hits: list[tuple[str, float]] = []
    for point in points:
        chunk_id = (point.payload or {}).get(CHUNK_FIELD)
        if isinstance(chunk_id, str):
            hits.append((chunk_id, float(point.score)))
    return hits


def point_payload(org_id: str, point: VectorPoint) -> dict[str, object]:
    """What every point carries: the ACL predicate's fields, and its chunk."""
    return {
        ORG_FIELD: org_id,
        SOURCE_FIELD: point.source,
        ACL_FIELD: list(point.acl),
        DOCUMENT_FIELD: point.document_id,
        CHUNK_FIELD: point.chunk_id,
    }


def store_failed(
    store: str, operation: str, exc: Exception, *, log_failure: bool = True
) -> VectorStoreUnavailable:
    """A vector store's failure, logged (once, by name and class, never data) and
    translated for search to degrade on."""
    if log_failure:
        log.warning(
            "vector_store.failed",
            operation=operation,
            store=store,
            error=type(exc).__name__,
            detail=str(exc)[:200],
        )
    return VectorStoreUnavailable(
        f"the vector store ({store}) failed on {operation}: {type(exc).__name__}"
    )
