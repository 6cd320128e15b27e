"""A steady mixed load against a running stack, and what became of each call: runs
of the handbook agent, confirmed writes (a scribe run proposing `append_note`,
approved), memory writes and document ingests, each kept as a `CallRecord`; and
afterwards, whether every acknowledged write is really there.

The fault tests and the replica benchmark share it, so "0 acknowledged writes
lost" means the same thing in both. Every call goes through the services' client
targets (round robin over the replicas, the retry policy of cairn_libs.clients),
as a caller in production would.

A confirmation needs the model to propose a write, which the offline model does
only when scripted; its script is one queue per model process, so one lane drives
the confirmations one at a time against the scripted model of
`stack.write_agent_setup`, and the other lanes never touch it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import asyncpg
import grpc
import httpx

from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import SCRIBE_AGENT

Kind = Literal["run", "confirm", "remember", "ingest"]
KINDS: tuple[Kind, ...] = ("run", "remember", "ingest", "confirm")
OK = "OK"
CALL_TIMEOUT_SECONDS = 30.0
LOAD_SOURCE = "load"


@dataclass
class CallRecord:
    kind: Kind
    key: str
    started: float
    ended: float = 0.0
    # OK, a gRPC status name, or RUN_<STATE> for a run that ended otherwise.
    outcome: str = ""
    detail: str = ""
    run_id: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class Missing:
    """Acknowledged writes that are not there afterwards (all empty: none lost)."""

    runs: list[str] = field(default_factory=list)
    confirmed_notes: list[str] = field(default_factory=list)
    memories: list[str] = field(default_factory=list)
    documents: list[str] = field(default_factory=list)
    notes_written_twice: list[str] = field(default_factory=list)

    @property
    def nothing(self) -> bool:
        return not (
            self.runs
            or self.confirmed_notes
            or self.memories
            or self.documents
            or self.notes_written_twice
        )


class MixedLoad:
    """`lanes` concurrent callers, each repeating one kind of call (lane i does
    KINDS[i % 4], at most one confirmation lane) until `stop`."""

    def __init__(
        self,
        targets: dict[str, str],
        *,
        issuer: TokenIssuer,
        org: str,
        lanes: int,
        scripted_model_url: str,
        question: str,
        kinds: Sequence[Kind] = KINDS,
    ) -> None:
        self._targets = targets
        self.org = org
        self._lanes = lanes
        self._kinds = tuple(kinds)
        self._scripted = scripted_model_url
        self._question = question
        self._person = call_metadata(
            issuer.caller_token(org_id=org, user_id="maria", roles=["manager", "employee"])
        )
        self._ingester = call_metadata(
            issuer.caller_token(org_id=org, user_id="docs-bot", roles=["ingester"])
        )
        self.records: list[CallRecord] = []
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: list[grpc.aio.Channel] = []

    def start(self) -> None:
        orchestrator = channel(self._targets["orchestrator"])
        memory = channel(self._targets["memory"])
        retrieval = channel(self._targets["retrieval"])
        self._channels = [orchestrator, memory, retrieval]
        self._orch = orchestrator_pb2_grpc.OrchestratorServiceStub(orchestrator)
        self._memory = memory_pb2_grpc.MemoryServiceStub(memory)
        self._retrieval = retrieval_pb2_grpc.RetrievalServiceStub(retrieval)
        confirm_lane_taken = False
        for lane in range(self._lanes):
            kind = self._kinds[lane % len(self._kinds)]
            if kind == "confirm":
                if confirm_lane_taken:
                    kind = "run"
                confirm_lane_taken = True
            self._tasks.append(asyncio.create_task(self._lane(kind)))

    async def stop(self) -> None:
        self._stopping.set()
        await asyncio.gather(*self._tasks)
        for ch in self._channels:
            await ch.close(grace=None)

    def since(self, moment: float) -> list[CallRecord]:
        return [r for r in self.records if r.ended >= moment]

    async def wait_for_calls(self, count: int, *, after: float, within: float = 60.0) -> None:
        """Until `count` calls that began after `after` have succeeded."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if sum(1 for r in self.records if r.started >= after and r.ok) >= count:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"fewer than {count} calls succeeded within {within} s of the mark")

    async def _lane(self, kind: Kind) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while not self._stopping.is_set():
                record = CallRecord(kind=kind, key=uuid.uuid4().hex[:12], started=time.monotonic())
                self.records.append(record)
                try:
                    if kind == "run":
                        await self._run(record)
                    elif kind == "confirm":
                        await self._confirm(record, http)
                    elif kind == "remember":
                        await self._remember(record)
                    else:
                        await self._ingest(record)
                except grpc.aio.AioRpcError as exc:
                    record.outcome = exc.code().name
                    record.detail = exc.details() or ""
                except httpx.HTTPError as exc:
                    record.outcome = "MODEL_CONTROL_FAILED"
                    record.detail = str(exc)
                record.ended = time.monotonic()
                if not record.ok:
                    # A caller that was refused waits a moment, as a real one would.
                    await asyncio.sleep(0.05)

    def _ended(self, record: CallRecord, run: orchestrator_pb2.Run) -> None:
        record.run_id = run.run_id
        if run.state == orchestrator_pb2.RUN_STATE_COMPLETED:
            record.outcome = OK
        else:
            record.outcome = orchestrator_pb2.RunState.Name(run.state).replace("_STATE", "")
            record.detail = run.reason

    async def _run(self, record: CallRecord) -> None:
        response = await self._orch.StartRun(
            orchestrator_pb2.StartRunRequest(agent="handbook", input=self._question),
            metadata=self._person,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        self._ended(record, response.run)

    async def _confirm(self, record: CallRecord, http: httpx.AsyncClient) -> None:
        # A step left over from a call that failed before the model read it would be
        # spent by the next run's second model call: start from an empty queue.
        (await http.post(f"{self._scripted}/_control/reset")).raise_for_status()
        note = f"note {record.key}"
        step = {"action": "tool_call", "name": "append_note", "arguments": {"text": note}}
        (
            await http.post(f"{self._scripted}/_control/script", json={"steps": [step]})
        ).raise_for_status()
        started = await self._orch.StartRun(
            orchestrator_pb2.StartRunRequest(agent=SCRIBE_AGENT, input=f"Please note {note}."),
            metadata=self._person,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        run = started.run
        record.run_id = run.run_id
        if run.state != orchestrator_pb2.RUN_STATE_CONFIRMATION_PENDING:
            self._ended(record, run)
            return
        resolved = await self._orch.ResolveConfirmation(
            orchestrator_pb2.ResolveConfirmationRequest(
                confirmation_token=run.pending_confirmation.confirmation_token,
                decision=orchestrator_pb2.DECISION_APPROVE,
            ),
            metadata=self._person,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        self._ended(record, resolved.run)

    async def _remember(self, record: CallRecord) -> None:
        await self._memory.Remember(
            memory_pb2.RememberRequest(
                text=f"The load test wrote memory {record.key}.",
                subject=memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_WORKSPACE),
            ),
            metadata=self._person,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        record.outcome = OK

    async def _ingest(self, record: CallRecord) -> None:
        document = retrieval_pb2.Document(
            document_id=f"load-{record.key}",
            source=LOAD_SOURCE,
            title=f"Load document {record.key}",
            text=f"This document {record.key} was ingested under load. " * 4,
            acl=retrieval_pb2.Acl(roles=["employee"]),
        )
        outcomes = [
            progress.result.outcome
            async for progress in self._retrieval.IngestDocuments(
                retrieval_pb2.IngestDocumentsRequest(documents=[document]),
                metadata=self._ingester,
                timeout=CALL_TIMEOUT_SECONDS,
            )
            if progress.HasField("result")
        ]
        # Each call ingests its own document id, so only a retry of this same call can
        # meet it already stored: UNCHANGED, or REPLACED when the retry reached a local
        # replica whose own embedded vector store lacked its vectors. All three mean
        # the document is stored.
        good = (
            retrieval_pb2.DOCUMENT_OUTCOME_INGESTED,
            retrieval_pb2.DOCUMENT_OUTCOME_UNCHANGED,
            retrieval_pb2.DOCUMENT_OUTCOME_REPLACED,
        )
        if outcomes and all(o in good for o in outcomes):
            record.outcome = OK
        else:
            record.outcome = "INGEST_FAILED"
            record.detail = ",".join(retrieval_pb2.DocumentOutcome.Name(o) for o in outcomes)

    async def missing(self, pg_url: str) -> Missing:
        """Which acknowledged writes are not there: runs read back through the
        orchestrator, the rest from each service's tables."""
        found = Missing()
        acknowledged = [r for r in self.records if r.ok]
        async with channel(self._targets["orchestrator"]) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
            for record in acknowledged:
                if record.kind not in ("run", "confirm"):
                    continue
                run = (
                    await stub.GetRun(
                        orchestrator_pb2.GetRunRequest(run_id=record.run_id),
                        metadata=self._person,
                        timeout=CALL_TIMEOUT_SECONDS,
                    )
                ).run
                if run.state != orchestrator_pb2.RUN_STATE_COMPLETED:
                    found.runs.append(record.run_id)
        conn = await asyncpg.connect(pg_url)
        try:
            bodies = {
                r["body"]
                for r in await conn.fetch(
                    "SELECT body FROM memory.memories WHERE org_id = $1", self.org
                )
            }
            documents = {
                r["document_id"]
                for r in await conn.fetch(
                    "SELECT document_id FROM retrieval.documents WHERE org_id = $1", self.org
                )
            }
            notes: dict[str, int] = {}
            if await conn.fetchval("SELECT to_regclass('orchestrator_test.notes') IS NOT NULL"):
                for row in await conn.fetch(
                    "SELECT text FROM orchestrator_test.notes WHERE org_id = $1", self.org
                ):
                    notes[row["text"]] = notes.get(row["text"], 0) + 1
        finally:
            await conn.close()
        for record in acknowledged:
            if record.kind == "remember":
                if f"The load test wrote memory {record.key}." not in bodies:
                    found.memories.append(record.key)
            elif record.kind == "ingest":
                if f"load-{record.key}" not in documents:
                    found.documents.append(record.key)
            elif record.kind == "confirm" and notes.get(f"note {record.key}", 0) != 1:
                found.confirmed_notes.append(record.key)
        found.notes_written_twice = [text for text, n in notes.items() if n > 1]
        return found


def failures(records: Sequence[CallRecord]) -> list[CallRecord]:
    return [r for r in records if r.ended and not r.ok]
