"""What the REST proxy adds in front of the services, measured against gRPC in the
same run on the same stack:

- latency: a handbook run started and then fetched (StartRun, GetRun) over REST and
  over gRPC, the two alternating one iteration each so drift of the stack (caches,
  the database, the machine) falls on both alike; p50/p99 of each and the difference;
- throughput: `GET /v1/agents` over REST and `ListAgents` over gRPC, each at the same
  concurrency for the same time, and the proxy process's CPU (utime + stime from
  /proc/<pid>/stat) per REST request.

The REST client is aiohttp with keep-alive (one pooled connector, as many
connections as the concurrency); the gRPC client is one grpc.aio channel. Both run
in this process, on the same machine as the services, so the figures include the
clients' own cost; they are figures to compare, not targets asserted here (issue
11's targets: the proxy adds <= 1 ms at p50 and keeps >= 70% of gRPC throughput).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from bench.figures import Figure, percentile
from bench.harness import STATE, bench_stack
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.demo_corpus import handbook_documents, load_handbook
from cairn_libs.stack import (
    ServiceProcess,
    build_restproxy,
    free_port,
    start_restproxy,
    wait_for_http,
)

CONCURRENCY = 32
CLIENTS = {"rest_client": "aiohttp keep-alive", "grpc_client": "grpc.aio, one channel"}


def cpu_ms(pid: int) -> float:
    """utime + stime of process `pid` so far, in milliseconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # the command name (field 2) may hold spaces; fields after it start at state (3)
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) * 1000 / os.sysconf("SC_CLK_TCK")


async def run_restproxy(*, quick: bool = False) -> list[Figure]:
    runs = 20 if quick else 100
    seconds = 3.0 if quick else 15.0
    corpus = load_handbook()
    binary = build_restproxy()
    with bench_stack(("gateway", "retrieval", "memory", "orchestrator")) as stack:
        proxy = start_restproxy(
            port=free_port(),
            addresses=stack.addresses,
            env={},
            log_dir=STATE / "logs",
            binary=binary,
        )
        try:
            wait_for_http(proxy)
            base = f"http://{proxy.address}"
            org = f"bench-rest-{int(time.time())}"
            ingester = call_metadata(
                stack.issuer.caller_token(org_id=org, user_id="docs-bot", roles=["ingester"])
            )
            retrieval = channel(stack.addresses["retrieval"])
            async for _ in retrieval_pb2_grpc.RetrievalServiceStub(retrieval).IngestDocuments(
                retrieval_pb2.IngestDocumentsRequest(documents=handbook_documents(corpus)),
                metadata=ingester,
                timeout=300,
            ):
                pass
            await retrieval.close(grace=None)

            token = stack.issuer.caller_token(org_id=org, user_id="maria", roles=["manager"])
            metadata = call_metadata(token)
            headers = {"Authorization": f"Bearer {token}"}
            orch = channel(stack.addresses["orchestrator"])
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(orch)
            connector = aiohttp.TCPConnector(limit=CONCURRENCY, keepalive_timeout=60)
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(
                base_url=base, connector=connector, timeout=timeout, headers=headers
            ) as http:
                latency = await _run_latency(stub, http, metadata, corpus["question"], runs)
                throughput = await _agents_throughput(stub, http, metadata, proxy, seconds)
            await orch.close(grace=None)
        finally:
            proxy.stop()
    return latency + throughput


