"""Bringing up what a benchmark measures: the same processes `make run` starts,
on free ports, with state under state/bench."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import (
    REPO_ROOT,
    ServiceProcess,
    free_port,
    stack_env,
    start_embedded_postgres,
    start_fake_provider,
    start_service,
    wait_for_health,
    wait_for_http,
)

STATE = REPO_ROOT / "state" / "bench"


@dataclass
class BenchStack:
    model_url: str
    addresses: dict[str, str]
    issuer: TokenIssuer


@contextmanager
def bench_stack(services: tuple[str, ...]) -> Iterator[BenchStack]:
    STATE.mkdir(parents=True, exist_ok=True)
    private_key, public_key = generate_dev_keypair(STATE / "keys")
    pg_url = start_embedded_postgres(STATE / "pg")
    logs = STATE / "logs"
    model_port = free_port()
    model = start_fake_provider(port=model_port, log_dir=logs, name="bench")
    ports = {name: free_port() for name in ("gateway", "retrieval", "memory", "orchestrator")}
    addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    env = {
        **stack_env(
            database_url=pg_url,
            keys=(private_key, public_key),
            qdrant_path=STATE / "qdrant",
            model_url=f"http://127.0.0.1:{model_port}",
            addresses=addresses,
        ),
        "CAIRN_LOG_LEVEL": "WARNING",
    }
    processes: list[ServiceProcess] = [model]
    try:
        wait_for_http(model)
        for name in services:
            processes.append(start_service(name, port=ports[name], env=env, log_dir=logs))
        for proc in processes[1:]:
            wait_for_health(proc, timeout=90)
        yield BenchStack(
            model_url=f"http://127.0.0.1:{model_port}",
            addresses=addresses,
            issuer=TokenIssuer.from_file(private_key),
        )
    finally:
        for proc in reversed(processes):
            proc.stop()
