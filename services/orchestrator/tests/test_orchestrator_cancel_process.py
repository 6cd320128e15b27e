"""CancelRun with real processes: two orchestrators on one PostgreSQL, the gateway,
and the offline model holding a call. A run started on one orchestrator is
cancelled through the other: the first notices through the run's state, cancels
its model call, and its StartRun answers CANCELLED with who cancelled; a pending
confirmation cancelled through one cannot be approved through the other. The
run's language travels the same way: a card proposed in Chinese on one is shown
in Chinese by the other."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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
    control,
    detail,
    get_run,
    notes,
    resolve,
    script,
    trajectory,
)


@dataclass
class TwoOrchestrators:
    model_url: str
    first: Orchestrator
    second: Orchestrator
    pg_url: str


@pytest.fixture(scope="module")
def two_orchestrators(
    service_env: dict[str, str], pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoOrchestrators]:
    base = tmp_path_factory.mktemp("orchestrator-cancel")
    logs = base / "logs"
    agents = base / "agents"
    agents.mkdir()
    (agents / "scribe.yaml").write_text(SCRIBE_SPEC)
    model_port = free_port()
    model = start_fake_provider(port=model_port, log_dir=logs, name="cancel")
    gateway_port = free_port()
    env = {
        **service_env,
        "CAIRN_OFFLINE_MODEL_URL": f"http://127.0.0.1:{model_port}/v1",
        "CAIRN_AGENTS_DIR": str(agents),
        "CAIRN_GATEWAY_ADDR": f"127.0.0.1:{gateway_port}",
        "CAIRN_RETRIEVAL_ADDR": "none",
        "CAIRN_MEMORY_ADDR": "none",
        "CAIRN_TEST_WRITE_TOOL": "1",
    }
    gateway: ServiceProcess = start_service(
        "gateway", port=gateway_port, env=env, log_dir=logs, suffix="-cancel"
    )
    first = Orchestrator(env=env, log_dir=logs)
    second = Orchestrator(env=env, log_dir=logs / "second")
    try:
        wait_for_http(model)
        wait_for_health(gateway, timeout=90)
        first.start()
        second.start()
        yield TwoOrchestrators(f"http://127.0.0.1:{model_port}", first, second, pg_url)
    finally:
        first.stop()
        second.stop()
        gateway.stop()
        model.stop()


@pytest.fixture(autouse=True)
def fresh_script(two_orchestrators: TwoOrchestrators) -> None:
    control(two_orchestrators.model_url, "reset", {})


@pytest.fixture
def alice(issuer: TokenIssuer, new_org: str) -> str:
    return issuer.caller_token(org_id=new_org, user_id="alice")


def _stub(channel: grpc.Channel) -> orchestrator_pb2_grpc.OrchestratorServiceStub:
    return orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


def _start(address: str, token: str, question: str, *, language: str = "") -> pb.Run:
    with grpc.insecure_channel(address) as channel:
        run: pb.Run = (
            _stub(channel)
            .StartRun(
                pb.StartRunRequest(agent="scribe", input=question, language=language),
                metadata=call_metadata(token),
                timeout=40,
            )
            .run
        )
    return run


def _cancel(address: str, token: str, run_id: str, reason: str = "") -> pb.Run:
    with grpc.insecure_channel(address) as channel:
        run: pb.Run = (
            _stub(channel)
            .CancelRun(
                pb.CancelRunRequest(run_id=run_id, reason=reason),
                metadata=call_metadata(token),
                timeout=10,
            )
            .run
        )
    return run


def _runs(address: str, token: str, state: int) -> list[pb.Run]:
    with grpc.insecure_channel(address) as channel:
        runs = (
            _stub(channel)
            .ListRuns(
                pb.ListRunsRequest(page_size=10, state=state),
                metadata=call_metadata(token),
                timeout=10,
            )
            .runs
        )
    return list(runs)


def test_a_run_held_in_a_model_call_on_one_orchestrator_is_cancelled_through_the_other(
    two_orchestrators: TwoOrchestrators, alice: str
) -> None:
    # Held far longer than StartRun waits: only a cancelled call lets it answer in time.
    script(two_orchestrators.model_url, {"action": "hang", "seconds": 120})
    with ThreadPoolExecutor(max_workers=1) as pool:
        asking = pool.submit(
            _start, two_orchestrators.first.address, alice, f"Hold on ({uuid.uuid4().hex[:6]})"
        )
        (running,) = wait_until(
            lambda: _runs(two_orchestrators.second.address, alice, pb.RUN_STATE_RUNNING), timeout=30
        )
        cancelled = _cancel(
            two_orchestrators.second.address, alice, running.run_id, "taking too long"
        )
        assert cancelled.state == pb.RUN_STATE_CANCELLED and cancelled.cancelled_by == "alice"
        answered = asking.result(timeout=35)

    assert answered.run_id == running.run_id
    assert answered.state == pb.RUN_STATE_CANCELLED
    assert answered.reason == "cancelled by alice: taking too long"
    steps = trajectory(two_orchestrators.second.address, alice, running.run_id)
    assert steps[-1].kind == pb.STEP_KIND_MODEL_CALL and steps[-1].error.code == "run.cancelled"
    with pytest.raises(grpc.RpcError) as refused:
        _cancel(two_orchestrators.first.address, alice, running.run_id)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has already ended (CANCELLED)" in (refused.value.details() or "")


def test_a_chinese_card_cancelled_through_one_orchestrator_cannot_be_approved_on_the_other(
    two_orchestrators: TwoOrchestrators, alice: str, new_org: str
) -> None:
    script(
        two_orchestrators.model_url,
        {"action": "tool_call", "name": "append_note", "arguments": {"text": "买牛奶"}},
    )
    run = _start(
        two_orchestrators.first.address, alice, f"记一下 ({uuid.uuid4().hex[:6]})", language="zh-CN"
    )
    assert run.state == pb.RUN_STATE_CONFIRMATION_PENDING and run.language == "zh-Hans"
    card = run.pending_confirmation.card
    assert card.summary == "在测试记录中追加一条笔记" and card.language == "zh-Hans"
    assert not card.language_fallback
    shown = get_run(two_orchestrators.second.address, alice, run.run_id)
    assert shown.pending_confirmation.card.summary == card.summary

    _cancel(two_orchestrators.second.address, alice, run.run_id, "不用了")
    with pytest.raises(grpc.RpcError) as refused:
        resolve(two_orchestrators.first.address, alice, run.pending_confirmation.confirmation_token)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "can no longer be approved; its write did not run" in (refused.value.details() or "")
    assert notes(two_orchestrators.pg_url, new_org) == []
    ended = get_run(two_orchestrators.first.address, alice, run.run_id)
    assert ended.state == pb.RUN_STATE_CANCELLED and ended.reason.startswith(
        "cancelled by alice: 不用了"
    )
    cancel_step = trajectory(two_orchestrators.first.address, alice, run.run_id)[-1]
    assert (
        detail(cancel_step)["decision"] == "CANCELLED" and detail(cancel_step)["write"] == "not_run"
    )


def test_start_run_asked_to_return_when_started_answers_running_and_the_run_goes_on(
    two_orchestrators: TwoOrchestrators, alice: str
) -> None:
    # The model holds its call far longer than StartRun is given: only an answer
    # given once the run exists comes back in time.
    script(two_orchestrators.model_url, {"action": "hang", "seconds": 120})
    with grpc.insecure_channel(two_orchestrators.first.address) as channel:
        started = (
            _stub(channel)
            .StartRun(
                pb.StartRunRequest(
                    agent="scribe",
                    input=f"Hold on ({uuid.uuid4().hex[:6]})",
                    return_when_started=True,
                ),
                metadata=call_metadata(alice),
                timeout=10,
            )
            .run
        )
    assert started.state == pb.RUN_STATE_RUNNING and started.run_id

    # The run goes on after the answer: its model call is in flight, seen through
    # the other orchestrator, and the stream there follows it to its end.
    assert (
        get_run(two_orchestrators.second.address, alice, started.run_id).state
        == pb.RUN_STATE_RUNNING
    )
    with grpc.insecure_channel(two_orchestrators.second.address) as channel:
        events = _stub(channel).StreamRun(
            pb.StreamRunRequest(run_id=started.run_id), metadata=call_metadata(alice), timeout=40
        )
        _cancel(two_orchestrators.second.address, alice, started.run_id, "seen enough")
        seen = list(events)
    assert seen, "the stream ended without an event"
    last = seen[-1]
    assert last.kind == pb.RUN_EVENT_KIND_RUN_FINISHED
    assert last.run.state == pb.RUN_STATE_CANCELLED
    # The working orchestrator hears of the cancel and records the cut-short call.
    steps = wait_until(
        lambda: trajectory(two_orchestrators.first.address, alice, started.run_id), timeout=10
    )
    assert steps[-1].kind == pb.STEP_KIND_MODEL_CALL and steps[-1].error.code == "run.cancelled"
