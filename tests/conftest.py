"""The whole system for cross-service tests: the offline model and the four
services as separate processes over real gRPC, a real PostgreSQL, Qdrant local
mode, and an OTLP receiver in this process that collects every span they export.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.demo_corpus import handbook_documents, load_handbook
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import (
    REPO_ROOT,
    ServiceProcess,
    free_port,
    stack_env,
    start_fake_provider,
    start_service,
    wait_for_health,
    wait_for_http,
)
from tests.replicas_support import ReplicaStack, session_replica_stack

SERVICES = ("gateway", "retrieval", "memory", "orchestrator")


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace endpoint that keeps what it is sent."""

    def __init__(self) -> None:
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        collected = []
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    collected.append(_collected(service, span))
        with self._lock:
            self._spans.extend(collected)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: str) -> list[CollectedSpan]:
        with self._lock:
            return [s for s in self._spans if s.trace_id == trace_id]


def _collected(service: str, span: trace_pb2.Span) -> CollectedSpan:
    attributes: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        attributes[a.key] = getattr(a.value, kind) if kind else None
    return CollectedSpan(
        service=service,
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        attributes=attributes,
    )


@pytest.fixture(scope="session")
def otlp() -> Iterator[tuple[OtlpReceiver, str]]:
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


@dataclass
class Stack:
    addresses: dict[str, str]
    processes: dict[str, ServiceProcess]
    model: ServiceProcess
    model_url: str
    issuer: TokenIssuer
    otlp: OtlpReceiver
    org: str
    corpus: dict[str, Any] = field(default_factory=dict)

    def token(self, user: str, roles: list[str], *, org: str | None = None) -> str:
        return self.issuer.caller_token(org_id=org or self.org, user_id=user, roles=roles)


@pytest.fixture(scope="session")
def stack(
    service_env: dict[str, str],
    pg_url: str,
    dev_keys: tuple[Path, Path],
    issuer: TokenIssuer,
    otlp: tuple[OtlpReceiver, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("stack")
    logs = base / "logs"
    model_port = free_port()
    model = start_fake_provider(port=model_port, log_dir=logs)
    ports = {name: free_port() for name in SERVICES}
    addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    env = {
        **service_env,
        **stack_env(
            database_url=pg_url,
            keys=dev_keys,
            qdrant_path=base / "qdrant",
            model_url=f"http://127.0.0.1:{model_port}",
            addresses=addresses,
        ),
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp[1],
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    processes = {
        name: start_service(name, port=ports[name], env=env, log_dir=logs) for name in SERVICES
    }
    try:
        wait_for_http(model)
        for proc in processes.values():
            wait_for_health(proc, timeout=90)
        stack = Stack(
            addresses=addresses,
            processes=processes,
            model=model,
            model_url=f"http://127.0.0.1:{model_port}",
            issuer=issuer,
            otlp=otlp[0],
            org=f"org-{uuid.uuid4().hex[:10]}",
        )
        stack.corpus = _ingest_handbook(stack)
        yield stack
    finally:
        for proc in processes.values():
            proc.stop()
        model.stop()


def _ingest_handbook(stack: Stack) -> dict[str, Any]:
    corpus = load_handbook()
    token = stack.token(corpus["ingester"]["user"], corpus["ingester"]["roles"])
    documents = handbook_documents(corpus)
    with grpc.insecure_channel(stack.addresses["retrieval"]) as ch:
        list(
            retrieval_pb2_grpc.RetrievalServiceStub(ch).IngestDocuments(
                retrieval_pb2.IngestDocumentsRequest(documents=documents),
                metadata=call_metadata(token),
                timeout=120,
            )
        )
    return corpus


def repo_path(*parts: str) -> Path:
    return REPO_ROOT.joinpath(*parts)


@pytest.fixture(scope="session")
def replicas(
    tmp_path_factory: pytest.TempPathFactory,
    dev_keys: tuple[Path, Path],
    service_env: dict[str, str],
) -> Iterator[ReplicaStack]:
    """Three replicas of every service on a PostgreSQL of their own, started by the
    first test that asks and shared by the replica and fault tests."""
    with session_replica_stack(tmp_path_factory, keys=dev_keys, service_env=service_env) as stack:
        yield stack
