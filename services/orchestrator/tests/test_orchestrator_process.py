"""The orchestrator as its own process, over real gRPC, against the real PostgreSQL.

Gateway, retrieval and memory are either closed ports (the run must degrade
honestly and end FAILED with the reason) or small gRPC servers started here that
speak the real contracts and keep the metadata they received, so we can see
whose credentials reached them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn.orchestrator.v1 import orchestrator_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.fence import block_body as tool_data
from cairn_libs.identity import TokenIssuer, TokenVerifier, generate_dev_keypair
from cairn_libs.stack import ServiceProcess, free_port, serving

HEX16 = set("0123456789abcdef")


# ---------------------------------------------------------------- contract-speaking stand-ins


@dataclass
class Received:
    metadata: list[dict[str, str]] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def keep(self, request: Any, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.requests.append(request)
            self.metadata.append({key: str(value) for key, value in context.invocation_metadata()})


class Gateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Searches first, then answers citing the last labelled result the search returned."""

    def __init__(self) -> None:
        self.received = Received()

    def Chat(
        self, request: gateway_pb2.ChatRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.ChatResponse:
        self.received.keep(request, context)
        usage = gateway_pb2.Usage(prompt_tokens=50, completion_tokens=5, total_tokens=55)
        last = request.messages[-1]
        if last.role != gateway_pb2.MESSAGE_ROLE_TOOL:
            call = gateway_pb2.ToolCall(
                id="call-1",
                name="search_knowledge",
                arguments_json=json.dumps({"query": "leave", "sources": ["payroll"]}),
            )
            return gateway_pb2.ChatResponse(
                message=gateway_pb2.Message(
                    role=gateway_pb2.MESSAGE_ROLE_ASSISTANT, tool_calls=[call]
                ),
                finish_reason="tool_calls",
                usage=usage,
                provider="stand-in",
                model="stand-in-model",
                attempts=[
                    gateway_pb2.Attempt(
                        provider="stand-in",
                        model="stand-in-model",
                        outcome=gateway_pb2.ATTEMPT_OUTCOME_OK,
                        http_status=200,
                    )
                ],
            )
        label = json.loads(tool_data(last.content))["results"][-1]["label"]
        return gateway_pb2.ChatResponse(
            message=gateway_pb2.Message(
                role=gateway_pb2.MESSAGE_ROLE_ASSISTANT,
                content=f"Twenty days a year [{label}] [S99].",
            ),
            finish_reason="stop",
            usage=usage,
            provider="stand-in",
            model="stand-in-model",
        )


class Retrieval(retrieval_pb2_grpc.RetrievalServiceServicer):
    def __init__(self) -> None:
        self.received = Received()

    def Search(
        self, request: retrieval_pb2.SearchRequest, context: grpc.ServicerContext
    ) -> retrieval_pb2.SearchResponse:
        self.received.keep(request, context)
        # Each search finds the previous search's second passage again, and a new one.
        offset = len(self.received.requests)
        results = [
            retrieval_pb2.SearchResult(
                document_id=f"leave-{n}",
                chunk_id=f"leave-{n}#0",
                source="handbook",
                title=f"Leave {n}",
                char_start=0,
                char_end=40,
                text=f"Leave passage {n}.",
                fused_score=1.0 / n,
            )
            for n in (offset, offset + 1)
        ]
        return retrieval_pb2.SearchResponse(
            results=results,
            mode=retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY,
            mode_reason="no embedder is configured",
        )


class Memory(memory_pb2_grpc.MemoryServiceServicer):
    def __init__(self) -> None:
        self.received = Received()

    def Recall(
        self, request: memory_pb2.RecallRequest, context: grpc.ServicerContext
    ) -> memory_pb2.RecallResponse:
        self.received.keep(request, context)
        memory = memory_pb2.Memory(
            memory_id="mem-1",
            text="Works part time.",
            subject=memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_USER, id="alice"),
            state=memory_pb2.MEMORY_STATE_ACTIVE,
            provenance=memory_pb2.Provenance(
                author_kind=memory_pb2.AUTHOR_KIND_PERSON, author_id="alice"
            ),
        )
        return memory_pb2.RecallResponse(
            memories=[memory], mode=memory_pb2.RECALL_MODE_NEWEST_FIRST, mode_reason="no embedder"
        )


