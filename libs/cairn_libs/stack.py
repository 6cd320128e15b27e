"""Starting cairn's processes locally: the embedded PostgreSQL, the offline model
and the four services, each as its own OS process. Used by `make run` and by the
tests, so both exercise the same start-up path a deployment does.

Replicas. `start_replicas` starts N processes of one service on loopback ports, and
`replica_target` names them for a client as one `ipv4:` target, which every cairn
channel balances round robin (cairn_libs.clients). Each retrieval replica after the
first keeps its embedded vector store in a folder of its own (`replica-<n>` under
CAIRN_QDRANT_PATH): an embedded store is locked by the process holding it, so on one
machine without a Qdrant server the replicas share PostgreSQL (documents, chunks,
BM25) but not dense vectors; a deployment points every replica at one QDRANT_URL.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cairn_libs.errors import ConfigurationError

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

SERVICE_MODULES = {
    "gateway": "cairn_gateway",
    "retrieval": "cairn_retrieval",
    "memory": "cairn_memory",
    "orchestrator": "cairn_orchestrator",
}


REPLICAS_ENV = "CAIRN_REPLICAS"


def replicas_setting(env: Mapping[str, str] | None = None) -> int:
    """How many replicas of each service the local stack starts (CAIRN_REPLICAS, 1)."""
    raw = (os.environ if env is None else env).get(REPLICAS_ENV, "").strip()
    if not raw:
        return 1
    if not raw.isdigit() or not 1 <= int(raw) <= 16:
        raise ConfigurationError(
            f"{REPLICAS_ENV}={raw!r} is not a number of replicas; give a whole number from 1 to 16"
        )
    return int(raw)


def replica_target(addresses: Sequence[str]) -> str:
    """One gRPC target for every replica's address: the address itself for one,
    `ipv4:a,b,c` for several (round robin and retries come from the channel)."""
    if not addresses:
        raise ValueError("a target needs at least one address")
    if len(addresses) == 1:
        return addresses[0]
    return "ipv4:" + ",".join(addresses)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stack_env(
    *,
    database_url: str,
    keys: tuple[Path, Path],
    qdrant_path: Path,
    model_url: str,
    addresses: Mapping[str, str],
) -> dict[str, str]:
    """What the four services need to find their database, keys, vector store, the
    offline model and each other: the one wiring `make run`, the tests and the
    benchmarks share. `keys` is (private, public) as generate_dev_keypair returns."""
    private_key, public_key = keys
    return {
        "DATABASE_URL": database_url,
        "CAIRN_JWT_PUBLIC_KEY_FILE": str(public_key),
        "CAIRN_SERVICE_SIGNING_KEY_FILE": str(private_key),
        "CAIRN_QDRANT_PATH": str(qdrant_path),
        "CAIRN_OFFLINE_MODEL_URL": f"{model_url}/v1",
        "CAIRN_AGENTS_DIR": str(REPO_ROOT / "agents"),
        "CAIRN_GATEWAY_ADDR": addresses["gateway"],
        "CAIRN_RETRIEVAL_ADDR": addresses["retrieval"],
        "CAIRN_MEMORY_ADDR": addresses["memory"],
        # memory's Forget erases the orchestrator's copies too (I9)
        "CAIRN_ORCHESTRATOR_ADDR": addresses["orchestrator"],
    }


def start_embedded_postgres(data_dir: Path) -> str:
    """Start (or reuse) pgserver's PostgreSQL in `data_dir`; return its URL.

    The server outlives this process (cleanup_mode=None) so a second `make run`
    or a later test session reuses it; `stop_embedded_postgres` stops it.
    """
    import warnings

    # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI) and falls
    # back to /tmp, which is what we want; the warning is noise here.
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    import pgserver

    data_dir.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(data_dir, cleanup_mode=None)
    uri: str = server.get_uri()
    return uri


def stop_embedded_postgres(data_dir: Path) -> None:
    import pgserver

    if (data_dir / "postmaster.pid").exists():
        pgserver.pg_ctl(
            ["-w", "stop"], pgdata=data_dir, user="pgserver" if os.geteuid() == 0 else None
        )


def resume_embedded_postgres(data_dir: Path, url: str) -> None:
    """Start again, with pg_ctl, a server that `stop_embedded_postgres` stopped in this
    process (pgserver keeps its handle and would not start it twice), on the same
    socket, so `url` reaches it again. The fault tests restart PostgreSQL so."""
    import pgserver

    socket_dir = url.rpartition("host=")[2].split("&", 1)[0]
    pgserver.pg_ctl(
        ["-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(data_dir / "log"), "start"],
        pgdata=data_dir,
        user="pgserver" if os.geteuid() == 0 else None,
        timeout=30,
    )


@dataclass
class ServiceProcess:
    name: str
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    def stop(self, *, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log_file is not None:
            self._log_file.close()
        return self.process.returncode

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        if self._log_file is not None:
            self._log_file.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def start_process(
    name: str,
    argv: list[str],
    *,
    env: Mapping[str, str],
    log_dir: Path,
    address: str,
) -> ServiceProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "ab")  # noqa: SIM115 - owned by ServiceProcess
    process = subprocess.Popen(
        argv,
        env={**os.environ, **env},
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
    )
    return ServiceProcess(
        name=name, address=address, process=process, log_path=log_path, _log_file=log_file
    )


def start_service(
    service: str, *, port: int, env: Mapping[str, str], log_dir: Path, suffix: str = ""
) -> ServiceProcess:
    return start_process(
        service + suffix,
        [sys.executable, "-m", SERVICE_MODULES[service]],
        env={**env, "CAIRN_PORT": str(port)},
        log_dir=log_dir,
        address=f"127.0.0.1:{port}",
    )


def replica_env(service: str, index: int, env: Mapping[str, str]) -> dict[str, str]:
    """A replica's own settings on top of the stack's: only the embedded vector store
    differs (see the module docstring)."""
    if service != "retrieval" or index == 0 or env.get("QDRANT_URL"):
        return dict(env)
    base = Path(env.get("CAIRN_QDRANT_PATH", str(REPO_ROOT / "state" / "qdrant")))
    return {**env, "CAIRN_QDRANT_PATH": str(base / f"replica-{index}")}


def start_replicas(
    service: str, *, ports: Sequence[int], env: Mapping[str, str], log_dir: Path
) -> list[ServiceProcess]:
    """One process of `service` per port; logs as <service>-<n>.log when several."""
    return [
        start_service(
            service,
            port=port,
            env=replica_env(service, index, env),
            log_dir=log_dir,
            suffix=f"-{index}" if len(ports) > 1 else "",
        )
        for index, port in enumerate(ports)
    ]


SCRIBE_AGENT = "scribe"
_SCRIBE_SPEC = """\
name: scribe
description: Keeps notes for the person; the replica tests' and benchmark's write agent.
tier: deep
system_prompt: |
  You keep notes for the person when they ask.
