"""What a CancelRun costs the person waiting: the time from CancelRun returning to
the cancelled run's StartRun answering CANCELLED, while the offline model holds
the run's model call. Measured with the cancel sent to the orchestrator working
the run (it is told at once) and to another orchestrator replica (the working one
finds out by asking PostgreSQL, every LoopSettings.cancel_poll_seconds), so the
figure shows what going through the shared store adds."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

from bench.figures import Figure, percentile
from bench.harness import STATE
from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn.orchestrator.v1 import orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import (
    ServiceProcess,
    free_port,
    stack_env,
    start_embedded_postgres,
    start_fake_provider,
    start_service,
    wait_for_health,
    wait_for_http,
)


def _hold_next_call(model_url: str) -> None:
    body = json.dumps({"steps": [{"action": "hang", "seconds": 60}]}).encode()
    request = urllib.request.Request(
        f"{model_url}/_control/script",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


async def run_cancel(*, quick: bool = False) -> list[Figure]:
    n = 3 if quick else 15
    STATE.mkdir(parents=True, exist_ok=True)
    keys = generate_dev_keypair(STATE / "keys")
    pg_url = start_embedded_postgres(STATE / "pg")
    logs = STATE / "logs"
    model_port = free_port()
    model_url = f"http://127.0.0.1:{model_port}"
    ports = {name: free_port() for name in ("gateway", "orchestrator", "second")}
    addresses = {
        "gateway": f"127.0.0.1:{ports['gateway']}",
        "retrieval": "none",
        "memory": "none",
        "orchestrator": f"127.0.0.1:{ports['orchestrator']}",
    }
    env = {
        **stack_env(
            database_url=pg_url,
            keys=keys,
            qdrant_path=STATE / "qdrant",
            model_url=model_url,
            addresses=addresses,
        ),
        "CAIRN_LOG_LEVEL": "WARNING",
    }
    processes: list[ServiceProcess] = [
        start_fake_provider(port=model_port, log_dir=logs, name="bench-cancel")
    ]
    try:
        wait_for_http(processes[0])
        processes.append(start_service("gateway", port=ports["gateway"], env=env, log_dir=logs))
        for name in ("orchestrator", "second"):
            processes.append(
                start_service(
                    "orchestrator", port=ports[name], env=env, log_dir=logs, suffix=f"-{name}"
                )
            )
        for proc in processes[1:]:
            wait_for_health(proc, timeout=90)
        issuer = TokenIssuer.from_file(keys[0])
        metadata = call_metadata(
            issuer.caller_token(org_id=f"bench-cancel-{int(time.time())}", user_id="tom")
        )
        working = channel(f"127.0.0.1:{ports['orchestrator']}")
        other = channel(f"127.0.0.1:{ports['second']}")
        stubs = {
            "same": orchestrator_pb2_grpc.OrchestratorServiceStub(working),
            "other": orchestrator_pb2_grpc.OrchestratorServiceStub(other),
        }
        samples: dict[str, list[float]] = {"same": [], "other": []}
        for _ in range(n):
            for through, cancel_stub in stubs.items():
                samples[through].append(
                    await _one_cancel(stubs["same"], cancel_stub, metadata, model_url)
                )
        await working.close(grace=None)
        await other.close(grace=None)
    finally:
        for proc in reversed(processes):
            proc.stop()
    figures = []
    for through, values in samples.items():
        where = "the working orchestrator" if through == "same" else "another replica"
        for q in (50, 99):
            figures.append(
                Figure(
                    f"cancel_to_answer_p{q}_ms",
                    percentile(values, q) * 1000,
                    "ms",
                    {"cancel_sent_to": where, "runs": len(values), "held_model_call": True},
                )
            )
    return figures


async def _one_cancel(start_stub: Any, cancel_stub: Any, metadata: Any, model_url: str) -> float:
    """Start a run whose model call is held, cancel it, and time how long after
    CancelRun returned its StartRun answered."""
    await asyncio.to_thread(_hold_next_call, model_url)
    asking = asyncio.ensure_future(
        start_stub.StartRun(
            pb.StartRunRequest(agent="handbook", input="Hold this one."),
            metadata=metadata,
            timeout=50,
        )
    )
    run_id = ""
    while not run_id:
        listed = await cancel_stub.ListRuns(
            pb.ListRunsRequest(page_size=1, state=pb.RUN_STATE_RUNNING),
            metadata=metadata,
            timeout=10,
        )
        run_id = listed.runs[0].run_id if listed.runs else ""
        if not run_id:
            await asyncio.sleep(0.01)
    await cancel_stub.CancelRun(
        pb.CancelRunRequest(run_id=run_id, reason="bench"), metadata=metadata, timeout=10
    )
    cancelled_at = time.perf_counter()
    answer = await asking
    answered_at = time.perf_counter()
    if answer.run.state != pb.RUN_STATE_CANCELLED:
        raise RuntimeError(
            f"run {run_id} ended {pb.RunState.Name(answer.run.state)}, not CANCELLED"
        )
    return answered_at - cancelled_at
