"""A document's writes: the pending version, its publication, its vectors and
its deletion, each changing the BM25 statistics of its own audiences in the
transaction that changes the chunks they count; all on one connection holding
the document's lock, so two writers of the same id cannot interleave."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress

import asyncpg

from cairn_libs.db import Database, vector_literal
from cairn_retrieval.domain import PreparedDocument, Published, StoredVersion
from cairn_retrieval.postgres.connection import DATABASE_AWAY, translated


async def _apply_statistics(
    conn: asyncpg.Connection,
    org_id: str,
    audiences: Mapping[int, tuple[int, int]],
    terms: Mapping[tuple[str, int], int],
) -> None:
    """Add (chunks, total length) per audience and df per (term, audience).

    Audience rows are locked first, in id order, then term rows in (term,
    audience) order: two writers touch the same term rows only when they write
    to the same audience, and then the audience lock has already ordered them.
    """
    if not audiences:
        return
    ids = sorted(audiences)
    await conn.execute(
        "SELECT 1 FROM audiences WHERE audience_id = ANY($1::bigint[]) "
        "ORDER BY audience_id FOR UPDATE",
        ids,
    )
    await conn.execute(
        "UPDATE audiences a SET chunks = a.chunks + d.n, total_length = a.total_length + d.total "
        "FROM unnest($1::bigint[], $2::bigint[], $3::bigint[]) AS d(audience_id, n, total) "
        "WHERE a.audience_id = d.audience_id",
        ids,
        [audiences[i][0] for i in ids],
        [audiences[i][1] for i in ids],
    )
    keys = sorted((k for k, delta in terms.items() if delta), key=lambda k: (k[0].encode(), k[1]))
    if not keys:
        return
    await conn.execute(
        "INSERT INTO term_stats (org_id, term, audience_id, df) "
        "SELECT $1, d.term, d.audience_id, d.delta "
        "FROM unnest($2::text[], $3::bigint[], $4::bigint[]) WITH ORDINALITY "
        "AS d(term, audience_id, delta, position) ORDER BY d.position "
        "ON CONFLICT (org_id, term, audience_id) DO UPDATE SET df = term_stats.df + EXCLUDED.df",
        org_id,
        [k[0] for k in keys],
        [k[1] for k in keys],
        [terms[k] for k in keys],
    )
    if any(terms[k] < 0 for k in keys):
        await conn.execute(
            "DELETE FROM term_stats t USING unnest($2::text[], $3::bigint[]) AS d(term, audience_id) "
            "WHERE t.org_id = $1 AND t.term = d.term AND t.audience_id = d.audience_id "
            "AND t.df <= 0",
            org_id,
            [k[0] for k in keys if terms[k] < 0],
            [k[1] for k in keys if terms[k] < 0],
        )


async def _remove_ready(
    conn: asyncpg.Connection, org_id: str, removed: Sequence[asyncpg.Record]
) -> None:
    """Take removed ready chunks (chunk_no, audience_id, length) out of the
    postings and the statistics, in the caller's transaction."""
    ready = [r for r in removed if r["state"] == "ready"]
    if not ready:
        return
    postings = await conn.fetch(
        "DELETE FROM postings WHERE org_id = $1 AND chunk_no = ANY($2::bigint[]) "
        "RETURNING term, audience_id",
        org_id,
        [r["chunk_no"] for r in ready],
    )
    audiences: dict[int, tuple[int, int]] = {}
    for r in ready:
        n, total = audiences.get(r["audience_id"], (0, 0))
        audiences[r["audience_id"]] = (n - 1, total - r["length"])
    terms = Counter((p["term"], p["audience_id"]) for p in postings)
    await _apply_statistics(conn, org_id, audiences, {k: -v for k, v in terms.items()})


