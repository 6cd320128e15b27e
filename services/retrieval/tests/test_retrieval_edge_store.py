"""The Qdrant Edge store in-process: it admits exactly what the ACL predicate
admits, its searches are exact (the same candidates as a brute-force scan of the
visible points, before and after the shard is optimized), it keeps its points
across a reopen, and it refuses what it cannot serve with a clear error."""

from __future__ import annotations

import asyncio
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import qdrant_edge as qe
from qdrant_client.http import models as qm

from cairn_libs.acl import AclPredicate, document_reach
from cairn_libs.identity import Principal
from cairn_retrieval import edge_store
from cairn_retrieval.edge_store import EdgeVectorStore, edge_filter
from cairn_retrieval.errors import VectorStoreUnavailable
from cairn_retrieval.vectors import VectorPoint

DIMENSIONS = 8
GROUPS = ["g1", "g2", "g3", "g4"]
SOURCES = ["wiki", "hr"]


def _points(rng: random.Random, count: int, *, prefix: str = "c") -> list[VectorPoint]:
    return [
        VectorPoint(
            chunk_id=f"{prefix}{i:04d}#0",
            document_id=f"{prefix}{i:04d}",
            source=rng.choice(SOURCES),
            acl=tuple(f"group:{g}" for g in rng.sample(GROUPS, rng.randint(1, 2))),
            vector=[rng.gauss(0, 1) for _ in range(DIMENSIONS)],
        )
        for i in range(count)
    ]


def _predicate(org_id: str, groups: tuple[str, ...], sources: list[str]) -> AclPredicate:
    return AclPredicate.for_caller(
        Principal(org_id=org_id, user_id="reader", groups=groups), sources
    )


def _exact_top(
    points: list[VectorPoint], org_id: str, predicate: AclPredicate, query: list[float], k: int
) -> list[str]:
    admitted = [p for p in points if predicate.admits(org_id=org_id, source=p.source, acl=p.acl)]
    matrix = np.array([p.vector for p in admitted], dtype=np.float64)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    q = np.array(query) / np.linalg.norm(query)
    order = np.argsort(-(matrix @ q), kind="stable")[:k]
    return [admitted[i].chunk_id for i in order]


async def test_searches_are_exact_under_the_acl_before_and_after_optimizing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(edge_store, "OPTIMIZE_AFTER", 150)  # optimize mid-way
    rng = random.Random(5)
    store = EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=DIMENSIONS)
    mine = _points(rng, 240)
    theirs = _points(rng, 120, prefix="x")  # another org, same chunk ids scheme
    try:
        await store.upsert("org-a", mine[:100])
        await store.upsert("org-b", theirs)
        await store.upsert("org-a", mine[100:])
        for _ in range(30):
            groups = tuple(rng.sample(GROUPS, rng.randint(1, 3)))
            sources = rng.sample(SOURCES, rng.randint(1, 2))
            predicate = _predicate("org-a", groups, sources)
            query = [rng.gauss(0, 1) for _ in range(DIMENSIONS)]
            k = rng.choice([1, 5, 20])
            hits = await store.search(query, predicate, limit=k)
            assert [c for c, _ in hits] == _exact_top(mine, "org-a", predicate, query, k)
            assert all(-1.0001 <= score <= 1.0001 for _, score in hits)
    finally:
        await store.close()


async def test_deletes_remove_points_and_a_reopened_shard_keeps_the_rest(tmp_path: Path) -> None:
    rng = random.Random(9)
    points = _points(rng, 30)
    everyone = _predicate("org-a", tuple(GROUPS), SOURCES)
    store = EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=DIMENSIONS)
    await store.upsert("org-a", points)
    await store.delete_chunks("org-a", [points[0].chunk_id, points[1].chunk_id])
    await store.delete_document("org-a", points[2].document_id)
    await store.delete_document("org-b", points[3].document_id)  # another org's: no effect
    await store.close()

    reopened = EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=DIMENSIONS)
    try:
        hits = await reopened.search(points[5].vector, everyone, limit=100)
    finally:
        await reopened.close()
    assert sorted(c for c, _ in hits) == sorted(p.chunk_id for p in points[3:])
    assert hits[0][0] == points[5].chunk_id


