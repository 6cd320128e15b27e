"""Which vectors a document has: re-ingesting embeds what was ingested without an
embedder, the gateway's Embed works behind the same protocol, and vectors of
two models never meet in one collection."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg
import grpc
import pytest

from cairn.retrieval.v1 import retrieval_pb2
from cairn_libs.embedding import LOCAL_MODEL_ID
from cairn_libs.stack import (
    ServiceProcess,
    free_port,
    start_service,
    wait_for_health,
    wait_until,
)
from cairn_retrieval.domain import MODEL_MISMATCH_REASON, is_unchanged

if TYPE_CHECKING:
    from conftest import Org, RunningRetrieval


def _document(document_id: str, text: str) -> retrieval_pb2.Document:
    return retrieval_pb2.Document(
        document_id=document_id,
        source="handbook",
        title=document_id,
        text=text,
        acl=retrieval_pb2.Acl(groups=["staff"]),
    )


NOTE = "The bicycle shed behind the east entrance is locked at nine every evening."


def test_unchanged_means_same_content_and_vectors_of_the_configured_model_in_this_store() -> None:
    def unchanged(model: str, store: str, embedded: int, embedder: str) -> bool:
        return is_unchanged(
            stored_embedding_model=model,
            stored_vector_store=store,
            ready_chunks=2,
            embedded_chunks=embedded,
            embedder_model=embedder,
            vector_store="edge=/a cairn_chunks",
        )

    assert unchanged("", "", 0, "")
    assert not unchanged("", "", 0, "m")
    assert not unchanged("old", "edge=/a cairn_chunks", 2, "m")
    assert not unchanged("m", "path=/b cairn_chunks", 2, "m")
    assert not unchanged("m", "edge=/a cairn_chunks", 1, "m")
    assert unchanged("m", "edge=/a cairn_chunks", 2, "m")


def test_a_document_whose_vectors_are_in_another_store_is_written_to_this_one(
    start_private: Callable[..., RunningRetrieval], org: Org
) -> None:
    before = start_private("before", engine="local", CAIRN_EMBEDDER="local")
    first = before.client.ingest(org.ingester(), [_document("shed", NOTE)])
    assert first[0].result.outcome == retrieval_pb2.DOCUMENT_OUTCOME_INGESTED
    # The same database, but the deployment now searches another store.
    after = start_private("after", engine="edge", CAIRN_EMBEDDER="local")

    again = after.client.ingest(org.ingester(), [_document("shed", NOTE)])
    once_more = after.client.ingest(org.ingester(), [_document("shed", NOTE)])

    assert again[0].result.outcome == retrieval_pb2.DOCUMENT_OUTCOME_REPLACED
    assert again[0].result.embedded_chunks == 1
    assert once_more[0].result.outcome == retrieval_pb2.DOCUMENT_OUTCOME_UNCHANGED
    answer = after.client.search(org.reader(groups=["staff"]), "when is it", ["handbook"])
    assert answer.mode == retrieval_pb2.SEARCH_MODE_DENSE_ONLY
    assert [r.document_id for r in answer.results] == ["shed"]


def test_a_document_ingested_without_an_embedder_is_embedded_when_ingested_again_with_one(
    keyword_retrieval: RunningRetrieval, retrieval: RunningRetrieval, org: Org
) -> None:
    first = keyword_retrieval.client.ingest(org.ingester(), [_document("shed", NOTE)])
    assert first[0].result.embedded_chunks == 0

    again = retrieval.client.ingest(org.ingester(), [_document("shed", NOTE)])
    once_more = retrieval.client.ingest(org.ingester(), [_document("shed", NOTE)])

    assert again[0].result.outcome == retrieval_pb2.DOCUMENT_OUTCOME_REPLACED
    assert again[0].result.embedded_chunks == again[0].result.chunks == 1
    assert once_more[0].result.outcome == retrieval_pb2.DOCUMENT_OUTCOME_UNCHANGED
    # Only common words: the dense half alone must find it now.
    answer = retrieval.client.search(org.reader(groups=["staff"]), "when is it", ["handbook"])
    assert answer.mode == retrieval_pb2.SEARCH_MODE_DENSE_ONLY
    assert [r.document_id for r in answer.results] == ["shed"]
    assert answer.results[0].dense_score > 0
    stats = retrieval.client.stats(org.ingester())
    assert (stats.chunks, stats.embedded_chunks) == (1, 1)


@pytest.fixture
def claimed_retrieval(
    start_private: Callable[..., RunningRetrieval], tmp_path: Path, pg_url: str
) -> RunningRetrieval:
    """A hybrid service whose collection was claimed by another model first."""
    qdrant = tmp_path / "claimed" / "qdrant"

    shard = qdrant / "edge" / "cairn_chunks"

    async def claim() -> None:
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute(
                "INSERT INTO retrieval.vector_collections (collection, model_id, dimensions) "
                "VALUES ($1, 'some-other-model', 384)",
                f"edge={qdrant / 'edge'} cairn_chunks "
                + (shard / "cairn-store-id").read_text().strip(),
            )
        finally:
            await conn.close()

    running = start_private("claimed", CAIRN_EMBEDDER="local")
    wait_until(lambda: (shard / "segments").exists() or None, timeout=30)
    asyncio.run(claim())
    return running


def test_a_collection_holding_another_models_vectors_is_never_written_and_searched_keyword_only(
    claimed_retrieval: RunningRetrieval, keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    keyword_retrieval.client.ingest(org.ingester(), [_document("shed", NOTE)])

    with pytest.raises(grpc.RpcError) as refused:
        claimed_retrieval.client.ingest(org.ingester(), [_document("shed", NOTE)])
    answer = claimed_retrieval.client.search(org.reader(groups=["staff"]), "bicycle", ["handbook"])

    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'some-other-model'" in refused.value.details()
    assert repr(LOCAL_MODEL_ID) in refused.value.details()
    assert "CAIRN_QDRANT_COLLECTION" in refused.value.details()
    assert answer.mode == retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY
    assert answer.mode_reason == MODEL_MISMATCH_REASON
    assert [r.document_id for r in answer.results] == ["shed"]


@pytest.fixture(scope="module")
def gateway(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """The gateway with no embedding provider: its Embed uses the local model."""
    logs = tmp_path_factory.mktemp("gateway-for-retrieval")
    process = start_service(
        "gateway", port=free_port(), env={**service_env, "CAIRN_EMBEDDER": "local"}, log_dir=logs
    )
    try:
        wait_for_health(process, timeout=60)
    except BaseException:
        process.stop()
        raise
    yield process
    process.stop()


def test_through_the_gateways_embed_search_is_hybrid_and_stats_name_the_model(
    gateway: ServiceProcess, start_private: Callable[..., RunningRetrieval], org: Org
) -> None:
    running = start_private(
        "via-gateway", CAIRN_RETRIEVAL_EMBEDDER="gateway", CAIRN_GATEWAY_ADDR=gateway.address
    )

    ingested = running.client.ingest(org.ingester(), [_document("shed", NOTE)])
    answer = running.client.search(org.reader(groups=["staff"]), "bicycle shed", ["handbook"])
    stats = running.client.stats(org.ingester())

    assert ingested[0].result.embedded_chunks == 1
    assert answer.mode == retrieval_pb2.SEARCH_MODE_HYBRID
    assert answer.results[0].dense_rank == 1
    assert stats.embedder == LOCAL_MODEL_ID


def test_a_gateway_model_that_is_not_configured_fails_the_document_and_says_so(
    gateway: ServiceProcess, start_private: Callable[..., RunningRetrieval], org: Org
) -> None:
    running = start_private(
        "wrong-model",
        CAIRN_RETRIEVAL_EMBEDDER="gateway",
        CAIRN_GATEWAY_ADDR=gateway.address,
        CAIRN_RETRIEVAL_EMBED_MODEL="no-such-model",
    )

    ingested = running.client.ingest(org.ingester(), [_document("shed", NOTE)])

    result = ingested[0].result
    assert result.outcome == retrieval_pb2.DOCUMENT_OUTCOME_FAILED
    assert "no-such-model" in result.error
    assert "the document was not changed" in result.error
