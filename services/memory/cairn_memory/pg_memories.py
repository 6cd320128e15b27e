"""Memories in PostgreSQL: remember (deduplicated by text, superseding in the same
transaction), semantic and newest-first recall, and embeddings kept later."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

import asyncpg
from opentelemetry import trace

from cairn_libs.db import vector_literal
from cairn_memory.domain import Memory, NewMemory, Subject, normalised_text
from cairn_memory.errors import SupersedesNotActive
from cairn_memory.pg_rows import MEMORY_COLUMNS, RECALLABLE, Rows, subject_filter
from cairn_memory.vault import StoredText

# pgvector >= 0.8: keep scanning the HNSW graph until k rows pass the org filter,
# in exact distance order, instead of returning fewer than k.
SEMANTIC_SETTINGS: Final = (
    "SET LOCAL hnsw.iterative_scan = strict_order",
    # Candidates per graph pass. Measured at 1M memories (100k in the org): 40 gave
    # recall@5 0.94 in 3.0 ms, 64 gave 0.984 in 4.3 ms, 100 gave 0.992 in 6.6 ms.
    "SET LOCAL hnsw.ef_search = 64",
    # Plan for this org's size every time: a generic plan cached by the prepared
    # statement cannot see the org id, and picks one strategy for every org (a full
    # distance sort of a 100k-memory org took 10x longer than the HNSW scan).
    "SET LOCAL plan_cache_mode = force_custom_plan",
    # A short LIMIT query never repays JIT compilation, which the planner may pick
    # for a mid-sized org's exact scan and which costs tens of milliseconds.
    "SET LOCAL jit = off",
)


# Below this many embedded active memories in the org, the exact answer (an
# index-only scan of the covering btree, migration 0006) is cheaper than a walk of
# the HNSW graph, which for a small share of all memories discards most neighbours
# it reaches. Measured at 1M memories: exact 1 ms at 1k, 5 ms at 10k; the graph
# 25 ms at 10k (1% of rows) but 4-10 ms at 100k (10%). The planner's HNSW cost does
# not see that, so the choice is made here, from a count bounded by the threshold.
EXACT_BELOW: Final = 20_000


def semantic_recall_sql(subject: Subject | None, *, exact: bool = False) -> str:
    """The nearest recallable memories. The nearest ids come from indexed columns
    alone: for an org under EXACT_BELOW embedded memories an exact index-only scan
    of its covering btree, above it the HNSW graph (each branch is gated by the
    bounded count, so only one runs); then their rows are read. `exact` forces the
    complete, exact answer (the fallback when the graph comes back short)."""
    subject_clause, _ = subject_filter(subject, first=5)
    # Ranking and score use the same half-precision distance, so order and scores agree.
    distance = "embedding_half <=> $3::halfvec(384)"
    candidates = f"""
                SELECT memory_id, {distance} AS distance
                FROM memories
                WHERE {RECALLABLE} AND embedding IS NOT NULL {subject_clause}"""
    exact_branch = f"""
            SELECT * FROM ({candidates}
                ORDER BY ({distance}) + 0
                LIMIT $4
            ) exact_nearest"""
    if exact:
        chosen = exact_branch
    else:
        chosen = f"""
            {exact_branch}
            WHERE (SELECT embedded FROM org_size) < {EXACT_BELOW}
            UNION ALL
            SELECT * FROM ({candidates}
                ORDER BY {distance}
                LIMIT $4
            ) graph_nearest
            WHERE (SELECT embedded FROM org_size) >= {EXACT_BELOW}"""
    # Counted on the thin (org_id, created_at) index of active memories: the covering
    # btree's entries carry a vector each, and counting 20k of them costs 15 ms.
    org_size = f"""
        org_size AS MATERIALIZED (
            SELECT count(*) AS embedded FROM (
                SELECT 1 FROM memories
                WHERE org_id = $1 AND state = 'ACTIVE'
                LIMIT {EXACT_BELOW}
            ) bounded
        ),"""
    # Whether the graph answered (the only branch that can come back short of k rows
    # the org holds): read from the count already made, so no second scan.
    approximate = "false" if exact else f"(SELECT embedded FROM org_size) >= {EXACT_BELOW}"
    return f"""
        WITH {"" if exact else org_size}
        nearest AS ({chosen}
        )
        SELECT {MEMORY_COLUMNS}, 1 - nearest.distance AS score, {approximate} AS approximate
        FROM nearest JOIN memories USING (memory_id)
        WHERE memories.org_id = $1
        ORDER BY nearest.distance, memories.memory_id
    """


def semantic_recall_args(
    *, org_id: str, subject: Subject | None, vector: Sequence[float], k: int, now: datetime
) -> list[Any]:
    _, subject_args = subject_filter(subject, first=5)
    return [org_id, now, vector_literal(vector), k, *subject_args]


def newest_recall_sql(subject: Subject | None) -> str:
    subject_clause, _ = subject_filter(subject, first=4)
    return f"""
        SELECT {MEMORY_COLUMNS} FROM memories
        WHERE {RECALLABLE} {subject_clause}
        ORDER BY memories.created_at DESC, memories.memory_id DESC
        LIMIT $3
    """


def newest_recall_args(*, org_id: str, subject: Subject | None, k: int, now: datetime) -> list[Any]:
    _, subject_args = subject_filter(subject, first=4)
    return [org_id, now, k, *subject_args]


class PostgresMemories:
    def __init__(self, rows: Rows) -> None:
        self._rows = rows

    async def remember(
        self, memory: NewMemory, *, org_id: str, embedding: Sequence[float] | None
    ) -> tuple[Memory, bool]:
        """Store `memory`, or return the active one with the same text (already_held=True)."""
        digest = self._rows.vault.digest(normalised_text(memory.text))
        stored = self._rows.vault.seal(memory.text, org_id=org_id)
        subject = memory.subject
        now = memory.created_at
        async with self._rows.connection() as conn, conn.transaction():
            if memory.supersedes:
                await self._lock_supersedable(conn, memory, org_id=org_id)
            # An ACTIVE twin past its expiry is expired in fact; record that, so the
            # one-active-text index does not hold a memory nobody can recall.
            await conn.execute(
                "UPDATE memories SET state = 'EXPIRED' WHERE org_id = $1 AND subject_kind = $2 "
                "AND subject_id = $3 AND text_digest = $4 AND state = 'ACTIVE' AND expires_at <= $5",
                org_id,
                subject.kind.value,
                subject.id,
                digest,
                now,
            )
            row = await conn.fetchrow(
                f"""
                INSERT INTO memories (
                    memory_id, org_id, subject_kind, subject_id, body, body_sealed, text_digest,
                    embedding, tags, importance, claim_type, event_at, valid_from, valid_until,
                    author_kind, author_id, run_id, on_behalf_of, source_ref, created_at,
                    expires_at, state
                ) VALUES (
                    $1::uuid, $2, $3, $4, $5, $6, $7, $8::vector, $9, $10, $11, $12, $13, $14,
                    $15, $16, $17, $18, $19, $20, $21, 'ACTIVE'
                )
                ON CONFLICT (org_id, subject_kind, subject_id, text_digest) WHERE state = 'ACTIVE'
                DO NOTHING
                RETURNING {MEMORY_COLUMNS}
                """,
                memory.memory_id,
                org_id,
                subject.kind.value,
                subject.id,
                stored.plain,
                stored.sealed,
                digest,
                vector_literal(embedding) if embedding is not None else None,
                list(memory.tags),
                memory.importance,
                memory.claim_type.value,
                memory.event_at,
                memory.valid_from,
                memory.valid_until,
                memory.author.kind.value,
                memory.author.id,
                memory.author.run_id,
                memory.author.on_behalf_of,
                memory.source_ref,
                memory.created_at,
                memory.expires_at,
            )
            already_held = row is None
            if row is None:
                row = await conn.fetchrow(
                    f"SELECT {MEMORY_COLUMNS} FROM memories WHERE org_id = $1 AND subject_kind = $2 "
                    "AND subject_id = $3 AND text_digest = $4 AND state = 'ACTIVE'",
                    org_id,
                    subject.kind.value,
                    subject.id,
                    digest,
                )
                if row is None:
                    raise SupersedesNotActive(
                        "the same text about this subject changed while it was being remembered; retry"
                    )
            held_id = str(row["memory_id"])
            replaced = [m for m in memory.supersedes if m != held_id]
            if replaced:
                await conn.execute(
                    "UPDATE memories SET state = 'SUPERSEDED', superseded_by = $2::uuid "
                    "WHERE org_id = $1 AND memory_id = ANY($3::uuid[])",
                    org_id,
                    held_id,
                    replaced,
                )
        return self._rows.memory(row, now=now), already_held

    async def _lock_supersedable(
        self, conn: asyncpg.Connection, memory: NewMemory, *, org_id: str
    ) -> None:
        rows = await conn.fetch(
            "SELECT memory_id::text AS memory_id FROM memories WHERE org_id = $1 "
            "AND memory_id = ANY($2::uuid[]) AND subject_kind = $3 AND subject_id = $4 "
            "AND state = 'ACTIVE' AND expires_at > $5 FOR UPDATE",
            org_id,
            list(memory.supersedes),
            memory.subject.kind.value,
            memory.subject.id,
            memory.created_at,
        )
        found = {str(r["memory_id"]) for r in rows}
        for index, memory_id in enumerate(memory.supersedes):
            if memory_id not in found:
                raise SupersedesNotActive(
                    f"supersedes[{index}] = {memory_id!r} is not an active memory of this subject "
                    "in your organisation; nothing was remembered or superseded"
                )

    async def recall_semantic(
        self,
        *,
        org_id: str,
        subject: Subject | None,
        vector: Sequence[float],
        k: int,
        now: datetime,
    ) -> list[Memory]:
        args = semantic_recall_args(org_id=org_id, subject=subject, vector=vector, k=k, now=now)
        async with self._rows.connection() as conn, conn.transaction():
            # One round trip: a simple-protocol string may hold several statements.
            await conn.execute("; ".join(SEMANTIC_SETTINGS))
            rows = await conn.fetch(semantic_recall_sql(subject), *args)
            # Short of k after the exact branch is the whole answer (the org or the
            # subject holds fewer); only a short graph answer, or none at all, is
            # asked again exactly.
            if len(rows) < k and (not rows or rows[0]["approximate"]):
                # An HNSW graph is not guaranteed to be connected: with many near-
                # duplicate memories a query can land in an island that holds fewer
                # than k of this org's rows although more exist. Fewer than k is
                # rare (or the org holds fewer), so answering it exactly costs little.
                trace.get_current_span().add_event(
                    "memory.recall.exact_fallback", {"cairn.memory.approximate_rows": len(rows)}
                )
                rows = await conn.fetch(semantic_recall_sql(subject, exact=True), *args)
        return [self._rows.memory(r, now=now, score=float(r["score"])) for r in rows]

    async def recall_newest(
        self, *, org_id: str, subject: Subject | None, k: int, now: datetime
    ) -> list[Memory]:
        async with self._rows.connection() as conn:
            rows = await conn.fetch(
                newest_recall_sql(subject),
                *newest_recall_args(org_id=org_id, subject=subject, k=k, now=now),
            )
        return [self._rows.memory(r, now=now) for r in rows]

    async def memories_without_embedding(
        self, *, limit: int, now: datetime
    ) -> list[tuple[str, str, str]]:
        """(org_id, memory_id, text) of active memories stored while no embedder was set."""
        async with self._rows.connection() as conn:
            rows = await conn.fetch(
                "SELECT org_id, memory_id::text AS memory_id, body, body_sealed FROM memories "
                "WHERE state = 'ACTIVE' AND embedding IS NULL AND expires_at > $1 "
                "ORDER BY created_at LIMIT $2",
                now,
                limit,
            )
        found = []
        for r in rows:
            text = self._rows.vault.open(
                StoredText(r["body"], r["body_sealed"]), org_id=r["org_id"]
            )
            if text is not None:
                found.append((str(r["org_id"]), str(r["memory_id"]), text))
        return found

    async def set_embeddings(self, embeddings: Sequence[tuple[str, str, Sequence[float]]]) -> None:
        """Attach embeddings to (org_id, memory_id) rows that are still active and unembedded."""
        async with self._rows.connection() as conn:
            await conn.executemany(
                "UPDATE memories SET embedding = $3::vector WHERE org_id = $1 "
                "AND memory_id = $2::uuid AND state = 'ACTIVE' AND embedding IS NULL",
                [(org, mid, vector_literal(vec)) for org, mid, vec in embeddings],
            )
