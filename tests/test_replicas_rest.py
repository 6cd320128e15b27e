"""The REST proxy in front of three replicas of every service: it dials the list
of replicas round robin with cairn's retry policy, so a read in flight on an
orchestrator replica that is SIGKILLed is answered by another one, and REST
callers see no error at all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from cairn_libs.stack import (
    build_restproxy,
    free_port,
    start_restproxy,
    wait_for_health,
    wait_for_http,
)
from tests.replicas_support import QUESTION, ReplicaStack

# The first module to use the shared stack starts its twelve processes.
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def rest_url(replicas: ReplicaStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    build_restproxy()
    port = free_port()
    proxy = start_restproxy(
        port=port,
        addresses=replicas.targets,
        env={},
        log_dir=tmp_path_factory.mktemp("restproxy-replicas"),
    )
    try:
        wait_for_http(proxy)
        yield f"http://127.0.0.1:{port}"
    finally:
        proxy.stop()


async def test_rest_reads_go_on_without_an_error_while_an_orchestrator_replica_is_killed(
    replicas: ReplicaStack, rest_url: str
) -> None:
    token = replicas.issuer.caller_token(org_id=replicas.new_org(), user_id="maria")
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=rest_url, headers=headers, timeout=30) as http:
        started = await http.post("/v1/runs", json={"agent": "handbook", "input": QUESTION})
        assert started.status_code == 200, started.text
        run_id = started.json()["run"]["runId"]
        statuses: list[int] = []
        stop = asyncio.Event()

        async def reader() -> None:
            while not stop.is_set():
                statuses.append((await http.get(f"/v1/runs/{run_id}")).status_code)

        readers = [asyncio.create_task(reader()) for _ in range(4)]
        deadline = time.monotonic() + 30
        while len(statuses) < 20:
            assert time.monotonic() < deadline, "the reads did not get going"
            await asyncio.sleep(0.01)
        replicas.local.kill("orchestrator", 1)
        killed_at = len(statuses)
        while len(statuses) < killed_at + 60:
            assert time.monotonic() < deadline, "the reads stopped after the kill"
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.gather(*readers)
    proc = replicas.local.start("orchestrator", 1, generation=100)
    await asyncio.to_thread(wait_for_health, proc, timeout=120)

    assert set(statuses) == {200}, sorted(set(statuses))
