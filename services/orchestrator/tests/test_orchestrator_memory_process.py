"""Memory in real runs: the orchestrator, gateway and memory service as their own
processes over real gRPC, the offline model over real HTTP, a real PostgreSQL.

What the model was sent is read back from the offline model's request log
(GET /_control/requests), so these tests see the prompt exactly as a vendor would.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn.orchestrator.v1 import orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.errors import DENIAL_MESSAGE
from cairn_libs.fence import NONCE_PATTERN
from cairn_libs.fence import block_body as tool_data
from cairn_libs.identity import TokenIssuer
from cairn_libs.memory_block import NEVER_A_REASON
from cairn_libs.pytest_plugin import stored_text_locations
from cairn_libs.stack import (
    ServiceProcess,
    free_port,
    start_fake_provider,
    start_service,
    wait_for_health,
    wait_for_http,
)
from services.orchestrator.tests.orchestrator_process_support import chat_requests, control

ASSISTANT_SPEC = """\
name: assistant
description: A personal assistant that remembers, for the memory tests.
tier: fast
system_prompt: |
  You are a helpful assistant. Use what you remember about the person.
tools: [recall_memory, recall, recall_search, remember, update_profile]
sources: []
reads_memory: true
budgets:
  tokens: 20000
  model_calls: 4
  wall_seconds: 60
