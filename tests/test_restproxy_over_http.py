"""The REST proxy (services/restproxy, grpc-gateway generated from protos/) as a
browser meets it: real HTTP to the real Go process in front of the real services.
What REST answers must be what gRPC answers; identity and trace context pass
through; nothing is minted or widened on the way."""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format

from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.errors import DENIAL_MESSAGE
from cairn_libs.identity import ACTOR_METADATA_KEY, TokenIssuer, generate_dev_keypair
from cairn_libs.stack import wait_until
from tests.conftest import OtlpReceiver, Stack
from tests.restproxy_support import running_restproxy

pytestmark = pytest.mark.timeout(180)

QUESTION = "How many days of leave do I get?"


@pytest.fixture(scope="module")
def rest(
    stack: Stack, otlp: tuple[OtlpReceiver, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with running_restproxy(
        stack, otlp_endpoint=otlp[1], log_dir=tmp_path_factory.mktemp("restproxy")
    ) as url:
        yield url


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _fresh_org() -> str:
    return f"org-{uuid.uuid4().hex[:10]}"


def _start_run_over_rest(rest: str, token: str, **headers: str) -> orchestrator_pb2.Run:
    response = httpx.post(
        f"{rest}/v1/runs",
        json={"agent": "handbook", "input": QUESTION},
        headers={**_bearer(token), **headers},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return json_format.Parse(response.text, orchestrator_pb2.StartRunResponse()).run


def _error_of(response: httpx.Response) -> dict[str, Any]:
    """The {code, message, details} of a refusal; a streaming route refused before
    its first event still sets the HTTP status, and sends it as its one
    {"error": ...} line."""
    body: dict[str, Any] = response.json()
    return body["error"] if set(body) == {"error"} else body


def _ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.iter_lines() if line.strip()]


def test_the_proxy_is_ready_when_every_backend_is_serving(rest: str) -> None:
    ready = httpx.get(f"{rest}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
    assert ready.json()["backends"] == {
        "orchestrator": "SERVING",
        "memory": "SERVING",
        "retrieval": "SERVING",
    }
    assert httpx.get(f"{rest}/healthz", timeout=10).status_code == 200


def test_openapi_lists_the_runs_and_not_the_model_gateway(rest: str) -> None:
    paths = httpx.get(f"{rest}/openapi.json", timeout=10).json()["paths"]
    assert {"/v1/runs", "/v1/runs/{runId}/events", "/v1/memory/memories"} <= set(paths)
    assert not [p for p in paths if p.startswith("/v1/gateway/")]
    assert httpx.post(f"{rest}/v1/gateway/chat", json={}, timeout=10).status_code == 404


def test_a_run_started_over_rest_reads_the_same_over_rest_and_grpc(stack: Stack, rest: str) -> None:
    token = stack.token("maria", ["manager"])
    started = _start_run_over_rest(rest, token)
    assert started.answer
    run_over_rest = json_format.Parse(
        httpx.get(f"{rest}/v1/runs/{started.run_id}", headers=_bearer(token), timeout=30).text,
        orchestrator_pb2.GetRunResponse(),
    )
    trajectory_over_rest = json_format.Parse(
        httpx.get(
            f"{rest}/v1/runs/{started.run_id}/trajectory", headers=_bearer(token), timeout=30
        ).text,
        orchestrator_pb2.GetTrajectoryResponse(),
    )
    with grpc.insecure_channel(stack.addresses["orchestrator"]) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        md = call_metadata(token)
        run_over_grpc = stub.GetRun(
            orchestrator_pb2.GetRunRequest(run_id=started.run_id), metadata=md, timeout=30
        )
        trajectory_over_grpc = stub.GetTrajectory(
            orchestrator_pb2.GetTrajectoryRequest(run_id=started.run_id), metadata=md, timeout=30
        )
    assert run_over_rest == run_over_grpc
    assert run_over_rest.run.answer == started.answer
    assert trajectory_over_rest == trajectory_over_grpc
    assert len(trajectory_over_rest.steps) >= 2


def test_a_runs_events_arrive_as_one_json_line_per_event_like_grpc_streams_them(
    stack: Stack, rest: str
) -> None:
    token = stack.token("maria", ["manager"])
    run = _start_run_over_rest(rest, token)
    with httpx.stream(
        "GET", f"{rest}/v1/runs/{run.run_id}/events", headers=_bearer(token), timeout=60
    ) as response:
        assert response.status_code == 200
        lines = _ndjson(response)
    assert all(set(line) == {"result"} for line in lines), lines
    over_rest = [
        json_format.ParseDict(line["result"], orchestrator_pb2.StreamRunResponse())
        for line in lines
    ]
    with grpc.insecure_channel(stack.addresses["orchestrator"]) as ch:
        over_grpc = list(
            orchestrator_pb2_grpc.OrchestratorServiceStub(ch).StreamRun(
                orchestrator_pb2.StreamRunRequest(run_id=run.run_id),
                metadata=call_metadata(token),
                timeout=60,
            )
        )
    assert over_rest == over_grpc
    steps = [
        e.step.seq for e in over_rest if e.kind == orchestrator_pb2.RUN_EVENT_KIND_STEP_FINISHED
    ]
    assert steps == sorted(steps) and len(steps) >= 2
    assert over_rest[-1].kind == orchestrator_pb2.RUN_EVENT_KIND_RUN_FINISHED


def _bad_tokens(stack: Stack, org: str, tmp_path: Path) -> dict[str, dict[str, str]]:
    forger = TokenIssuer.from_file(generate_dev_keypair(tmp_path / "other-key")[0])
    forged = forger.caller_token(org_id=org, user_id="mallory", roles=["ingester", "admin"])
    return {"no token": {}, "forged token": _bearer(forged)}


@pytest.mark.parametrize("kind", ["no token", "forged token"])
def test_a_missing_or_forged_token_is_401_and_nothing_is_written(
    stack: Stack, rest: str, kind: str, tmp_path: Path
) -> None:
    org = _fresh_org()
    headers = _bad_tokens(stack, org, tmp_path)[kind]
    writes = [
        ("/v1/runs", {"agent": "handbook", "input": QUESTION}),
        (
            "/v1/memory/memories",
            {"text": "likes tea", "subject": {"kind": "SUBJECT_KIND_WORKSPACE"}},
        ),
        (
            "/v1/retrieval/documents:ingest",
            {"documents": [{"documentId": "d1", "source": "handbook", "title": "t", "text": "x"}]},
        ),
    ]
    for path, body in writes:
        response = httpx.post(f"{rest}{path}", json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (path, response.text)
        error = _error_of(response)
        assert error["code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert error["message"] and "mallory" not in error["message"]
    _assert_nothing_written(stack, org)


def _assert_nothing_written(stack: Stack, org: str) -> None:
    md = call_metadata(stack.token("auditor", ["admin", "ingester", "employee"], org=org))
    with grpc.insecure_channel(stack.addresses["retrieval"]) as ch:
        stats = retrieval_pb2_grpc.RetrievalServiceStub(ch).Stats(
            retrieval_pb2.StatsRequest(), metadata=md, timeout=10
        )
    with grpc.insecure_channel(stack.addresses["memory"]) as ch:
        held = memory_pb2_grpc.MemoryServiceStub(ch).Held(
            memory_pb2.HeldRequest(
                subject=memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_WORKSPACE)
            ),
            metadata=md,
            timeout=10,
        )
    with grpc.insecure_channel(stack.addresses["orchestrator"]) as ch:
        runs = orchestrator_pb2_grpc.OrchestratorServiceStub(ch).ListRuns(
            orchestrator_pb2.ListRunsRequest(), metadata=md, timeout=10
        )
    assert (stats.documents, list(held.memories), list(runs.runs)) == (0, [], [])


def test_another_orgs_run_is_403_with_the_one_denial_like_a_run_that_does_not_exist(
    stack: Stack, rest: str
) -> None:
    run = _start_run_over_rest(rest, stack.token("maria", ["manager"]))
    stranger = _bearer(stack.token("maria", ["manager"], org=_fresh_org()))
    refusals = []
    for run_id in (run.run_id, f"run_{uuid.uuid4().hex}"):
        for suffix in ("", "/trajectory", "/events"):
            response = httpx.get(f"{rest}/v1/runs/{run_id}{suffix}", headers=stranger, timeout=30)
            body = _error_of(response)
            details = [(d["@type"], d["reason"]) for d in body["details"]]
            refusals.append((response.status_code, body["code"], body["message"], tuple(details)))
    assert set(refusals) == {
        (
            403,
            grpc.StatusCode.PERMISSION_DENIED.value[0],
            DENIAL_MESSAGE,
            (("type.googleapis.com/google.rpc.ErrorInfo", "DENIED"),),
        )
    }


def test_an_unknown_field_is_400_naming_it_and_nothing_is_written(stack: Stack, rest: str) -> None:
    org = _fresh_org()
    response = httpx.post(
        f"{rest}/v1/runs",
        json={"agent": "handbook", "input": QUESTION, "budgetUsd": 1000},
        headers=_bearer(stack.token("auditor", ["admin"], org=org)),
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert "budgetUsd" in response.json()["message"]
    _assert_nothing_written(stack, org)


def test_an_actor_header_from_outside_never_reaches_a_service(stack: Stack, rest: str) -> None:
    # A valid actor credential, as the orchestrator would send: if the proxy passed
    # it on, memory would record this person's write as an agent's in that run.
    actor = stack.issuer.actor_token(service="orchestrator", run_id="run_forged", agent="handbook")
    user = f"u-{uuid.uuid4().hex[:8]}"
    token = stack.token(user, ["employee"])
    response = httpx.post(
        f"{rest}/v1/memory/memories",
        json={"text": "prefers mornings", "subject": {"kind": "SUBJECT_KIND_USER", "id": user}},
        headers={
            **_bearer(token),
            ACTOR_METADATA_KEY: f"Bearer {actor}",
            f"Grpc-Metadata-{ACTOR_METADATA_KEY}": f"Bearer {actor}",
        },
        timeout=30,
    )
    assert response.status_code == 200, response.text
    provenance = json_format.Parse(response.text, memory_pb2.RememberResponse()).memory.provenance
    assert provenance.author_kind == memory_pb2.AUTHOR_KIND_PERSON
    assert (provenance.author_id, provenance.run_id) == (user, "")


def test_a_batch_of_documents_ingests_over_rest_with_progress_lines(
    stack: Stack, rest: str
) -> None:
    org = _fresh_org()
    token = stack.token("loader", ["ingester"], org=org)
    documents = [
        {
            "documentId": f"doc-{n}",
            "source": "handbook",
            "title": f"Note {n}",
            "text": f"Parking permit number {n} is renewed every spring.",
            "acl": {"roles": ["employee"]},
        }
        for n in range(3)
    ]
    with httpx.stream(
        "POST",
        f"{rest}/v1/retrieval/documents:ingest",
        json={"documents": documents},
        headers=_bearer(token),
        timeout=60,
    ) as response:
        assert response.status_code == 200
        lines = _ndjson(response)
    progress = [
        json_format.ParseDict(line["result"], retrieval_pb2.IngestDocumentsResponse())
        for line in lines
    ]
    assert [p.documents_done for p in progress] == [1, 2, 3]
    assert {p.result.outcome for p in progress} == {retrieval_pb2.DOCUMENT_OUTCOME_INGESTED}
    with grpc.insecure_channel(stack.addresses["retrieval"]) as ch:
        stats = retrieval_pb2_grpc.RetrievalServiceStub(ch).Stats(
            retrieval_pb2.StatsRequest(), metadata=call_metadata(token), timeout=10
        )
    assert stats.documents == 3


def test_a_traceparent_sent_over_rest_becomes_the_runs_trace_with_the_proxy_span_under_it(
    stack: Stack, rest: str
) -> None:
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    run = _start_run_over_rest(
        rest, stack.token("maria", ["manager"]), traceparent=f"00-{trace_id}-{caller_span}-01"
    )
    assert run.trace_id == trace_id

    def proxy_span_and_orchestrator_under_it() -> bool:
        spans = stack.otlp.spans(trace_id)
        proxy_ids = {s.span_id for s in spans if s.service == "restproxy"}
        server = [s for s in spans if s.service == "restproxy" and s.parent_span_id == caller_span]
        return bool(server) and any(
            s.service == "cairn_orchestrator" and s.parent_span_id in proxy_ids for s in spans
        )

    try:
        wait_until(proxy_span_and_orchestrator_under_it, timeout=30)
    except TimeoutError:
        spans = stack.otlp.spans(trace_id)
        pytest.fail(f"no proxy span between caller and orchestrator: {spans}")
    names = {s.name for s in stack.otlp.spans(trace_id) if s.service == "restproxy"}
    assert "POST /v1/runs" in names
