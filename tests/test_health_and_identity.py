"""Every service reports its health truthfully and refuses bad tokens before any work."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import (
    free_port,
    health_status,
    start_service,
    wait_for_health,
    wait_until,
)
from tests.conftest import SERVICES, Stack


class UnixSocketProxy:
    """Stands between the services and PostgreSQL's socket so a test can make the
    database unreachable (refuse and cut every connection) and reachable again."""

    def __init__(self, upstream: Path, listen_dir: Path) -> None:
        self._upstream = str(upstream)
        self._path = str(listen_dir / upstream.name)
        self._connections: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()

    def up(self) -> None:
        if os.path.exists(self._path):
            os.unlink(self._path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self._path)
        os.chmod(self._path, 0o777)
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            if os.path.exists(self._path):
                os.unlink(self._path)
            for conn in self._connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self._connections.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.connect(self._upstream)
            with self._lock:
                self._connections += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@pytest.fixture(scope="module")
def proxied_services(
    service_env: dict[str, str], pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[UnixSocketProxy, dict[str, Any]]]:
    socket_dir = Path(pg_url.split("host=")[1].split("&")[0])
    base = tmp_path_factory.mktemp("proxied")
    listen_dir = base / "sock"
    listen_dir.mkdir()
    os.chmod(listen_dir, 0o777)
    proxy = UnixSocketProxy(socket_dir / ".s.PGSQL.5432", listen_dir)
    proxy.up()
    env = {
        **service_env,
        "DATABASE_URL": pg_url.split("?")[0] + f"?host={listen_dir}",
        "CAIRN_QDRANT_PATH": str(base / "qdrant"),
        "CAIRN_EMBEDDER": "none",
    }
    procs = {
        name: start_service(
            name, port=free_port(), env=env, log_dir=base / "logs", suffix="-proxied"
        )
        for name in SERVICES
    }
    try:
        for proc in procs.values():
            wait_for_health(proc, timeout=90)
        yield proxy, procs
    finally:
        proxy.down()
        for proc in procs.values():
            proc.stop()


def test_each_service_reports_serving_then_not_serving_while_its_database_is_unreachable(
    proxied_services: tuple[UnixSocketProxy, dict[str, Any]],
) -> None:
    proxy, procs = proxied_services
    for proc in procs.values():
        assert health_status(proc.address) == "SERVING"
    proxy.down()
    try:
        for name, proc in procs.items():
            wait_until(lambda p=proc: health_status(p.address) == "NOT_SERVING", timeout=20)
            assert procs[name].process.poll() is None, (
                f"{name} must keep running while the database is away"
            )
    finally:
        proxy.up()
    for proc in procs.values():
        wait_until(lambda p=proc: health_status(p.address) == "SERVING", timeout=30)


def test_a_service_started_without_its_database_is_not_serving(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**service_env, "DATABASE_URL": f"postgresql://postgres:@/postgres?host={tmp_path}"}
    proc = start_service(
        "memory", port=free_port(), env={**env, "CAIRN_EMBEDDER": "none"}, log_dir=tmp_path / "logs"
    )
    try:
        wait_for_health(proc, want="NOT_SERVING", timeout=60)
        time.sleep(0.5)
        assert health_status(proc.address) == "NOT_SERVING"
    finally:
        proc.stop()


def _bad_tokens(issuer: TokenIssuer, org: str, tmp_path: Path) -> dict[str, str | None]:
    forger = TokenIssuer.from_file(generate_dev_keypair(tmp_path / "other-key")[0])
    return {
        "missing": None,
        "other key": forger.caller_token(
            org_id=org, user_id="mallory", roles=["ingester", "admin"]
        ),
        "expired": issuer.caller_token(
            org_id=org,
            user_id="mallory",
            roles=["ingester", "admin"],
            now=time.time() - 7200,
            ttl_seconds=60,
        ),
    }


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return call_metadata(token) if token else ()


def _write_calls(stack: Stack) -> dict[str, Callable[[grpc.Channel, str | None], Any]]:
    def gateway(ch: grpc.Channel, token: str | None) -> Any:
        return gateway_pb2_grpc.GatewayServiceStub(ch).Chat(
            gateway_pb2.ChatRequest(
                messages=[
                    gateway_pb2.Message(role=gateway_pb2.MESSAGE_ROLE_USER, content="unauth probe")
                ],
                tier=gateway_pb2.TIER_FAST,
            ),
            metadata=_metadata(token),
            timeout=10,
        )

    def retrieval(ch: grpc.Channel, token: str | None) -> Any:
        doc = retrieval_pb2.Document(
            document_id="planted",
            source="handbook",
            title="planted",
            text="planted text",
            acl=retrieval_pb2.Acl(roles=["employee"]),
        )
        return list(
            retrieval_pb2_grpc.RetrievalServiceStub(ch).IngestDocuments(
                retrieval_pb2.IngestDocumentsRequest(documents=[doc]),
                metadata=_metadata(token),
                timeout=10,
            )
        )

    def memory(ch: grpc.Channel, token: str | None) -> Any:
        return memory_pb2_grpc.MemoryServiceStub(ch).Remember(
            memory_pb2.RememberRequest(
                text="The planted memory is here.",
                subject=memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_WORKSPACE),
            ),
            metadata=_metadata(token),
            timeout=10,
        )

    def orchestrator(ch: grpc.Channel, token: str | None) -> Any:
        return orchestrator_pb2_grpc.OrchestratorServiceStub(ch).StartRun(
            orchestrator_pb2.StartRunRequest(agent="handbook", input="unauth probe"),
            metadata=_metadata(token),
            timeout=30,
        )

    return {
        "gateway": gateway,
        "retrieval": retrieval,
        "memory": memory,
        "orchestrator": orchestrator,
    }


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize("kind", ["missing", "other key", "expired"])
def test_a_bad_token_is_unauthenticated_and_nothing_is_written(
    stack: Stack, service: str, kind: str, tmp_path: Path
) -> None:
    org = f"org-{uuid.uuid4().hex[:10]}"
    token = _bad_tokens(stack.issuer, org, tmp_path)[kind]
    requests_before = len(httpx.get(f"{stack.model_url}/_control/requests").json()["requests"])
    with (
        grpc.insecure_channel(stack.addresses[service]) as ch,
        pytest.raises(grpc.RpcError) as caught,
    ):
        _write_calls(stack)[service](ch, token)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "mallory" not in (caught.value.details() or "")
    _assert_nothing_written(stack, org)
    assert (
        len(httpx.get(f"{stack.model_url}/_control/requests").json()["requests"]) == requests_before
    )


def _assert_nothing_written(stack: Stack, org: str) -> None:
    """Look with a valid token of the same org: nothing of the probe may exist."""
    admin = stack.token("auditor", ["admin", "ingester", "employee"], org=org)
    md = call_metadata(admin)
    with grpc.insecure_channel(stack.addresses["retrieval"]) as ch:
        stats = retrieval_pb2_grpc.RetrievalServiceStub(ch).Stats(
            retrieval_pb2.StatsRequest(), metadata=md, timeout=10
        )
        assert stats.documents == 0 and stats.chunks == 0
    with grpc.insecure_channel(stack.addresses["memory"]) as ch:
        held = memory_pb2_grpc.MemoryServiceStub(ch).Held(
            memory_pb2.HeldRequest(
                subject=memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_WORKSPACE)
            ),
            metadata=md,
            timeout=10,
        )
        assert list(held.memories) == []
    with grpc.insecure_channel(stack.addresses["orchestrator"]) as ch:
        runs = orchestrator_pb2_grpc.OrchestratorServiceStub(ch).ListRuns(
            orchestrator_pb2.ListRunsRequest(), metadata=md, timeout=10
        )
        assert list(runs.runs) == []


@pytest.mark.parametrize("service", SERVICES)
def test_health_and_reflection_need_no_token(stack: Stack, service: str) -> None:
    assert health_status(stack.addresses[service]) == "SERVING"
