"""Retrieval's PostgreSQL: documents, chunks, postings, and the statistics that
make Okapi BM25 exact over any caller's visible set and fast to compute.

BM25 statistics (N, total chunk length, document frequencies) are kept per
audience, the chunks of one org sharing a source and an ACL, and changed in the
transaction that publishes or deletes the chunks they count. The caller's ACL
predicate admits an audience whole or not at all, so the caller's statistics
are sums over admitted audiences: never counted over the whole table (a global
df or N would let a forbidden document move a caller's scores, DESIGN I2), and
never recounted from the postings at query time. A write changes only the
rows of its own audience; nothing is cached outside the transaction that reads
it, so no statistic can be stale. A search reads its statistics and its
postings in one REPEATABLE READ snapshot. Which postings it reads is decided
by `bm25` (MaxScore); the scores are those of the exhaustive formula.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass

import asyncpg

from cairn_libs.acl import AclPredicate
from cairn_libs.db import CONNECTION_ERRORS, Database, vector_literal
from cairn_retrieval import bm25 as okapi
from cairn_retrieval.domain import ChunkRecord, PreparedDocument, SourceCounts, StoredDocument
from cairn_retrieval.errors import DatabaseUnavailable
from cairn_retrieval.tokens import TITLE_PREFIX

# Every way a database that is down, restarting or overloaded shows itself: the
# shared list (which includes the InternalClientError of a restart mid-protocol),
# plus too many connections and a cancelled statement, both over once it recovers.
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    *CONNECTION_ERRORS,
    asyncpg.InsufficientResourcesError,
    asyncpg.OperatorInterventionError,
)


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except _CONNECTION_ERRORS as exc:
        raise DatabaseUnavailable(
            f"the retrieval database did not answer ({type(exc).__name__}); retry shortly"
        ) from exc


# asyncpg prepares every statement; after five runs PostgreSQL may switch to a
# generic plan, costed without the parameters. For these statements the row
# counts hinge on the parameters (a rare or a common term, one audience or ten),
# and a generic plan measured 30-100 times slower at 100k chunks.
_CUSTOM_PLANS = "SET LOCAL plan_cache_mode = force_custom_plan"


# Pass 1 keeps only the chunks with the best essential parts ($13 of them).
_KEPT_BEST = """
    SELECT chunk_no, term, s FROM (
        SELECT chunk_no, term, s,
               dense_rank() OVER (ORDER BY part DESC, chunk_no) AS place
        FROM partial
        WHERE part + $10::float8 >= $11::float8
    ) ranked
    WHERE place <= $13::int
"""


@dataclass(frozen=True, slots=True)
class StoredVersion:
    """What PostgreSQL holds for one document id right now."""

    content_hash: str | None
    embedding_model: str
    vector_store: str
    analyzer: str
    chunking: str
    ready_chunks: int
    embedded_chunks: int
    pending_chunk_ids: tuple[str, ...]

    @property
    def exists(self) -> bool:
        return (
            self.content_hash is not None or self.ready_chunks > 0 or bool(self.pending_chunk_ids)
        )


@dataclass(frozen=True, slots=True)
class StoredVector:
    """A chunk's vector as PostgreSQL holds it, with what its point carries."""

    chunk_no: int
    org_id: str
    chunk_id: str
    document_id: str
    source: str
    acl: tuple[str, ...]
    vector: list[float]


@dataclass(frozen=True, slots=True)
class Published:
    """What a publish replaced: the chunk ids whose vectors are now obsolete."""

    removed_chunks: int
    removed_embedded_chunk_ids: tuple[str, ...]


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