class PostgresDocumentSession:
    """One document's writes, on one connection holding that document's lock, so
    two concurrent ingests or deletes of the same id cannot interleave."""

    def __init__(self, conn: asyncpg.Connection, org_id: str, document_id: str) -> None:
        self._conn = conn
        self.org_id = org_id
        self.document_id = document_id

    async def current(self) -> StoredVersion:
        with translated():
            document = await self._conn.fetchrow(
                "SELECT content_hash, embedding_model, vector_store, analyzer, chunking "
                "FROM documents WHERE org_id = $1 AND document_id = $2",
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
            content_hash=document["content_hash"] if document is not None else None,
            embedding_model=document["embedding_model"] if document is not None else "",
            vector_store=document["vector_store"] if document is not None else "",
            analyzer=document["analyzer"] if document is not None else "",
            chunking=document["chunking"] if document is not None else "",
            ready_chunks=int(row["ready"]),
            embedded_chunks=int(row["embedded"]),
            pending_chunk_ids=tuple(row["pending"]),
        )

    async def discard_pending(self) -> None:
        """Drop chunks a failed or interrupted write left behind (never served;
        pending chunks have no postings and count in no statistic)."""
        with translated():
            await self._conn.execute(
                "DELETE FROM chunks WHERE org_id = $1 AND document_id = $2 AND state = 'pending'",
                self.org_id,
                self.document_id,
            )

    async def write_pending(
        self, prepared: PreparedDocument, *, vectors: Sequence[Sequence[float]] | None
    ) -> None:
        """The new version's chunks, invisible to search until published."""
        doc = prepared.document
        chunks = prepared.chunks
        embeddings = (
            [vector_literal(v) for v in vectors] if vectors is not None else [None] * len(chunks)
        )
        acl = list(prepared.acl_keys)
        with translated():
            async with self._conn.transaction():
                # DO NOTHING, then read: an update would lock the row and leave a
                # dead tuple behind on every ingest.
                await self._conn.execute(
                    "INSERT INTO audiences (org_id, source, acl) VALUES ($1, $2, $3::text[]) "
                    "ON CONFLICT (org_id, source, acl) DO NOTHING",
                    prepared.org_id,
                    doc.source,
                    acl,
                )
                audience_id = await self._conn.fetchval(
                    "SELECT audience_id FROM audiences "
                    "WHERE org_id = $1 AND source = $2 AND acl = $3::text[]",
                    prepared.org_id,
                    doc.source,
                    acl,
                )
                await self._conn.execute(
                    "INSERT INTO chunks (org_id, chunk_id, document_id, source, acl, audience_id, "
                    "title, text, ordinal, char_start, char_end, length, state, embedded, "
                    "embedding) "
                    "SELECT $1, u.chunk_id, $2, $3, $4::text[], $5, $6, u.text, u.ordinal, "
                    "u.char_start, u.char_end, u.length, 'pending', false, u.embedding::vector "
                    "FROM unnest($7::text[], $8::text[], $9::int[], $10::int[], $11::int[], "
                    "$12::int[], $13::text[]) "
                    "AS u(chunk_id, text, ordinal, char_start, char_end, length, embedding)",
                    prepared.org_id,
                    doc.document_id,
                    doc.source,
                    acl,
                    audience_id,
                    doc.title,
                    [c.chunk_id for c in chunks],
                    [c.text for c in chunks],
                    [c.ordinal for c in chunks],
                    [c.char_start for c in chunks],
                    [c.char_end for c in chunks],
                    [c.length for c in chunks],
                    embeddings,
                )

    async def publish(
        self, prepared: PreparedDocument, *, embedding_model: str, vector_store: str
    ) -> Published:
        """Swap versions in one transaction: the old chunks, their postings and
        their share of the statistics go; the new chunks become ready with
        theirs. `embedding_model` and `vector_store` are '' when the new chunks
        have no vectors."""
        doc = prepared.document
        org_id = prepared.org_id
        with translated():
            async with self._conn.transaction():
                removed = await self._conn.fetch(
                    "DELETE FROM chunks WHERE org_id = $1 AND document_id = $2 AND state = 'ready' "
                    "RETURNING chunk_id, chunk_no, audience_id, length, embedded, state",
                    org_id,
                    doc.document_id,
                )
                await _remove_ready(self._conn, org_id, removed)
                published = await self._conn.fetch(
                    "UPDATE chunks SET state = 'ready', embedded = $3, embedding_model = $4 "
                    "WHERE org_id = $1 AND chunk_id = ANY($2::text[]) "
                    "RETURNING chunk_id, chunk_no, audience_id, length",
                    org_id,
                    [c.chunk_id for c in prepared.chunks],
                    bool(embedding_model),
                    embedding_model,
                )
                numbers = {r["chunk_id"]: (r["chunk_no"], r["audience_id"]) for r in published}
                rows = [
                    (term, numbers[c.chunk_id][0], numbers[c.chunk_id][1], tf, c.length)
                    for c in prepared.chunks
                    for term, tf in c.term_frequencies.items()
                ]
                await self._conn.execute(
                    "INSERT INTO postings (org_id, term, chunk_no, audience_id, tf, length) "
                    "SELECT $1, u.term, u.chunk_no, u.audience_id, u.tf, u.length "
                    "FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::int[], $6::int[]) "
                    "AS u(term, chunk_no, audience_id, tf, length)",
                    org_id,
                    [r[0] for r in rows],
                    [r[1] for r in rows],
                    [r[2] for r in rows],
                    [r[3] for r in rows],
                    [r[4] for r in rows],
                )
                audiences: dict[int, tuple[int, int]] = {}
                for r in published:
                    n, total = audiences.get(r["audience_id"], (0, 0))
                    audiences[r["audience_id"]] = (n + 1, total + r["length"])
                term_deltas = Counter((r[0], r[2]) for r in rows)
                await _apply_statistics(self._conn, org_id, audiences, term_deltas)
                await self._conn.execute(
                    "INSERT INTO documents (org_id, document_id, source, title, content_hash, acl, "
                    "metadata, chunk_count, embedding_model, vector_store, text, analyzer, "
                    "chunking) "
                    "VALUES ($1, $2, $3, $4, $5, $6::text[], $7::jsonb, $8, $9, $10, $11, $12, $13) "
                    "ON CONFLICT (org_id, document_id) DO UPDATE SET source = EXCLUDED.source, "
                    "title = EXCLUDED.title, content_hash = EXCLUDED.content_hash, "
                    "text = EXCLUDED.text, analyzer = EXCLUDED.analyzer, "
                    "chunking = EXCLUDED.chunking, "
                    "acl = EXCLUDED.acl, metadata = EXCLUDED.metadata, "
                    "chunk_count = EXCLUDED.chunk_count, "
                    "embedding_model = EXCLUDED.embedding_model, "
                    "vector_store = EXCLUDED.vector_store, updated_at = now()",
                    org_id,
                    doc.document_id,
                    doc.source,
                    doc.title,
                    prepared.content_hash,
                    list(prepared.acl_keys),
                    json.dumps(dict(doc.metadata), default=str),
                    len(prepared.chunks),
                    embedding_model,
                    vector_store,
                    doc.text,
                    prepared.analyzer,
                    prepared.chunking,
                )
        return Published(
            removed_chunks=len(removed),
            removed_embedded_chunk_ids=tuple(r["chunk_id"] for r in removed if r["embedded"]),
        )

    async def ready_chunks(self) -> list[tuple[str, str]]:
        """(chunk id, text) of the served version, in order."""
        with translated():
            rows = await self._conn.fetch(
                "SELECT chunk_id, text FROM chunks WHERE org_id = $1 AND document_id = $2 "
                "AND state = 'ready' ORDER BY ordinal",
                self.org_id,
                self.document_id,
            )
        return [(r["chunk_id"], r["text"]) for r in rows]

    async def record_vectors(
        self,
        chunk_ids: Sequence[str],
        vectors: Sequence[Sequence[float]],
        *,
        embedding_model: str,
        vector_store: str,
    ) -> None:
        """Give the served chunks their vectors of `embedding_model`, kept in
        `vector_store`, in one transaction."""
        with translated():
            async with self._conn.transaction():
                await self._conn.execute(
                    "UPDATE chunks c SET embedding = u.embedding::vector, embedded = true, "
                    "embedding_model = $3 "
                    "FROM unnest($2::text[], $4::text[]) AS u(chunk_id, embedding) "
                    "WHERE c.org_id = $1 AND c.chunk_id = u.chunk_id AND c.state = 'ready'",
                    self.org_id,
                    list(chunk_ids),
                    embedding_model,
                    [vector_literal(v) for v in vectors],
                )
                await self._conn.execute(
                    "UPDATE documents SET embedding_model = $3, vector_store = $4, "
                    "updated_at = now() WHERE org_id = $1 AND document_id = $2",
                    self.org_id,
                    self.document_id,
                    embedding_model,
                    vector_store,
                )

    async def delete(self) -> int:
        """Remove the document, its chunks, postings and share of the statistics;
        the number of ready chunks removed."""
        with translated():
            async with self._conn.transaction():
                removed = await self._conn.fetch(
                    "DELETE FROM chunks WHERE org_id = $1 AND document_id = $2 "
                    "RETURNING chunk_no, audience_id, length, state",
                    self.org_id,
                    self.document_id,
                )
                await _remove_ready(self._conn, self.org_id, removed)
                await self._conn.execute(
                    "DELETE FROM documents WHERE org_id = $1 AND document_id = $2",
                    self.org_id,
                    self.document_id,
                )
        return sum(1 for r in removed if r["state"] == "ready")


