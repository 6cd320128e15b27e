"""The orchestration cost of one agent run across all four services, with the
offline model answering instantly: one memory recall, two model calls (a
search_knowledge tool call, then the answer) and one retrieval: the prefetch of
the question, which the model's search for the same question reuses (its step
says `reused_prefetch`). The shape of a run is checked on its trajectory before
anything is timed, so the figures measure what they say.

It also counts the PostgreSQL round trips one such run costs the orchestrator
(steps, state, leases, the pool's resets), on the wire: a second orchestrator
beside the stack's reaches PostgreSQL through a counting proxy
(bench/pg_round_trips.py), and runs one at a time, with nothing else on it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import json_format

from bench.figures import Figure, percentile
from bench.harness import STATE, BenchStack, bench_stack
from bench.pg_round_trips import counting_proxy
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.db import Database, PoolReset
from cairn_libs.demo_corpus import handbook_documents, load_handbook
from cairn_libs.identity import generate_dev_keypair
from cairn_libs.stack import (
    free_port,
    stack_env,
    start_embedded_postgres,
    start_service,
    wait_for_health,
)


async def run_orchestration(*, quick: bool = False) -> list[Figure]:
    n = 20 if quick else 100
    sustain_seconds = 10.0 if quick else 60.0
    corpus = load_handbook()
    with bench_stack(("gateway", "retrieval", "memory", "orchestrator")) as stack:
        org = f"bench-{int(time.time())}"
        ingester = call_metadata(
            stack.issuer.caller_token(org_id=org, user_id="docs-bot", roles=["ingester"])
        )
        ch = channel(stack.addresses["retrieval"])
        documents = handbook_documents(corpus)
        async for _ in retrieval_pb2_grpc.RetrievalServiceStub(ch).IngestDocuments(
            retrieval_pb2.IngestDocumentsRequest(documents=documents),
            metadata=ingester,
            timeout=300,
        ):
            pass
        await ch.close(grace=None)

        metadata = call_metadata(
            stack.issuer.caller_token(org_id=org, user_id="maria", roles=["manager"])
        )
        orch = channel(stack.addresses["orchestrator"])
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(orch)
        request = orchestrator_pb2.StartRunRequest(agent="handbook", input=corpus["question"])

        async def one_run() -> bool:
            try:
                run = (await stub.StartRun(request, metadata=metadata, timeout=60)).run
            except grpc.aio.AioRpcError:
                return False
            return run.state == orchestrator_pb2.RUN_STATE_COMPLETED

        for _ in range(5):
            await one_run()
        await _check_run_shape(stub, request, metadata)
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            ok = await one_run()
            samples.append((time.perf_counter() - started) * 1000)
            if not ok:
                raise RuntimeError("a benchmark run did not complete; see state/bench/logs")

        completed = errors = 0
        deadline = time.monotonic() + sustain_seconds

        async def runner() -> None:
            nonlocal completed, errors
            while time.monotonic() < deadline:
                if await one_run():
                    completed += 1
                else:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(runner() for _ in range(50)))
        elapsed = time.perf_counter() - started
        await orch.close(grace=None)
        trips = await _round_trips_per_run(stack, request, metadata, runs=10 if quick else 30)
    seq = {
        "runs": n,
        "model_calls_per_run": 2,
        "retrievals": 1,
        "reused_retrievals": 1,
        "memory_recalls": 1,
    }
    sustained = {"concurrency": 50, "seconds": sustain_seconds}
    return [
        Figure("run.orchestration.p50", percentile(samples, 50), "ms", seq),
        Figure("run.orchestration.p99", percentile(samples, 99), "ms", seq),
        Figure("run.sustained.runs_per_second", completed / elapsed, "runs/s", sustained),
        Figure("run.sustained.errors", float(errors), "runs", sustained),
        trips,
        *await _pooled_statement_cost(rounds=2 if quick else 5),
    ]


async def _pooled_statement_cost(*, rounds: int) -> list[Figure]:
    """What one store statement costs through a pool (acquire, a one-row query,
    release) under each of db.py's resets, alternating so load falls on both alike."""
    pg_url = start_embedded_postgres(STATE / "pg")
    schema = "bench_pool_reset"
    resets: tuple[PoolReset, ...] = ("session", "transaction")
    pools = {
        reset: Database(url=pg_url, schema=schema, migrations=[], max_size=1, reset=reset)
        for reset in resets
    }
    samples: dict[PoolReset, list[float]] = {reset: [] for reset in resets}
    try:
        for database in pools.values():
            if not await database.ready():
                raise RuntimeError(f"the bench PostgreSQL at {pg_url!r} did not answer")
        for _ in range(rounds):
            for reset, database in pools.items():
                for i in range(400):
                    started = time.perf_counter()
                    async with database.pool.acquire() as conn:
                        await conn.fetchval("SELECT $1::int", i)
                    samples[reset].append((time.perf_counter() - started) * 1000)
    finally:
        for database in pools.values():
            await database.close()
    parameters = {"statements": 400 * rounds, "alternating_rounds": rounds}
    return [
        Figure(
            f"run.postgres.pooled_statement.p{q}.{reset}_reset",
            percentile(samples[reset], q),
            "ms",
            parameters,
        )
        for reset in resets
        for q in (50, 99)
    ]