class DocumentSession:
    """One document's writes, on one connection holding that document's lock, so
    two concurrent ingests or deletes of the same id cannot interleave."""

    def __init__(self, conn: asyncpg.Connection, org_id: str, document_id: str) -> None:
        self._conn = conn
        self.org_id = org_id
        self.document_id = document_id

    async def current(self) -> StoredVersion:
        with _translated():
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
        with _translated():
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
        with _translated():
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
        with _translated():
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
        with _translated():
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
        with _translated():
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
        with _translated():
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
            # Releasing a connection the restart broke must not turn the caller's
            # answer (already given, or UNAVAILABLE) into INTERNAL.
            with suppress(*_CONNECTION_ERRORS):
                await pool.release(conn)

    async def bm25(
        self,
        predicate: AclPredicate,
        terms: Sequence[str],
        *,
        limit: int,
        first_pass_postings: int = okapi.FIRST_PASS_POSTINGS,
        exhaustive_below: int = okapi.EXHAUSTIVE_POSTINGS,
        probe_cost: int = okapi.PROBE_COST,
    ) -> tuple[list[tuple[str, float]], okapi.SearchTrace]:
        """Top `limit` visible chunks by Okapi BM25, best first, ties by chunk id.

        N, avgdl and df come from the audiences `predicate` admits; only ready
        chunks have postings or count in a statistic. Each chunk's score sums
        its terms' contributions in term order, so it is the same float whatever
        plan PostgreSQL picks and whatever pass scored it (I2 asks for identical
        scores, not merely close ones).
        """
        if not terms:
            return [], okapi.SearchTrace(passes=0, pruned=False)
        with _translated():
            async with (
                self._db.pool.acquire() as conn,
                conn.transaction(isolation="repeatable_read", readonly=True),
            ):
                await conn.execute(_CUSTOM_PLANS)
                return await self._bm25(
                    conn,
                    predicate,
                    terms,
                    limit,
                    first_pass_postings,
                    exhaustive_below,
                    probe_cost,
                )

    async def _bm25(
        self,
        conn: asyncpg.Connection,
        predicate: AclPredicate,
        terms: Sequence[str],
        limit: int,
        first_pass_postings: int,
        exhaustive_below: int,
        probe_cost: int,
    ) -> tuple[list[tuple[str, float]], okapi.SearchTrace]:
        audiences, stats = await self._visible_statistics(conn, predicate, terms)
        weights = okapi.term_weights(stats)

        async def score(plan: okapi.Pass) -> dict[str, float]:
            return await self._score(conn, predicate.org_id, audiences, stats, weights, plan, limit)

        return await okapi.top_chunks(
            weights,
            limit,
            score,
            budget=first_pass_postings,
            exhaustive_below=exhaustive_below,
            probe_cost=probe_cost,
        )

    async def _visible_statistics(
        self, conn: asyncpg.Connection, predicate: AclPredicate, terms: Sequence[str]
    ) -> tuple[list[int], okapi.VisibleStatistics]:
        clause, params = predicate.to_sql(alias="a", first_param=1)
        n = len(params)
        row = await conn.fetchrow(
            f"""
            WITH admitted AS (
                SELECT a.audience_id, a.chunks, a.total_length FROM audiences a
                WHERE {clause} AND a.chunks > 0
            ),
            df AS (
                SELECT t.term, sum(t.df)::bigint AS df FROM term_stats t
                WHERE t.org_id = ${n + 1} AND t.term = ANY(${n + 2}::text[])
                  AND t.audience_id IN (SELECT audience_id FROM admitted)
                GROUP BY t.term
            )
            SELECT
                (SELECT coalesce(array_agg(audience_id ORDER BY audience_id), '{{}}')
                 FROM admitted) AS audiences,
                (SELECT coalesce(sum(chunks), 0)::bigint FROM admitted) AS chunks,
                (SELECT coalesce(sum(total_length), 0)::bigint FROM admitted) AS total_length,
                (SELECT coalesce(array_agg(term), '{{}}') FROM df) AS terms,
                (SELECT coalesce(array_agg(df), '{{}}') FROM df) AS dfs
            """,
            *params,
            predicate.org_id,
            list(terms),
        )
        assert row is not None
        stats = okapi.VisibleStatistics(
            chunks=int(row["chunks"]),
            total_length=int(row["total_length"]),
            document_frequencies=dict(zip(row["terms"], map(int, row["dfs"]), strict=True)),
        )
        return list(row["audiences"]), stats

    async def _score(
        self,
        conn: asyncpg.Connection,
        org_id: str,
        audiences: Sequence[int],
        stats: okapi.VisibleStatistics,
        weights: Sequence[okapi.TermWeight],
        plan: okapi.Pass,
        limit: int,
    ) -> dict[str, float]:
        """Full scores of the chunks `plan` admits, cut to the best `limit` and
        anything tied with the last of them (the caller breaks ties by id)."""
        kept = (
            _KEPT_BEST
            if plan.best_partial is not None
            else "SELECT chunk_no, term, s FROM partial WHERE part + $10::float8 >= $11::float8"
        )
        rows = await conn.fetch(
            f"""
            WITH weight AS (
                SELECT * FROM unnest($3::text[], $4::float8[]) AS w(term, idf)
            ),
            essential AS (
                SELECT p.chunk_no, p.term,
                       w.idf * p.tf * ($5::float8 + 1)
                       / (p.tf + $5::float8 * (1 - $6::float8 + $6::float8 * p.length / $7::float8))
                       AS s
                FROM postings p JOIN weight w ON w.term = p.term
                WHERE p.org_id = $1 AND p.term = ANY($8::text[])
                  AND p.audience_id = ANY($2::bigint[])
            ),
            -- A window, not a join back to the survivors: the planner cannot
            -- estimate these row counts, and a window never turns quadratic.
            partial AS (
                SELECT chunk_no, term, s, sum(s) OVER (PARTITION BY chunk_no) AS part
                FROM essential
            ),
            kept AS ({kept}),
            survivor AS (
                SELECT DISTINCT chunk_no FROM kept WHERE cardinality($9::text[]) > 0
            ),
            rest AS (
                SELECT v.chunk_no, p.term,
                       w.idf * p.tf * ($5::float8 + 1)
                       / (p.tf + $5::float8 * (1 - $6::float8 + $6::float8 * p.length / $7::float8))
                       AS s
                FROM survivor v
                CROSS JOIN LATERAL (
                    SELECT q.term, q.tf, q.length FROM postings q
                    WHERE q.org_id = $1 AND q.chunk_no = v.chunk_no
                      AND q.term = ANY($9::text[])
                ) p
                JOIN weight w ON w.term = p.term
            ),
            scored AS (
                SELECT chunk_no, sum(s ORDER BY term COLLATE "C") AS score FROM (
                    SELECT chunk_no, term, s FROM kept
                    UNION ALL
                    SELECT chunk_no, term, s FROM rest
                ) contribution
                GROUP BY chunk_no
            ),
            cutoff AS (
                SELECT min(score) AS score FROM (
                    SELECT score FROM scored ORDER BY score DESC LIMIT $12
                ) best
            )
            SELECT c.chunk_id, s.score
            FROM scored s CROSS JOIN cutoff
            JOIN chunks c ON c.chunk_no = s.chunk_no
            WHERE s.score >= cutoff.score AND c.org_id = $1
            """,
            org_id,
            list(audiences),
            [w.term for w in weights],
            [w.idf for w in weights],
            okapi.BM25_K1,
            okapi.BM25_B,
            stats.average_length,
            list(plan.essential),
            list(plan.rest),
            plan.rest_bound if math.isfinite(plan.rest_bound) else 1e300,
            plan.floor if math.isfinite(plan.floor) else -1e300,
            limit,
            *([plan.best_partial] if plan.best_partial is not None else []),
        )
        return {r["chunk_id"]: float(r["score"]) for r in rows}

    async def bm25_exhaustive(
        self, predicate: AclPredicate, terms: Sequence[str], *, limit: int
    ) -> list[tuple[str, float]]:
        """The plain statement BM25 had before audiences and pruning: statistics
        counted over the visible chunks and every posting of every term scored.
        Kept as the benchmark's baseline and the tests' second opinion."""
        if not terms:
            return []
        clause, params = predicate.to_sql(alias="c", first_param=1)
        n = len(params)
        sql = f"""
            WITH visible AS (
                SELECT c.chunk_no, c.length FROM chunks c
                WHERE {clause} AND c.state = 'ready'
            ),
            corpus AS (
                SELECT count(*)::float8 AS n, avg(length)::float8 AS avgdl FROM visible
            ),
            hits AS (
                SELECT p.term, v.chunk_no, p.tf::float8 AS tf, v.length::float8 AS dl
                FROM postings p JOIN visible v ON v.chunk_no = p.chunk_no
                WHERE p.org_id = ${n + 1} AND p.term = ANY(${n + 2}::text[])
            ),
            df AS (
                SELECT term, count(*)::float8 AS df FROM hits GROUP BY term
            ),
            scored AS (
                SELECT h.chunk_no,
                       sum(ln(1 + (s.n - d.df + 0.5) / (d.df + 0.5))
                           * CASE WHEN starts_with(h.term, ${n + 6}) THEN ${n + 7}::float8
                                  ELSE 1 END
                           * h.tf * (${n + 3}::float8 + 1)
                           / (h.tf + ${n + 3}::float8
                              * (1 - ${n + 4}::float8
                                 + ${n + 4}::float8 * h.dl / NULLIF(s.avgdl, 0)))
                           ORDER BY h.term COLLATE "C")
                       AS score
                FROM hits h JOIN df d ON d.term = h.term CROSS JOIN corpus s
                GROUP BY h.chunk_no
            )
            SELECT c.chunk_id, s.score FROM scored s JOIN chunks c ON c.chunk_no = s.chunk_no
            ORDER BY s.score DESC, c.chunk_id COLLATE "C"
            LIMIT ${n + 5}
        """
        with _translated():
            async with self._db.pool.acquire() as conn, conn.transaction(readonly=True):
                await conn.execute(_CUSTOM_PLANS)
                rows = await conn.fetch(
                    sql,
                    *params,
                    predicate.org_id,
                    list(terms),
                    okapi.BM25_K1,
                    okapi.BM25_B,
                    limit,
                    TITLE_PREFIX,
                    okapi.TITLE_WEIGHT,
                )
        return [(r["chunk_id"], float(r["score"])) for r in rows]

    async def visible_chunks(
        self,
        predicate: AclPredicate,
        chunk_ids: Sequence[str],
        *,
        query_vector: Sequence[float] | None,
        model_id: str,
    ) -> tuple[dict[str, ChunkRecord], dict[str, float]]:
        """The named chunks the predicate admits and that are ready (others are
        absent), and the cosine similarity to `query_vector` of each one holding
        a vector of `model_id` (a vector of another model is not comparable)."""
        if not chunk_ids:
            return {}, {}
        clause, params = predicate.to_sql(alias="c", first_param=1)
        n = len(params)
        with _translated():
            rows = await self._db.pool.fetch(
                "SELECT c.chunk_id, c.document_id, c.source, c.title, c.char_start, c.char_end, "
                f"c.text, CASE WHEN c.embedding_model = ${n + 3} "
                f"THEN 1 - (c.embedding <=> ${n + 2}::vector) END AS dense_score "
                f"FROM chunks c WHERE {clause} AND c.state = 'ready' "
                f"AND c.chunk_id = ANY(${n + 1}::text[])",
                *params,
                list(chunk_ids),
                vector_literal(query_vector) if query_vector is not None else None,
                model_id,
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

    async def document(self, org_id: str, document_id: str) -> StoredDocument | None:
        """The document of `org_id` with that id as last ingested, or None."""
        with _translated():
            row = await self._db.pool.fetchrow(
                "SELECT document_id, source, title, text, acl, metadata::text AS metadata "
                "FROM documents WHERE org_id = $1 AND document_id = $2",
                org_id,
                document_id,
            )
        if row is None:
            return None
        return StoredDocument(
            org_id=org_id,
            document_id=row["document_id"],
            source=row["source"],
            title=row["title"],
            text=row["text"],
            acl_keys=tuple(row["acl"]),
            metadata=json.loads(row["metadata"]),
        )

    async def claim_collection(
        self, collection: str, *, model_id: str, dimensions: int
    ) -> tuple[str, int]:
        """Record `model_id` as the model `collection` holds unless one is recorded;
        the recorded (model id, dimensions)."""
        with _translated():
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

    async def index_versions(self) -> list[tuple[str, str, str, str, str]]:
        """(org, document id, source, analyzer, chunking) of every document."""
        with _translated():
            rows = await self._db.pool.fetch(
                "SELECT org_id, document_id, source, analyzer, chunking FROM documents "
                "ORDER BY org_id, document_id"
            )
        return [tuple(r) for r in rows]

    async def recorded_store(self, location: str) -> str | None:
        """The store id PostgreSQL last wrote vectors to at `location`, if any."""
        with _translated():
            found = await self._db.pool.fetchval(
                "SELECT store_id FROM vector_stores WHERE location = $1", location
            )
        return str(found) if found is not None else None

    async def record_store(self, location: str, store_id: str) -> None:
        with _translated():
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
        with _translated():
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
        with _translated():
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
        with _translated():
            status = await self._db.pool.execute(
                "UPDATE documents SET vector_store = $2 "
                "WHERE vector_store = $1 OR starts_with(vector_store, $1 || ' ')",
                location,
                identity,
            )
        return int(status.split()[-1])

    async def counts_by_source(self, org_id: str, *, model_id: str) -> list[SourceCounts]:
        """Embedded chunks are those with a vector from `model_id`, or from any
        model when it is '' (no embedder configured)."""
        with _translated():
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