class PostgresDocumentWrites:
    def __init__(self, db: Database) -> None:
        self._db = db

    @asynccontextmanager
    async def document_session(
        self, org_id: str, document_id: str
    ) -> AsyncIterator[PostgresDocumentSession]:
        lock_key = f"retrieval\x1f{org_id}\x1f{document_id}"
        pool = self._db.pool
        with translated():
            conn = await pool.acquire()
            try:
                await conn.execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", lock_key)
            except BaseException:
                # A lock call cut short (cancelled, timed out) may have been granted
                # with its answer lost: the session is closed, never pooled holding it.
                await _discard(pool, conn)
                raise
        try:
            yield PostgresDocumentSession(conn, org_id, document_id)
        finally:
            try:
                await conn.execute("SELECT pg_advisory_unlock(hashtextextended($1, 0))", lock_key)
            except DATABASE_AWAY:
                await _discard(pool, conn)
            except BaseException:
                # An unlock cut short (a cancelled ingest) may not have reached the
                # server: the pool's reset does not release session locks, so the
                # session goes, and the lock with it.
                await _discard(pool, conn)
                raise
            else:
                # Releasing a connection the restart broke must not turn the caller's
                # answer (already given, or UNAVAILABLE) into INTERNAL.
                with suppress(*DATABASE_AWAY):
                    await pool.release(conn)


async def _discard(pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
    """Close the session (which releases every advisory lock it holds) and give its
    slot back to the pool."""
    conn.terminate()
    with suppress(*DATABASE_AWAY):
        await pool.release(conn)
