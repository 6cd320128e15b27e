"""Confirmed writes, budgets and the trajectory with real processes: the orchestrator
and the gateway over real gRPC, the offline model over real HTTP (scripted per
request), a real PostgreSQL, and the test-only `append_note` write tool whose
effect is counted in a table.

The orchestrator is killed with SIGKILL around the execution of an approved write
and started again; the write must take effect exactly once, and no model call or
tool call that was recorded before the kill may be made again."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn.orchestrator.v1 import orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import (
    ServiceProcess,
    free_port,
    start_fake_provider,
    start_service,
    wait_for_health,
    wait_for_http,
    wait_until,
)
from services.orchestrator.tests.orchestrator_process_support import (
    SCRIBE_SPEC,
    Orchestrator,
    budget_spec,
    chat_requests,
    confirmation_state,
    control,
    detail,
    get_run,
    kinds,
    notes,
    resolve,
    script,
    start_run,
    tool_messages,
    trajectory,
)

LEASE_SECONDS = "1.5"


@dataclass
class WriteStack:
    model_url: str
    orchestrator: Orchestrator
    pg_url: str


@pytest.fixture(scope="module")
def write_stack(
    service_env: dict[str, str], pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WriteStack]:
    base = tmp_path_factory.mktemp("orchestrator-writes")
    logs = base / "logs"
    agents = base / "agents"
    agents.mkdir()
    (agents / "scribe.yaml").write_text(SCRIBE_SPEC)
    (agents / "one_call.yaml").write_text(budget_spec("one_call", model_calls=1))
    (agents / "few_tokens.yaml").write_text(budget_spec("few_tokens", tokens=60))
    (agents / "one_second.yaml").write_text(budget_spec("one_second", wall=1))
    model_port = free_port()
    model = start_fake_provider(port=model_port, log_dir=logs, name="writes")
    gateway_port = free_port()
    env = {
        **service_env,
        "CAIRN_OFFLINE_MODEL_URL": f"http://127.0.0.1:{model_port}/v1",
        "CAIRN_AGENTS_DIR": str(agents),
        "CAIRN_GATEWAY_ADDR": f"127.0.0.1:{gateway_port}",
        "CAIRN_RETRIEVAL_ADDR": "none",
        "CAIRN_MEMORY_ADDR": "none",
        "CAIRN_TEST_WRITE_TOOL": "1",
        "CAIRN_RUN_LEASE_SECONDS": LEASE_SECONDS,
    }
    gateway: ServiceProcess = start_service(
        "gateway", port=gateway_port, env=env, log_dir=logs, suffix="-writes"
    )
    orchestrator = Orchestrator(env=env, log_dir=logs)
    try:
        wait_for_http(model)
        wait_for_health(gateway, timeout=90)
        orchestrator.start()
        yield WriteStack(f"http://127.0.0.1:{model_port}", orchestrator, pg_url)
    finally:
        orchestrator.stop()
        gateway.stop()
        model.stop()


@pytest.fixture(autouse=True)
def fresh_script(write_stack: WriteStack) -> None:
    control(write_stack.model_url, "reset", {})


@pytest.fixture
def alice(issuer: TokenIssuer, new_org: str) -> str:
    return issuer.caller_token(org_id=new_org, user_id="alice")


def note_call(text: str, **pauses: float) -> dict[str, Any]:
    return {"action": "tool_call", "name": "append_note", "arguments": {"text": text, **pauses}}


def question() -> str:
    # Unique per test, so the model's request log can be read per run.
    return f"Please note this down ({uuid.uuid4().hex[:8]})."


# ---------------------------------------------------------------- a write never runs unconfirmed


def test_a_write_never_runs_unconfirmed_and_the_run_waits_with_its_card(
    write_stack: WriteStack, alice: str, new_org: str
) -> None:
    asked = question()
    script(
        write_stack.model_url,
        {
            "action": "tool_call",
            "calls": [
                {"name": "append_note", "arguments": {"text": "buy milk"}},
                {"name": "search_knowledge", "arguments": {"query": "milk"}},
            ],
        },
    )
    run = start_run(write_stack.orchestrator.address, alice, "scribe", asked)

    assert run.state == pb.RUN_STATE_CONFIRMATION_PENDING
    card = run.pending_confirmation.card
    assert card.summary == "Append a note to the test ledger"
    assert [(d.label, d.value) for d in card.details] == [("Note", "buy milk")]
    assert run.pending_confirmation.tool_name == "append_note"
    assert run.pending_confirmation.expires_at.seconds > run.pending_confirmation.created_at.seconds
    assert notes(write_stack.pg_url, new_org) == []
    assert len(chat_requests(write_stack.model_url, containing=asked)) == 1
    steps = trajectory(write_stack.orchestrator.address, alice, run.run_id)
    assert kinds(steps) == ["MODEL_CALL", "TOOL_CALL", "CONFIRMATION_REQUESTED"]
    assert steps[1].name == "search_knowledge"
    assert detail(steps[2])["card"]["summary"] == card.summary
    with grpc.insecure_channel(write_stack.orchestrator.address) as channel:
        pending = (
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            .ListPendingConfirmations(
                pb.ListPendingConfirmationsRequest(), metadata=call_metadata(alice), timeout=10
            )
            .confirmations
        )
    assert [p.confirmation_token for p in pending] == [run.pending_confirmation.confirmation_token]


def test_an_actor_token_cannot_approve_even_with_the_persons_own_token(
    write_stack: WriteStack, alice: str, issuer: TokenIssuer, new_org: str
) -> None:
    script(write_stack.model_url, note_call("buy milk"))
    run = start_run(write_stack.orchestrator.address, alice, "scribe", question())
    actor = issuer.actor_token(service="orchestrator", run_id=run.run_id, agent="scribe")
    with (
        grpc.insecure_channel(write_stack.orchestrator.address) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        orchestrator_pb2_grpc.OrchestratorServiceStub(channel).ResolveConfirmation(
            pb.ResolveConfirmationRequest(
                confirmation_token=run.pending_confirmation.confirmation_token,
                decision=pb.DECISION_APPROVE,
            ),
            metadata=call_metadata(alice, actor_token=actor),
            timeout=10,
        )
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    bob = issuer.caller_token(org_id=new_org, user_id="bob", roles=["admin"])
    with pytest.raises(grpc.RpcError) as refused:
        resolve(write_stack.orchestrator.address, bob, run.pending_confirmation.confirmation_token)
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert notes(write_stack.pg_url, new_org) == []


# ---------------------------------------------------------------- exactly once


def test_two_simultaneous_approvals_execute_the_write_once(
    write_stack: WriteStack, alice: str, new_org: str
) -> None:
    asked = question()
    script(
        write_stack.model_url,
        note_call("buy milk", pause_after_seconds=0.5),
        {"action": "answer", "content": "Noted: buy milk."},
    )
    run = start_run(write_stack.orchestrator.address, alice, "scribe", asked)
    token = run.pending_confirmation.confirmation_token
    both_ready = threading.Barrier(2)

    def approve() -> pb.Run:
        with grpc.insecure_channel(write_stack.orchestrator.address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            request = pb.ResolveConfirmationRequest(
                confirmation_token=token, decision=pb.DECISION_APPROVE
            )
            both_ready.wait()
            answered: pb.Run = stub.ResolveConfirmation(
                request, metadata=call_metadata(alice), timeout=60
            ).run
            return answered

    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(lambda _: approve(), range(2)))

    assert [o.state for o in outcomes] == [pb.RUN_STATE_COMPLETED] * 2
    assert {o.answer for o in outcomes} == {"Noted: buy milk."}
    assert notes(write_stack.pg_url, new_org) == [("buy milk", 1)]
    steps = trajectory(write_stack.orchestrator.address, alice, run.run_id)
    assert kinds(steps).count("CONFIRMATION_RESOLVED") == 1
    assert [s.name for s in steps if s.kind == pb.STEP_KIND_TOOL_CALL] == ["append_note"]
    assert len(chat_requests(write_stack.model_url, containing=asked)) == 2


@pytest.mark.parametrize(
    "kill_point",
    ["before_the_effect", "after_the_effect", "after_the_result_was_recorded"],
)
def test_killed_around_an_approved_write_and_restarted_it_takes_effect_exactly_once(
    write_stack: WriteStack, alice: str, new_org: str, kill_point: str
) -> None:
    asked = question()
    hold = {
        "before_the_effect": {"pause_before_seconds": 30},
        "after_the_effect": {"pause_after_seconds": 30},
        "after_the_result_was_recorded": {},
    }[kill_point]
    steps_scripted: list[dict[str, Any]] = [note_call("call the bank", **hold)]
    if kill_point == "after_the_result_was_recorded":
        steps_scripted.append({"action": "hang", "seconds": 30})
    script(write_stack.model_url, *steps_scripted)
    orchestrator = write_stack.orchestrator
    run = start_run(orchestrator.address, alice, "scribe", asked)
    token = run.pending_confirmation.confirmation_token

    approving = ThreadPoolExecutor(max_workers=1)
    in_flight = approving.submit(resolve, orchestrator.address, alice, token)
    if kill_point == "before_the_effect":
        wait_until(lambda: confirmation_state(write_stack.pg_url, token) == "EXECUTING")
    elif kill_point == "after_the_effect":
        wait_until(lambda: notes(write_stack.pg_url, new_org))
    else:
        wait_until(lambda: confirmation_state(write_stack.pg_url, token) == "EXECUTED")
        wait_until(lambda: len(chat_requests(write_stack.model_url, containing=asked)) == 2)
    orchestrator.restart_after_kill()
    with pytest.raises(grpc.RpcError):
        in_flight.result(timeout=30)  # the approval's connection died with the process
    approving.shutdown()

    # The new process finds the run its predecessor left and gives it back to alice.
    back = wait_until(
        lambda: (
            r
            if (r := get_run(orchestrator.address, alice, run.run_id)).state
            == pb.RUN_STATE_CONFIRMATION_PENDING
            else None
        )
    )
    assert back.pending_confirmation.confirmation_token == token
    assert "You approved this" in back.pending_confirmation.card.warnings[0]
    control(write_stack.model_url, "reset", {})
    script(write_stack.model_url, {"action": "answer", "content": "The bank call is noted."})
    done = resolve(orchestrator.address, alice, token)

    assert done.state == pb.RUN_STATE_COMPLETED, done.reason
    assert done.answer == "The bank call is noted."
    rows = notes(write_stack.pg_url, new_org)
    assert [text for text, _ in rows] == ["call the bank"]  # took effect exactly once
    # Interrupted while it was with its target, it was handed over again with the
    # same key; once its result was recorded, never again.
    handed_over = rows[0][1]
    assert handed_over == (1 if kill_point == "after_the_result_was_recorded" else 2)
    steps = trajectory(orchestrator.address, alice, run.run_id)
    # The model call that proposed the write was made once and never again.
    assert kinds(steps).count("MODEL_CALL") == 2
    assert kinds(steps)[:3] == ["MODEL_CALL", "CONFIRMATION_REQUESTED", "CONFIRMATION_RESOLVED"]
    executed = [s for s in steps if s.kind == pb.STEP_KIND_TOOL_CALL]
    assert len(executed) == 1 and detail(executed[0])["result"]["appended"] is True
    resumed = [
        detail(s)["resumed_after_interruption"]
        for s in steps
        if s.kind == pb.STEP_KIND_CONFIRMATION_RESOLVED
    ]
    assert resumed == [False, True]


def test_a_run_killed_with_no_approval_in_flight_is_failed_with_the_reason_after_restart(
    write_stack: WriteStack, alice: str
) -> None:
    script(write_stack.model_url, {"action": "hang", "seconds": 30})
    orchestrator = write_stack.orchestrator
    pool = ThreadPoolExecutor(max_workers=1)
    asking = pool.submit(start_run, orchestrator.address, alice, "scribe", question())

    def running_run() -> str | None:
        with grpc.insecure_channel(orchestrator.address) as channel:
            runs = (
                orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
                .ListRuns(pb.ListRunsRequest(), metadata=call_metadata(alice), timeout=10)
                .runs
            )
        return runs[0].run_id if runs else None

    run_id = wait_until(running_run)
    orchestrator.restart_after_kill()
    with pytest.raises(grpc.RpcError):
        asking.result(timeout=30)
    pool.shutdown()
    ended = wait_until(
        lambda: (
            r
            if (r := get_run(orchestrator.address, alice, run_id)).state == pb.RUN_STATE_FAILED
            else None
        )
    )
    assert "orchestrator stopped while this run was working" in ended.reason


# ---------------------------------------------------------------- denial


def test_a_denial_reaches_the_model_as_a_tool_message_with_the_persons_note(
    write_stack: WriteStack, alice: str, new_org: str
) -> None:
    asked = question()
    script(
        write_stack.model_url,
        note_call("sell the car"),
        {"action": "answer", "content": "Understood, nothing was noted."},
    )
    run = start_run(write_stack.orchestrator.address, alice, "scribe", asked)
    done = resolve(
        write_stack.orchestrator.address,
        alice,
        run.pending_confirmation.confirmation_token,
        approve=False,
        note="not the car",
    )
    assert done.state == pb.RUN_STATE_COMPLETED
    assert notes(write_stack.pg_url, new_org) == []
    first, second = chat_requests(write_stack.model_url, containing=asked)
    assert tool_messages(first) == []
    (denied,) = tool_messages(second)
    assert "tool.denied" in denied["content"] and "not the car" in denied["content"]
    steps = trajectory(write_stack.orchestrator.address, alice, run.run_id)
    resolved = next(s for s in steps if s.kind == pb.STEP_KIND_CONFIRMATION_RESOLVED)
    assert detail(resolved)["decision"] == "DENY" and detail(resolved)["resolved_by"] == "alice"
    assert detail(resolved)["note"] == "not the car" and detail(resolved)["resolved_at"]


# ---------------------------------------------------------------- budgets


def test_the_model_call_budget_ends_the_run_budget_exhausted_with_its_trajectory(
    write_stack: WriteStack, alice: str
) -> None:
    run = start_run(write_stack.orchestrator.address, alice, "one_call", question())
    assert run.state == pb.RUN_STATE_BUDGET_EXHAUSTED
    assert "model-call budget of 1" in run.reason
    assert run.usage.model_calls == 1
    assert kinds(trajectory(write_stack.orchestrator.address, alice, run.run_id)) == ["MODEL_CALL"]


def test_the_token_budget_ends_the_run_when_the_gateway_says_the_call_cannot_fit(
    write_stack: WriteStack, alice: str
) -> None:
    run = start_run(write_stack.orchestrator.address, alice, "few_tokens", question())
    assert run.state == pb.RUN_STATE_BUDGET_EXHAUSTED
    assert "60 tokens left" in run.reason
    (step,) = trajectory(write_stack.orchestrator.address, alice, run.run_id)
    assert step.kind == pb.STEP_KIND_MODEL_CALL and step.error.code == "gateway.resource_exhausted"


def test_the_wall_time_budget_ends_a_run_whose_model_call_outlives_it(
    write_stack: WriteStack, alice: str
) -> None:
    script(write_stack.model_url, {"action": "hang", "seconds": 5})
    run = start_run(write_stack.orchestrator.address, alice, "one_second", question())
    assert run.state == pb.RUN_STATE_BUDGET_EXHAUSTED
    assert "wall-time budget of 1 s" in run.reason
    assert kinds(trajectory(write_stack.orchestrator.address, alice, run.run_id)) == ["MODEL_CALL"]


# ---------------------------------------------------------------- the trajectory, live


def test_every_step_of_a_run_is_streamed_as_it_starts_and_finishes_and_is_in_its_trajectory(
    write_stack: WriteStack, alice: str
) -> None:
    # The default demo model searches first, then answers; both calls are held for
    # a second, so the stream is open while the run is still working, however late
    # the run becomes visible to ListRuns on a loaded machine.
    script(
        write_stack.model_url, {"action": "hang", "seconds": 1}, {"action": "hang", "seconds": 1}
    )
    orchestrator = write_stack.orchestrator
    pool = ThreadPoolExecutor(max_workers=1)
    asking = pool.submit(start_run, orchestrator.address, alice, "scribe", question())

    def running_run() -> str | None:
        with grpc.insecure_channel(orchestrator.address) as channel:
            runs = (
                orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
                .ListRuns(pb.ListRunsRequest(), metadata=call_metadata(alice), timeout=10)
                .runs
            )
        return runs[0].run_id if runs else None

    run_id = wait_until(running_run)
    with grpc.insecure_channel(orchestrator.address) as channel:
        events = list(
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel).StreamRun(
                pb.StreamRunRequest(run_id=run_id), metadata=call_metadata(alice), timeout=30
            )
        )
    run = asking.result(timeout=30)
    pool.shutdown()

    assert run.state == pb.RUN_STATE_COMPLETED
    steps = trajectory(orchestrator.address, alice, run_id)
    assert kinds(steps) == ["MODEL_CALL", "TOOL_CALL", "MODEL_CALL"]
    assert [s.seq for s in steps] == [1, 2, 3]
    names = [pb.RunEventKind.Name(e.kind).removeprefix("RUN_EVENT_KIND_") for e in events]
    finished = [e.step for e in events if e.kind == pb.RUN_EVENT_KIND_STEP_FINISHED]
    assert [(s.seq, s.span_id) for s in finished] == [(s.seq, s.span_id) for s in steps]
    started = [e.step for e in events if e.kind == pb.RUN_EVENT_KIND_STEP_STARTED]
    # The steps that began after the stream opened were announced as they began
    # (seq 0, not yet finished), each before its end; the last model call, held for
    # a second, is always among them.
    assert started, "no step was announced as it started"
    assert [(s.span_id, s.seq) for s in started] == [
        (s.span_id, 0) for s in steps[len(steps) - len(started) :]
    ]
    assert not any(s.HasField("finished_at") for s in started)
    for step in started:
        began = next(i for i, e in enumerate(events) if e.step.span_id == step.span_id)
        ended = next(
            i
            for i, e in enumerate(events)
            if e.kind == pb.RUN_EVENT_KIND_STEP_FINISHED and e.step.span_id == step.span_id
        )
        assert began < ended
    assert names[-2:] == ["ANSWER", "RUN_FINISHED"]
    assert events[-1].run.state == pb.RUN_STATE_COMPLETED
