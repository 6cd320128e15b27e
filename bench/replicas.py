"""What replicas cost and what a fault costs, on one machine:

- spreading: runs/s and p50/p99 of a handbook run with 1 and with 3 replicas of
  every service, at the same concurrency (on 2 cores expect no speed-up: the
  figure is the cost of spreading the same work over three times the processes);
- faults: under a steady mixed load (runs, memory writes, ingests) over 3 replicas,
  one replica of each service SIGKILLed in turn: the calls that failed, and the
  recovery time (from the kill to the end of the last call that failed because of
  it; 0 when every call was retried without the caller noticing); for the
  orchestrator also how long a run that was on the killed replica stayed RUNNING
  before a survivor ended it, against the lease setting;
- `python -m bench soak --minutes N`: a mixed load of runs, confirmations, memory
  writes and ingests at steady concurrency over 3 replicas, printing per minute the
  RSS of every process, the p99 of each kind of call and the errors, and at the
  end each process's RSS growth after the first (warm-up) minute.

Targets (issue 14): 0 errors outside the killed replica's in-flight calls,
recovery within the lease setting, RSS growth under 10% over the soak after
warm-up. Nothing here asserts them; the figures are for people to read.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import grpc
import httpx
from rich.console import Console
from rich.table import Table

from bench.figures import Figure, percentile
from bench.harness import STATE
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.load import CallRecord, Kind, MixedLoad, failures
from cairn_libs.stack import (
    SCRIBE_AGENT,
    SERVICE_MODULES,
    LocalStack,
    ServiceProcess,
    start_embedded_postgres,
    wait_for_health,
)
from tests.replicas_support import replica_stack

SERVICES = tuple(SERVICE_MODULES)
CONCURRENCY = 16
LEASE_SECONDS = 5.0
QUESTION = "How many days of annual leave do I get?"
STOPPED_REASON = "the orchestrator stopped while this run was working"
console = Console(width=max(Console().width, 140))


@dataclass
class BenchReplicas:
    local: LocalStack
    offline: ServiceProcess
    scripted: ServiceProcess
    pg_url: str
    issuer: TokenIssuer

    @property
    def scripted_url(self) -> str:
        return f"http://{self.scripted.address}"

    @property
    def offline_url(self) -> str:
        return f"http://{self.offline.address}"

    def load(self, *, lanes: int, kinds: Sequence[Kind]) -> MixedLoad:
        return MixedLoad(
            self.local.targets,
            issuer=self.issuer,
            org=f"bench-{uuid.uuid4().hex[:10]}",
            lanes=lanes,
            scripted_model_url=self.scripted_url,
            question=QUESTION,
            kinds=kinds,
        )


@contextmanager
def replicas_stack(replicas: int) -> Iterator[BenchReplicas]:
    """The replica and fault tests' stack (tests/replicas_support.py), with the
    bench's lease, on the bench's PostgreSQL."""
    base = STATE / f"replicas-{replicas}"
    base.mkdir(parents=True, exist_ok=True)
    with replica_stack(
        base,
        pg_url=start_embedded_postgres(STATE / "pg"),
        keys=generate_dev_keypair(STATE / "keys"),
        service_env={"CAIRN_LOG_LEVEL": "WARNING"},
        replicas=replicas,
        lease_seconds=LEASE_SECONDS,
    ) as started:
        yield BenchReplicas(
            started.local, started.offline, started.scripted, started.pg_url, started.issuer
        )


# --- spreading -----------------------------------------------------------------------


async def _throughput(stack: BenchReplicas, seconds: float) -> tuple[float, list[float], int]:
    load = stack.load(lanes=CONCURRENCY, kinds=("run",))
    load.start()
    await asyncio.sleep(min(3.0, seconds / 3))  # warm-up, not counted
    mark = time.monotonic()
    await asyncio.sleep(seconds)
    await load.stop()
    counted = [r for r in load.records if r.started >= mark and r.ended]
    done = [r for r in counted if r.ok]
    elapsed = max(r.ended for r in counted) - mark if counted else seconds
    return len(done) / elapsed, [r.seconds * 1000 for r in done], len(counted) - len(done)


# --- faults --------------------------------------------------------------------------


async def _hanging_run(stack: BenchReplicas, org: str) -> asyncio.Task[object]:
    async with httpx.AsyncClient(timeout=10) as http:
        (await http.post(f"{stack.scripted_url}/_control/reset")).raise_for_status()
        steps = {"steps": [{"action": "hang", "seconds": 120}]}
        (await http.post(f"{stack.scripted_url}/_control/script", json=steps)).raise_for_status()
        token = stack.issuer.caller_token(org_id=org, user_id="alice")

        async def start() -> object:
            async with channel(stack.local.address("orchestrator", 0)) as ch:
                try:
                    return await orchestrator_pb2_grpc.OrchestratorServiceStub(ch).StartRun(
                        orchestrator_pb2.StartRunRequest(agent=SCRIBE_AGENT, input="Wait."),
                        metadata=call_metadata(token),
                        timeout=120,
                    )
                except grpc.aio.AioRpcError as exc:
                    return exc.code()

        task = asyncio.create_task(start())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (await http.get(f"{stack.scripted_url}/_control/requests")).json()["requests"]:
                return task
            await asyncio.sleep(0.05)
    raise RuntimeError("the run meant to be orphaned never reached the model")


async def _orphan_ended(pg_url: str, org: str, *, within: float) -> str:
    deadline = time.monotonic() + within
    conn = await asyncpg.connect(pg_url)
    try:
        while time.monotonic() < deadline:
            rows = await conn.fetch(
                "SELECT state, reason FROM orchestrator.runs WHERE org_id = $1", org
            )
            if rows and all(r["state"] != "RUNNING" for r in rows):
                return str(rows[0]["reason"])
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    raise RuntimeError(f"the orphaned run was not ended within {within} s")


async def _faults(stack: BenchReplicas, *, settle_seconds: float) -> list[Figure]:
    lanes = CONCURRENCY // 2
    load = stack.load(lanes=lanes, kinds=("run", "remember", "ingest"))
    load.start()
    figures: list[Figure] = []
    params = {"replicas": 3, "lanes": lanes, "lease_seconds": LEASE_SECONDS}
    try:
        await load.wait_for_calls(lanes, after=time.monotonic())
        for generation, service in enumerate(SERVICES, start=1):
            orphan_org = f"orphan-{uuid.uuid4().hex[:8]}"
            hanging = await _hanging_run(stack, orphan_org) if service == "orchestrator" else None
            in_flight = {r.key for r in load.records if not r.ended}
            killed_at = time.monotonic()
            stack.local.kill(service, 0)
            if hanging is not None:
                reason = await _orphan_ended(stack.pg_url, orphan_org, within=LEASE_SECONDS * 4)
                orphan_seconds = time.monotonic() - killed_at
                hanging.cancel()
                figures.append(
                    Figure(
                        "replicas.sigkill.orchestrator.orphaned_run_ended_after",
                        orphan_seconds,
                        "s",
                        {**params, "true_reason": STOPPED_REASON in reason},
                    )
                )
            await asyncio.sleep(settle_seconds)
            caused = [r for r in failures(load.records) if r.key in in_flight]
            beyond = [
                r for r in failures(load.records) if r.key not in in_flight and killed_at <= r.ended
            ]
            recovery = max((r.ended - killed_at for r in caused), default=0.0)
            figures += [
                Figure(f"replicas.sigkill.{service}.errors", float(len(caused)), "calls", params),
                Figure(
                    f"replicas.sigkill.{service}.errors_not_in_flight",
                    float(len(beyond)),
                    "calls",
                    params,
                ),
                Figure(f"replicas.sigkill.{service}.recovery", recovery, "s", params),
            ]
            proc = stack.local.start(service, 0, generation=generation)
            await asyncio.to_thread(wait_for_health, proc, timeout=120)
    finally:
        await load.stop()
    missing = await load.missing(stack.pg_url)
    lost = (
        len(missing.runs)
        + len(missing.memories)
        + len(missing.documents)
        + len(missing.confirmed_notes)
    )
    internal = sum(1 for r in load.records if r.outcome in ("INTERNAL", "UNKNOWN"))
    figures += [
        Figure("replicas.sigkill.acknowledged_writes_lost", float(lost), "writes", params),
        Figure("replicas.sigkill.internal_errors", float(internal), "calls", params),
    ]
    return figures


async def run_replicas(*, quick: bool = False) -> list[Figure]:
    seconds = 8.0 if quick else 30.0
    figures: list[Figure] = []
    for count in (1, 3):
        with replicas_stack(count) as stack:
            rate, latencies, errors = await _throughput(stack, seconds)
            params = {"replicas_per_service": count, "concurrency": CONCURRENCY, "seconds": seconds}
            figures += [
                Figure(f"replicas.x{count}.runs_per_second", rate, "runs/s", params),
                Figure(f"replicas.x{count}.run.p50", percentile(latencies, 50), "ms", params),
                Figure(f"replicas.x{count}.run.p99", percentile(latencies, 99), "ms", params),
                Figure(f"replicas.x{count}.errors", float(errors), "runs", params),
            ]
            if count == 3:
                figures += await _faults(stack, settle_seconds=2.0 if quick else 5.0)
    return figures


# --- soak ----------------------------------------------------------------------------


def _rss_mib(processes: Sequence[ServiceProcess]) -> dict[str, float]:
    """Resident set size of each process, from /proc/<pid>/status (VmRSS, in kB)."""
    sizes = {}
    for proc in processes:
        try:
            status = Path(f"/proc/{proc.process.pid}/status").read_text()
        except OSError:
            sizes[proc.name] = 0.0
            continue
        kib = next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")),
            0,
        )
        sizes[proc.name] = kib / 1024
    return sizes


def _minute_table(minute: int, records: Sequence[CallRecord], rss: dict[str, float]) -> Table:
    table = Table(title=f"soak minute {minute}")
    table.add_column("kind")
    table.add_column("calls", justify="right")
    table.add_column("p99 ms", justify="right")
    table.add_column("errors", justify="right")
    for kind in ("run", "confirm", "remember", "ingest"):
        done = [r for r in records if r.kind == kind]
        ok = [r.seconds * 1000 for r in done if r.ok]
        table.add_row(
            kind,
            str(len(done)),
            f"{percentile(ok, 99):,.1f}" if ok else "-",
            str(len(done) - len(ok)),
        )
    table.add_section()
    for name, mib in sorted(rss.items()):
        table.add_row(f"RSS {name}", "", f"{mib:,.1f} MiB", "")
    return table


async def soak(minutes: float, *, lanes: int = CONCURRENCY) -> list[Figure]:
    figures: list[Figure] = []
    with replicas_stack(3) as stack:
        processes = [*stack.local.processes(), stack.offline, stack.scripted]
        load = stack.load(lanes=lanes, kinds=("run", "remember", "ingest", "confirm"))
        load.start()
        started = time.monotonic()
        after_warmup: dict[str, float] = {}
        rss: dict[str, float] = {}
        p99s: list[float] = []
        minute = 0
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                while time.monotonic() - started < minutes * 60:
                    minute_start = time.monotonic()
                    await asyncio.sleep(min(60.0, minutes * 60 - (minute_start - started)))
                    minute += 1
                    # The offline model keeps every request it is sent, for tests to
                    # read; over a soak that is its memory, not cairn's.
                    (await http.post(f"{stack.offline_url}/_control/reset")).raise_for_status()
                    rss = _rss_mib(processes)
                    if minute == 1:
                        after_warmup = dict(rss)
                    window = [r for r in load.records if r.ended and r.ended >= minute_start]
                    ok = [r.seconds * 1000 for r in window if r.ok]
                    if ok:
                        p99s.append(percentile(ok, 99))
                    console.print(_minute_table(minute, window, rss))
        finally:
            await load.stop()
        missing = await load.missing(stack.pg_url)
    errors = failures(load.records)
    params = {"minutes": minutes, "lanes": lanes, "replicas": 3}
    cairn = [name for name in rss if not name.startswith("fakeprovider")]
    growth = {
        name: (rss[name] - after_warmup[name]) / after_warmup[name] * 100
        for name in cairn
        if after_warmup.get(name)
    }
    figures += [
        Figure("soak.calls", float(sum(1 for r in load.records if r.ended)), "calls", params),
        Figure("soak.errors", float(len(errors)), "calls", params),
        Figure("soak.acknowledged_writes_lost", float(0 if missing.nothing else 1), "any", params),
        Figure("soak.p99.worst_minute", max(p99s, default=0.0), "ms", params),
        Figure(
            "soak.rss_growth_after_warmup.max",
            max(growth.values(), default=0.0),
            "%",
            {**params, "worst": max(growth, key=lambda n: growth[n]) if growth else ""},
        ),
    ]
    if minute < 2:
        console.print(
            "[yellow]soak: RSS growth after warm-up needs at least two minutes; "
            "the growth figure compares the end with the first minute[/]"
        )
    for name, value in sorted(growth.items()):
        console.print(f"RSS growth after warm-up {name}: {value:+.1f}%")
    for record in errors[:20]:
        console.print(f"error: {record.kind} {record.outcome} {record.detail[:120]}")
    return figures
