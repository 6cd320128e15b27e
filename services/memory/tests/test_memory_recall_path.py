"""Semantic recall takes the exact path for an org under EXACT_BELOW memories and
the HNSW graph above it, and only one of the two runs: the planner prices the graph
walk for an org that is a small share of all memories far below what it costs, so
the choice is made from a bounded count (migration 0006's covering btree serves the
exact path). Read from the executed plan, so a change that runs both, or the wrong
one, shows."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

import cairn_memory.pg_memories as pg_memories
from cairn_libs.db import Database
from cairn_memory.pg_memories import SEMANTIC_SETTINGS, semantic_recall_args, semantic_recall_sql

NOW = datetime(2034, 1, 1, tzinfo=UTC)


async def _fill(conn: asyncpg.Connection, org_id: str, count: int) -> None:
    """`count` active embedded memories with pseudo-random unit-ish vectors."""
    await conn.execute(
        """
        INSERT INTO memories (memory_id, org_id, subject_kind, subject_id, body, text_digest,
            embedding, importance, claim_type, author_kind, author_id, created_at, expires_at,
            state)
        SELECT gen_random_uuid(), $1, 'WORKSPACE', '', 'note ' || i, sha256(($1 || i)::bytea),
            (SELECT array_agg(sin(i * 7.3 + d * 1.1))::vector(384)
               FROM generate_series(1, 384) AS d),
            3, 'UNKNOWN', 'PERSON', 'alice', $2, $3, 'ACTIVE'
        FROM generate_series(1, $4) AS i
        """,
        org_id,
        NOW - timedelta(days=1),
        NOW + timedelta(days=365),
        count,
    )


def _branches_run(plan: Any) -> list[bool]:
    """For the Append that unites the exact and the graph branch: whether each ran."""

    def ran(node: dict[str, Any]) -> bool:
        return node.get("Actual Loops", 0) > 0 and (
            "Index Name" in node
            or "Relation Name" in node
            or any(ran(c) for c in node.get("Plans", ()))
        )

    def find(node: dict[str, Any]) -> list[bool] | None:
        if node.get("Node Type") == "Append":
            return [any(ran(c) for c in child.get("Plans", ())) for child in node["Plans"]]
        for child in node.get("Plans", ()):
            found = find(child)
            if found is not None:
                return found
        return None

    branches = find(plan[0]["Plan"])
    assert branches is not None, "the recall statement has no exact/graph Append"
    return branches


def _uses_graph(plan: Any) -> bool:
    def walk(node: dict[str, Any]) -> bool:
        here = (
            node.get("Index Name") == "memories_embedding_hnsw" and node.get("Actual Loops", 0) > 0
        )
        return here or any(walk(c) for c in node.get("Plans", ()))

    return walk(plan[0]["Plan"])


async def _recall_plan(database: Database, org_id: str) -> tuple[Any, int]:
    vector = [float(i % 7) / 7 for i in range(384)]
    args = semantic_recall_args(org_id=org_id, subject=None, vector=vector, k=5, now=NOW)
    async with database.pool.acquire() as conn, conn.transaction():
        await conn.execute("; ".join(SEMANTIC_SETTINGS))
        raw = await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + semantic_recall_sql(None), *args
        )
        rows = await conn.fetch(semantic_recall_sql(None), *args)
    return json.loads(raw), len(rows)


async def test_a_small_org_is_answered_exactly_and_a_large_one_by_the_graph_never_both(
    isolated_database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The threshold scaled down, so the large org costs a test a few hundred rows.
    monkeypatch.setattr(pg_memories, "EXACT_BELOW", 200)
    small, large = f"small-{uuid.uuid4().hex[:6]}", f"large-{uuid.uuid4().hex[:6]}"
    async with isolated_database.pool.acquire() as conn:
        await _fill(conn, small, 150)
        await _fill(conn, large, 400)

    small_plan, small_rows = await _recall_plan(isolated_database, small)
    large_plan, large_rows = await _recall_plan(isolated_database, large)

    assert (small_rows, large_rows) == (5, 5)
    assert _branches_run(small_plan) == [True, False]
    assert _branches_run(large_plan) == [False, True]
    assert not _uses_graph(small_plan)