"""

VERBATIM = (
    "Here is the relocation plan, exactly as agreed:\n\n"
    "  1. Budget: EUR 12,400 (not 12,000!), paid in two parts.\n"
    "  2. Start date\t2026-03-01; the flat is in Lindenstraße 7.\n"
    + "".join(
        f"  {n}. Detail line {n} with  double  spaces and a tab\there.\n" for n in range(3, 40)
    )
)


@dataclass
class MemoryStack:
    model_url: str
    memory: ServiceProcess
    orchestrator: ServiceProcess
    memoryless: ServiceProcess


@pytest.fixture(scope="module")
def memory_stack(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MemoryStack]:
    base = tmp_path_factory.mktemp("orchestrator-memory")
    logs = base / "logs"
    agents = base / "agents"
    agents.mkdir()
    (agents / "assistant.yaml").write_text(ASSISTANT_SPEC)
    model_port = free_port()
    model = start_fake_provider(port=model_port, log_dir=logs)
    ports = {name: free_port() for name in ("gateway", "memory", "orchestrator", "memoryless")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    env = {
        **service_env,
        "CAIRN_EMBEDDER": "none",
        "CAIRN_OFFLINE_MODEL_URL": f"http://127.0.0.1:{model_port}/v1",
        "CAIRN_AGENTS_DIR": str(agents),
        "CAIRN_GATEWAY_ADDR": addr["gateway"],
        "CAIRN_RETRIEVAL_ADDR": "none",
        "CAIRN_MEMORY_ADDR": addr["memory"],
    }
    processes = [
        start_service("gateway", port=ports["gateway"], env=env, log_dir=logs, suffix="-mem"),
        start_service(
            "memory",
            port=ports["memory"],
            # Forget reaches the orchestrator's copies too (I9).
            env={**env, "CAIRN_ORCHESTRATOR_ADDR": addr["orchestrator"]},
            log_dir=logs,
            suffix="-mem",
        ),
        start_service(
            "orchestrator", port=ports["orchestrator"], env=env, log_dir=logs, suffix="-mem"
        ),
        start_service(
            "orchestrator",
            port=ports["memoryless"],
            env={**env, "CAIRN_MEMORY_ADDR": "none"},
            log_dir=logs,
            suffix="-nomem",
        ),
    ]
    try:
        wait_for_http(model)
        for proc in processes:
            wait_for_health(proc, timeout=90)
        yield MemoryStack(
            model_url=f"http://127.0.0.1:{model_port}",
            memory=processes[1],
            orchestrator=processes[2],
            memoryless=processes[3],
        )
    finally:
        for proc in processes:
            proc.stop()
        model.stop()


# ---------------------------------------------------------------- helpers


def fenced(text: str, kind: str) -> str:
    """The body of the first block of `kind` in `text` ('' when there is none)."""
    lines = text.split("\n")
    for index, line in enumerate(lines):
        match = NONCE_PATTERN.match(line)
        if match and match["kind"] == kind:
            close = f"<<<END-CAIRN-DATA nonce={match['nonce']}>>>"
            end = lines.index(close, index)
            return "\n".join(lines[index + 1 : end])
    return ""


def start_run(
    proc: ServiceProcess,
    token: str,
    question: str,
    *,
    conversation_id: str = "",
    earlier: Sequence[tuple[int, str]] = (),
) -> tuple[pb.Run, list[pb.Step]]:
    with grpc.insecure_channel(proc.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        run = stub.StartRun(
            pb.StartRunRequest(
                agent="assistant",
                input=question,
                conversation_id=conversation_id,
                messages=[pb.ConversationTurn(role=r, content=c) for r, c in earlier],
            ),
            metadata=call_metadata(token),
            timeout=60,
        ).run
        steps = stub.GetTrajectory(
            pb.GetTrajectoryRequest(run_id=run.run_id), metadata=call_metadata(token), timeout=10
        ).steps
    return run, list(steps)


def detail(step: pb.Step) -> dict[str, Any]:
    return json_format.MessageToDict(step.detail)


def memory_stub(channel: grpc.Channel) -> Any:
    return memory_pb2_grpc.MemoryServiceStub(channel)


# ---------------------------------------------------------------- tests


def test_recalled_memories_reach_the_user_message_with_the_pinned_sentence_never_the_system(
    memory_stack: MemoryStack, issuer: TokenIssuer, new_org: str
) -> None:
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    with grpc.insecure_channel(memory_stack.memory.address) as channel:
        kept = (
            memory_stub(channel)
            .Remember(
                memory_pb2.RememberRequest(
                    text="Prefers answers in German.",
                    subject=memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_USER, id="alice"),
                    claim_type=memory_pb2.CLAIM_TYPE_USER_STATEMENT,
                ),
                metadata=call_metadata(token),
                timeout=10,
            )
            .memory
        )
    question = f"How should you answer me? ({uuid.uuid4().hex[:8]})"
    run, steps = start_run(memory_stack.orchestrator, token, question)
    assert run.state == pb.RUN_STATE_COMPLETED, run.reason

    (messages,) = chat_requests(memory_stack.model_url, containing=question)
    system, user = messages[0], messages[-1]
    assert system["role"] == "system" and user["role"] == "user"
    for leaked in ("Prefers answers in German", NEVER_A_REASON, "CAIRN-DATA kind=memory"):
        assert leaked not in system["content"]
    block = fenced(user["content"], "memory")
    assert '"Prefers answers in German."' in block
    assert "noted by alice on" in block and "about user alice" in block
    assert block.rstrip().endswith(NEVER_A_REASON)
    assert user["content"].rstrip().endswith(question)

    memory_read = next(s for s in steps if s.kind == pb.STEP_KIND_MEMORY_READ)
    assert detail(memory_read)["memory_ids"] == [kept.memory_id]
    assert detail(memory_read)["mode"] == "NEWEST_FIRST"


def test_compaction_archives_a_large_turn_and_recall_brings_it_back_verbatim(
    memory_stack: MemoryStack, issuer: TokenIssuer, new_org: str
) -> None:
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    conversation = f"conv-{uuid.uuid4().hex[:10]}"
    earlier = [(pb.TURN_ROLE_USER, VERBATIM), (pb.TURN_ROLE_ASSISTANT, "Noted, thank you.")]
    control(memory_stack.model_url, "reset", {})

    first_question = f"What was the budget? ({uuid.uuid4().hex[:8]})"
    run, steps = start_run(
        memory_stack.orchestrator,
        token,
        first_question,
        conversation_id=conversation,
        earlier=earlier,
    )
    assert run.state == pb.RUN_STATE_COMPLETED, run.reason
    (archive_step,) = [s for s in steps if s.name == "conversation"]
    assert archive_step.kind == pb.STEP_KIND_CONVERSATION_ARCHIVE and not archive_step.HasField(
        "error"
    )
    archived = detail(archive_step)
    (block_id,) = archived["cited_block_ids"]
    assert archived["archived"][0]["block_id"] == block_id
    assert archived["archived"][0]["chars"] == len(VERBATIM)

    (messages,) = chat_requests(memory_stack.model_url, containing=first_question)
    window = fenced(messages[-1]["content"], "conversation")
    assert f"recall:{block_id}" in window and "assistant: Noted, thank you." in window
    assert VERBATIM not in messages[-1]["content"]  # it travels clipped, by reference

    # The archive keeps the block verbatim, for its owner only.
    with grpc.insecure_channel(memory_stack.memory.address) as channel:
        stub = memory_stub(channel)
        block = stub.RecallBlock(
            memory_pb2.RecallBlockRequest(block_id=block_id),
            metadata=call_metadata(token),
            timeout=10,
        ).block
        assert block.content == VERBATIM and block.conversation_id == conversation
        bob = issuer.caller_token(org_id=new_org, user_id="bob")
        with pytest.raises(grpc.RpcError) as refused:
            stub.RecallBlock(
                memory_pb2.RecallBlockRequest(block_id=block_id),
                metadata=call_metadata(bob),
                timeout=10,
            )
        assert refused.value.details() == DENIAL_MESSAGE

    # The next turn sends the same history; the model asks for the block back.
    control(
        memory_stack.model_url,
        "script",
        {
            "steps": [
                {
                    "action": "tool_call",
                    "name": "recall",
                    "arguments": {"id": f"recall:{block_id}"},
                },
                {"action": "answer", "content": "The budget was EUR 12,400."},
            ]
        },
    )
    second_question = f"Read me the plan again ({uuid.uuid4().hex[:8]})"
    run, steps = start_run(
        memory_stack.orchestrator,
        token,
        second_question,
        conversation_id=conversation,
        earlier=earlier,
    )
    assert run.state == pb.RUN_STATE_COMPLETED, run.reason
    (again,) = [s for s in steps if s.name == "conversation"]
    assert detail(again)["cited_block_ids"] == [block_id]  # archived once, cited again
    (recall_step,) = [s for s in steps if s.kind == pb.STEP_KIND_TOOL_CALL]
    assert recall_step.name == "recall" and not recall_step.HasField("error")
    assert detail(recall_step)["result"]["content"] == VERBATIM

    _, after_tool = chat_requests(memory_stack.model_url, containing=second_question)
    tool_message = after_tool[-1]
    assert tool_message["role"] == "tool"
    assert json.loads(tool_data(tool_message["content"]))["content"] == VERBATIM


def test_a_deployment_that_keeps_no_memories_answers_the_memory_tools_plainly(
    memory_stack: MemoryStack, issuer: TokenIssuer, new_org: str
) -> None:
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    control(memory_stack.model_url, "reset", {})
    control(
        memory_stack.model_url,
        "script",
        {
            "steps": [
                {
                    "action": "tool_call",
                    "name": "remember",
                    "arguments": {
                        "text": "Prefers answers in German.",
                        "subject": {"kind": "USER"},
                    },
                },
                {"action": "answer", "content": "I cannot keep that here."},
            ]
        },
    )
    run, steps = start_run(memory_stack.memoryless, token, "Remember that I prefer German.")
    assert run.state == pb.RUN_STATE_COMPLETED, run.reason
    (remember,) = [s for s in steps if s.kind == pb.STEP_KIND_TOOL_CALL]
    assert remember.name == "remember" and not remember.HasField("error")
    assert detail(remember)["result"] == {
        "kept": False,
        "note": "this deployment keeps no memories; nothing was kept",
    }
    assert run.answer == "I cannot keep that here."
    memory_read = next(s for s in steps if s.kind == pb.STEP_KIND_MEMORY_READ)
    assert memory_read.error.code == "memory.not_configured"


def test_memory_tool_definitions_reach_the_model_with_their_schemas(
    memory_stack: MemoryStack, issuer: TokenIssuer, new_org: str
) -> None:
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    question = f"Anything? ({uuid.uuid4().hex[:8]})"
    run, _ = start_run(memory_stack.orchestrator, token, question)
    assert run.state == pb.RUN_STATE_COMPLETED, run.reason
    entry = next(
        e
        for e in control(memory_stack.model_url, "requests")["requests"]
        if e["path"].endswith("/chat/completions") and question in json.dumps(e.get("body") or {})
    )
    offered = {t["function"]["name"]: t["function"] for t in entry["body"]["tools"]}
    assert set(offered) == {
        "recall_memory",
        "recall",
        "recall_search",
        "remember",
        "update_profile",
    }
    assert offered["remember"]["parameters"]["required"] == ["text", "subject"]
    assert offered["remember"]["parameters"]["additionalProperties"] is False


def test_remember_goes_through_confirmation_into_memory_with_author_model_and_the_run_id(
    memory_stack: MemoryStack, issuer: TokenIssuer, new_org: str
) -> None:
    token = issuer.caller_token(org_id=new_org, user_id="alice")
    control(memory_stack.model_url, "reset", {})
    control(
        memory_stack.model_url,
        "script",
        {
            "steps": [
                {
                    "action": "tool_call",
                    "name": "remember",
                    "arguments": {
                        "text": "Prefers answers in German.",
                        "subject": {"kind": "USER"},
                        "claim_type": "USER_STATEMENT",
                    },
                },
                {"action": "answer", "content": "I will remember that."},
            ]
        },
    )
    run, _ = start_run(memory_stack.orchestrator, token, "Please answer me in German from now on.")
    assert run.state == pb.RUN_STATE_CONFIRMATION_PENDING, run.reason
    pending = run.pending_confirmation
    assert pending.tool_name == "remember" and pending.run_id == run.run_id
    card = {d.label: d.value for d in pending.card.details}
    assert card["What will be kept"] == "Prefers answers in German."
    assert card["About"] == "user alice (the person asking)"
    assert f"in run {run.run_id}), not a person" in card["Written by"]
    assert "(90 days from now)" in card["Kept until"]
    assert pending.card.warnings and pending.card.warnings[0].startswith("Personal data")

    with grpc.insecure_channel(memory_stack.memory.address) as channel:
        stub = memory_stub(channel)

        def held() -> list[memory_pb2.Memory]:
            return list(
                stub.Recall(
                    memory_pb2.RecallRequest(
                        subject=memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_USER, id="alice")
                    ),
                    metadata=call_metadata(token),
                    timeout=10,
                ).memories
            )

        assert held() == []  # nothing is written before a person says yes
        with grpc.insecure_channel(memory_stack.orchestrator.address) as orchestrator:
            done = (
                orchestrator_pb2_grpc.OrchestratorServiceStub(orchestrator)
                .ResolveConfirmation(
                    pb.ResolveConfirmationRequest(
                        confirmation_token=pending.confirmation_token,
                        decision=pb.DECISION_APPROVE,
                    ),
                    metadata=call_metadata(token),
                    timeout=60,
                )
                .run
            )
        assert done.state == pb.RUN_STATE_COMPLETED, done.reason
        assert done.answer == "I will remember that."
        (kept,) = held()

    assert kept.text == "Prefers answers in German."
    provenance = kept.provenance
    assert provenance.author_kind == memory_pb2.AUTHOR_KIND_MODEL
    assert (provenance.run_id, provenance.author_id, provenance.on_behalf_of) == (
        run.run_id,
        "assistant",
        "alice",
    )
    lifetime = provenance.expires_at.ToDatetime() - provenance.created_at.ToDatetime()
    assert lifetime.days == 90

    # The next run reads it back, and the model is told an agent wrote it, in which run.
    question = f"How should you answer me? ({uuid.uuid4().hex[:8]})"
    later, _ = start_run(memory_stack.orchestrator, token, question)
    assert later.state == pb.RUN_STATE_COMPLETED, later.reason
    (messages,) = chat_requests(memory_stack.model_url, containing=question)
    block = fenced(messages[-1]["content"], "memory")
    assert f"written by an agent in run {run.run_id}" in block
    assert '"Prefers answers in German."' in block


# ---------------------------------------------------------------- erasure reaches every copy (I9)


def _resolve(proc: ServiceProcess, token: str, confirmation_token: str) -> pb.Run:
    with grpc.insecure_channel(proc.address) as channel:
        run: pb.Run = (
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            .ResolveConfirmation(
                pb.ResolveConfirmationRequest(
                    confirmation_token=confirmation_token, decision=pb.DECISION_APPROVE
                ),
                metadata=call_metadata(token),
                timeout=60,
            )
            .run
        )
    return run


def test_forget_leaves_no_copy_of_the_erased_text_in_any_table_and_every_rpc_shows_the_tombstone(
    memory_stack: MemoryStack, issuer: TokenIssuer, new_org: str, pg_url: str
) -> None:
    officer = issuer.caller_token(org_id=new_org, user_id="maria", roles=["privacy_officer"])
    tag = uuid.uuid4().hex[:8]
    dana = {"kind": "CANDIDATE", "id": f"dana-{tag}"}
    subject = memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_CANDIDATE, id=dana["id"])
    recalled = f"Dana asked to move her interview for a hospital visit {tag}."
    approved = f"Dana prefers interviews before noon because of treatment {tag}."
    proposed = f"Dana mentioned a second operation planned for spring {tag}."
    archived = f"Long notes from the call with Dana about her health and schedule {tag}. " * 4

    with grpc.insecure_channel(memory_stack.memory.address) as channel:
        memory = memory_stub(channel)
        memory.Remember(
            memory_pb2.RememberRequest(text=recalled, subject=subject),
            metadata=call_metadata(officer),
            timeout=10,
        )
        block_id = memory.Archive(
            memory_pb2.ArchiveRequest(
                label="Call notes",
                role="user",
                content=archived,
                conversation_id=f"conv-{tag}",
                subjects=[subject],
            ),
            metadata=call_metadata(officer),
            timeout=10,
        ).block_id

    # A run that recalls the memory and quotes it in its answer.
    control(memory_stack.model_url, "reset", {})
    script_steps: list[dict[str, Any]] = [
        {
            "action": "tool_call",
            "name": "recall_memory",
            "arguments": {"query": "Dana", "subject": dana},
        },
        {"action": "tool_call", "name": "recall", "arguments": {"id": f"recall:{block_id}"}},
        {"action": "answer", "content": f"From memory: {recalled}"},
    ]
    control(memory_stack.model_url, "script", {"steps": script_steps})
    reading, _ = start_run(memory_stack.orchestrator, officer, f"What about Dana? {tag}")
    assert reading.state == pb.RUN_STATE_COMPLETED, reading.reason
    assert recalled in reading.answer

    # A run whose write a person approved, and one whose write is still waiting.
    control(
        memory_stack.model_url,
        "script",
        {
            "steps": [
                {
                    "action": "tool_call",
                    "name": "remember",
                    "arguments": {"text": approved, "subject": dana},
                },
                {"action": "answer", "content": "Kept."},
                {
                    "action": "tool_call",
                    "name": "remember",
                    "arguments": {"text": proposed, "subject": dana},
                },
            ]
        },
    )
    writing, _ = start_run(memory_stack.orchestrator, officer, f"Keep this about Dana {tag}")
    assert writing.state == pb.RUN_STATE_CONFIRMATION_PENDING, writing.reason
    written = _resolve(
        memory_stack.orchestrator, officer, writing.pending_confirmation.confirmation_token
    )
    assert written.state == pb.RUN_STATE_COMPLETED, written.reason
    waiting, _ = start_run(memory_stack.orchestrator, officer, f"And this too {tag}")
    assert waiting.state == pb.RUN_STATE_CONFIRMATION_PENDING, waiting.reason

    with grpc.insecure_channel(memory_stack.memory.address) as channel:
        erasure = (
            memory_stub(channel)
            .Forget(
                memory_pb2.ForgetRequest(subject=subject),
                metadata=call_metadata(officer),
                timeout=30,
            )
            .erasure
        )
        tombstone = (
            memory_stub(channel)
            .RecallBlock(
                memory_pb2.RecallBlockRequest(block_id=block_id),
                metadata=call_metadata(officer),
                timeout=10,
            )
            .block
        )
    assert erasure.copies_erased and erasure.memories_erased == 2 and erasure.blocks_erased == 1
    assert tombstone.erased and tombstone.content == ""

    for text in (recalled, approved, proposed, archived.strip()):
        assert stored_text_locations(pg_url, text, schemas=["memory", "orchestrator"]) == [], text

    with grpc.insecure_channel(memory_stack.orchestrator.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        shown = stub.GetRun(
            pb.GetRunRequest(run_id=reading.run_id), metadata=call_metadata(officer), timeout=10
        ).run
        steps = stub.GetTrajectory(
            pb.GetTrajectoryRequest(run_id=reading.run_id),
            metadata=call_metadata(officer),
            timeout=10,
        ).steps
        ended = stub.GetRun(
            pb.GetRunRequest(run_id=waiting.run_id), metadata=call_metadata(officer), timeout=10
        ).run
        pending = stub.ListPendingConfirmations(
            pb.ListPendingConfirmationsRequest(), metadata=call_metadata(officer), timeout=10
        ).confirmations
    assert shown.answer == "From memory: [erased]"
    recall_step = next(s for s in steps if s.name == "recall_memory")
    assert detail(recall_step)["result"]["memories"][0]["text"] == "[erased]"
    assert ended.state == pb.RUN_STATE_CANCELLED and "erased" in ended.reason
    assert [p.run_id for p in pending if p.run_id == waiting.run_id] == []


def test_forget_copies_is_refused_with_the_one_denial_to_someone_who_may_not_forget(
    memory_stack: MemoryStack, issuer: TokenIssuer, new_org: str
) -> None:
    colleague = issuer.caller_token(org_id=new_org, user_id="tom")
    with (
        grpc.insecure_channel(memory_stack.orchestrator.address) as channel,
        pytest.raises(grpc.RpcError) as refused,
    ):
        orchestrator_pb2_grpc.OrchestratorServiceStub(channel).ForgetCopies(
            pb.ForgetCopiesRequest(
                subject=memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_CANDIDATE, id="dana")
            ),
            metadata=call_metadata(colleague),
            timeout=10,
        )
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == DENIAL_MESSAGE