async def test_a_shard_made_for_other_dimensions_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    store = EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=DIMENSIONS)
    await store.upsert("org-a", _points(random.Random(1), 3))
    await store.close()

    other = EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=384)
    with pytest.raises(VectorStoreUnavailable, match="384 dimensions.*CAIRN_QDRANT_COLLECTION"):
        await other.ensure_collection()
    assert not await other.probe()


async def test_a_shard_made_again_in_the_same_folder_is_another_store(tmp_path: Path) -> None:
    store = EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=DIMENSIONS)
    await store.upsert("org-a", _points(random.Random(2), 3))
    first = store.identity()
    await store.close()
    assert (
        EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=DIMENSIONS).identity()
        == first
    )

    shutil.rmtree(tmp_path / "chunks")
    again = EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=DIMENSIONS)
    await again.ensure_collection()
    await again.close()
    assert again.identity() != first
    assert again.identity().startswith(f"edge={tmp_path} chunks ")


async def test_a_shard_without_reach_keys_is_refused_with_the_reason(tmp_path: Path) -> None:
    older = qe.EdgeShard.create(
        str(tmp_path / "chunks"),
        qe.EdgeConfig(vectors=qe.EdgeVectorParams(size=DIMENSIONS, distance=qe.Distance.Cosine)),
    )
    older.close()
    store = EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=DIMENSIONS)
    with pytest.raises(VectorStoreUnavailable, match="no 'reach' index.*ingest again"):
        await store.ensure_collection()


async def test_a_shard_held_by_another_process_reads_as_unavailable(tmp_path: Path) -> None:
    store = EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=DIMENSIONS)
    await store.ensure_collection()
    try:
        script = (
            "import asyncio, sys\n"
            "from cairn_retrieval.edge_store import EdgeVectorStore\n"
            f"s = EdgeVectorStore(path={str(tmp_path)!r}, collection='chunks', dimensions=8)\n"
            "sys.exit(0 if asyncio.run(s.probe()) else 3)\n"
        )
        second = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
        assert await asyncio.wait_for(second.wait(), timeout=60) == 3
    finally:
        await store.close()


def test_the_edge_filters_admit_exactly_what_the_predicate_admits(tmp_path: Path) -> None:
    rng = random.Random(13)
    shard = qe.EdgeShard.create(
        str(tmp_path / "shard"),
        qe.EdgeConfig(vectors=qe.EdgeVectorParams(size=2, distance=qe.Distance.Cosine)),
    )
    rows = []
    for i in range(200):
        org = rng.choice(["org-a", "org-b"])
        source = rng.choice([*SOURCES, "ops"])
        acl = [f"group:{g}" for g in rng.sample(GROUPS, rng.randint(1, 3))]
        if rng.random() < 0.2:
            acl.append(rng.choice(["user:reader", "user:other"]))
        rows.append((i, org, source, acl))
    shard.update(
        qe.UpdateOperation.upsert_points(
            [
                qe.Point(
                    i,
                    [1.0, 0.5],
                    {
                        "org_id": org,
                        "source": source,
                        "acl": acl,
                        "reach": document_reach(org, source, acl),
                    },
                )
                for i, org, source, acl in rows
            ]
        )
    )
    try:
        for _ in range(40):
            groups = tuple(rng.sample(GROUPS, rng.randint(0, 3)))
            sources = rng.sample([*SOURCES, "ops"], rng.randint(1, 3))
            predicate = _predicate("org-a", groups, sources)
            expected = {
                i
                for i, org, source, acl in rows
                if predicate.admits(org_id=org, source=source, acl=acl)
            }
            for query_filter in (predicate.to_qdrant_filter(), predicate.to_qdrant_reach_filter()):
                records, _ = shard.scroll(
                    qe.ScrollRequest(limit=1000, filter=edge_filter(query_filter))
                )
                assert {int(r.id) for r in records} == expected  # type: ignore[call-overload]
    finally:
        shard.close()


def test_the_edge_filter_refuses_a_condition_it_cannot_translate() -> None:
    unknown = qm.Filter(must=[qm.FieldCondition(key="n", range=qm.Range(gte=1))])
    with pytest.raises(TypeError, match="cannot translate"):
        edge_filter(unknown)
    with pytest.raises(TypeError, match="min_should"):
        edge_filter(
            qm.Filter(
                min_should=qm.MinShould(
                    conditions=[qm.FieldCondition(key="a", match=qm.MatchValue(value="b"))],
                    min_count=1,
                )
            )
        )
