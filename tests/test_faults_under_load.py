"""Real faults under steady load, with three replicas of every service: one replica
of each service SIGKILLed in turn, then PostgreSQL itself restarted.

What must hold: the only calls that fail are ones in flight when a process died,
each UNAVAILABLE (never INTERNAL) or retried without the caller noticing; no
acknowledged write is lost (runs COMPLETED, memories remembered, documents
ingested, all there afterwards); a run that was on the killed orchestrator is ended
by a surviving replica, with the true reason, within its lease; and after a
database restart every process goes NOT_SERVING and comes back by itself.

The stack (tests/replicas_support.py) has a PostgreSQL of its own, so restarting
it disturbs no other test; every replica killed here is started again.
"""

from __future__ import annotations

import asyncio
import sys
import time

import asyncpg
import grpc
import httpx
import pytest

from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn.orchestrator.v1 import orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.load import CallRecord, MixedLoad, failures
from cairn_libs.stack import (
    SCRIBE_AGENT,
    ServiceProcess,
    health_status,
    wait_for_health,
)
from tests.replicas_support import (
    LEASE_SECONDS,
    QUESTION,
    SERVICES,
    ReplicaStack,
)

LANES = 6
# The orchestrator replica's lease lapses at most LEASE_SECONDS after its last
# renewal; a survivor's upkeep (every third of a lease) then ends the run.
ENDED_WITHIN_SECONDS = LEASE_SECONDS * 2
STOPPED_REASON = "the orchestrator stopped while this run was working"
pytestmark = pytest.mark.timeout(300)


def _load(stack: ReplicaStack) -> MixedLoad:
    return MixedLoad(
        stack.targets,
        issuer=stack.issuer,
        org=stack.new_org(),
        lanes=LANES,
        scripted_model_url=stack.scripted_url,
        question=QUESTION,
        kinds=("run", "remember", "ingest"),
    )


def _never_internal(records: list[CallRecord]) -> None:
    wrong = [r for r in records if r.outcome in ("INTERNAL", "UNKNOWN") or "INTERNAL" in r.detail]
    assert wrong == [], wrong


async def _hanging_run_on(stack: ReplicaStack, index: int, org: str) -> asyncio.Task[object]:
    """A scribe run on orchestrator replica `index` whose model call hangs, begun
    once the model holds the call: the run is certainly being worked on there."""
    async with httpx.AsyncClient(timeout=10) as http:
        (await http.post(f"{stack.scripted_url}/_control/reset")).raise_for_status()
        (
            await http.post(
                f"{stack.scripted_url}/_control/script",
                json={"steps": [{"action": "hang", "seconds": 60}]},
            )
        ).raise_for_status()
        token = stack.issuer.caller_token(org_id=org, user_id="alice")

        async def start() -> object:
            async with channel(stack.local.address("orchestrator", index)) as ch:
                try:
                    return await orchestrator_pb2_grpc.OrchestratorServiceStub(ch).StartRun(
                        pb.StartRunRequest(agent=SCRIBE_AGENT, input="Note that I waited."),
                        metadata=call_metadata(token),
                        timeout=60,
                    )
                except grpc.aio.AioRpcError as exc:
                    return exc.code()

        started = asyncio.create_task(start())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            received = (await http.get(f"{stack.scripted_url}/_control/requests")).json()
            if received["requests"]:
                return started
            await asyncio.sleep(0.05)
    raise TimeoutError("the hanging run never reached the model")