tools: [search_knowledge, append_note]
sources: []
reads_memory: false
budgets:
  tokens: 20000
  model_calls: 6
  wall_seconds: 60
"""


def write_agent_setup(base: Path, *, offline_url: str, scripted_url: str) -> dict[str, str]:
    """Settings for a stack whose runs of the bundled agents answer from the offline
    model while `scribe` runs (tier deep) go to a second, scripted offline model and
    propose the test-only `append_note` write. A script is one queue per model
    process, so runs that other load drives never spend the scribe's steps."""
    agents = base / "agents"
    agents.mkdir(parents=True, exist_ok=True)
    for spec in (REPO_ROOT / "agents").glob("*.yaml"):
        text = spec.read_text()
        # An agent with tool sources needs their systems running (the demo people
        # directory); without them every orchestrator start waits out the listing.
        if "tool_sources:" not in text:
            (agents / spec.name).write_text(text)
    (agents / "scribe.yaml").write_text(_SCRIBE_SPEC)
    config = base / "providers.yaml"
    config.write_text(
        "providers:\n"
        f"  - name: offline\n    base_url: {offline_url}/v1\n    offline_demo: true\n"
        "    models: {fast: cairn-offline-demo, balanced: cairn-offline-demo}\n"
        f"  - name: scripted\n    base_url: {scripted_url}/v1\n    offline_demo: true\n"
        "    models: {deep: cairn-offline-demo}\n"
    )
    return {
        "CAIRN_AGENTS_DIR": str(agents),
        "CAIRN_GATEWAY_CONFIG": str(config),
        "CAIRN_TEST_WRITE_TOOL": "1",
    }


def plan_replica_ports(services: Sequence[str], *, replicas: int) -> dict[str, list[int]]:
    """A free loopback port for each replica of each service."""
    return {service: [free_port() for _ in range(replicas)] for service in services}


