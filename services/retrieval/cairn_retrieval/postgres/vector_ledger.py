"""What PostgreSQL records about the vector collections: the model each holds,
the store id it last wrote to at a location, and the vectors it wrote there
(what a rebuilt collection is made of)."""

from __future__ import annotations

import json

from cairn_libs.db import Database
from cairn_retrieval.domain import StoredVector
from cairn_retrieval.postgres.connection import translated


class PostgresVectorLedger:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def claim_collection(
        self, collection: str, *, model_id: str, dimensions: int
    ) -> tuple[str, int]:
        """Record `model_id` as the model `collection` holds unless one is recorded;
        the recorded (model id, dimensions)."""
        with translated():
            await self._db.pool.execute(
                "INSERT INTO vector_collections (collection, model_id, dimensions) "
                "VALUES ($1, $2, $3) ON CONFLICT (collection) DO NOTHING",
                collection,
                model_id,
                dimensions,
            )
            row = await self._db.pool.fetchrow(
                "SELECT model_id, dimensions FROM vector_collections WHERE collection = $1",
                collection,
            )
        assert row is not None
        return str(row["model_id"]), int(row["dimensions"])

    async def recorded_store(self, location: str) -> str | None:
        """The store id PostgreSQL last wrote vectors to at `location`, if any."""
        with translated():
            found = await self._db.pool.fetchval(
                "SELECT store_id FROM vector_stores WHERE location = $1", location
            )
        return str(found) if found is not None else None

    async def record_store(self, location: str, store_id: str) -> None:
        with translated():
            await self._db.pool.execute(
                "INSERT INTO vector_stores (location, store_id) VALUES ($1, $2) "
                "ON CONFLICT (location) DO UPDATE SET store_id = EXCLUDED.store_id, "
                "recorded_at = now()",
                location,
                store_id,
            )

    async def expected_points(self, location: str, *, model_id: str) -> int:
        """Ready chunks with a vector of `model_id` that PostgreSQL wrote to a
        store at `location` (any store id made there)."""
        with translated():
            count = await self._db.pool.fetchval(
                "SELECT count(*) FROM chunks c JOIN documents d "
                "ON d.org_id = c.org_id AND d.document_id = c.document_id "
                "WHERE c.state = 'ready' AND c.embedded AND c.embedding_model = $2 "
                "AND (d.vector_store = $1 OR starts_with(d.vector_store, $1 || ' '))",
                location,
                model_id,
            )
        return int(count)

    async def stored_vectors(
        self, location: str, *, model_id: str, after_chunk_no: int, limit: int
    ) -> list[StoredVector]:
        """Ready chunks holding a vector of `model_id` that PostgreSQL wrote to a
        store at `location`, in chunk_no order from `after_chunk_no` (exclusive):
        what the rebuilt collection there is made of."""
        with translated():
            rows = await self._db.pool.fetch(
                "SELECT c.chunk_no, c.org_id, c.chunk_id, c.document_id, c.source, c.acl, "
                "c.embedding::text AS embedding FROM chunks c JOIN documents d "
                "ON d.org_id = c.org_id AND d.document_id = c.document_id "
                "WHERE c.state = 'ready' AND c.embedded AND c.embedding_model = $2 "
                "AND (d.vector_store = $1 OR starts_with(d.vector_store, $1 || ' ')) "
                "AND c.chunk_no > $3 ORDER BY c.chunk_no LIMIT $4",
                location,
                model_id,
                after_chunk_no,
                limit,
            )
        return [
            StoredVector(
                chunk_no=int(r["chunk_no"]),
                org_id=r["org_id"],
                chunk_id=r["chunk_id"],
                document_id=r["document_id"],
                source=r["source"],
                acl=tuple(r["acl"]),
                vector=json.loads(r["embedding"]),
            )
            for r in rows
        ]

    async def move_documents(self, location: str, *, identity: str) -> int:
        """Record that the documents whose vectors were written at `location` now
        have them in the store `identity`; the number of documents."""
        with translated():
            status = await self._db.pool.execute(
                "UPDATE documents SET vector_store = $2 "
                "WHERE vector_store = $1 OR starts_with(vector_store, $1 || ' ')",
                location,
                identity,
            )
        return int(status.split()[-1])
