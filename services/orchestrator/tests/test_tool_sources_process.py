"""Tools from other systems, with real processes: the orchestrator and the gateway
over gRPC, the offline model over HTTP (scripted per request), the demo people
directory serving the same tools as a ToolService (gRPC) and as an MCP server
(streamable HTTP) on a real PostgreSQL, and a tool server that misbehaves on
purpose (tool_source_server.py). Every test runs over both transports."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import jwt
import pytest

from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn.orchestrator.v1 import orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.errors import Unauthenticated
from cairn_libs.identity import TokenIssuer, TokenVerifier
from cairn_libs.stack import (
    ServiceProcess,
    free_port,
    start_fake_provider,
    start_process,
    start_service,
    wait_for_health,
    wait_for_http,
)
from services.orchestrator.tests.orchestrator_process_support import (
    Orchestrator,
    chat_requests,
    control,
    detail,
    get_run,
    kinds,
    resolve,
    script,
    start_run,
    tool_messages,
    trajectory,
)

TRANSPORTS = ("grpc", "mcp")
HERE = Path(__file__).resolve().parent
ORG = "northwind"

CARD = """\
        card:
          en:
            summary: "Book {days} days of leave from {start_date}"
            details: {Start: "{start_date}", Days: "{days}"}
            warnings: ["Taken from your balance at once."]
          zh-Hans:
            summary: "从 {start_date} 起请假 {days} 天"
"""


def directory_spec(transport: str, address: str) -> str:
    prefix = f"{transport}_"
    return f"""\
name: directory-{transport}
description: The people directory over {transport}.
tier: balanced
system_prompt: You answer from the people directory.
tools: []
sources: []
reads_memory: false
tool_sources:
  - name: directory-{transport}
    transport: {transport}
    address: {address}
    tools:
      {prefix}count_open_positions: {{effect: read, remote_name: count_open_positions}}
      {prefix}leave_balance: {{effect: read, remote_name: leave_balance}}
      {prefix}request_leave:
        effect: write
        remote_name: request_leave
{CARD}budgets: {{tokens: 20000, model_calls: 6, wall_seconds: 60}}
"""


def misbehaving_spec(transport: str, address: str, doomed_address: str) -> str:
    prefix = f"{transport}_"
    return f"""\
name: misbehaving-{transport}
description: A tool server that misbehaves, over {transport}.
tier: balanced
system_prompt: You call the tools you are told to.
tools: []
sources: []
reads_memory: false
tool_sources:
  - name: misbehaving-{transport}
    transport: {transport}
    address: {address}
    tools:
      {prefix}whoami: {{effect: read, remote_name: whoami}}
      {prefix}hang: {{effect: read, remote_name: hang, timeout_seconds: 1}}
      {prefix}huge: {{effect: read, remote_name: huge, result_byte_cap: 4096, timeout_seconds: 30}}
      {prefix}not_json: {{effect: read, remote_name: not_json}}
      {prefix}hinted_write:
        effect: write
        remote_name: hinted_write
        card:
          en: {{summary: "Write {{text}}"}}
  - name: doomed-{transport}
    transport: {transport}
    address: {doomed_address}
    tools:
      {prefix}doomed_whoami: {{effect: read, remote_name: whoami}}
