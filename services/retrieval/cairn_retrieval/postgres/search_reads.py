"""The reads a search makes: Okapi BM25 over the caller's visible audiences, and
the named candidates the predicate admits, with their dense scores recomputed
here (see the package docstring for how the statistics stay exact).

The statistics and the postings are read in one REPEATABLE READ snapshot.
Which postings are read is decided by `bm25` (MaxScore); the scores are those
of the exhaustive formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import asyncpg

from cairn_libs.acl import AclPredicate
from cairn_libs.db import Database, vector_literal
from cairn_retrieval import bm25 as okapi
from cairn_retrieval.domain import ChunkRecord
from cairn_retrieval.postgres.connection import CUSTOM_PLANS, translated
from cairn_retrieval.tokens import TITLE_PREFIX

# Pass 1 keeps only the chunks with the best essential parts ($13 of them).
_KEPT_BEST = """
    SELECT chunk_no, term, s FROM (
        SELECT chunk_no, term, s,
               dense_rank() OVER (ORDER BY part DESC, chunk_no) AS place
        FROM partial
        WHERE part + $11::float8 >= $12::float8
    ) ranked
    WHERE place <= $13::int
"""


class PostgresSearchReads:
    def __init__(self, db: Database) -> None:
        self._db = db

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
        with translated():
            async with (
                self._db.pool.acquire() as conn,
                conn.transaction(isolation="repeatable_read", readonly=True),
            ):
                await conn.execute(CUSTOM_PLANS)
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
        # A pass with no floor keeps every chunk it reads: it skips the window (a
        # sort and a pass over every posting read, a third of a large exhaustive
        # pass) and sends no pruning parameters.
        bounds = [
            plan.rest_bound if math.isfinite(plan.rest_bound) else 1e300,
            plan.floor if math.isfinite(plan.floor) else -1e300,
        ]
        pruning: list[float | int] = []
        if plan.best_partial is not None:
            kept = _KEPT_BEST
            pruning = [*bounds, plan.best_partial]
        elif plan.prunes:
            kept = "SELECT chunk_no, term, s FROM partial WHERE part + $11::float8 >= $12::float8"
            pruning = bounds
        else:
            kept = "SELECT chunk_no, term, s FROM essential"
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
                    SELECT score FROM scored ORDER BY score DESC LIMIT $10
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
            limit,
            *pruning,
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
        with translated():
            async with self._db.pool.acquire() as conn, conn.transaction(readonly=True):
                await conn.execute(CUSTOM_PLANS)
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
        with translated():
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
