"""Three replicas of every service for the replica and fault tests: the same
processes `make run` starts, each service on three loopback ports, dialled by
every caller as one round-robin target; two offline models (the bundled agents'
and the scribe's scripted one, see cairn_libs.stack.write_agent_setup); and a
PostgreSQL of their own, so the fault tests' restart of it disturbs no other test.

Starting twelve service processes is most of these tests' time, so the stack is
started once per test session (the `replicas` fixture in tests/conftest.py) and used
by every module that asks; a test that kills a replica starts it again before it ends."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import (
    SERVICE_MODULES,
    LocalStack,
    ServiceProcess,
    free_port,
    plan_replica_ports,
    replica_targets,
    stack_env,
    start_embedded_postgres,
    start_fake_provider,
    start_local_stack,
    stop_embedded_postgres,
    wait_for_http,
    write_agent_setup,
)

T = TypeVar("T")
SERVICES = tuple(SERVICE_MODULES)
LEASE_SECONDS = 2.0
QUESTION = "How many days of annual leave do I get?"


@dataclass
class ReplicaStack:
    local: LocalStack
    offline: ServiceProcess
    scripted: ServiceProcess
    pg_url: str
    issuer: TokenIssuer
    pg_dir: Path | None = None

    @property
    def targets(self) -> dict[str, str]:
        return self.local.targets

    @property
    def scripted_url(self) -> str:
        return f"http://{self.scripted.address}"

    def new_org(self) -> str:
        return f"org-{uuid.uuid4().hex[:10]}"


@contextmanager
def replica_stack(
    base: Path,
    *,
    pg_url: str,
    keys: tuple[Path, Path],
    service_env: dict[str, str],
    replicas: int = 3,
    lease_seconds: float = LEASE_SECONDS,
) -> Iterator[ReplicaStack]:
    """The stack on `pg_url` (the bench's replicas suite starts it too)."""
    logs = base / "logs"
    offline = start_fake_provider(port=free_port(), log_dir=logs, name="offline")
    scripted = start_fake_provider(port=free_port(), log_dir=logs, name="scripted")
    local: LocalStack | None = None
    try:
        wait_for_http(offline)
        wait_for_http(scripted)
        ports = plan_replica_ports(SERVICES, replicas=replicas)
        env = {
            **service_env,
            **stack_env(
                database_url=pg_url,
                keys=keys,
                qdrant_path=base / "qdrant",
                model_url=f"http://{offline.address}",
                addresses=replica_targets(ports),
            ),
            **write_agent_setup(
                base,
                offline_url=f"http://{offline.address}",
                scripted_url=f"http://{scripted.address}",
            ),
            "CAIRN_RUN_LEASE_SECONDS": str(lease_seconds),
            "CAIRN_GATEWAY_COOLDOWN_SYNC_SECONDS": "0.2",
        }
        local = start_local_stack(ports, env=env, log_dir=logs, timeout=180)
        yield ReplicaStack(
            local=local,
            offline=offline,
            scripted=scripted,
            pg_url=pg_url,
            issuer=TokenIssuer.from_file(keys[0]),
        )
    finally:
        if local is not None:
            local.stop()
        offline.stop()
        scripted.stop()


async def poll(predicate: Callable[[], T | None], *, within: float, interval: float = 0.05) -> T:
    """Wait for an event the code under test causes (the async twin of wait_until)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(f"condition not met within {within} s")


@contextmanager
def session_replica_stack(
    tmp_path_factory: pytest.TempPathFactory,
    *,
    keys: tuple[Path, Path],
    service_env: dict[str, str],
) -> Iterator[ReplicaStack]:
    """The three-replica stack on a PostgreSQL of its own, for the session's
    `replicas` fixture (tests/conftest.py)."""
    pg_base = Path(tempfile.mkdtemp(prefix="cairn-replicas-"))
    pg_base.chmod(0o755)  # as root, PostgreSQL runs as `pgserver`, which must reach it
    pg_url = start_embedded_postgres(pg_base / "pg")
    try:
        with replica_stack(
            tmp_path_factory.mktemp("replicas"),
            pg_url=pg_url,
            keys=keys,
            service_env={**service_env, "DATABASE_URL": pg_url},
        ) as stack:
            stack.pg_dir = pg_base / "pg"
            yield stack
    finally:
        stop_embedded_postgres(pg_base / "pg")
        shutil.rmtree(pg_base, ignore_errors=True)
