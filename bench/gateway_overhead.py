"""What the gateway adds to a model call: a direct HTTP call to the fake provider
versus the same call through the gateway over gRPC, in one run, side by side."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx

from bench.figures import Figure, percentile
from bench.harness import bench_stack
from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn_libs.clients import call_metadata, channel

PROMPT = "What is the capital of France? Answer in one short sentence."
BODY = {
    "model": "cairn-offline-demo",
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": 64,
}


async def _sequential(call: Callable[[], Awaitable[None]], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


async def _concurrent(
    call: Callable[[], Awaitable[None]], *, concurrency: int, total: int
) -> tuple[float, list[float]]:
    samples: list[float] = []
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            await call()
            samples.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - started), samples


async def run_gateway_overhead(*, quick: bool = False) -> list[Figure]:
    n = 60 if quick else 400
    total = 300 if quick else 3000
    with bench_stack(("gateway",)) as stack:
        token = stack.issuer.caller_token(org_id="bench", user_id="bench")
        metadata = call_metadata(token)
        request = gateway_pb2.ChatRequest(
            messages=[gateway_pb2.Message(role=gateway_pb2.MESSAGE_ROLE_USER, content=PROMPT)],
            tier=gateway_pb2.TIER_FAST,
            max_tokens=64,
        )
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=stack.model_url, limits=limits, timeout=30) as http:
            ch = channel(stack.addresses["gateway"])
            stub = gateway_pb2_grpc.GatewayServiceStub(ch)

            async def direct() -> None:
                response = await http.post("/v1/chat/completions", json=BODY)
                response.raise_for_status()

            async def via_gateway() -> None:
                await stub.Chat(request, metadata=metadata, timeout=30)

            async def direct_first_token() -> None:
                async with http.stream(
                    "POST", "/v1/chat/completions", json={**BODY, "stream": True}
                ) as response:
                    async for line in response.aiter_lines():
                        if '"content":"' in line.replace(
                            " ", ""
                        ) and '"content":""' not in line.replace(" ", ""):
                            return

            async def gateway_first_token() -> None:
                stream = stub.ChatStream(
                    gateway_pb2.ChatStreamRequest(chat=request), metadata=metadata, timeout=30
                )
                async for message in stream:
                    if message.content_delta:
                        stream.cancel()
                        return

            for warm in (direct, via_gateway, direct_first_token, gateway_first_token):
                await _sequential(warm, 20)
            seq_direct = await _sequential(direct, n)
            seq_gateway = await _sequential(via_gateway, n)
            ttft_direct = await _sequential(direct_first_token, n)
            ttft_gateway = await _sequential(gateway_first_token, n)
            rps_direct, conc_direct = await _concurrent(direct, concurrency=32, total=total)
            rps_gateway, conc_gateway = await _concurrent(via_gateway, concurrency=32, total=total)
            await ch.close()
    seq = {"requests": n, "mode": "sequential"}
    conc = {"requests": total, "concurrency": 32}
    return [
        Figure("gateway.direct_http.p50", percentile(seq_direct, 50), "ms", seq),
        Figure("gateway.via_gateway.p50", percentile(seq_gateway, 50), "ms", seq),
        Figure(
            "gateway.added.p50", percentile(seq_gateway, 50) - percentile(seq_direct, 50), "ms", seq
        ),
        Figure("gateway.direct_http.p99", percentile(seq_direct, 99), "ms", seq),
        Figure("gateway.via_gateway.p99", percentile(seq_gateway, 99), "ms", seq),
        Figure("gateway.direct_stream.first_token.p50", percentile(ttft_direct, 50), "ms", seq),
        Figure(
            "gateway.via_gateway_stream.first_token.p50", percentile(ttft_gateway, 50), "ms", seq
        ),
        Figure(
            "gateway.added.first_token.p50",
            percentile(ttft_gateway, 50) - percentile(ttft_direct, 50),
            "ms",
            seq,
        ),
        Figure("gateway.direct_http.rps", rps_direct, "req/s", conc),
        Figure("gateway.via_gateway.rps", rps_gateway, "req/s", conc),
        Figure("gateway.kept_share_of_direct_rps", rps_gateway / rps_direct, "ratio", conc),
        Figure("gateway.direct_http.concurrent_p99", percentile(conc_direct, 99), "ms", conc),
        Figure("gateway.via_gateway.concurrent_p99", percentile(conc_gateway, 99), "ms", conc),
    ]
