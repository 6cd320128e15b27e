"""Retrieval service processes for the tests: each a real `python -m
cairn_retrieval` on the shared PostgreSQL, with an embedded Qdrant in its own
temporary folder (either engine locks its folder to one process).

The hybrid services run once per embedded engine, qdrant-client's local mode and
Qdrant Edge, so every test of a hybrid service, the non-interference property
among them, holds for both."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import grpc
import pytest
import qdrant_edge as qe
from qdrant_client import AsyncQdrantClient
from qdrant_client.http import models as qm

from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import ServiceProcess, free_port, start_service, wait_for_health


class RetrievalClient:
    """A sync client over real gRPC (sync so hypothesis tests can use it too)."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = retrieval_pb2_grpc.RetrievalServiceStub(self._channel)

    def ingest(
        self, token: str, documents: Iterable[retrieval_pb2.Document]
    ) -> list[retrieval_pb2.IngestDocumentsResponse]:
        request = retrieval_pb2.IngestDocumentsRequest(documents=list(documents))
        return list(self._stub.IngestDocuments(request, metadata=call_metadata(token), timeout=60))

    def search(
        self,
        token: str,
        query: str,
        sources: Sequence[str],
        *,
        k: int = 0,
        mode: retrieval_pb2.SearchMode = retrieval_pb2.SEARCH_MODE_UNSPECIFIED,
    ) -> retrieval_pb2.SearchResponse:
        request = retrieval_pb2.SearchRequest(query=query, sources=list(sources), k=k, mode=mode)
        return self._stub.Search(request, metadata=call_metadata(token), timeout=30)

    def get_document(self, token: str, document_id: str) -> retrieval_pb2.Document:
        request = retrieval_pb2.GetDocumentRequest(document_id=document_id)
        answer = self._stub.GetDocument(request, metadata=call_metadata(token), timeout=30)
        return answer.document

    def delete(self, token: str, document_id: str) -> retrieval_pb2.DeleteDocumentResponse:
        request = retrieval_pb2.DeleteDocumentRequest(document_id=document_id)
        return self._stub.DeleteDocument(request, metadata=call_metadata(token), timeout=30)

    def stats(self, token: str) -> retrieval_pb2.StatsResponse:
        return self._stub.Stats(
            retrieval_pb2.StatsRequest(), metadata=call_metadata(token), timeout=30
        )

    def close(self) -> None:
        self._channel.close()


ENGINES = ("local", "edge")


@dataclass
class RunningRetrieval:
    process: ServiceProcess
    client: RetrievalClient
    qdrant_path: Path | None
    engine: str

    async def stored_points(self, org_id: str) -> list[tuple[str, dict[str, object]]]:
        """(point id, payload) of every point of `org_id` in the embedded store.
        Stop the process first: the store's folder is locked while it runs."""
        assert self.qdrant_path is not None
        if self.engine == "edge":
            shard = qe.EdgeShard.load(str(self.qdrant_path / "edge" / "cairn_chunks"))
            try:
                records, _ = shard.scroll(
                    qe.ScrollRequest(
                        limit=1000,
                        filter=qe.Filter(
                            must=[qe.FieldCondition("org_id", match=qe.MatchValue(org_id))]
                        ),
                        with_payload=True,
                    )
                )
            finally:
                shard.close()
            return [(str(r.id), dict(r.payload or {})) for r in records]
        client = AsyncQdrantClient(path=str(self.qdrant_path))
        try:
            points, _ = await client.scroll(
                "cairn_chunks",
                scroll_filter=qm.Filter(
                    must=[qm.FieldCondition(key="org_id", match=qm.MatchValue(value=org_id))]
                ),
                limit=1000,
                with_payload=True,
            )
        finally:
            await client.close()
        return [(str(p.id), dict(p.payload or {})) for p in points]