budgets: {{tokens: 20000, model_calls: 6, wall_seconds: 60}}
"""


@dataclass
class ToolServer:
    proc: ServiceProcess
    grpc_address: str
    mcp_url: str
    ledger: Path


def start_tool_server(name: str, base: Path, logs: Path) -> ToolServer:
    grpc_port, mcp_port = free_port(), free_port()
    ledger = base / f"{name}.ledger"
    ledger.touch()
    proc = start_process(
        name,
        [
            sys.executable,
            str(HERE / "tool_source_server.py"),
            "--grpc-port",
            str(grpc_port),
            "--mcp-port",
            str(mcp_port),
            "--ledger",
            str(ledger),
        ],
        env={},
        log_dir=logs,
        address=f"127.0.0.1:{grpc_port}",
    )
    return ToolServer(proc, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{mcp_port}/mcp", ledger)


@dataclass
class Stack:
    model_url: str
    orchestrator: Orchestrator
    pg_url: str
    misbehaving: ToolServer
    doomed: ToolServer


@pytest.fixture(scope="module")
def tool_source_stack(
    service_env: dict[str, str], pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("tool-sources")
    logs = base / "logs"
    agents = base / "agents"
    agents.mkdir()
    model_port, gateway_port = free_port(), free_port()
    directory_port, directory_mcp_port = free_port(), free_port()
    directory = start_process(
        "people-directory",
        [sys.executable, "-m", "cairn_people_directory"],
        env={
            **service_env,
            "CAIRN_PORT": str(directory_port),
            "CAIRN_MCP_PORT": str(directory_mcp_port),
        },
        log_dir=logs,
        address=f"127.0.0.1:{directory_port}",
    )
    misbehaving = start_tool_server("misbehaving", base, logs)
    doomed = start_tool_server("doomed", base, logs)
    for transport in TRANSPORTS:
        directory_address = (
            f"127.0.0.1:{directory_port}"
            if transport == "grpc"
            else f"http://127.0.0.1:{directory_mcp_port}/mcp"
        )
        (agents / f"directory-{transport}.yaml").write_text(
            directory_spec(transport, directory_address)
        )
        pick = (lambda s: s.grpc_address) if transport == "grpc" else (lambda s: s.mcp_url)
        (agents / f"misbehaving-{transport}.yaml").write_text(
            misbehaving_spec(transport, pick(misbehaving), pick(doomed))
        )
    model = start_fake_provider(port=model_port, log_dir=logs, name="tools")
    env = {
        **service_env,
        "CAIRN_OFFLINE_MODEL_URL": f"http://127.0.0.1:{model_port}/v1",
        "CAIRN_AGENTS_DIR": str(agents),
        "CAIRN_GATEWAY_ADDR": f"127.0.0.1:{gateway_port}",
        "CAIRN_RETRIEVAL_ADDR": "none",
        "CAIRN_MEMORY_ADDR": "none",
        "CAIRN_TOOL_LIST_TIMEOUT_SECONDS": "10",
    }
    gateway = start_service("gateway", port=gateway_port, env=env, log_dir=logs, suffix="-tools")
    orchestrator = Orchestrator(env=env, log_dir=logs)
    try:
        wait_for_http(model)
        for server in (directory, misbehaving.proc, doomed.proc):
            wait_for_health(server, timeout=60)
        wait_for_health(gateway, timeout=90)
        orchestrator.start()
        yield Stack(f"http://127.0.0.1:{model_port}", orchestrator, pg_url, misbehaving, doomed)
    finally:
        orchestrator.stop()
        gateway.stop()
        model.stop()
        for server in (directory, misbehaving.proc, doomed.proc):
            server.stop()


@pytest.fixture(autouse=True)
def fresh_script(tool_source_stack: Stack) -> None:
    control(tool_source_stack.model_url, "reset", {})


@pytest.fixture
def maria(issuer: TokenIssuer) -> str:
    return issuer.caller_token(org_id=ORG, user_id="maria", roles=["manager"])


@pytest.fixture
def tom(issuer: TokenIssuer) -> str:
    return issuer.caller_token(org_id=ORG, user_id="tom", roles=["employee"])


def question() -> str:
    return f"A question about the directory ({uuid.uuid4().hex[:8]})"


def ask(
    tool_source_stack: Stack,
    token: str,
    agent: str,
    tool: str,
    arguments: dict[str, Any] | None = None,
) -> tuple[pb.Run, list[pb.Step], str]:
    asked = question()
    script(
        tool_source_stack.model_url,
        {"action": "tool_call", "name": tool, "arguments": arguments or {}},
        {"action": "answer", "content": "Here is what the directory says."},
    )
    run = start_run(tool_source_stack.orchestrator.address, token, agent, asked)
    return run, trajectory(tool_source_stack.orchestrator.address, token, run.run_id), asked


def tool_step(steps: list[pb.Step], name: str) -> pb.Step:
    return next(s for s in steps if s.name == name and kinds([s]) == ["TOOL_CALL"])


def leave_requests(pg_url: str, idempotency_key: str) -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        conn = await asyncpg.connect(pg_url)
        try:
            rows = await conn.fetch(
                "SELECT user_id, days, deliveries FROM people_directory.leave_requests "
                "WHERE org_id = $1 AND idempotency_key = $2",
                ORG,
                idempotency_key,
            )
        finally:
            await conn.close()
        return [dict(r) for r in rows]

    return asyncio.run(read())


# ---------------------------------------------------------------- list, call, result, error


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_imported_tool_is_offered_called_and_its_result_reaches_the_model_with_the_source_named(
    tool_source_stack: Stack, maria: str, transport: str
) -> None:
    tool = f"{transport}_count_open_positions"
    run, steps, asked = ask(tool_source_stack, maria, f"directory-{transport}", tool)

    assert run.state == pb.RUN_STATE_COMPLETED
    assert kinds(steps) == ["MODEL_CALL", "TOOL_CALL", "MODEL_CALL"]
    assert tool in detail(steps[0])["tools_offered"]
    call = detail(tool_step(steps, tool))
    assert call["source"] == f"directory-{transport}"
    assert call["transport"] == transport
    assert call["result"]["total"] == 2
    assert [t["open_positions"] for t in call["result"]["teams"]] == [2]
    second = chat_requests(tool_source_stack.model_url, containing=asked)[1]
    assert '"total": 2' in tool_messages(second)[0]["content"].replace('"total":2', '"total": 2')


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_caller_without_the_role_gets_the_one_denial_from_the_tool_as_data(
    tool_source_stack: Stack, tom: str, transport: str
) -> None:
    tool = f"{transport}_count_open_positions"
    run, steps, _ = ask(tool_source_stack, tom, f"directory-{transport}", tool)

    assert run.state == pb.RUN_STATE_COMPLETED
    step = tool_step(steps, tool)
    assert step.error.code == "permission_denied"
    assert step.error.message == "not found or not yours to see"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_tool_server_narrows_by_the_person_the_token_names(
    tool_source_stack: Stack, maria: str, tom: str, transport: str
) -> None:
    tool = f"{transport}_leave_balance"
    _, own, _ = ask(tool_source_stack, tom, f"directory-{transport}", tool)
    _, managed, _ = ask(tool_source_stack, maria, f"directory-{transport}", tool, {"person": "tom"})
    _, other, _ = ask(tool_source_stack, tom, f"directory-{transport}", tool, {"person": "maria"})

    assert detail(tool_step(own, tool))["result"]["person"] == "tom"
    assert detail(tool_step(managed, tool))["result"]["person"] == "tom"
    assert tool_step(other, tool).error.code == "permission_denied"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_tool_server_receives_the_callers_token_and_nothing_cairn_would_accept_as_cairn(
    tool_source_stack: Stack, tom: str, transport: str, dev_keys: tuple[Path, Path]
) -> None:
    tool = f"{transport}_whoami"
    run, steps, _ = ask(tool_source_stack, tom, f"misbehaving-{transport}", tool)

    received = {
        k.lower(): v for k, v in detail(tool_step(steps, tool))["result"]["metadata"].items()
    }
    assert received["authorization"] == f"Bearer {tom}"
    actor = received["x-cairn-actor"].removeprefix("Bearer ")
    key = dev_keys[1].read_bytes()
    cairn = TokenVerifier(key=key)
    with pytest.raises(Unauthenticated):
        cairn.verify_actor(actor)
    with pytest.raises(Unauthenticated):
        cairn.verify_caller(actor)
    assert TokenVerifier(key=key, audience="cairn-tools").verify_actor(actor).run_id == run.run_id
    # Nothing else it was sent is a token signed by cairn's key.
    others = {n: v for n, v in received.items() if n not in ("authorization", "x-cairn-actor")}
    assert not [n for n, v in others.items() if signed_with(key, v)]


def signed_with(key: bytes, value: str) -> bool:
    for word in value.replace(",", " ").split():
        try:
            jwt.decode(word, key, algorithms=["EdDSA"], options={"verify_aud": False})
        except jwt.PyJWTError:
            continue
        return True
    return False


# ---------------------------------------------------------------- writes


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_imported_write_waits_for_its_card_and_runs_once_after_simultaneous_approvals(
    tool_source_stack: Stack, tom: str, transport: str
) -> None:
    tool = f"{transport}_request_leave"
    script(
        tool_source_stack.model_url,
        {"action": "tool_call", "name": tool, "arguments": {"start_date": "2027-03-01", "days": 1}},
        {"action": "answer", "content": "Booked."},
    )
    run = start_run(
        tool_source_stack.orchestrator.address, tom, f"directory-{transport}", question()
    )

    assert run.state == pb.RUN_STATE_CONFIRMATION_PENDING
    card = run.pending_confirmation.card
    assert card.summary == "Book 1 days of leave from 2027-03-01"
    assert [(d.label, d.value) for d in card.details] == [("Start", "2027-03-01"), ("Days", "1")]
    token = run.pending_confirmation.confirmation_token
    assert leave_requests(tool_source_stack.pg_url, token) == []

    def approve() -> pb.Run | grpc.RpcError:
        try:
            return resolve(tool_source_stack.orchestrator.address, tom, token)
        except grpc.RpcError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(lambda _: approve(), range(2)))
    assert any(isinstance(o, pb.Run) for o in outcomes)
    final = get_run(tool_source_stack.orchestrator.address, tom, run.run_id)
    assert final.state == pb.RUN_STATE_COMPLETED
    assert leave_requests(tool_source_stack.pg_url, token) == [
        {"user_id": "tom", "days": 1, "deliveries": 1}
    ]
    steps = trajectory(tool_source_stack.orchestrator.address, tom, run.run_id)
    executed = [s for s in steps if s.name == tool and kinds([s]) == ["TOOL_CALL"]]
    assert len(executed) == 1
    assert detail(executed[0])["source"] == f"directory-{transport}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_server_that_calls_a_tool_read_only_does_not_lower_the_specs_write(
    tool_source_stack: Stack, tom: str, transport: str
) -> None:
    tool = f"{transport}_hinted_write"
    before = tool_source_stack.misbehaving.ledger.read_text()
    script(
        tool_source_stack.model_url,
        {"action": "tool_call", "name": tool, "arguments": {"text": "x"}},
    )
    run = start_run(
        tool_source_stack.orchestrator.address, tom, f"misbehaving-{transport}", question()
    )

    assert run.state == pb.RUN_STATE_CONFIRMATION_PENDING
    assert run.pending_confirmation.card.summary == "Write x"
    assert tool_source_stack.misbehaving.ledger.read_text() == before


# ---------------------------------------------------------------- sources that misbehave


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_source_that_hangs_is_a_timeout_and_the_run_completes(
    tool_source_stack: Stack, tom: str, transport: str
) -> None:
    tool = f"{transport}_hang"
    run, steps, _ = ask(tool_source_stack, tom, f"misbehaving-{transport}", tool)

    assert run.state == pb.RUN_STATE_COMPLETED
    step = tool_step(steps, tool)
    assert step.error.code == "tool.timeout"
    assert "within 1 s" in step.error.message


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_source_that_returns_ten_megabytes_is_cut_at_the_tools_byte_cap(
    tool_source_stack: Stack, tom: str, transport: str
) -> None:
    tool = f"{transport}_huge"
    run, steps, asked = ask(tool_source_stack, tom, f"misbehaving-{transport}", tool)

    assert run.state == pb.RUN_STATE_COMPLETED
    call = detail(tool_step(steps, tool))
    assert call["truncated"] is True
    assert call["result_bytes"] > 10 * 1024 * 1024
    content = tool_messages(chat_requests(tool_source_stack.model_url, containing=asked)[1])[0][
        "content"
    ]
    assert "[truncated: this result was cut at 4096 bytes" in content
    assert len(content.encode()) < 8192


def test_a_source_that_returns_invalid_json_is_error_data_and_the_run_completes(
    tool_source_stack: Stack, tom: str
) -> None:
    run, steps, _ = ask(tool_source_stack, tom, "misbehaving-grpc", "grpc_not_json")

    assert run.state == pb.RUN_STATE_COMPLETED
    step = tool_step(steps, "grpc_not_json")
    assert step.error.code == "tool.invalid_result"
    assert "not JSON" in step.error.message


def test_a_source_that_went_down_is_unavailable_data_and_the_run_completes(
    tool_source_stack: Stack, tom: str
) -> None:
    tool_source_stack.doomed.proc.stop()
    for transport in TRANSPORTS:
        tool = f"{transport}_doomed_whoami"
        run, steps, _ = ask(tool_source_stack, tom, f"misbehaving-{transport}", tool)

        assert run.state == pb.RUN_STATE_COMPLETED, transport
        assert tool_step(steps, tool).error.code == "tool.unavailable", transport


def test_every_source_is_named_in_the_trajectory_of_a_run_that_used_several(
    tool_source_stack: Stack, tom: str
) -> None:
    script(
        tool_source_stack.model_url,
        {
            "action": "tool_call",
            "calls": [
                {"name": "grpc_whoami", "arguments": {}},
                {"name": "grpc_not_json", "arguments": {}},
            ],
        },
        {"action": "answer", "content": "done"},
    )
    run = start_run(tool_source_stack.orchestrator.address, tom, "misbehaving-grpc", question())
    steps = trajectory(tool_source_stack.orchestrator.address, tom, run.run_id)

    named = {s.name: detail(s).get("source") for s in steps if kinds([s]) == ["TOOL_CALL"]}
    assert named == {"grpc_whoami": "misbehaving-grpc", "grpc_not_json": "misbehaving-grpc"}


def start_run_in(tool_source_stack: Stack, token: str, agent: str, language: str) -> pb.Run:
    with grpc.insecure_channel(tool_source_stack.orchestrator.address) as channel:
        run: pb.Run = (
            orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            .StartRun(
                pb.StartRunRequest(agent=agent, input=question(), language=language),
                metadata=call_metadata(token),
                timeout=60,
            )
            .run
        )
    return run


def test_an_imported_writes_card_is_in_the_runs_language_or_says_it_fell_back(
    tool_source_stack: Stack, tom: str
) -> None:
    script(
        tool_source_stack.model_url,
        {
            "action": "tool_call",
            "name": "grpc_request_leave",
            "arguments": {"start_date": "2027-04-01", "days": 2},
        },
    )
    chinese = start_run_in(tool_source_stack, tom, "directory-grpc", "zh-Hans")
    script(
        tool_source_stack.model_url,
        {"action": "tool_call", "name": "grpc_hinted_write", "arguments": {"text": "y"}},
    )
    english_only = start_run_in(tool_source_stack, tom, "misbehaving-grpc", "zh-Hans")

    card = chinese.pending_confirmation.card
    assert (card.summary, card.language, card.language_fallback) == (
        "从 2027-04-01 起请假 2 天",
        "zh-Hans",
        False,
    )
    card = english_only.pending_confirmation.card
    assert (card.summary, card.language, card.language_fallback) == ("Write y", "en", True)
