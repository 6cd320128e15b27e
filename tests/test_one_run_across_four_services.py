"""One real run across all four processes: caller's rights (I1, I2), the
trajectory, and one trace for the whole run."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.stack import log_events, wait_until
from tests.conftest import Stack

CONFIDENTIAL_DOC = "handbook-bonus-pool-2026"
CONFIDENTIAL_PHRASES = ("company factor of 0.9", "9 percent of base salary", "Bonus pool 2026")


def _run(
    stack: Stack, user: str, roles: list[str]
) -> tuple[orchestrator_pb2.Run, orchestrator_pb2.GetTrajectoryResponse]:
    token = stack.token(user, roles)
    with grpc.insecure_channel(stack.addresses["orchestrator"]) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        run = stub.StartRun(
            orchestrator_pb2.StartRunRequest(agent="handbook", input=stack.corpus["question"]),
            metadata=call_metadata(token),
            timeout=120,
        ).run
        trajectory = stub.GetTrajectory(
            orchestrator_pb2.GetTrajectoryRequest(run_id=run.run_id),
            metadata=call_metadata(token),
            timeout=30,
        )
    return run, trajectory


@pytest.fixture(scope="module")
def manager_run(
    stack: Stack,
) -> tuple[orchestrator_pb2.Run, orchestrator_pb2.GetTrajectoryResponse]:
    return _run(stack, "maria", ["manager"])


@pytest.fixture(scope="module")
def employee_run(
    stack: Stack,
) -> tuple[orchestrator_pb2.Run, orchestrator_pb2.GetTrajectoryResponse]:
    return _run(stack, "tom", ["employee"])


def test_the_answer_cites_a_chunk_the_manager_may_read(manager_run: Any) -> None:
    run, _ = manager_run
    assert run.state == orchestrator_pb2.RUN_STATE_COMPLETED, run.reason
    assert run.answer.startswith("[offline demo model]")
    cited = {c.document_id for c in run.citations}
    assert CONFIDENTIAL_DOC in cited
    for citation in run.citations:
        assert f"[{citation.label}]" in run.answer
        assert citation.chunk_id and citation.char_end > citation.char_start


def test_an_employee_asking_the_same_gets_nothing_of_the_managers_chunk(employee_run: Any) -> None:
    run, trajectory = employee_run
    assert run.state == orchestrator_pb2.RUN_STATE_COMPLETED, run.reason
    assert run.citations, "the employee should still get an answer from what they may read"
    assert CONFIDENTIAL_DOC not in {c.document_id for c in run.citations}
    everything = json_format.MessageToJson(run) + json_format.MessageToJson(trajectory)
    assert CONFIDENTIAL_DOC not in everything
    for phrase in CONFIDENTIAL_PHRASES:
        assert phrase not in everything


def test_the_employee_trajectory_retrieved_only_visible_documents(employee_run: Any) -> None:
    _, trajectory = employee_run
    retrievals = [s for s in trajectory.steps if s.kind == orchestrator_pb2.STEP_KIND_RETRIEVAL]
    assert retrievals, "the handbook agent names a source, so a retrieval step must exist"
    for step in retrievals:
        detail = json_format.MessageToDict(step.detail)
        for result in detail.get("results", []):
            assert result["document_id"] != CONFIDENTIAL_DOC


def test_get_trajectory_returns_every_step_in_order_with_its_span(manager_run: Any) -> None:
    run, trajectory = manager_run
    kinds = [s.kind for s in trajectory.steps]
    assert [s.seq for s in trajectory.steps] == list(range(1, len(trajectory.steps) + 1))
    assert orchestrator_pb2.STEP_KIND_MEMORY_READ in kinds
    assert orchestrator_pb2.STEP_KIND_RETRIEVAL in kinds
    assert kinds.count(orchestrator_pb2.STEP_KIND_MODEL_CALL) == 2  # tool call, then answer
    assert orchestrator_pb2.STEP_KIND_TOOL_CALL in kinds
    assert kinds.index(orchestrator_pb2.STEP_KIND_TOOL_CALL) > kinds.index(
        orchestrator_pb2.STEP_KIND_MODEL_CALL
    )
    for step in trajectory.steps:
        assert len(step.span_id) == 16 and int(step.span_id, 16) != 0
        assert step.started_at.ToDatetime() <= step.finished_at.ToDatetime()
    assert len({s.span_id for s in trajectory.steps}) == len(trajectory.steps)
    assert trajectory.trace_id == run.trace_id
    model_call = next(
        s for s in trajectory.steps if s.kind == orchestrator_pb2.STEP_KIND_MODEL_CALL
    )
    detail = json_format.MessageToDict(model_call.detail)
    assert detail["provider"] == "offline"
    assert detail["model"] == "cairn-offline-demo"


def test_all_spans_of_a_run_share_one_trace_and_form_one_tree(
    stack: Stack, manager_run: Any
) -> None:
    run, trajectory = manager_run

    wanted = {"cairn_gateway", "cairn_retrieval", "cairn_memory", "cairn_orchestrator"}

    def missing() -> list[str]:
        # Spans arrive in export batches; the tree is complete when it is closed at the
        # top (the StartRun server span ends last), every step's span has arrived,
        # and no span waits for its parent.
        spans = stack.otlp.spans(run.trace_id)
        ids = {s.span_id for s in spans}
        gaps = [f"no span from {svc}" for svc in sorted(wanted - {s.service for s in spans})]
        if not any(not s.parent_span_id for s in spans):
            gaps.append("no root span")
        gaps += [
            f"step {st.seq} span {st.span_id}" for st in trajectory.steps if st.span_id not in ids
        ]
        # A process exports a child before its parent when a batch leaves between
        # their ends; the tree is only complete once every parent has arrived too.
        gaps += [
            f"the parent of {s.service}:{s.name}"
            for s in spans
            if s.parent_span_id and s.parent_span_id not in ids
        ]
        return gaps

    try:
        wait_until(lambda: not missing(), timeout=30)
    except TimeoutError:
        pytest.fail(f"the trace stayed incomplete: {missing()}")
    spans = stack.otlp.spans(run.trace_id)
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if not s.parent_span_id]
    assert len(roots) == 1, [(s.service, s.name) for s in roots]
    run_spans = [s for s in spans if s.name == "invoke_agent handbook"]
    assert len(run_spans) == 1
    run_span = run_spans[0]
    assert run_span.service == "cairn_orchestrator"
    assert run_span.attributes.get("cairn.run_id") == run.run_id

    def ancestors(span: Any) -> list[Any]:
        chain = []
        while span.parent_span_id:
            assert span.parent_span_id in by_id, (
                f"{span.service}:{span.name} hangs off a span outside the trace"
            )
            span = by_id[span.parent_span_id]
            chain.append(span)
            assert len(chain) < 50
        return chain

    # The run span may sit under the StartRun server span (and a caller's own trace);
    # every other span of the run hangs under the run span.
    above_run = {s.span_id for s in ancestors(run_span)}
    for span in spans:
        if span is run_span or span.span_id in above_run:
            continue
        assert run_span in ancestors(span), f"{span.service}:{span.name} is not under the run span"
    assert {s.service for s in spans if run_span in ancestors(s)} >= {
        "cairn_gateway",
        "cairn_retrieval",
        "cairn_memory",
        "cairn_orchestrator",
    }
    for step in trajectory.steps:
        assert step.span_id in by_id, f"step {step.seq} names a span that was never exported"
    chat_spans = [s for s in spans if s.service == "cairn_gateway" and s.name.startswith("chat ")]
    assert chat_spans and all(
        s.attributes.get("gen_ai.provider.name") == "offline" for s in chat_spans
    )


def test_log_lines_of_other_services_name_the_run_and_its_trace(
    stack: Stack, manager_run: Any
) -> None:
    run, _ = manager_run
    for service in ("retrieval", "memory"):
        events = wait_until(
            lambda s=service: [
                e for e in log_events(stack.processes[s]) if e.get("run_id") == run.run_id
            ],
            timeout=10,
        )
        assert all(e.get("trace_id") == run.trace_id for e in events), service
    orchestrator_lines = [
        e for e in log_events(stack.processes["orchestrator"]) if e.get("run_id") == run.run_id
    ]
    assert orchestrator_lines and all(e.get("trace_id") == run.trace_id for e in orchestrator_lines)


def test_no_log_line_carries_the_question_or_a_document(stack: Stack, manager_run: Any) -> None:
    run, _ = manager_run
    for proc in stack.processes.values():
        text = proc.log_text()
        assert run.input not in text, proc.name
        for phrase in CONFIDENTIAL_PHRASES:
            assert phrase not in text, proc.name