def start_retrieval(
    service_env: dict[str, str], base: Path, name: str, *, engine: str = "edge", **extra: str
) -> RunningRetrieval:
    qdrant_path = base / "qdrant"
    env = {
        **service_env,
        "CAIRN_QDRANT_PATH": str(qdrant_path),
        "CAIRN_QDRANT_ENGINE": engine,
        **extra,
    }
    process = start_service(
        "retrieval", port=free_port(), env=env, log_dir=base / "logs", suffix=f"-{name}"
    )
    try:
        wait_for_health(process, timeout=60)
    except BaseException:
        process.stop()
        raise
    return RunningRetrieval(
        process=process,
        client=RetrievalClient(process.address),
        qdrant_path=None if "QDRANT_URL" in extra else qdrant_path,
        engine=engine,
    )


def _serve(
    service_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *,
    engine: str = "edge",
    **extra: str,
) -> Iterator[RunningRetrieval]:
    running = start_retrieval(
        service_env, tmp_path_factory.mktemp(name), name, engine=engine, **extra
    )
    yield running
    running.client.close()
    running.process.stop()


@pytest.fixture(scope="session", params=ENGINES, ids=[f"qdrant-{e}" for e in ENGINES])
def retrieval(
    service_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[RunningRetrieval]:
    """Hybrid: the local ONNX embedder and an embedded Qdrant, once per engine."""
    yield from _serve(
        service_env,
        tmp_path_factory,
        f"hybrid-{request.param}",
        engine=request.param,
        CAIRN_EMBEDDER="local",
    )


@pytest.fixture(scope="session")
def keyword_retrieval(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningRetrieval]:
    """Started with CAIRN_EMBEDDER=none."""
    yield from _serve(service_env, tmp_path_factory, "keyword", CAIRN_EMBEDDER="none")


@pytest.fixture(scope="session")
def unreachable_qdrant_retrieval(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningRetrieval]:
    """An embedder, but QDRANT_URL points at a port nothing listens on."""
    yield from _serve(
        service_env,
        tmp_path_factory,
        "noqdrant",
        CAIRN_EMBEDDER="local",
        QDRANT_URL=f"http://127.0.0.1:{free_port()}",
        CAIRN_QDRANT_TIMEOUT_SECONDS="2",
    )


@pytest.fixture(params=ENGINES, ids=[f"qdrant-{e}" for e in ENGINES])
def private_retrieval(
    service_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[RunningRetrieval]:
    """A hybrid service of the test's own, so the test may stop it and open its
    Qdrant folder to count points; once per engine."""
    running = start_retrieval(
        service_env, tmp_path, "private", engine=request.param, CAIRN_EMBEDDER="local"
    )
    yield running
    running.client.close()
    running.process.stop()


@pytest.fixture
def start_private(
    service_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., RunningRetrieval]]:
    """Start services of the test's own, with extra environment; all stopped after."""
    started: list[RunningRetrieval] = []

    def start(name: str, **extra: str) -> RunningRetrieval:
        running = start_retrieval(service_env, tmp_path / name, name, **extra)
        started.append(running)
        return running

    yield start
    for running in started:
        running.client.close()
        running.process.stop()


@pytest.fixture
def start_in(service_env: dict[str, str]) -> Iterator[Callable[..., RunningRetrieval]]:
    """Start a service on the embedded store in `base` (so one test can start
    several, one after another, on the same folder); all stopped after."""
    started: list[RunningRetrieval] = []

    def start(base: Path, name: str, *, engine: str = "edge", **extra: str) -> RunningRetrieval:
        running = start_retrieval(service_env, base, name, engine=engine, **extra)
        started.append(running)
        return running

    yield start
    for running in started:
        running.client.close()
        running.process.stop()


@dataclass(frozen=True)
class Org:
    """Tokens for one fresh org."""

    org_id: str
    issuer: TokenIssuer

    def ingester(self) -> str:
        return self.issuer.caller_token(org_id=self.org_id, user_id="loader", roles=["ingester"])

    def reader(
        self,
        user_id: str = "reader",
        *,
        roles: list[str] | None = None,
        groups: list[str] | None = None,
    ) -> str:
        return self.issuer.caller_token(
            org_id=self.org_id, user_id=user_id, roles=roles or [], groups=groups or []
        )


@pytest.fixture
def org(new_org: str, issuer: TokenIssuer) -> Org:
    return Org(new_org, issuer)


@pytest.fixture
async def pg(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_url)
    try:
        yield conn
    finally:
        await conn.close()
