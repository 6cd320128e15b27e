"""Semantic recall returns k memories whenever the org holds k recallable ones, even
when the approximate HNSW scan comes back short (its graph is not guaranteed to be
connected; the benchmark's 1M-row dataset has queries that land in such islands),
because a short answer is redone exactly."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

import cairn_memory.pg_memories as pg_memories
from cairn_libs.clock import FakeClock
from cairn_libs.db import Database
from cairn_libs.embedding import Embedder
from cairn_libs.identity import CallIdentity, Principal
from cairn_memory.domain import RecallMode, RecallQuery, RememberDraft, Subject, SubjectKind
from cairn_memory.keeper import MemoryKeeper
from cairn_memory.pg_memories import EXACT_BELOW, semantic_recall_args, semantic_recall_sql
from cairn_memory.postgres import PostgresStore
from cairn_memory.vault import PlainVault

NOTES = (
    "The team loves hiking in the mountains.",
    "Our offsite was a canoe trip on the lake.",
    "Several people cycle to the office every day.",
    "The quarterly budget review is on Thursday.",
    "Lunch on Fridays is pizza in the kitchen.",
    "The office plants are watered on Mondays.",
)
QUERY = "outdoor activities"


@pytest.fixture
async def keeper_with_notes(
    isolated_database: Database, local_embedder: Embedder, new_org: str
) -> MemoryKeeper:
    keeper = MemoryKeeper(
        store=PostgresStore(isolated_database, vault=PlainVault()),
        embedder=local_embedder,
        clock=FakeClock(datetime(2034, 1, 1, tzinfo=UTC)),
    )
    alice = CallIdentity(principal=Principal(org_id=new_org, user_id="alice"))
    for text in NOTES:
        await keeper.remember(
            RememberDraft(text=text, subject_kind=SubjectKind.WORKSPACE, subject_id=""), alice
        )
    return keeper


async def exact_order(embedder: Embedder) -> list[str]:
    query, *notes = np.asarray(await embedder.embed([QUERY, *NOTES]))
    similarity = np.asarray(notes) @ query
    return [NOTES[i] for i in np.argsort(-similarity)]


async def test_a_short_approximate_answer_is_redone_exactly(
    keeper_with_notes: MemoryKeeper,
    local_embedder: Embedder,
    new_org: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def approximate_finds_one(subject: Subject | None, *, exact: bool = False) -> str:
        sql = semantic_recall_sql(subject, exact=exact)
        if exact:
            return sql
        # The graph branch answers (as for an org past EXACT_BELOW), and comes back short.
        graph = sql.replace(f"< {EXACT_BELOW}", "< 0").replace(f">= {EXACT_BELOW}", ">= 0")
        assert graph != sql, "the branch gates were not found in the statement"
        return graph.replace("LIMIT $4", "LIMIT least($4, 1)")

    monkeypatch.setattr(pg_memories, "semantic_recall_sql", approximate_finds_one)
    recalled = await keeper_with_notes.recall(
        RecallQuery(query=QUERY, subject=None, k=4, include_profile=False),
        Principal(org_id=new_org, user_id="alice"),
    )
    assert recalled.mode is RecallMode.SEMANTIC
    assert [m.text for m in recalled.memories] == (await exact_order(local_embedder))[:4]


async def test_a_short_answer_of_the_exact_branch_is_the_whole_answer_and_not_asked_again(
    keeper_with_notes: MemoryKeeper,
    local_embedder: Embedder,
    new_org: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[bool] = []

    def counted(subject: Subject | None, *, exact: bool = False) -> str:
        asked.append(exact)
        return semantic_recall_sql(subject, exact=exact)

    monkeypatch.setattr(pg_memories, "semantic_recall_sql", counted)
    everything = await exact_order(local_embedder)
    recalled = await keeper_with_notes.recall(
        RecallQuery(query=QUERY, subject=None, k=len(everything) + 5, include_profile=False),
        Principal(org_id=new_org, user_id="alice"),
    )
    # The org holds fewer than k and is under EXACT_BELOW: the exact branch answered.
    assert [m.text for m in recalled.memories] == everything
    assert asked == [False]


async def test_the_exact_statement_never_uses_the_hnsw_index_and_ranks_exactly(
    keeper_with_notes: MemoryKeeper,
    isolated_database: Database,
    local_embedder: Embedder,
    new_org: str,
) -> None:
    (vector,) = await local_embedder.embed([QUERY])
    args = semantic_recall_args(
        org_id=new_org, subject=None, vector=vector, k=6, now=datetime(2034, 1, 1, tzinfo=UTC)
    )
    async with isolated_database.pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")
        await conn.execute("SET LOCAL enable_sort = off")
        plan = await conn.fetch("EXPLAIN " + semantic_recall_sql(None, exact=True), *args)
        rows = await conn.fetch(semantic_recall_sql(None, exact=True), *args)
    assert not any("hnsw" in line[0] for line in plan)
    assert [r["body"] for r in rows] == await exact_order(local_embedder)
