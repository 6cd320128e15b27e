"""The retry policy every cairn channel carries: UNAVAILABLE is sent again, to
another replica, only on the RPCs listed as safe, and never when a live service
said it itself; calls spread round robin over a target's addresses."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from cairn.gateway.v1 import gateway_pb2
from cairn.memory.v1 import memory_pb2
from cairn.orchestrator.v1 import orchestrator_pb2
from cairn.retrieval.v1 import retrieval_pb2
from cairn.tools.v1 import tools_pb2
from cairn_libs.clients import channel, dial_target
from cairn_libs.errors import ConfigurationError, DependencyUnavailable
from cairn_libs.server import to_rpc_status
from cairn_libs.service_config import MAX_ATTEMPTS, NOT_RETRIED, RETRY_SAFE, service_config
from cairn_libs.stack import REPO_ROOT, free_port, replica_target, replicas_setting

RECALL = "/cairn.memory.v1.MemoryService/Recall"
START_RUN = "/cairn.orchestrator.v1.OrchestratorService/StartRun"


def test_every_rpc_of_every_service_is_decided_retry_safe_or_not_with_a_reason() -> None:
    declared = {
        service.full_name: {method.name for method in service.methods}
        for module in (gateway_pb2, memory_pb2, orchestrator_pb2, retrieval_pb2, tools_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
    }
    decided: dict[str, set[str]] = {}
    for table in (RETRY_SAFE, NOT_RETRIED):
        for service, methods in table.items():
            for method, why in methods.items():
                assert why.strip(), f"{service}/{method} has no reason"
                assert method not in decided.setdefault(service, set()), f"{method} twice"
                decided[service].add(method)
    assert decided == declared


class _Replica:
    """A server for two raw-bytes methods that fails the first `failures` calls with
    UNAVAILABLE, with or without the pushback a cairn service sends."""

    def __init__(self, *, failures: int, pushback: bool) -> None:
        self.failures = failures
        self.pushback = pushback
        self.calls: Counter[str] = Counter()

    def handler(self, method: str) -> Any:
        async def answer(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            self.calls[method] += 1
            if self.calls[method] <= self.failures:
                if self.pushback:
                    status = to_rpc_status(DependencyUnavailable("the database is away"))
                    await context.abort(status.code, status.details, status.trailing_metadata)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
            return b"ok"

        return grpc.unary_unary_rpc_method_handler(answer)


@asynccontextmanager
async def _served(replica: _Replica) -> AsyncIterator[str]:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handlers: dict[str, dict[str, Any]] = {}
    for full in (RECALL, START_RUN):
        service, method = full.strip("/").split("/")
        handlers.setdefault(service, {})[method] = replica.handler(full)
    for service, methods in handlers.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    try:
        yield address
    finally:
        await server.stop(None)


async def _call(target: str, method: str) -> bytes | grpc.StatusCode:
    async with channel(target) as ch:
        try:
            reply: bytes = await ch.unary_unary(method)(b"", timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return reply


async def test_a_read_that_meets_a_replica_going_away_is_sent_again_and_succeeds() -> None:
    replica = _Replica(failures=MAX_ATTEMPTS - 1, pushback=False)
    async with _served(replica) as address:
        assert await _call(address, RECALL) == b"ok"
    assert replica.calls[RECALL] == MAX_ATTEMPTS


async def test_start_run_is_never_sent_twice() -> None:
    replica = _Replica(failures=1, pushback=False)
    async with _served(replica) as address:
        assert await _call(address, START_RUN) == grpc.StatusCode.UNAVAILABLE
    assert replica.calls[START_RUN] == 1


async def test_an_unavailable_said_by_a_live_service_is_not_retried_and_keeps_its_reason() -> None:
    replica = _Replica(failures=1, pushback=True)
    async with _served(replica) as address, channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await ch.unary_unary(RECALL)(b"", timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "database" in (caught.value.details() or "")
    assert replica.calls[RECALL] == 1


async def test_calls_to_a_replica_target_spread_round_robin_over_every_address() -> None:
    replicas = [_Replica(failures=0, pushback=False) for _ in range(3)]
    async with (
        _served(replicas[0]) as a,
        _served(replicas[1]) as b,
        _served(replicas[2]) as c,
        channel(replica_target([a, b, c])) as ch,
    ):
        await ch.channel_ready()
        stub = ch.unary_unary(RECALL)
        # The channel is ready once one address is; round_robin takes turns among the
        # ready ones, so on a slow machine the first calls may all reach the first. Call
        # until every address has answered once (each then is ready), with a deadline.
        deadline = asyncio.get_running_loop().time() + 20
        while not all(r.calls[RECALL] for r in replicas):
            assert asyncio.get_running_loop().time() < deadline, [r.calls[RECALL] for r in replicas]
            await stub(b"", timeout=10)
        before = [r.calls[RECALL] for r in replicas]
        await asyncio.gather(*(stub(b"", timeout=10) for _ in range(30)))
    spread = [r.calls[RECALL] - seen for r, seen in zip(replicas, before, strict=True)]
    # With every address ready, round_robin takes strict turns: 30 calls, 10 each.
    assert all(share >= 5 for share in spread), spread


async def test_a_read_on_a_killed_replica_goes_to_a_live_one() -> None:
    alive = _Replica(failures=0, pushback=False)
    dead_address = f"127.0.0.1:{free_port()}"  # nothing listens here any more
    async with _served(alive) as address:
        target = replica_target([dead_address, address])
        results = [await _call(target, RECALL) for _ in range(6)]
    assert results == [b"ok"] * 6


def test_a_plain_address_list_is_dialled_as_ipv4_and_a_hostname_list_is_refused() -> None:
    assert dial_target("127.0.0.1:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert dial_target("dns:///orchestrator:50054") == "dns:///orchestrator:50054"
    assert dial_target("127.0.0.1:50051") == "127.0.0.1:50051"
    with pytest.raises(ConfigurationError, match="dns:///"):
        dial_target("gateway-0:50051,gateway-1:50051")


def test_the_rest_proxy_dials_with_the_same_service_config() -> None:
    # The proxy embeds this file (services/restproxy/proxy.go); rewrite it with
    # `python -c "import json; from cairn_libs.service_config import service_config;
    # print(json.dumps(service_config(), indent=2))" > services/restproxy/service_config.json`.
    written = json.loads((REPO_ROOT / "services" / "restproxy" / "service_config.json").read_text())
    assert written == service_config()


def test_the_replicas_setting_is_a_count_from_1_to_16_and_says_so_otherwise() -> None:
    assert replicas_setting({}) == 1
    assert replicas_setting({"CAIRN_REPLICAS": "3"}) == 3
    for bad in ("0", "17", "three", "-1"):
        with pytest.raises(ConfigurationError, match=f"CAIRN_REPLICAS={bad!r}"):
            replicas_setting({"CAIRN_REPLICAS": bad})
    assert replica_target(["127.0.0.1:1"]) == "127.0.0.1:1"
    assert replica_target(["127.0.0.1:1", "127.0.0.1:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
