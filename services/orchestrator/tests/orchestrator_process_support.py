"""What the orchestrator's process tests share: a restartable orchestrator process,
the offline model's control surface, and reads of what a write really did.

The test-only `append_note` write tool (CAIRN_TEST_WRITE_TOOL=1) keeps one row per
confirmation token in `orchestrator_test.notes` and counts how often a handler was
handed that token, so "took effect once" and "was handed over once" can be told
apart."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import grpc
from google.protobuf import json_format

from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn.orchestrator.v1 import orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.stack import ServiceProcess, free_port, start_service, wait_for_health

T = TypeVar("T")

SCRIBE_SPEC = """\
name: scribe
description: Keeps notes for the person, for the confirmation tests.
tier: balanced
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


def budget_spec(name: str, *, tokens: int = 20000, model_calls: int = 6, wall: int = 60) -> str:
    return f"""\
name: {name}
description: An agent with a tight budget, for the budget tests.
tier: balanced
system_prompt: You answer briefly.
tools: [search_knowledge]
sources: []
reads_memory: false
budgets:
  tokens: {tokens}
  model_calls: {model_calls}
  wall_seconds: {wall}
"""


@dataclass
class Orchestrator:
    """An orchestrator process that a test may kill and start again."""

    env: dict[str, str]
    log_dir: Path
    proc: ServiceProcess | None = None
    generation: int = 0
    retired: list[ServiceProcess] = field(default_factory=list)

    def start(self) -> None:
        self.generation += 1
        self.proc = start_service(
            "orchestrator",
            port=free_port(),
            env=self.env,
            log_dir=self.log_dir,
            suffix=f"-{self.generation}",
        )
        wait_for_health(self.proc, timeout=90)

    @property
    def address(self) -> str:
        assert self.proc is not None
        return self.proc.address

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, nothing is released."""
        assert self.proc is not None
        self.proc.kill()
        self.retired.append(self.proc)
        self.proc = None

    def restart_after_kill(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def control(model_url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"{model_url}/_control/{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def script(model_url: str, *steps: dict[str, Any]) -> None:
    control(model_url, "script", {"steps": list(steps)})


def chat_requests(model_url: str, *, containing: str) -> list[list[dict[str, Any]]]:
    """The messages of each chat request whose user message holds `containing`."""
    found = []
    for entry in control(model_url, "requests")["requests"]:
        if not entry["path"].endswith("/chat/completions"):
            continue
        messages = (entry.get("body") or {}).get("messages", [])
        if any(
            m.get("role") == "user" and containing in (m.get("content") or "") for m in messages
        ):
            found.append(messages)
    return found


def tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m.get("role") == "tool"]


def start_run(address: str, token: str, agent: str, question: str) -> pb.Run:
    with grpc.insecure_channel(address) as channel:
        run: pb.Run = (
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            .StartRun(
                pb.StartRunRequest(agent=agent, input=question),
                metadata=call_metadata(token),
                timeout=60,
            )
            .run
        )
    return run


def get_run(address: str, token: str, run_id: str) -> pb.Run:
    with grpc.insecure_channel(address) as channel:
        run: pb.Run = (
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            .GetRun(pb.GetRunRequest(run_id=run_id), metadata=call_metadata(token), timeout=10)
            .run
        )
    return run


def trajectory(address: str, token: str, run_id: str) -> list[pb.Step]:
    with grpc.insecure_channel(address) as channel:
        steps = (
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            .GetTrajectory(
                pb.GetTrajectoryRequest(run_id=run_id), metadata=call_metadata(token), timeout=10
            )
            .steps
        )
    return list(steps)


def resolve(
    address: str, token: str, confirmation_token: str, *, approve: bool = True, note: str = ""
) -> pb.Run:
    with grpc.insecure_channel(address) as channel:
        run: pb.Run = (
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            .ResolveConfirmation(
                pb.ResolveConfirmationRequest(
                    confirmation_token=confirmation_token,
                    decision=pb.DECISION_APPROVE if approve else pb.DECISION_DENY,
                    note=note,
                ),
                metadata=call_metadata(token),
                timeout=60,
            )
            .run
        )
    return run


def kinds(steps: list[pb.Step]) -> list[str]:
    return [pb.StepKind.Name(s.kind).removeprefix("STEP_KIND_") for s in steps]


def detail(step: pb.Step) -> dict[str, Any]:
    return json_format.MessageToDict(step.detail)


def in_thread(work: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end on a loop of its own, away from the test session's
    loop (a sync test must not replace or close that one)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, work).result()


def notes(pg_url: str, org_id: str) -> list[tuple[str, int]]:
    return in_thread(_notes(pg_url, org_id))


def confirmation_state(pg_url: str, token: str) -> str:
    return in_thread(_confirmation_state(pg_url, token))


async def _notes(pg_url: str, org_id: str) -> list[tuple[str, int]]:
    """(text, handed_over) of every note the org's runs appended."""
    conn = await asyncpg.connect(pg_url)
    try:
        exists = await conn.fetchval("SELECT to_regclass('orchestrator_test.notes') IS NOT NULL")
        if not exists:
            return []
        rows = await conn.fetch(
            """
            SELECT n.text, h.handed_over FROM orchestrator_test.notes n
            JOIN orchestrator_test.handovers h USING (idempotency_key)
            WHERE n.org_id = $1 ORDER BY n.created_at
            """,
            org_id,
        )
    finally:
        await conn.close()
    return [(r["text"], r["handed_over"]) for r in rows]


async def _confirmation_state(pg_url: str, token: str) -> str:
    conn = await asyncpg.connect(pg_url)
    try:
        state: str = await conn.fetchval(
            "SELECT state FROM orchestrator.confirmations WHERE confirmation_token = $1", token
        )
    finally:
        await conn.close()
    return state
