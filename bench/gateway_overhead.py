"""What the gateway adds to a model call: a direct HTTP call to the fake provider
versus the same call through the gateway over gRPC, in one run, side by side.

Fairness, because a comparison is only as good as its baseline:
- The direct client is a fast one: one aiohttp session with keep-alive, as a
  production caller would hold. (httpx, measured the same way, reached only about
  430 requests/s here: a baseline that slow would flatter the gateway.)
- Both clients do the same work per call: encode the request, read and decode the
  whole answer (JSON for HTTP, protobuf for gRPC). Streams are read to the end in
  both cases, first-token time taken on the way, so neither side pays for opening a
  fresh connection after an abandoned stream.
- Each measured phase runs in its own fresh load-generator process (`python -m
  bench.gateway_overhead --phase ...`) holding only the client it needs, so the two
  sides never share an event loop, a garbage collector or gRPC's background threads.
  The process that starts the stack stays idle while a phase runs.
- The gRPC channel is plain, without the OpenTelemetry client interceptor: client
  tracing is the caller's cost, not the gateway's. The gateway itself runs as
  deployed (server tracing, token verification, access logs at WARNING).
- Phases alternate direct/gateway in rounds and the samples of all rounds are
  pooled, so a slow moment on the machine lands on both sides.

The `gated` side is the gateway as a run meets it: a second gateway process whose
provider has ceilings (tokens and requests per minute, so every call takes from and
settles its ceiling in PostgreSQL), each call inside a run with a remaining budget
(reserved and released in PostgreSQL), and a freshly minted caller token and
acting credential on every call, so nothing can be saved by remembering a token.
The tokens are minted before the timed loop: minting is the caller's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bench.figures import Figure, percentile

PROMPT = "What is the capital of France? Answer in one short sentence."
MAX_TOKENS = 64
BODY: dict[str, Any] = {
    "model": "cairn-offline-demo",
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": MAX_TOKENS,
}
CONCURRENCY = 32
TOKEN_VARIABLE = "CAIRN_BENCH_TOKEN"
SIGNING_KEY_VARIABLE = "CAIRN_BENCH_SIGNING_KEY"
# Far above what the bench sends: every call is granted, and still counted.
GATED_CEILING = 1_000_000_000
GATED_BUDGET = 1_000_000

Call = Callable[[], Awaitable[float | None]]


# --- the load generator (runs in its own process) --------------------------------


async def _sequential(call: Call, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        first = await call()
        samples.append(((first if first is not None else time.perf_counter()) - started) * 1000)
    return samples


async def _concurrent(call: Call, *, concurrency: int, total: int) -> tuple[float, list[float]]:
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


async def _direct_phase(kind: str, target: str, n: int, warmup: int) -> dict[str, Any]:
    import aiohttp

    url = f"{target}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def unary() -> float | None:
            async with session.post(url, json=BODY) as response:
                response.raise_for_status()
                await response.json()
            return None

        async def first_token() -> float | None:
            first = None
            async with session.post(url, json={**BODY, "stream": True}) as response:
                response.raise_for_status()
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and any(
                        c.get("delta", {}).get("content") for c in chunk["choices"]
                    ):
                        first = time.perf_counter()
            return first

        return await _measure(kind, unary, first_token, n, warmup)


def _fresh_metadata(count: int) -> list[tuple[tuple[str, str], ...]]:
    """One caller token and one acting credential (for a run of its own) per call."""
    import uuid

    from cairn_libs.clients import call_metadata
    from cairn_libs.identity import TokenIssuer

    issuer = TokenIssuer.from_file(os.environ[SIGNING_KEY_VARIABLE])
    return [
        call_metadata(
            issuer.caller_token(org_id="bench", user_id="bench"),
            actor_token=issuer.actor_token(
                service="orchestrator", run_id=f"run-{uuid.uuid4().hex[:12]}", agent="bench"
            ),
        )
        for _ in range(count)
    ]


async def _gateway_phase(
    kind: str, target: str, n: int, warmup: int, *, gated: bool = False
) -> dict[str, Any]:
    import grpc

    from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from cairn_libs.clients import call_metadata

    calls = n + warmup * (4 if kind == "concurrent" else 1)
    fresh = _fresh_metadata(calls) if gated else []
    fixed = () if gated else call_metadata(os.environ[TOKEN_VARIABLE])

    def metadata() -> tuple[tuple[str, str], ...]:
        return fresh.pop() if gated else fixed

    request = gateway_pb2.ChatRequest(
        messages=[gateway_pb2.Message(role=gateway_pb2.MESSAGE_ROLE_USER, content=PROMPT)],
        tier=gateway_pb2.TIER_FAST,
        max_tokens=MAX_TOKENS,
    )
    if gated:
        request.remaining_budget_tokens = GATED_BUDGET
    stream_request = gateway_pb2.ChatStreamRequest(chat=request)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def unary() -> float | None:
            await stub.Chat(request, metadata=metadata(), timeout=30)
            return None

        async def first_token() -> float | None:
            first = None
            async for event in stub.ChatStream(stream_request, metadata=metadata(), timeout=30):
                if first is None and event.content_delta:
                    first = time.perf_counter()
            return first

        return await _measure(kind, unary, first_token, n, warmup)


async def _measure(
    kind: str, unary: Call, first_token: Call, n: int, warmup: int
) -> dict[str, Any]:
    if kind == "sequential":
        await _sequential(unary, warmup)
        return {"samples_ms": await _sequential(unary, n)}
    if kind == "first_token":
        await _sequential(first_token, warmup)
        return {"samples_ms": await _sequential(first_token, n)}
    await _concurrent(unary, concurrency=CONCURRENCY, total=warmup * 4)
    rps, samples = await _concurrent(unary, concurrency=CONCURRENCY, total=n)
    return {"samples_ms": samples, "rps": rps}


def _load_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_overhead")
    parser.add_argument("--side", choices=["direct", "gateway", "gated"], required=True)
    parser.add_argument(
        "--kind", choices=["sequential", "first_token", "concurrent"], required=True
    )
    parser.add_argument("--target", required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args(argv)
    if args.side == "direct":
        phase = _direct_phase(args.kind, args.target, args.n, args.warmup)
    else:
        phase = _gateway_phase(
            args.kind, args.target, args.n, args.warmup, gated=args.side == "gated"
        )
    result = asyncio.run(phase)
    sys.stdout.write(json.dumps(result) + "\n")


# --- the suite (starts the stack, runs the phases, reports) ----------------------


def _phase(
    side: str, kind: str, target: str, n: int, token: str, signing_key: str
) -> dict[str, Any]:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gateway_overhead",
            "--side",
            side,
            "--kind",
            kind,
            "--target",
            target,
            "--n",
            str(n),
        ],
        env={**os.environ, TOKEN_VARIABLE: token, SIGNING_KEY_VARIABLE: signing_key},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"load phase {side}/{kind} failed:\n{completed.stderr}")
    result: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


def _gated_provider_file(model_url: str) -> str:
    """One provider with ceilings on, serving every tier with the offline model."""
    return (
        "providers:\n"
        "  - name: gated\n"
        f"    base_url: {model_url}/v1\n"
        f"    tokens_per_minute: {GATED_CEILING}\n"
        f"    requests_per_minute: {GATED_CEILING}\n"
        "    models: {fast: cairn-offline-demo, balanced: cairn-offline-demo, "
        "deep: cairn-offline-demo}\n"
    )


@contextmanager
def _gated_gateway(model_url: str) -> Iterator[str]:
    """A second gateway on the bench's database, with the gated provider file."""
    from bench.harness import STATE
    from cairn_libs.identity import generate_dev_keypair
    from cairn_libs.stack import (
        free_port,
        stack_env,
        start_embedded_postgres,
        start_service,
        wait_for_health,
    )

    keys = generate_dev_keypair(STATE / "keys")
    config = STATE / "gateway-gated.yaml"
    config.write_text(_gated_provider_file(model_url))
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {
        **stack_env(
            database_url=start_embedded_postgres(STATE / "pg"),
            keys=keys,
            qdrant_path=STATE / "qdrant",
            model_url=model_url,
            addresses=dict.fromkeys(("gateway", "retrieval", "memory", "orchestrator"), address),
        ),
        "CAIRN_LOG_LEVEL": "WARNING",
        "CAIRN_GATEWAY_CONFIG": str(config),
    }
    process = start_service("gateway", port=port, env=env, log_dir=STATE / "logs", suffix="-gated")
    try:
        wait_for_health(process, timeout=90)
        yield address
    finally:
        process.stop()


