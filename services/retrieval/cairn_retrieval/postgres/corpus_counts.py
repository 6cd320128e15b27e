"""The operator's "is it really ingested" counts: documents, chunks and
embedded chunks per source of one org."""

from __future__ import annotations

from cairn_libs.db import Database
from cairn_retrieval.domain import SourceCounts
from cairn_retrieval.postgres.connection import translated


class PostgresCorpusCounts:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def counts_by_source(self, org_id: str, *, model_id: str) -> list[SourceCounts]:
        """Embedded chunks are those with a vector from `model_id`, or from any
        model when it is '' (no embedder configured)."""
        with translated():
            documents = await self._db.pool.fetch(
                "SELECT source, count(*) AS n FROM documents WHERE org_id = $1 GROUP BY source",
                org_id,
            )
            chunks = await self._db.pool.fetch(
                "SELECT source, count(*) AS n, "
                "count(*) FILTER (WHERE embedded AND ($2 = '' OR embedding_model = $2)) "
                "AS embedded FROM chunks WHERE org_id = $1 AND state = 'ready' GROUP BY source",
                org_id,
                model_id,
            )
        per_source: dict[str, list[int]] = {}
        for r in documents:
            per_source.setdefault(r["source"], [0, 0, 0])[0] = int(r["n"])
        for r in chunks:
            entry = per_source.setdefault(r["source"], [0, 0, 0])
            entry[1] = int(r["n"])
            entry[2] = int(r["embedded"])
        return [
            SourceCounts(source=s, documents=v[0], chunks=v[1], embedded_chunks=v[2])
            for s, v in sorted(per_source.items())
        ]