async def _run_latency(
    stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub,
    http: aiohttp.ClientSession,
    metadata: tuple[tuple[str, str], ...],
    question: str,
    runs: int,
) -> list[Figure]:
    request = orchestrator_pb2.StartRunRequest(agent="handbook", input=question)
    # the GetRun alone, timed inside each iteration: a call with no run behind it, so
    # the proxy's share is not buried under a run's own ~50 ms of variation
    fetches: dict[str, list[float]] = {"grpc": [], "rest": []}

    async def over_grpc() -> None:
        run = (await stub.StartRun(request, metadata=metadata, timeout=60)).run
        fetch_started = time.perf_counter()
        fetched = await stub.GetRun(
            orchestrator_pb2.GetRunRequest(run_id=run.run_id), metadata=metadata, timeout=10
        )
        fetches["grpc"].append((time.perf_counter() - fetch_started) * 1000)
        if fetched.run.state != orchestrator_pb2.RUN_STATE_COMPLETED:
            state = orchestrator_pb2.RunState.Name(fetched.run.state)
            raise RuntimeError(f"a gRPC benchmark run ended {state}; see state/bench/logs")

    async def over_rest() -> None:
        async with http.post("/v1/runs", json={"agent": "handbook", "input": question}) as started:
            body = await started.json()
            if started.status != 200:
                raise RuntimeError(f"POST /v1/runs answered {started.status}: {body}")
        fetch_started = time.perf_counter()
        async with http.get(f"/v1/runs/{body['run']['runId']}") as fetched:
            run = await fetched.json()
        fetches["rest"].append((time.perf_counter() - fetch_started) * 1000)
        if fetched.status != 200 or run.get("run", {}).get("state") != "RUN_STATE_COMPLETED":
            raise RuntimeError(f"a REST benchmark run answered {fetched.status}: {run}")

    for _ in range(5):
        await over_grpc()
        await over_rest()
    samples: dict[str, list[float]] = {"grpc": [], "rest": []}
    fetches["grpc"].clear()
    fetches["rest"].clear()
    for i in range(runs):
        # alternate which goes first, so neither always follows the other
        order = [("grpc", over_grpc), ("rest", over_rest)]
        for kind, call in order if i % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            await call()
            samples[kind].append((time.perf_counter() - started) * 1000)
    parameters = {"runs": runs, "agent": "handbook", "calls": "StartRun+GetRun", **CLIENTS}
    p = {(kind, q): percentile(samples[kind], q) for kind in samples for q in (50, 99)}
    f = {(kind, q): percentile(fetches[kind], q) for kind in fetches for q in (50, 99)}
    alone = {**parameters, "calls": "GetRun alone (timed inside the same iterations)"}
    return [
        Figure("rest.run.grpc.p50", p["grpc", 50], "ms", parameters),
        Figure("rest.run.rest.p50", p["rest", 50], "ms", parameters),
        Figure("rest.run.added.p50", p["rest", 50] - p["grpc", 50], "ms", parameters),
        Figure("rest.run.grpc.p99", p["grpc", 99], "ms", parameters),
        Figure("rest.run.rest.p99", p["rest", 99], "ms", parameters),
        Figure("rest.run.added.p99", p["rest", 99] - p["grpc", 99], "ms", parameters),
        Figure("rest.getrun.grpc.p50", f["grpc", 50], "ms", alone),
        Figure("rest.getrun.rest.p50", f["rest", 50], "ms", alone),
        Figure("rest.getrun.added.p50", f["rest", 50] - f["grpc", 50], "ms", alone),
        Figure("rest.getrun.added.p99", f["rest", 99] - f["grpc", 99], "ms", alone),
    ]


async def _sustain(call: Callable[[], Awaitable[None]], seconds: float) -> tuple[int, float]:
    """`call` from CONCURRENCY workers for `seconds`: (completed calls, elapsed s)."""
    done = 0
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await call()
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return done, time.perf_counter() - started


async def _agents_throughput(
    stub: orchestrator_pb2_grpc.OrchestratorServiceAsyncStub,
    http: aiohttp.ClientSession,
    metadata: tuple[tuple[str, str], ...],
    proxy: ServiceProcess,
    seconds: float,
) -> list[Figure]:
    pid = proxy.process.pid
    request = orchestrator_pb2.ListAgentsRequest()

    async def over_grpc() -> None:
        response = await stub.ListAgents(request, metadata=metadata, timeout=10)
        if not response.agents:
            raise RuntimeError("ListAgents listed no agents")

    async def over_rest() -> None:
        async with http.get("/v1/agents") as response:
            body = await response.read()
            if response.status != 200 or b"handbook" not in body:
                raise RuntimeError(f"GET /v1/agents answered {response.status}: {body[:300]!r}")

    # warm both paths (connections, the proxy's pool) before anything is timed
    await _sustain(over_grpc, 0.5)
    await _sustain(over_rest, 0.5)
    # this process's CPU too: if the clients use a core of their own, they, not the
    # services, may be what limits either figure
    client_before = time.process_time()
    grpc_done, grpc_elapsed = await _sustain(over_grpc, seconds)
    client_grpc = (time.process_time() - client_before) * 1000 / grpc_done
    cpu_before, client_before = cpu_ms(pid), time.process_time()
    rest_done, rest_elapsed = await _sustain(over_rest, seconds)
    cpu_after, client_rest = cpu_ms(pid), (time.process_time() - client_before) * 1000 / rest_done
    grpc_rps, rest_rps = grpc_done / grpc_elapsed, rest_done / rest_elapsed
    parameters = {"concurrency": CONCURRENCY, "seconds": seconds, **CLIENTS}
    return [
        Figure("rest.agents.grpc.requests_per_second", grpc_rps, "req/s", parameters),
        Figure("rest.agents.rest.requests_per_second", rest_rps, "req/s", parameters),
        Figure("rest.agents.rest_share_of_grpc", 100 * rest_rps / grpc_rps, "%", parameters),
        Figure(
            "rest.agents.proxy_cpu_per_request",
            (cpu_after - cpu_before) / rest_done,
            "ms",
            {**parameters, "requests": rest_done, "source": "/proc/<pid>/stat utime+stime"},
        ),
        Figure("rest.agents.grpc.client_cpu_per_request", client_grpc, "ms", parameters),
        Figure("rest.agents.rest.client_cpu_per_request", client_rest, "ms", parameters),
    ]
