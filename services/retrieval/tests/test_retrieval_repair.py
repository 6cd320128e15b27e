"""Vector store repair without re-embedding, on the real embedded engines (Qdrant
Edge, and qdrant-client's local mode, which speaks the server's client API): a
collection wiped and made again, or replaced, is noticed at start-up and served
keyword-only with the reason; `python -m cairn_retrieval reindex vectors`
rebuilds it from PostgreSQL's vectors and hybrid answers come back unchanged."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from qdrant_client import AsyncQdrantClient
from qdrant_client.http import models as qm

from cairn.retrieval.v1 import retrieval_pb2
from cairn_retrieval.domain import VECTOR_STORE_NEEDS_REPAIR_REASON

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import Org, RunningRetrieval

POLICIES = {
    "travel": "Book trains for trips under five hours; economy flights otherwise.",
    "meals": "Meals on business trips are reimbursed up to forty euros a day.",
    "laptops": "Lock your screen when you leave your desk; report a lost laptop at once.",
}
QUESTION = "how much are meals reimbursed on a trip"


def _env(service_env: dict[str, str], base: Path, engine: str) -> dict[str, str]:
    return {
        **service_env,
        "CAIRN_QDRANT_PATH": str(base / "qdrant"),
        "CAIRN_QDRANT_ENGINE": engine,
        "CAIRN_EMBEDDER": "local",
    }


def _start(
    start_in: Callable[..., RunningRetrieval], base: Path, name: str, engine: str
) -> RunningRetrieval:
    return start_in(base, name, engine=engine, CAIRN_EMBEDDER="local")


def _reindex(env: dict[str, str], what: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cairn_retrieval", "reindex", what],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _answer(running: RunningRetrieval, org: Org) -> retrieval_pb2.SearchResponse:
    return running.client.search(org.reader(groups=["staff"]), QUESTION, ["handbook"], k=3)


def _ingest(running: RunningRetrieval, org: Org) -> None:
    running.client.ingest(
        org.ingester(),
        [
            retrieval_pb2.Document(
                document_id=key,
                source="handbook",
                title=key.title(),
                text=text,
                acl=retrieval_pb2.Acl(groups=["staff"]),
            )
            for key, text in POLICIES.items()
        ],
    )


def _stop(running: RunningRetrieval) -> None:
    running.client.close()
    running.process.stop()


def _wipe(base: Path, engine: str) -> None:
    if engine == "edge":
        shutil.rmtree(base / "qdrant" / "edge" / "cairn_chunks")
        return

    async def drop() -> None:
        client = AsyncQdrantClient(path=str(base / "qdrant"))
        try:
            await client.delete_collection("cairn_chunks")
        finally:
            await client.close()

    asyncio.run(drop())


@pytest.mark.parametrize("engine", ["edge", "local"])
def test_a_wiped_collection_is_keyword_only_until_reindex_rebuilds_it_from_postgres(
    service_env: dict[str, str],
    start_in: Callable[..., RunningRetrieval],
    tmp_path: Path,
    org: Org,
    engine: str,
) -> None:
    first = _start(start_in, tmp_path, "first", engine)
    try:
        _ingest(first, org)
        before = _answer(first, org)
    finally:
        _stop(first)
    assert before.mode == retrieval_pb2.SEARCH_MODE_HYBRID
    assert before.results[0].document_id == "meals" and before.results[0].dense_rank == 1
    _wipe(tmp_path, engine)

    wiped = _start(start_in, tmp_path, "wiped", engine)
    try:
        degraded = _answer(wiped, org)
    finally:
        _stop(wiped)
    assert degraded.mode == retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY
    assert degraded.mode_reason == VECTOR_STORE_NEEDS_REPAIR_REASON
    assert all(r.dense_rank == 0 for r in degraded.results)

    rebuilt = _reindex(_env(service_env, tmp_path, engine), "vectors")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "nothing embedded" in rebuilt.stdout
    assert f"{len(POLICIES)} points from PostgreSQL" in rebuilt.stdout

    repaired = _start(start_in, tmp_path, "repaired", engine)
    try:
        after = _answer(repaired, org)
        # New documents go on working in the rebuilt collection.
        repaired.client.ingest(
            org.ingester(),
            [
                retrieval_pb2.Document(
                    document_id="parking",
                    source="handbook",
                    text="Parking permits are renewed every January.",
                    acl=retrieval_pb2.Acl(groups=["staff"]),
                )
            ],
        )
        parking = repaired.client.search(
            org.reader(groups=["staff"]), "car park", ["handbook"], k=1
        )
    finally:
        _stop(repaired)
    assert after == before
    assert parking.mode == retrieval_pb2.SEARCH_MODE_HYBRID
    assert parking.results[0].document_id == "parking"


def test_a_collection_put_in_place_by_something_else_is_not_searched(
    service_env: dict[str, str], start_in: Callable[..., RunningRetrieval], tmp_path: Path, org: Org
) -> None:
    first = _start(start_in, tmp_path, "first", "local")
    try:
        _ingest(first, org)
    finally:
        _stop(first)

    async def replace() -> None:
        client = AsyncQdrantClient(path=str(tmp_path / "qdrant"))
        try:
            await client.delete_collection("cairn_chunks")
            await client.create_collection(
                "cairn_chunks",
                vectors_config=qm.VectorParams(size=384, distance=qm.Distance.COSINE),
            )
            await client.upsert(
                "cairn_chunks",
                points=[qm.PointStruct(id=i, vector=[1.0] * 384, payload={}) for i in range(5)],
            )
        finally:
            await client.close()

    asyncio.run(replace())
    foreign = _start(start_in, tmp_path, "foreign", "local")
    try:
        answer = _answer(foreign, org)
        with pytest.raises(Exception) as caught:
            foreign.client.search(
                org.reader(groups=["staff"]),
                QUESTION,
                ["handbook"],
                mode=retrieval_pb2.SEARCH_MODE_DENSE_ONLY,
            )
    finally:
        _stop(foreign)
    assert answer.mode == retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY
    assert answer.mode_reason == VECTOR_STORE_NEEDS_REPAIR_REASON
    assert "FAILED_PRECONDITION" in str(caught.value)


def test_reindex_documents_remakes_documents_indexed_another_way_from_their_stored_text(
    service_env: dict[str, str], start_in: Callable[..., RunningRetrieval], tmp_path: Path, org: Org
) -> None:
    plain = start_in(
        tmp_path, "plain", engine="edge", CAIRN_EMBEDDER="local",
        CAIRN_RETRIEVAL_LANGUAGE="none",
    )  # fmt: skip
    try:
        _ingest(plain, org)
        unstemmed = plain.client.search(
            org.reader(groups=["staff"]), "reimburse", ["handbook"],
            mode=retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY,
        )  # fmt: skip
    finally:
        _stop(plain)
    assert list(unstemmed.results) == []

    remade = _reindex(_env(service_env, tmp_path, "edge"), "documents")
    assert remade.returncode == 0, remade.stderr
    assert f"{len(POLICIES)} replaced" in remade.stdout

    stemmed = _start(start_in, tmp_path, "stemmed", "edge")
    try:
        answer = stemmed.client.search(
            org.reader(groups=["staff"]), "reimburse", ["handbook"],
            mode=retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY,
        )  # fmt: skip
        hybrid = _answer(stemmed, org)
    finally:
        _stop(stemmed)
    assert [r.document_id for r in answer.results] == ["meals"]
    assert hybrid.mode == retrieval_pb2.SEARCH_MODE_HYBRID
    again = _reindex(_env(service_env, tmp_path, "edge"), "documents")
    assert "every document is indexed as this service indexes" in again.stdout
