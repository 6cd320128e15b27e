"""The demo people directory as a process, called directly over both of its
transports: it decides on the person its token names, and on nothing else."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from cairn.tools.v1 import tools_pb2, tools_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import ServiceProcess, free_port, start_process, wait_for_health


@dataclass
class Directory:
    proc: ServiceProcess
    mcp_url: str


@pytest.fixture(scope="module")
def directory(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Directory]:
    grpc_port, mcp_port = free_port(), free_port()
    proc = start_process(
        "people-directory",
        [sys.executable, "-m", "cairn_people_directory"],
        env={**service_env, "CAIRN_PORT": str(grpc_port), "CAIRN_MCP_PORT": str(mcp_port)},
        log_dir=tmp_path_factory.mktemp("directory-logs"),
        address=f"127.0.0.1:{grpc_port}",
    )
    try:
        wait_for_health(proc, timeout=60)
        yield Directory(proc, f"http://127.0.0.1:{mcp_port}/mcp")
    finally:
        proc.stop()


def tools_token(issuer: TokenIssuer) -> str:
    """What cairn lists with: its actor token for the cairn-tools audience."""
    tools = TokenIssuer(private_key=issuer.private_key, audience="cairn-tools")
    return tools.actor_token(service="orchestrator", run_id="tools/list")


def invoke(
    directory: Directory, token: str, name: str, arguments: dict[str, object], key: str = ""
) -> tools_pb2.InvokeToolResponse:
    with grpc.insecure_channel(directory.proc.address) as channel:
        response: tools_pb2.InvokeToolResponse = tools_pb2_grpc.ToolServiceStub(channel).InvokeTool(
            tools_pb2.InvokeToolRequest(
                name=name, arguments_json=json.dumps(arguments), idempotency_key=key
            ),
            metadata=call_metadata(token),
            timeout=10,
        )
    return response


def test_cairns_tool_token_may_list_the_tools_but_never_run_one(
    directory: Directory, issuer: TokenIssuer
) -> None:
    token = tools_token(issuer)
    with grpc.insecure_channel(directory.proc.address) as channel:
        listed = tools_pb2_grpc.ToolServiceStub(channel).ListTools(
            tools_pb2.ListToolsRequest(), metadata=call_metadata(token), timeout=10
        )
    assert [t.name for t in listed.tools] == [
        "count_open_positions",
        "leave_balance",
        "request_leave",
    ]
    assert [t.read_only_hint for t in listed.tools] == [True, True, False]

    with pytest.raises(grpc.RpcError) as refused:
        invoke(directory, token, "leave_balance", {})
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_a_manager_of_another_org_gets_the_one_denial(
    directory: Directory, issuer: TokenIssuer
) -> None:
    stranger = issuer.caller_token(org_id="elsewhere", user_id="maria", roles=["manager"])

    for name, arguments in (("count_open_positions", {}), ("leave_balance", {"person": "tom"})):
        response = invoke(directory, stranger, name, arguments)
        assert response.WhichOneof("outcome") == "error"
        assert (response.error.code, response.error.message) == (
            "permission_denied",
            "not found or not yours to see",
        )


def test_request_leave_books_once_per_idempotency_key(
    directory: Directory, issuer: TokenIssuer
) -> None:
    aisha = issuer.caller_token(org_id="northwind", user_id="aisha", roles=["employee"])
    key = uuid.uuid4().hex
    before = json.loads(invoke(directory, aisha, "leave_balance", {}).result_json)["days_left"]

    first = json.loads(
        invoke(
            directory, aisha, "request_leave", {"start_date": "2027-05-03", "days": 2}, key
        ).result_json
    )
    again = json.loads(
        invoke(
            directory, aisha, "request_leave", {"start_date": "2027-05-03", "days": 2}, key
        ).result_json
    )
    after = json.loads(invoke(directory, aisha, "leave_balance", {}).result_json)["days_left"]

    assert (first["already_booked"], again["already_booked"]) == (False, True)
    assert first["request_id"] == again["request_id"]
    assert after == before - 2
    unkeyed = invoke(directory, aisha, "request_leave", {"start_date": "2027-05-03", "days": 1})
    assert unkeyed.error.code == "invalid_arguments"


def test_the_mcp_server_refuses_a_request_without_a_token_before_any_tool(
    directory: Directory,
) -> None:
    response = httpx.post(
        directory.mcp_url,
        json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
        headers={"Accept": "application/json, text/event-stream"},
        timeout=10,
    )
    assert response.status_code == 401


async def test_both_transports_give_a_person_the_same_answer(
    directory: Directory, issuer: TokenIssuer
) -> None:
    tom = issuer.caller_token(org_id="northwind", user_id="tom", roles=["employee"])
    over_grpc = json.loads(invoke(directory, tom, "leave_balance", {}).result_json)
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {tom}"}) as http,
        Client(streamable_http_client(directory.mcp_url, http_client=http), cache=None) as client,
    ):
        result = await client.call_tool("leave_balance", {})
        denied = await client.call_tool("count_open_positions", {})

    assert result.structured_content == over_grpc
    assert denied.is_error
    assert json.loads("".join(getattr(c, "text", "") for c in denied.content))["code"] == (
        "permission_denied"
    )
