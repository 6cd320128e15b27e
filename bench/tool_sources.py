"""What a tool from another system costs a run, per transport, against a built-in.

The same run is made again and again: the offline model asks for one tool, then
answers. The tool is the demo people directory's `leave_balance` reached as a
ToolService (gRPC) or through its MCP server (streamable HTTP), or the built-in
`search_knowledge` (a retrieval search over gRPC). What is measured is the tool
call step as the trajectory records it (finished_at - started_at): the
dispatcher's own work, the round trip to the tool server and the tool's own SQL.
Each run's trajectory is checked to hold exactly that one successful tool call
before its figure is kept, so a failing source cannot pass for a fast one."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from bench.figures import Figure, percentile
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import (
    REPO_ROOT,
    ServiceProcess,
    free_port,
    stack_env,
    start_embedded_postgres,
    start_fake_provider,
    start_process,
    start_service,
    wait_for_health,
    wait_for_http,
)

STATE = REPO_ROOT / "state" / "bench"

AGENT = """\
name: toolbench
description: One tool call per run, for the tool-source benchmark.
tier: fast
system_prompt: You call the tool you are told to.
tools: [search_knowledge]
sources: [handbook]
reads_memory: false
tool_sources:
  - name: directory-grpc
    transport: grpc
    address: {grpc}
    tools:
      grpc_leave_balance: {{effect: read, remote_name: leave_balance}}
  - name: directory-mcp
    transport: mcp
    address: {mcp}
    tools:
      mcp_leave_balance: {{effect: read, remote_name: leave_balance}}
budgets: {{tokens: 100000, model_calls: 4, wall_seconds: 60}}
"""

CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("grpc", "grpc_leave_balance", {}),
    ("mcp", "mcp_leave_balance", {}),
    ("builtin", "search_knowledge", {"query": "leave"}),
)


def _script(model_url: str, tool: str, arguments: dict[str, Any]) -> None:
    steps = [
        {"action": "tool_call", "name": tool, "arguments": arguments},
        {"action": "answer", "content": "ok"},
    ]
    request = urllib.request.Request(
        f"{model_url}/_control/script",
        data=json.dumps({"steps": steps}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def _step_ms(step: orchestrator_pb2.Step) -> float:
    started = step.started_at.seconds + step.started_at.nanos / 1e9
    finished = step.finished_at.seconds + step.finished_at.nanos / 1e9
    return (finished - started) * 1000


async def run_tool_sources(*, quick: bool = False) -> list[Figure]:
    n = 30 if quick else 200
    STATE.mkdir(parents=True, exist_ok=True)
    private_key, public_key = generate_dev_keypair(STATE / "keys")
    issuer = TokenIssuer.from_file(private_key)
    pg_url = start_embedded_postgres(STATE / "pg")
    logs = STATE / "logs"
    ports = {name: free_port() for name in ("gateway", "retrieval", "orchestrator")}
    addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    directory_port, mcp_port, model_port = free_port(), free_port(), free_port()
    agents = Path(tempfile.mkdtemp(prefix="toolbench-agents-"))
    (agents / "toolbench.yaml").write_text(
        AGENT.format(grpc=f"127.0.0.1:{directory_port}", mcp=f"http://127.0.0.1:{mcp_port}/mcp")
    )
    env = {
        **stack_env(
            database_url=pg_url,
            keys=(private_key, public_key),
            qdrant_path=STATE / "qdrant-tools",
            model_url=f"http://127.0.0.1:{model_port}",
            addresses={**addresses, "memory": "none"},
        ),
        "CAIRN_AGENTS_DIR": str(agents),
        "CAIRN_MEMORY_ADDR": "none",
        "CAIRN_LOG_LEVEL": "WARNING",
    }
    model = start_fake_provider(port=model_port, log_dir=logs, name="toolbench")
    processes: list[ServiceProcess] = [model]
    try:
        directory = start_process(
            "people-directory-bench",
            [sys.executable, "-m", "cairn_people_directory"],
            env={**env, "CAIRN_PORT": str(directory_port), "CAIRN_MCP_PORT": str(mcp_port)},
            log_dir=logs,
            address=f"127.0.0.1:{directory_port}",
        )
        processes.append(directory)
        wait_for_http(model)
        wait_for_health(directory, timeout=60)
        for name in ("gateway", "retrieval", "orchestrator"):
            proc = start_service(name, port=ports[name], env=env, log_dir=logs, suffix="-tools")
            processes.append(proc)
            wait_for_health(proc, timeout=90)
        return await _measure(
            issuer, addresses["orchestrator"], f"http://127.0.0.1:{model_port}", n
        )
    finally:
        for proc in reversed(processes):
            proc.stop()


async def _measure(issuer: TokenIssuer, address: str, model_url: str, n: int) -> list[Figure]:
    metadata = call_metadata(
        issuer.caller_token(org_id="northwind", user_id="tom", roles=["employee"])
    )
    orch = channel(address)
    stub = orchestrator_pb2_grpc.OrchestratorServiceStub(orch)

    async def one(tool: str, arguments: dict[str, Any]) -> float:
        await asyncio.to_thread(_script, model_url, tool, arguments)
        run = (
            await stub.StartRun(
                orchestrator_pb2.StartRunRequest(agent="toolbench", input="bench"),
                metadata=metadata,
                timeout=60,
            )
        ).run
        steps = (
            await stub.GetTrajectory(
                orchestrator_pb2.GetTrajectoryRequest(run_id=run.run_id),
                metadata=metadata,
                timeout=10,
            )
        ).steps
        calls = [s for s in steps if s.kind == orchestrator_pb2.STEP_KIND_TOOL_CALL]
        if run.state != orchestrator_pb2.RUN_STATE_COMPLETED or len(calls) != 1:
            raise RuntimeError(f"a {tool} run did not make one tool call; see state/bench/logs")
        if calls[0].error.code:
            raise RuntimeError(f"{tool} failed in the benchmark: {calls[0].error.message}")
        return _step_ms(calls[0])

    figures: list[Figure] = []
    medians: dict[str, float] = {}
    try:
        for transport, tool, arguments in CASES:
            for _ in range(5):
                await one(tool, arguments)
            samples = [await one(tool, arguments) for _ in range(n)]
            parameters = {"transport": transport, "tool": tool, "n": n}
            medians[transport] = percentile(samples, 50)
            figures += [
                Figure("tool_call_step_p50", percentile(samples, 50), "ms", parameters),
                Figure("tool_call_step_p99", percentile(samples, 99), "ms", parameters),
            ]
        for transport in ("grpc", "mcp"):
            figures.append(
                Figure(
                    "tool_call_step_p50_over_builtin",
                    medians[transport] - medians["builtin"],
                    "ms",
                    {"transport": transport, "builtin": "search_knowledge", "n": n},
                )
            )
    except grpc.aio.AioRpcError as exc:
        raise RuntimeError(f"the tool-source benchmark could not run: {exc.details()}") from exc
    finally:
        await orch.close(grace=None)
    return figures