@dataclass
class StandIns:
    gateway: Gateway
    retrieval: Retrieval
    memory: Memory
    address: str


@pytest.fixture(scope="module")
def stand_ins() -> Iterator[StandIns]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    gateway, retrieval, memory = Gateway(), Retrieval(), Memory()
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(gateway, server)
    retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(retrieval, server)
    memory_pb2_grpc.add_MemoryServiceServicer_to_server(memory, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield StandIns(gateway, retrieval, memory, f"127.0.0.1:{port}")
    server.stop(grace=None)


def _orchestrator(
    service_env: dict[str, str], log_dir: Path, *, suffix: str, **addresses: str
) -> Iterator[ServiceProcess]:
    env = {**service_env, **addresses}
    with serving("orchestrator", env=env, log_dir=log_dir, suffix=suffix) as proc:
        yield proc


@pytest.fixture(scope="module")
def orchestrator_without_dependencies(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """Gateway, retrieval and memory addresses all point at closed ports."""
    yield from _orchestrator(
        service_env,
        tmp_path_factory.mktemp("orchestrator-isolated"),
        suffix="-isolated",
        CAIRN_GATEWAY_ADDR=f"127.0.0.1:{free_port()}",
        CAIRN_RETRIEVAL_ADDR=f"127.0.0.1:{free_port()}",
        CAIRN_MEMORY_ADDR=f"127.0.0.1:{free_port()}",
    )


@pytest.fixture(scope="module")
def orchestrator_with_stand_ins(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, stand_ins: StandIns
) -> Iterator[ServiceProcess]:
    yield from _orchestrator(
        service_env,
        tmp_path_factory.mktemp("orchestrator-connected"),
        suffix="-connected",
        CAIRN_GATEWAY_ADDR=stand_ins.address,
        CAIRN_RETRIEVAL_ADDR=stand_ins.address,
        CAIRN_MEMORY_ADDR=stand_ins.address,
    )


@pytest.fixture(scope="module")
def orchestrator_without_memory(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, stand_ins: StandIns
) -> Iterator[ServiceProcess]:
    yield from _orchestrator(
        service_env,
        tmp_path_factory.mktemp("orchestrator-memoryless"),
        suffix="-memoryless",
        CAIRN_GATEWAY_ADDR=stand_ins.address,
        CAIRN_RETRIEVAL_ADDR=stand_ins.address,
        CAIRN_MEMORY_ADDR="none",
    )


@pytest.fixture
def stub_for() -> Iterator[Any]:
    channels: list[grpc.Channel] = []

    def make(proc: ServiceProcess) -> orchestrator_pb2_grpc.OrchestratorServiceStub:
        channel = grpc.insecure_channel(proc.address)
        channels.append(channel)
        return orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

    yield make
    for channel in channels:
        channel.close()


def ask(
    stub: Any, token: str, *, agent: str = "handbook", question: str = "How many days of leave?"
) -> pb.Run:
    response = stub.StartRun(
        pb.StartRunRequest(
            agent=agent,
            input=question,
            conversation_id="conv-1",
            messages=[pb.ConversationTurn(role=pb.TURN_ROLE_USER, content="Hi")],
        ),
        metadata=call_metadata(token),
        timeout=60,
    )
    run: pb.Run = response.run
    return run


# ---------------------------------------------------------------- tests


def test_list_agents_serves_the_handbook_spec(
    orchestrator_without_dependencies: ServiceProcess,
    stub_for: Any,
    issuer: TokenIssuer,
    new_org: str,
) -> None:
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    agents = (
        stub_for(orchestrator_without_dependencies)
        .ListAgents(pb.ListAgentsRequest(), metadata=call_metadata(token), timeout=10)
        .agents
    )
    handbook = {a.name: a for a in agents}["handbook"]
    assert handbook.tier == gateway_pb2.TIER_BALANCED
    assert list(handbook.tools) == ["search_knowledge"] and list(handbook.sources) == ["handbook"]
    assert handbook.reads_memory is True
    assert (
        handbook.budgets.tokens,
        handbook.budgets.model_calls,
        handbook.budgets.wall_seconds,
    ) == (20000, 6, 60)


def test_callers_without_a_valid_token_are_refused_before_any_run_is_written(
    orchestrator_without_dependencies: ServiceProcess,
    stub_for: Any,
    issuer: TokenIssuer,
    new_org: str,
    tmp_path: Path,
) -> None:
    stub = stub_for(orchestrator_without_dependencies)
    forger = TokenIssuer.from_file(generate_dev_keypair(tmp_path / "other-keys")[0])
    expired = issuer.caller_token(org_id=new_org, user_id="alice", ttl_seconds=1, now=1_000_000)
    for metadata in [
        (),
        call_metadata(forger.caller_token(org_id=new_org, user_id="alice")),
        call_metadata(expired),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            stub.StartRun(
                pb.StartRunRequest(agent="handbook", input="q"), metadata=metadata, timeout=10
            )
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    admin = issuer.caller_token(org_id=new_org, user_id="root", roles=["admin"])
    assert (
        list(stub.ListRuns(pb.ListRunsRequest(), metadata=call_metadata(admin), timeout=10).runs)
        == []
    )


def test_an_unknown_agent_is_invalid_argument_naming_the_known_ones(
    orchestrator_without_dependencies: ServiceProcess,
    stub_for: Any,
    issuer: TokenIssuer,
    new_org: str,
) -> None:
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    with pytest.raises(grpc.RpcError) as refused:
        ask(stub_for(orchestrator_without_dependencies), token, agent="helpdesk")
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "'helpdesk'" in refused.value.details() and "'handbook'" in refused.value.details()


def test_with_every_dependency_down_the_run_fails_with_the_reason_and_records_each_gap(
    orchestrator_without_dependencies: ServiceProcess,
    stub_for: Any,
    issuer: TokenIssuer,
    new_org: str,
) -> None:
    stub = stub_for(orchestrator_without_dependencies)
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    run = ask(stub, token)
    assert run.state == pb.RUN_STATE_FAILED
    assert "model call failed" in run.reason and "gateway" in run.reason
    assert run.user_id == "alice" and run.conversation_id == "conv-1"

    trajectory = stub.GetTrajectory(
        pb.GetTrajectoryRequest(run_id=run.run_id), metadata=call_metadata(token), timeout=10
    )
    kinds = [pb.StepKind.Name(s.kind) for s in trajectory.steps]
    assert kinds == ["STEP_KIND_MEMORY_READ", "STEP_KIND_RETRIEVAL", "STEP_KIND_MODEL_CALL"]
    assert [s.seq for s in trajectory.steps] == [1, 2, 3]
    assert [s.error.code for s in trajectory.steps] == [
        "memory.unavailable",
        "retrieval.unavailable",
        "gateway.unavailable",
    ]
    assert len(trajectory.trace_id) == 32 and trajectory.trace_id == run.trace_id
    for step in trajectory.steps:
        assert len(step.span_id) == 16 and set(step.span_id) <= HEX16 and step.span_id != "0" * 16
    assert len({s.span_id for s in trajectory.steps}) == 3

    fetched = stub.GetRun(
        pb.GetRunRequest(run_id=run.run_id), metadata=call_metadata(token), timeout=10
    ).run
    assert fetched.state == pb.RUN_STATE_FAILED and fetched.reason == run.reason


def test_someone_elses_run_and_a_missing_run_get_the_same_denial(
    orchestrator_without_dependencies: ServiceProcess,
    stub_for: Any,
    issuer: TokenIssuer,
    new_org: str,
) -> None:
    stub = stub_for(orchestrator_without_dependencies)
    alice = issuer.caller_token(org_id=new_org, user_id="alice")
    run = ask(stub, alice)
    bob = issuer.caller_token(org_id=new_org, user_id="bob")
    stranger = issuer.caller_token(org_id=f"{new_org}-other", user_id="alice", roles=["admin"])
    refusals = []
    for token, run_id in [(bob, run.run_id), (stranger, run.run_id), (alice, "run_doesnotexist")]:
        for call in (
            lambda t=token, r=run_id: stub.GetRun(
                pb.GetRunRequest(run_id=r), metadata=call_metadata(t), timeout=10
            ),
            lambda t=token, r=run_id: stub.GetTrajectory(
                pb.GetTrajectoryRequest(run_id=r), metadata=call_metadata(t), timeout=10
            ),
            lambda t=token, r=run_id: list(
                stub.StreamRun(pb.StreamRunRequest(run_id=r), metadata=call_metadata(t), timeout=10)
            ),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            refusals.append((refused.value.code(), refused.value.details()))
    assert set(refusals) == {(grpc.StatusCode.PERMISSION_DENIED, "not found or not permitted")}
    admin = issuer.caller_token(org_id=new_org, user_id="carol", roles=["admin"])
    assert (
        stub.GetRun(
            pb.GetRunRequest(run_id=run.run_id), metadata=call_metadata(admin), timeout=10
        ).run.run_id
        == run.run_id
    )


def test_list_runs_shows_a_caller_their_own_runs_newest_first_page_by_page(
    orchestrator_without_dependencies: ServiceProcess,
    stub_for: Any,
    issuer: TokenIssuer,
    new_org: str,
) -> None:
    stub = stub_for(orchestrator_without_dependencies)
    alice = issuer.caller_token(org_id=new_org, user_id="alice")
    bob = issuer.caller_token(org_id=new_org, user_id="bob")
    mine = [ask(stub, alice, question=f"q{i}").run_id for i in range(3)]
    theirs = ask(stub, bob).run_id
    first = stub.ListRuns(
        pb.ListRunsRequest(page_size=2), metadata=call_metadata(alice), timeout=10
    )
    second = stub.ListRuns(
        pb.ListRunsRequest(page_size=2, page_token=first.next_page_token),
        metadata=call_metadata(alice),
        timeout=10,
    )
    assert [r.run_id for r in [*first.runs, *second.runs]] == list(reversed(mine))
    assert second.next_page_token == ""
    admin = issuer.caller_token(org_id=new_org, user_id="carol", roles=["admin"])
    everyone = stub.ListRuns(pb.ListRunsRequest(), metadata=call_metadata(admin), timeout=10)
    assert [r.run_id for r in everyone.runs] == [theirs, *reversed(mine)]


def test_a_run_answers_over_real_grpc_with_the_callers_own_token_reaching_every_service(
    orchestrator_with_stand_ins: ServiceProcess,
    stand_ins: StandIns,
    stub_for: Any,
    issuer: TokenIssuer,
    new_org: str,
    dev_keys: tuple[Path, Path],
) -> None:
    stub = stub_for(orchestrator_with_stand_ins)
    token = issuer.caller_token(org_id=new_org, user_id="alice", roles=["employee"])
    before = {
        name: len(getattr(stand_ins, name).received.requests)
        for name in ("gateway", "retrieval", "memory")
    }
    run = ask(stub, token)

    assert run.state == pb.RUN_STATE_COMPLETED, run.reason
    # Prefetch found S1, S2; the tool's search found a new passage as S3, which the
    # answer cites; the invented [S99] cites nothing.
    assert run.answer.endswith("[S3] [S99].")
    assert [(c.label, c.document_id, c.source) for c in run.citations] == [
        ("S3", f"leave-{before['retrieval'] + 3}", "handbook")
    ]
    assert (run.usage.model_calls, run.usage.total_tokens) == (2, 110)

    verifier = TokenVerifier(key=dev_keys[1].read_bytes())
    for name in ("retrieval", "memory", "gateway"):
        received = getattr(stand_ins, name).received
        for metadata in received.metadata[before[name] :]:
            assert metadata["authorization"] == f"Bearer {token}"
            actor = verifier.verify_actor(metadata["x-cairn-actor"].removeprefix("Bearer "))
            assert (actor.service, actor.run_id, actor.agent) == (
                "orchestrator",
                run.run_id,
                "handbook",
            )
    searches = stand_ins.retrieval.received.requests[before["retrieval"] :]
    assert [(list(s.sources), s.k) for s in searches] == [(["handbook"], 4), (["handbook"], 4)]
    recall = stand_ins.memory.received.requests[before["memory"]]
    assert (recall.query, recall.k) == ("How many days of leave?", 5)

    first_chat = stand_ins.gateway.received.requests[before["gateway"]]
    system, user = first_chat.messages
    assert "Leave passage" not in system.content and "Works part time" not in system.content
    assert "Leave passage" in user.content and "Works part time" in user.content
    assert user.content.rstrip().endswith("How many days of leave?")
    assert first_chat.tier == gateway_pb2.TIER_BALANCED and first_chat.run_id == run.run_id
    assert first_chat.remaining_budget_tokens == 20000
    assert [t.name for t in first_chat.tools] == ["search_knowledge"]

    trajectory = stub.GetTrajectory(
        pb.GetTrajectoryRequest(run_id=run.run_id), metadata=call_metadata(token), timeout=10
    )
    kinds = [pb.StepKind.Name(s.kind).removeprefix("STEP_KIND_") for s in trajectory.steps]
    assert kinds == ["MEMORY_READ", "RETRIEVAL", "MODEL_CALL", "TOOL_CALL", "MODEL_CALL"]
    details = [json_format.MessageToDict(s.detail) for s in trajectory.steps]
    assert details[0]["mode"] == "NEWEST_FIRST" and details[0]["memory_ids"] == ["mem-1"]
    assert (
        details[1]["mode"] == "KEYWORD_ONLY"
        and details[1]["mode_reason"] == "no embedder is configured"
    )
    assert [r["label"] for r in details[1]["results"]] == ["S1", "S2"]
    assert details[2]["provider"] == "stand-in" and details[2]["model"] == "stand-in-model"
    assert details[2]["attempts"][0]["outcome"] == "OK"
    assert (
        details[3]["arguments"] == {"query": "leave", "sources": ["payroll"]}
        and details[3]["truncated"] is False
    )
    assert trajectory.steps[3].name == "search_knowledge" and not trajectory.steps[3].HasField(
        "error"
    )


def test_stream_run_replays_the_steps_then_the_answer_and_the_finished_run(
    orchestrator_with_stand_ins: ServiceProcess, stub_for: Any, issuer: TokenIssuer, new_org: str
) -> None:
    stub = stub_for(orchestrator_with_stand_ins)
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    run = ask(stub, token)
    events = list(
        stub.StreamRun(
            pb.StreamRunRequest(run_id=run.run_id), metadata=call_metadata(token), timeout=10
        )
    )
    kinds = [pb.RunEventKind.Name(e.kind).removeprefix("RUN_EVENT_KIND_") for e in events]
    assert kinds == ["STEP_FINISHED"] * 5 + ["ANSWER", "RUN_FINISHED"]
    assert [e.step.seq for e in events[:5]] == [1, 2, 3, 4, 5]
    assert events[5].answer_delta == run.answer
    assert events[-1].run.state == pb.RUN_STATE_COMPLETED


def test_a_confirmation_token_nobody_issued_reads_as_the_one_denial(
    orchestrator_with_stand_ins: ServiceProcess, stub_for: Any, issuer: TokenIssuer, new_org: str
) -> None:
    stub = stub_for(orchestrator_with_stand_ins)
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    assert (
        list(
            stub.ListPendingConfirmations(
                pb.ListPendingConfirmationsRequest(), metadata=call_metadata(token), timeout=10
            ).confirmations
        )
        == []
    )
    for guess in ("c1", "cnf_" + "A" * 43):
        with pytest.raises(grpc.RpcError) as refused:
            stub.ResolveConfirmation(
                pb.ResolveConfirmationRequest(
                    confirmation_token=guess, decision=pb.DECISION_APPROVE
                ),
                metadata=call_metadata(token),
                timeout=10,
            )
        assert (refused.value.code(), refused.value.details()) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "not found or not permitted",
        )


def test_a_deployment_that_keeps_no_memories_says_so_in_the_trajectory_and_still_answers(
    orchestrator_without_memory: ServiceProcess, stub_for: Any, issuer: TokenIssuer, new_org: str
) -> None:
    stub = stub_for(orchestrator_without_memory)
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    run = ask(stub, token)
    assert run.state == pb.RUN_STATE_COMPLETED
    trajectory = stub.GetTrajectory(
        pb.GetTrajectoryRequest(run_id=run.run_id), metadata=call_metadata(token), timeout=10
    )
    first = trajectory.steps[0]
    assert first.kind == pb.STEP_KIND_MEMORY_READ and first.error.code == "memory.not_configured"