async def _round_trips_per_run(
    stack: BenchStack,
    request: orchestrator_pb2.StartRunRequest,
    metadata: tuple[tuple[str, str], ...],
    *,
    runs: int,
) -> Figure:
    """Round trips per run of a counted orchestrator: its upkeep is pushed out of the
    window (a long lease, one readiness check), so what is counted is the runs'."""
    keys = generate_dev_keypair(STATE / "keys")
    pg_url = start_embedded_postgres(STATE / "pg")
    async with counting_proxy(pg_url) as (counted_url, counts):
        env = {
            **stack_env(
                database_url=counted_url,
                keys=keys,
                qdrant_path=STATE / "qdrant",
                model_url=stack.model_url,
                addresses=stack.addresses,
            ),
            "CAIRN_LOG_LEVEL": "WARNING",
            "CAIRN_RUN_LEASE_SECONDS": "600",
            "CAIRN_HEALTH_INTERVAL_SECONDS": "3600",
        }
        port = free_port()
        proc = start_service(
            "orchestrator", port=port, env=env, log_dir=STATE / "logs", suffix="-counted"
        )
        try:
            await asyncio.to_thread(wait_for_health, proc, timeout=90)
            ch = channel(f"127.0.0.1:{port}")
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
            for _ in range(5):  # every statement prepared on the connections it uses
                await stub.StartRun(request, metadata=metadata, timeout=60)
            await _settled(lambda: counts.total)
            counts.reset()
            for _ in range(runs):
                run = (await stub.StartRun(request, metadata=metadata, timeout=60)).run
                if run.state != orchestrator_pb2.RUN_STATE_COMPLETED:
                    raise RuntimeError("a counted run did not complete; see state/bench/logs")
            await _settled(lambda: counts.total)
            await ch.close(grace=None)
        finally:
            proc.stop()
    per_statement = {label: round(n / runs, 2) for label, n in counts.by_statement.most_common()}
    return Figure(
        "run.postgres.round_trips_per_run",
        counts.total / runs,
        "round trips",
        {"runs": runs, "sequential": True, "by_statement": per_statement},
    )


async def _settled(
    read: Callable[[], int], *, quiet_seconds: float = 0.5, deadline_seconds: float = 10
) -> None:
    """Wait until no round trip has passed for `quiet_seconds` (the steps a run
    writes behind its answer included), or the deadline."""
    deadline = time.monotonic() + deadline_seconds
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_seconds:
        await asyncio.sleep(0.05)
        if (now := read()) != last:
            last, since = now, time.monotonic()


EXPECTED_STEPS = ["MEMORY_READ", "RETRIEVAL", "MODEL_CALL", "TOOL_CALL", "MODEL_CALL"]


async def _check_run_shape(
    stub: Any,
    request: orchestrator_pb2.StartRunRequest,
    metadata: tuple[tuple[str, str], ...],
) -> None:
    run = (await stub.StartRun(request, metadata=metadata, timeout=60)).run
    steps = (
        await stub.GetTrajectory(
            orchestrator_pb2.GetTrajectoryRequest(run_id=run.run_id), metadata=metadata, timeout=10
        )
    ).steps
    kinds = [orchestrator_pb2.StepKind.Name(s.kind).removeprefix("STEP_KIND_") for s in steps]
    if run.state != orchestrator_pb2.RUN_STATE_COMPLETED or kinds != EXPECTED_STEPS:
        raise RuntimeError(
            f"a benchmark run ended {orchestrator_pb2.RunState.Name(run.state)} with steps "
            f"{kinds}; the benchmark times runs of {EXPECTED_STEPS}"
        )
    tool_detail = json_format.MessageToDict(steps[3].detail)
    if tool_detail.get("reused_prefetch") is not True:
        raise RuntimeError(
            "the model's search_knowledge call did not reuse the prefetch "
            f"(its step detail: {sorted(tool_detail)}); the benchmark times runs that do"
        )