async def run_gateway_overhead(*, quick: bool = False) -> list[Figure]:
    from bench.harness import STATE, bench_stack

    rounds = 2 if quick else 3
    n = 100 if quick else 400
    total = 600 if quick else 3000
    samples: dict[tuple[str, str], list[float]] = {}
    rps: dict[str, list[float]] = {"direct": [], "gateway": [], "gated": []}
    with bench_stack(("gateway",)) as stack, _gated_gateway(stack.model_url) as gated:
        token = stack.issuer.caller_token(org_id="bench", user_id="bench")
        signing_key = str(STATE / "keys" / "dev_signing_key.pem")
        targets = {
            "direct": stack.model_url,
            "gateway": stack.addresses["gateway"],
            "gated": gated,
        }
        for _ in range(rounds):
            for kind, count in (("sequential", n), ("first_token", n), ("concurrent", total)):
                for side in ("direct", "gateway", "gated"):
                    result = await asyncio.to_thread(
                        _phase, side, kind, targets[side], count // rounds, token, signing_key
                    )
                    samples.setdefault((side, kind), []).extend(result["samples_ms"])
                    if kind == "concurrent":
                        rps[side].append(result["rps"])

    def p(side: str, kind: str, q: float) -> float:
        return percentile(samples[(side, kind)], q)

    seq = {"requests": n, "mode": "sequential", "rounds": rounds}
    conc = {"requests": total, "concurrency": CONCURRENCY, "rounds": rounds}
    # Requests per second: the mean over rounds, each round a fresh process per side.
    rps_direct = sum(rps["direct"]) / len(rps["direct"])
    rps_gateway = sum(rps["gateway"]) / len(rps["gateway"])
    rps_gated = sum(rps["gated"]) / len(rps["gated"])
    gated_params = {
        **seq,
        "run_budget": True,
        "ceilings": True,
        "fresh_token_per_call": True,
    }
    return [
        Figure("gateway.direct_http.p50", p("direct", "sequential", 50), "ms", seq),
        Figure("gateway.via_gateway.p50", p("gateway", "sequential", 50), "ms", seq),
        Figure(
            "gateway.added.p50",
            p("gateway", "sequential", 50) - p("direct", "sequential", 50),
            "ms",
            {**seq, "target_at_most": 1.5},
        ),
        Figure("gateway.direct_http.p99", p("direct", "sequential", 99), "ms", seq),
        Figure("gateway.via_gateway.p99", p("gateway", "sequential", 99), "ms", seq),
        Figure(
            "gateway.added.p99",
            p("gateway", "sequential", 99) - p("direct", "sequential", 99),
            "ms",
            seq,
        ),
        Figure("gateway.direct_stream.first_token.p50", p("direct", "first_token", 50), "ms", seq),
        Figure(
            "gateway.via_gateway_stream.first_token.p50", p("gateway", "first_token", 50), "ms", seq
        ),
        Figure(
            "gateway.added.first_token.p50",
            p("gateway", "first_token", 50) - p("direct", "first_token", 50),
            "ms",
            {**seq, "target_at_most": 2.0},
        ),
        Figure("gateway.direct_http.rps", rps_direct, "req/s", conc),
        Figure("gateway.via_gateway.rps", rps_gateway, "req/s", conc),
        Figure(
            "gateway.kept_share_of_direct_rps",
            rps_gateway / rps_direct,
            "ratio",
            {**conc, "target_at_least": 0.25},
        ),
        Figure("gateway.direct_http.concurrent_p99", p("direct", "concurrent", 99), "ms", conc),
        Figure("gateway.via_gateway.concurrent_p99", p("gateway", "concurrent", 99), "ms", conc),
        Figure("gateway.gated.p50", p("gated", "sequential", 50), "ms", gated_params),
        Figure(
            "gateway.gated.added.p50",
            p("gated", "sequential", 50) - p("direct", "sequential", 50),
            "ms",
            {**gated_params, "target_at_most": 1.0},
        ),
        Figure(
            "gateway.gated.over_plain_gateway.p50",
            p("gated", "sequential", 50) - p("gateway", "sequential", 50),
            "ms",
            gated_params,
        ),
        Figure("gateway.gated.p99", p("gated", "sequential", 99), "ms", gated_params),
        Figure(
            "gateway.gated.added.p99",
            p("gated", "sequential", 99) - p("direct", "sequential", 99),
            "ms",
            gated_params,
        ),
        Figure(
            "gateway.gated.added.first_token.p50",
            p("gated", "first_token", 50) - p("direct", "first_token", 50),
            "ms",
            gated_params,
        ),
        Figure("gateway.gated.rps", rps_gated, "req/s", {**conc, **gated_params}),
        Figure(
            "gateway.gated.concurrent_p99",
            p("gated", "concurrent", 99),
            "ms",
            {**conc, **gated_params},
        ),
    ]


if __name__ == "__main__":
    _load_main(sys.argv[1:])
