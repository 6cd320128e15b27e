"""A run is not tied to the replica that started it: with three replicas of every
service, a run started on one orchestrator is streamed on another and approved on
a third, and twenty approvals at once spread over the replicas make one write."""

from __future__ import annotations

import asyncio

import asyncpg
import grpc
import httpx
import pytest

from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn.orchestrator.v1 import orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.stack import SCRIBE_AGENT
from tests.replicas_support import ReplicaStack

# The first module to use the shared stack starts its twelve processes.
pytestmark = pytest.mark.timeout(300)


def _orchestrator(stack: ReplicaStack, index: int) -> grpc.aio.Channel:
    """A channel to one orchestrator replica only, to say which one takes a call."""
    return channel(stack.local.address("orchestrator", index))


async def _propose_note(stack: ReplicaStack, token: str, text: str, **pauses: float) -> pb.Run:
    async with httpx.AsyncClient(timeout=10) as http:
        (await http.post(f"{stack.scripted_url}/_control/reset")).raise_for_status()
        step = {"action": "tool_call", "name": "append_note", "arguments": {"text": text, **pauses}}
        (
            await http.post(f"{stack.scripted_url}/_control/script", json={"steps": [step]})
        ).raise_for_status()
    async with _orchestrator(stack, 0) as ch:
        run: pb.Run = (
            await orchestrator_pb2_grpc.OrchestratorServiceStub(ch).StartRun(
                pb.StartRunRequest(agent=SCRIBE_AGENT, input=f"Please note: {text}"),
                metadata=call_metadata(token),
                timeout=30,
            )
        ).run
    assert run.state == pb.RUN_STATE_CONFIRMATION_PENDING, run.reason
    return run


async def _notes(pg_url: str, org: str) -> list[tuple[str, int]]:
    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch(
            "SELECT n.text, h.handed_over FROM orchestrator_test.notes n "
            "JOIN orchestrator_test.handovers h USING (idempotency_key) WHERE n.org_id = $1",
            org,
        )
    finally:
        await conn.close()
    return [(r["text"], r["handed_over"]) for r in rows]


async def test_a_run_started_on_one_replica_is_streamed_on_another_and_approved_on_a_third(
    replicas: ReplicaStack,
) -> None:
    org = replicas.new_org()
    token = replicas.issuer.caller_token(org_id=org, user_id="alice")
    run = await _propose_note(replicas, token, "order paper")

    async with _orchestrator(replicas, 2) as streaming, _orchestrator(replicas, 1) as approving:
        events = orchestrator_pb2_grpc.OrchestratorServiceStub(streaming).StreamRun(
            pb.StreamRunRequest(run_id=run.run_id), metadata=call_metadata(token), timeout=60
        )
        seen: list[pb.StreamRunResponse] = []

        async def follow() -> None:
            async for event in events:
                seen.append(event)

        following = asyncio.create_task(follow())
        # The stream on replica 2 has caught up with the run once it announced the card.
        while not any(e.kind == pb.RUN_EVENT_KIND_CONFIRMATION_PENDING for e in seen):
            assert not following.done(), "the stream ended before the confirmation"
            await asyncio.sleep(0.02)
        approved = (
            await orchestrator_pb2_grpc.OrchestratorServiceStub(approving).ResolveConfirmation(
                pb.ResolveConfirmationRequest(
                    confirmation_token=run.pending_confirmation.confirmation_token,
                    decision=pb.DECISION_APPROVE,
                ),
                metadata=call_metadata(token),
                timeout=30,
            )
        ).run
        await asyncio.wait_for(following, timeout=30)

    assert approved.state == pb.RUN_STATE_COMPLETED
    finished = [e for e in seen if e.kind == pb.RUN_EVENT_KIND_RUN_FINISHED]
    assert [e.run.state for e in finished] == [pb.RUN_STATE_COMPLETED]
    streamed_steps = [
        pb.StepKind.Name(e.step.kind) for e in seen if e.kind == pb.RUN_EVENT_KIND_STEP_FINISHED
    ]
    assert "STEP_KIND_CONFIRMATION_RESOLVED" in streamed_steps
    assert "STEP_KIND_TOOL_CALL" in streamed_steps
    assert await _notes(replicas.pg_url, org) == [("order paper", 1)]


async def test_twenty_concurrent_approvals_spread_over_three_replicas_make_one_write(
    replicas: ReplicaStack,
) -> None:
    org = replicas.new_org()
    token = replicas.issuer.caller_token(org_id=org, user_id="alice")
    # The first hand-over holds the write for a moment, so the approvals overlap it.
    run = await _propose_note(replicas, token, "book the room", pause_after_seconds=0.5)
    request = pb.ResolveConfirmationRequest(
        confirmation_token=run.pending_confirmation.confirmation_token,
        decision=pb.DECISION_APPROVE,
    )
    channels = [_orchestrator(replicas, i) for i in range(3)]
    try:
        stubs = [orchestrator_pb2_grpc.OrchestratorServiceStub(ch) for ch in channels]
        for ch in channels:
            await ch.channel_ready()

        async def approve(i: int) -> pb.Run | grpc.StatusCode:
            try:
                answered: pb.Run = (
                    await stubs[i % 3].ResolveConfirmation(
                        request, metadata=call_metadata(token), timeout=30
                    )
                ).run
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return answered

        answers = await asyncio.gather(*(approve(i) for i in range(20)))
        final = (
            await stubs[0].GetRun(
                pb.GetRunRequest(run_id=run.run_id), metadata=call_metadata(token), timeout=10
            )
        ).run
        steps = (
            await stubs[1].GetTrajectory(
                pb.GetTrajectoryRequest(run_id=run.run_id),
                metadata=call_metadata(token),
                timeout=10,
            )
        ).steps
    finally:
        for ch in channels:
            await ch.close(grace=None)

    # Every approver hears about the one run; none is told of a second write or an error.
    assert all(isinstance(a, pb.Run) for a in answers), answers
    assert {a.run_id for a in answers if isinstance(a, pb.Run)} == {run.run_id}
    assert final.state == pb.RUN_STATE_COMPLETED
    assert await _notes(replicas.pg_url, org) == [("book the room", 1)]
    assert [s.kind for s in steps].count(pb.STEP_KIND_CONFIRMATION_RESOLVED) == 1
    assert [s.name for s in steps if s.kind == pb.STEP_KIND_TOOL_CALL] == ["append_note"]