async def _runs_of(pg_url: str, org: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(pg_url)
    try:
        rows: list[asyncpg.Record] = await conn.fetch(
            "SELECT run_id, state, reason FROM orchestrator.runs WHERE org_id = $1", org
        )
    finally:
        await conn.close()
    return rows


async def test_sigkill_of_one_replica_of_each_service_fails_only_its_calls_in_flight_and_loses_nothing(
    replicas: ReplicaStack,
) -> None:
    load = _load(replicas)
    load.start()
    kills: list[tuple[str, float, set[str]]] = []
    hanging_org = replicas.new_org()
    ended_after = 0.0
    restarted: list[ServiceProcess] = []
    try:
        await load.wait_for_calls(LANES, after=time.monotonic())
        for generation, service in enumerate(SERVICES, start=1):
            hanging = None
            if service == "orchestrator":
                hanging = await _hanging_run_on(replicas, 0, hanging_org)
            in_flight = {r.key for r in load.records if not r.ended}
            killed_at = time.monotonic()
            replicas.local.kill(service, 0)
            kills.append((service, killed_at, in_flight))
            # The load goes on over the two replicas left.
            await load.wait_for_calls(LANES, after=killed_at)
            if hanging is not None:
                assert await asyncio.wait_for(hanging, 30) == grpc.StatusCode.UNAVAILABLE
                rows = await poll_async_runs(replicas.pg_url, hanging_org, within=30)
                ended_after = time.monotonic() - killed_at
                assert [r["state"] for r in rows] == ["FAILED"]
                assert STOPPED_REASON in rows[0]["reason"]
            # Started again at once; its start-up overlaps the next kill.
            restarted.append(replicas.local.start(service, 0, generation=generation))
        for proc in restarted:
            await asyncio.to_thread(wait_for_health, proc, timeout=120)
        await load.wait_for_calls(LANES, after=time.monotonic())
    finally:
        await load.stop()

    _never_internal(load.records)
    in_flight_at_a_kill = set().union(*(keys for _, _, keys in kills))
    failed = failures(load.records)
    assert all(r.key in in_flight_at_a_kill for r in failed), failed
    assert all(r.outcome == "UNAVAILABLE" or r.outcome.startswith("RUN_") for r in failed), failed
    assert len(failed) <= LANES * len(SERVICES)
    missing = await load.missing(replicas.pg_url)
    assert missing.nothing, missing
    assert sum(r.ok for r in load.records) > 4 * LANES
    # Ended by a surviving replica within the lease (plus one upkeep round).
    assert ended_after < ENDED_WITHIN_SECONDS + 1.0, ended_after
    assert all(r.detail for r in failed), "a failure without its reason"
    # No run of the load is left working with nobody on it.
    await poll_async_runs(replicas.pg_url, load.org, within=ENDED_WITHIN_SECONDS + 1.0)


async def poll_async_runs(pg_url: str, org: str, *, within: float) -> list[asyncpg.Record]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        rows = await _runs_of(pg_url, org)
        if rows and all(r["state"] != "RUNNING" for r in rows):
            return rows
        await asyncio.sleep(0.05)
    raise TimeoutError("the run on the killed orchestrator was not ended")


async def _pg_ctl(call: str, *args: object) -> None:
    """pg_ctl from a child process: forking this one, whose gRPC threads are busy,
    to run pg_ctl as another user crashed the child."""
    code = (
        "import sys; from pathlib import Path; "
        "from cairn_libs.stack import resume_embedded_postgres, stop_embedded_postgres; " + call
    )
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", code, *map(str, args))
    assert await asyncio.wait_for(child.wait(), 60) == 0


async def test_postgres_restarted_under_load_every_service_goes_not_serving_and_comes_back_losing_nothing(
    replicas: ReplicaStack,
) -> None:
    assert replicas.pg_dir is not None
    data_dir, url = replicas.pg_dir, replicas.pg_url
    processes = replicas.local.processes()
    load = _load(replicas)
    load.start()
    try:
        await load.wait_for_calls(LANES, after=time.monotonic())
        await _pg_ctl("stop_embedded_postgres(Path(sys.argv[1]))", data_dir)

        async def statuses() -> set[str]:
            found = await asyncio.gather(
                *(asyncio.to_thread(health_status, p.address) for p in processes)
            )
            return set(found)

        deadline = time.monotonic() + 30
        while await statuses() != {"NOT_SERVING"}:
            assert time.monotonic() < deadline, await statuses()
            await asyncio.sleep(0.1)
        await _pg_ctl("resume_embedded_postgres(Path(sys.argv[1]), sys.argv[2])", data_dir, url)
        back = time.monotonic()
        deadline = back + 60
        while await statuses() != {"SERVING"}:
            assert time.monotonic() < deadline, await statuses()
            await asyncio.sleep(0.1)
        await load.wait_for_calls(LANES, after=time.monotonic())
    finally:
        await load.stop()

    _never_internal(load.records)
    failed = failures(load.records)
    assert all(r.outcome == "UNAVAILABLE" or r.outcome.startswith("RUN_") for r in failed), failed
    assert all(r.detail for r in failed), "a failure without its reason"
    missing = await load.missing(url)
    assert missing.nothing, missing
    assert all(p.process.poll() is None for p in processes), "a service died with its database"