def replica_targets(ports: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Each service's client target over all its replicas (for stack_env)."""
    return {
        service: replica_target([f"127.0.0.1:{port}" for port in service_ports])
        for service, service_ports in ports.items()
    }


@dataclass
class LocalStack:
    """N replicas of each service on loopback ports, each of which a test or a
    benchmark may SIGKILL and start again on its own port."""

    ports: dict[str, list[int]]
    env: dict[str, str]
    log_dir: Path
    replicas: dict[str, list[ServiceProcess]] = field(default_factory=dict)
    retired: list[ServiceProcess] = field(default_factory=list)

    @property
    def targets(self) -> dict[str, str]:
        return replica_targets(self.ports)

    def address(self, service: str, index: int) -> str:
        return f"127.0.0.1:{self.ports[service][index]}"

    def start(self, service: str, index: int, *, generation: int = 0) -> ServiceProcess:
        """Start (or start again) replica `index` of `service` on its own port."""
        suffix = f"-{index}" + (f"-g{generation}" if generation else "")
        proc = start_service(
            service,
            port=self.ports[service][index],
            env=replica_env(service, index, self.env),
            log_dir=self.log_dir,
            suffix=suffix,
        )
        self.replicas.setdefault(service, [])
        if index < len(self.replicas[service]):
            self.retired.append(self.replicas[service][index])
            self.replicas[service][index] = proc
        else:
            self.replicas[service].append(proc)
        return proc

    def kill(self, service: str, index: int) -> ServiceProcess:
        """SIGKILL one replica: no shutdown code runs, nothing is released."""
        proc = self.replicas[service][index]
        proc.kill()
        return proc

    def processes(self) -> list[ServiceProcess]:
        return [proc for procs in self.replicas.values() for proc in procs]

    def stop(self) -> None:
        for proc in reversed(self.processes()):
            proc.stop()
        for proc in self.retired:
            proc.stop()


def start_local_stack(
    ports: Mapping[str, Sequence[int]],
    *,
    env: Mapping[str, str],
    log_dir: Path,
    timeout: float = 120.0,
) -> LocalStack:
    """Every replica of every service in `ports`, SERVING before it is handed over;
    `env` should name the services by `replica_targets(ports)` (see stack_env)."""
    stack = LocalStack(
        ports={service: list(p) for service, p in ports.items()}, env=dict(env), log_dir=log_dir
    )
    try:
        for service, service_ports in ports.items():
            for index in range(len(service_ports)):
                stack.start(service, index)
        for proc in stack.processes():
            wait_for_health(proc, timeout=timeout)
    except BaseException:
        stack.stop()
        raise
    return stack


@contextmanager
def serving(
    service: str, *, env: Mapping[str, str], log_dir: Path, suffix: str = "", timeout: float = 60.0
) -> Iterator[ServiceProcess]:
    """A service process on a free port, SERVING before it is handed over and
    stopped afterwards, also when it never became healthy."""
    proc = start_service(service, port=free_port(), env=env, log_dir=log_dir, suffix=suffix)
    try:
        wait_for_health(proc, timeout=timeout)
        yield proc
    finally:
        proc.stop()


RESTPROXY_BINARY = REPO_ROOT / "build" / "bin" / "restproxy"


def build_restproxy() -> Path:
    """Build the Go REST proxy (services/restproxy) into build/bin, as `make restproxy`
    does; with Go's build cache an unchanged proxy rebuilds in about a second."""
    RESTPROXY_BINARY.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["go", "build", "-o", str(RESTPROXY_BINARY), "."],
        cwd=REPO_ROOT / "services" / "restproxy",
        check=True,
    )
    return RESTPROXY_BINARY


def start_restproxy(
    *,
    port: int,
    addresses: Mapping[str, str],
    env: Mapping[str, str],
    log_dir: Path,
    binary: Path = RESTPROXY_BINARY,
) -> ServiceProcess:
    """The REST proxy on `port` in front of the services at `addresses`; wait for it
    with `wait_for_http` (it listens only once every handler is registered)."""
    return start_process(
        "restproxy",
        [str(binary)],
        env={
            **env,
            "CAIRN_RESTPROXY_ADDR": f"127.0.0.1:{port}",
            "CAIRN_ORCHESTRATOR_ADDR": addresses["orchestrator"],
            "CAIRN_MEMORY_ADDR": addresses["memory"],
            "CAIRN_RETRIEVAL_ADDR": addresses["retrieval"],
            "CAIRN_GATEWAY_ADDR": addresses["gateway"],
        },
        log_dir=log_dir,
        address=f"127.0.0.1:{port}",
    )


def start_fake_provider(
    *, port: int, log_dir: Path, name: str = "offline", extra: list[str] | None = None
) -> ServiceProcess:
    return start_process(
        f"fakeprovider-{name}",
        [
            sys.executable,
            "-m",
            "cairn_fakeprovider",
            "--port",
            str(port),
            "--name",
            name,
            *(extra or []),
        ],
        env={},
        log_dir=log_dir,
        address=f"127.0.0.1:{port}",
    )


def health_status(address: str, *, timeout: float = 2.0) -> str:
    """SERVING, NOT_SERVING, or UNREACHABLE."""
    with grpc.insecure_channel(address) as ch:
        try:
            response = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def wait_until(
    predicate: Callable[[], T | None], *, timeout: float = 30.0, interval: float = 0.05
) -> T:
    """Poll for an event the code under test causes, rather than sleep a fixed time;
    return the first truthy value, or raise TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met in time")


def wait_for_health(proc: ServiceProcess, *, want: str = "SERVING", timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise RuntimeError(
                f"{proc.name} exited with {proc.process.returncode}:\n{proc.log_text()[-4000:]}"
            )
        last = health_status(proc.address, timeout=1.0)
        if last == want:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{proc.name} stayed {last} (wanted {want}):\n{proc.log_text()[-4000:]}")


def wait_for_http(proc: ServiceProcess, *, timeout: float = 20.0) -> None:
    host, _, port = proc.address.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.log_text()[-4000:]}")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{proc.name} did not listen on {proc.address}")


def log_events(proc: ServiceProcess) -> list[dict[str, object]]:
    """The JSON log lines a process wrote (non-JSON lines are skipped)."""
    events = []
    for line in proc.log_text().splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            events.append(value)
    return events
