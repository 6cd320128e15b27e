"""The orchestration cost of one agent run across all four services, with the
offline model answering instantly: one memory recall, two model calls (a
search_knowledge tool call, then the answer) and one retrieval: the prefetch of
the question, which the model's search for the same question reuses (its step
says `reused_prefetch`). The shape of a run is checked on its trajectory before
anything is timed, so the figures measure what they say."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from google.protobuf import json_format

from bench.figures import Figure, percentile
from bench.harness import bench_stack
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata, channel
from cairn_libs.demo_corpus import handbook_documents, load_handbook


async def run_orchestration(*, quick: bool = False) -> list[Figure]:
    n = 20 if quick else 100
    sustain_seconds = 10.0 if quick else 60.0
    corpus = load_handbook()
    with bench_stack(("gateway", "retrieval", "memory", "orchestrator")) as stack:
        org = f"bench-{int(time.time())}"
        ingester = call_metadata(
            stack.issuer.caller_token(org_id=org, user_id="docs-bot", roles=["ingester"])
        )
        ch = channel(stack.addresses["retrieval"])
        documents = handbook_documents(corpus)
        async for _ in retrieval_pb2_grpc.RetrievalServiceStub(ch).IngestDocuments(
            retrieval_pb2.IngestDocumentsRequest(documents=documents),
            metadata=ingester,
            timeout=300,
        ):
            pass
        await ch.close(grace=None)

        metadata = call_metadata(
            stack.issuer.caller_token(org_id=org, user_id="maria", roles=["manager"])
        )
        orch = channel(stack.addresses["orchestrator"])
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(orch)
        request = orchestrator_pb2.StartRunRequest(agent="handbook", input=corpus["question"])

        async def one_run() -> bool:
            try:
                run = (await stub.StartRun(request, metadata=metadata, timeout=60)).run
            except grpc.aio.AioRpcError:
                return False
            return run.state == orchestrator_pb2.RUN_STATE_COMPLETED

        for _ in range(5):
            await one_run()
        await _check_run_shape(stub, request, metadata)
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            ok = await one_run()
            samples.append((time.perf_counter() - started) * 1000)
            if not ok:
                raise RuntimeError("a benchmark run did not complete; see state/bench/logs")

        completed = errors = 0
        deadline = time.monotonic() + sustain_seconds

        async def runner() -> None:
            nonlocal completed, errors
            while time.monotonic() < deadline:
                if await one_run():
                    completed += 1
                else:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(runner() for _ in range(50)))
        elapsed = time.perf_counter() - started
        await orch.close(grace=None)
    seq = {
        "runs": n,
        "model_calls_per_run": 2,
        "retrievals": 1,
        "reused_retrievals": 1,
        "memory_recalls": 1,
    }
    sustained = {"concurrency": 50, "seconds": sustain_seconds}
    return [
        Figure("run.orchestration.p50", percentile(samples, 50), "ms", seq),
        Figure("run.orchestration.p99", percentile(samples, 99), "ms", seq),
        Figure("run.sustained.runs_per_second", completed / elapsed, "runs/s", sustained),
        Figure("run.sustained.errors", float(errors), "runs", sustained),
    ]


EXPECTED_STEPS = ["MEMORY_READ", "RETRIEVAL", "MODEL_CALL", "TOOL_CALL", "MODEL_CALL"]


async def _check_run_shape(
    stub: Any,
    request: orchestrator_pb2.StartRunRequest,
    metadata: tuple[tuple[str, str], ...],
) -> None:
    run = (await stub.StartRun(request, metadata=metadata, timeout=60)).run
    steps = (
        await stub.GetTrajectory(
            orchestrator_pb2.GetTrajectoryRequest(run_id=run.run_id), metadata=metadata, timeout=10
        )
    ).steps
    kinds = [orchestrator_pb2.StepKind.Name(s.kind).removeprefix("STEP_KIND_") for s in steps]
    if run.state != orchestrator_pb2.RUN_STATE_COMPLETED or kinds != EXPECTED_STEPS:
        raise RuntimeError(
            f"a benchmark run ended {orchestrator_pb2.RunState.Name(run.state)} with steps "
            f"{kinds}; the benchmark times runs of {EXPECTED_STEPS}"
        )
    tool_detail = json_format.MessageToDict(steps[3].detail)
    if tool_detail.get("reused_prefetch") is not True:
        raise RuntimeError(
            "the model's search_knowledge call did not reuse the prefetch "
            f"(its step detail: {sorted(tool_detail)}); the benchmark times runs that do"
        )
