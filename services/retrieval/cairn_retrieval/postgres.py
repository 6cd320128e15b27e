"""Retrieval's PostgreSQL: documents, chunks and postings, and true Okapi BM25
computed in one statement over the caller's visible set.

BM25 statistics (N, average chunk length, document frequencies) are counted at
query time from the chunks the caller's ACL predicate admits, not kept as
global counters: a global df or N would let a forbidden document move a
caller's scores (DESIGN I2), and per-caller counters cannot be maintained for
every combination of org, sources and ACL keys.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import asyncpg

from cairn_libs.acl import AclPredicate
from cairn_libs.db import Database, vector_literal
from cairn_retrieval.domain import (
    BM25_B,
    BM25_K1,
    ChunkRecord,
    PreparedDocument,
    SourceCounts,
)
from cairn_retrieval.errors import DatabaseUnavailable

_CONNECTION_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.ConnectionFailureError,
    asyncpg.AdminShutdownError,
)


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except _CONNECTION_ERRORS as exc:
        raise DatabaseUnavailable(
            f"the retrieval database did not answer ({type(exc).__name__}); retry shortly"
        ) from exc


@dataclass(frozen=True, slots=True)
class StoredVersion:
    """What PostgreSQL holds for one document id right now."""

    content_hash: str | None
    ready_chunks: int
    embedded_chunks: int
    pending_chunk_ids: tuple[str, ...]

    @property
    def exists(self) -> bool:
        return (
            self.content_hash is not None or self.ready_chunks > 0 or bool(self.pending_chunk_ids)
        )


@dataclass(frozen=True, slots=True)
class Published:
    """What a publish replaced: the chunk ids whose vectors are now obsolete."""

    removed_chunks: int
    removed_embedded_chunk_ids: tuple[str, ...]


class DocumentSession:
    """One document's writes, on one connection holding that document's lock, so
    two concurrent ingests or deletes of the same id cannot interleave."""

    def __init__(self, conn: asyncpg.Connection, org_id: str, document_id: str) -> None:
        self._conn = conn
        self.org_id = org_id
        self.document_id = document_id

    async def current(self) -> StoredVersion:
        with _translated():
            content_hash = await self._conn.fetchval(
                "SELECT content_hash FROM documents WHERE org_id = $1 AND document_id = $2",
                self.org_id,
                self.document_id,
            )
            row = await self._conn.fetchrow(
                "SELECT count(*) FILTER (WHERE state = 'ready') AS ready, "
                "count(*) FILTER (WHERE state = 'ready' AND embedded) AS embedded, "
                "coalesce(array_agg(chunk_id) FILTER (WHERE state = 'pending'), '{}') AS pending "
                "FROM chunks WHERE org_id = $1 AND document_id = $2",
                self.org_id,
                self.document_id,
            )
        assert row is not None
        return StoredVersion(
            content_hash=content_hash,
            ready_chunks=int(row["ready"]),
            embedded_chunks=int(row["embedded"]),
            pending_chunk_ids=tuple(row["pending"]),
        )

    async def discard_pending(self) -> None:
        """Drop chunks a failed or interrupted write left behind (never served)."""
        with _translated():
            await self._conn.execute(
                "DELETE FROM chunks WHERE org_id = $1 AND document_id = $2 AND state = 'pending'",
                self.org_id,
                self.document_id,
            )

    async def write_pending(
        self, prepared: PreparedDocument, *, vectors: Sequence[Sequence[float]] | None
    ) -> None:
        """The new version's chunks and postings, invisible to search until published."""
        doc = prepared.document
        chunks = prepared.chunks
        embeddings = (
            [vector_literal(v) for v in vectors] if vectors is not None else [None] * len(chunks)
        )
        postings = [
            (c.chunk_id, term, tf) for c in chunks for term, tf in c.term_frequencies.items()
        ]
        with _translated():
            async with self._conn.transaction():
                await self._conn.execute(
                    "INSERT INTO chunks (org_id, chunk_id, document_id, source, acl, title, text, "
                    "ordinal, char_start, char_end, length, state, embedded, embedding) "
                    "SELECT $1, u.chunk_id, $2, $3, $4::text[], $5, u.text, u.ordinal, "
                    "u.char_start, u.char_end, u.length, 'pending', false, u.embedding::vector "
                    "FROM unnest($6::text[], $7::text[], $8::int[], $9::int[], $10::int[], "
                    "$11::int[], $12::text[]) "
                    "AS u(chunk_id, text, ordinal, char_start, char_end, length, embedding)",
                    prepared.org_id,
                    doc.document_id,
                    doc.source,
                    list(prepared.acl_keys),
                    doc.title,
                    [c.chunk_id for c in chunks],
                    [c.text for c in chunks],
                    [c.ordinal for c in chunks],
                    [c.char_start for c in chunks],
                    [c.char_end for c in chunks],
                    [c.length for c in chunks],
                    embeddings,
                )
                await self._conn.execute(
                    "INSERT INTO postings (org_id, chunk_id, term, tf) "
                    "SELECT $1, u.chunk_id, u.term, u.tf "
                    "FROM unnest($2::text[], $3::text[], $4::int[]) AS u(chunk_id, term, tf)",
                    prepared.org_id,
                    [p[0] for p in postings],
                    [p[1] for p in postings],
                    [p[2] for p in postings],
                )

    async def publish(self, prepared: PreparedDocument, *, embedded: bool) -> Published:
        """Swap versions in one transaction: the old chunks go, the new become ready."""
        doc = prepared.document
        with _translated():
            async with self._conn.transaction():
                removed = await self._conn.fetch(
                    "DELETE FROM chunks WHERE org_id = $1 AND document_id = $2 AND state = 'ready' "
                    "RETURNING chunk_id, embedded",
                    prepared.org_id,
                    doc.document_id,
                )
                await self._conn.execute(
                    "UPDATE chunks SET state = 'ready', embedded = $3 "
                    "WHERE org_id = $1 AND chunk_id = ANY($2::text[])",
                    prepared.org_id,
                    [c.chunk_id for c in prepared.chunks],
                    embedded,
                )
                await self._conn.execute(
                    "INSERT INTO documents (org_id, document_id, source, title, content_hash, acl, "
                    "metadata, chunk_count) VALUES ($1, $2, $3, $4, $5, $6::text[], $7::jsonb, $8) "
                    "ON CONFLICT (org_id, document_id) DO UPDATE SET source = EXCLUDED.source, "
                    "title = EXCLUDED.title, content_hash = EXCLUDED.content_hash, "
                    "acl = EXCLUDED.acl, metadata = EXCLUDED.metadata, "
                    "chunk_count = EXCLUDED.chunk_count, updated_at = now()",
                    prepared.org_id,
                    doc.document_id,
                    doc.source,
                    doc.title,
                    prepared.content_hash,
                    list(prepared.acl_keys),
                    json.dumps(dict(doc.metadata), default=str),
                    len(prepared.chunks),
                )
        return Published(
            removed_chunks=len(removed),
            removed_embedded_chunk_ids=tuple(r["chunk_id"] for r in removed if r["embedded"]),
        )

    async def delete(self) -> int:
        """Remove the document, its chunks and postings; the number of ready chunks removed."""
        with _translated():
            async with self._conn.transaction():
                removed = await self._conn.fetch(
                    "DELETE FROM chunks WHERE org_id = $1 AND document_id = $2 RETURNING state",
                    self.org_id,
                    self.document_id,
                )
                await self._conn.execute(
                    "DELETE FROM documents WHERE org_id = $1 AND document_id = $2",
                    self.org_id,
                    self.document_id,
                )
        return sum(1 for r in removed if r["state"] == "ready")


class ChunkStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    @asynccontextmanager
    async def document_session(
        self, org_id: str, document_id: str
    ) -> AsyncIterator[DocumentSession]:
        lock_key = f"retrieval\x1f{org_id}\x1f{document_id}"
        pool = self._db.pool
        with _translated():
            conn = await pool.acquire()
            try:
                await conn.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", lock_key)
            except BaseException:
                await pool.release(conn)
                raise
        try:
            yield DocumentSession(conn, org_id, document_id)
        finally:
            try:
                await conn.execute("SELECT pg_advisory_unlock(hashtextextended($1, 0))", lock_key)
            except _CONNECTION_ERRORS:
                # A closed session releases its advisory locks with it.
                conn.terminate()
            await pool.release(conn)

    async def bm25(
        self, predicate: AclPredicate, terms: Sequence[str], *, limit: int
    ) -> list[tuple[str, float]]:
        """Top `limit` visible chunks by Okapi BM25, best first, ties by chunk id.

        idf = ln(1 + (N - df + 0.5) / (df + 0.5)), with N, avgdl and df counted
        over the chunks `predicate` admits that are ready; nothing else is read.
        Per-term contributions are summed in term order, so a chunk's score is the
        same float whatever plan or row order PostgreSQL picks (I2 asks for
        identical scores, not merely close ones).
        """
        if not terms:
            return []
        clause, params = predicate.to_sql(alias="c", first_param=1)
        n = len(params)
        sql = f"""
            WITH visible AS (
                SELECT c.chunk_id, c.length FROM chunks c
                WHERE {clause} AND c.state = 'ready'
            ),
            corpus AS (
                SELECT count(*)::float8 AS n, avg(length)::float8 AS avgdl FROM visible
            ),
            hits AS (
                SELECT p.term, p.chunk_id, p.tf::float8 AS tf, v.length::float8 AS dl
                FROM postings p JOIN visible v ON v.chunk_id = p.chunk_id
                WHERE p.org_id = ${n + 1} AND p.term = ANY(${n + 2}::text[])
            ),
            df AS (
                SELECT term, count(*)::float8 AS df FROM hits GROUP BY term
            )
            SELECT h.chunk_id,
                   sum(ln(1 + (s.n - d.df + 0.5) / (d.df + 0.5))
                       * h.tf * (${n + 3}::float8 + 1)
                       / (h.tf + ${n + 3}::float8
                          * (1 - ${n + 4}::float8 + ${n + 4}::float8 * h.dl / NULLIF(s.avgdl, 0)))
                       ORDER BY h.term COLLATE "C")
                   AS score
            FROM hits h JOIN df d ON d.term = h.term CROSS JOIN corpus s
            GROUP BY h.chunk_id
            ORDER BY score DESC, h.chunk_id COLLATE "C"
            LIMIT ${n + 5}
        """
        with _translated():
            rows = await self._db.pool.fetch(
                sql, *params, predicate.org_id, list(terms), BM25_K1, BM25_B, limit
            )
        return [(r["chunk_id"], float(r["score"])) for r in rows]

    async def visible_chunks(
        self,
        predicate: AclPredicate,
        chunk_ids: Sequence[str],
        *,
        query_vector: Sequence[float] | None,
    ) -> tuple[dict[str, ChunkRecord], dict[str, float]]:
        """The named chunks the predicate admits and that are ready (others are
        absent), and the cosine similarity of each embedded one to `query_vector`."""
        if not chunk_ids:
            return {}, {}
        clause, params = predicate.to_sql(alias="c", first_param=1)
        n = len(params)
        with _translated():
            rows = await self._db.pool.fetch(
                "SELECT c.chunk_id, c.document_id, c.source, c.title, c.char_start, c.char_end, "
                f"c.text, 1 - (c.embedding <=> ${n + 2}::vector) AS dense_score "
                f"FROM chunks c WHERE {clause} AND c.state = 'ready' "
                f"AND c.chunk_id = ANY(${n + 1}::text[])",
                *params,
                list(chunk_ids),
                vector_literal(query_vector) if query_vector is not None else None,
            )
        records = {
            r["chunk_id"]: ChunkRecord(
                chunk_id=r["chunk_id"],
                document_id=r["document_id"],
                source=r["source"],
                title=r["title"],
                char_start=r["char_start"],
                char_end=r["char_end"],
                text=r["text"],
            )
            for r in rows
        }
        dense_scores = {
            r["chunk_id"]: float(r["dense_score"]) for r in rows if r["dense_score"] is not None
        }
        return records, dense_scores

    async def counts_by_source(self, org_id: str) -> list[SourceCounts]:
        with _translated():
            documents = await self._db.pool.fetch(
                "SELECT source, count(*) AS n FROM documents WHERE org_id = $1 GROUP BY source",
                org_id,
            )
            chunks = await self._db.pool.fetch(
                "SELECT source, count(*) AS n, count(*) FILTER (WHERE embedded) AS embedded "
                "FROM chunks WHERE org_id = $1 AND state = 'ready' GROUP BY source",
                org_id,
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
