"""Client channels to other cairn services: a dependency that comes back is used
again within about a second, not after gRPC's default backoff of many seconds."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from cairn_libs.clients import (
    DEFAULT_MAX_RECONNECT_BACKOFF_MS,
    MAX_RECONNECT_BACKOFF_ENV,
    channel,
    channel_options,
    max_reconnect_backoff_ms,
)
from cairn_libs.errors import ConfigurationError
from cairn_libs.stack import free_port


async def _health_server(address: str) -> grpc.aio.Server:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    server.add_insecure_port(address)
    await server.start()
    return server


async def test_a_client_reconnects_within_about_a_second_after_its_server_restarts() -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = await _health_server(address)
    client = channel(address)
    try:
        await health_pb2_grpc.HealthStub(client).Check(health_pb2.HealthCheckRequest(), timeout=5)
        await server.stop(None)

        # While the server is away, something on its port refuses every connection:
        # each refusal is one reconnect attempt, so the test waits on those events
        # until the backoff has had time to grow.
        attempts: asyncio.Queue[float] = asyncio.Queue()

        async def refuse(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            attempts.put_nowait(time.monotonic())
            writer.close()

        refuser = await asyncio.start_server(refuse, "127.0.0.1", port, reuse_address=True)
        # A channel with no call waiting may drop to IDLE after a failure and stop
        # trying on its own; asking it to connect again keeps the attempts coming.
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 5 and time.monotonic() < deadline:
            client.get_state(try_to_connect=True)
            try:
                await asyncio.wait_for(attempts.get(), timeout=2)
            except TimeoutError:
                continue
            seen += 1
        assert seen == 5, "the client stopped trying to reconnect"
        refuser.close()
        await refuser.wait_closed()

        server = await _health_server(address)
        back = time.monotonic()
        await asyncio.wait_for(client.channel_ready(), timeout=60)

        # gRPC's default backoff (1 s growing by 1.6x, jittered) took 5-6 s here.
        assert time.monotonic() - back < 2.5
    finally:
        await client.close()
        await server.stop(None)


def test_the_reconnect_backoff_cap_is_a_setting_with_a_one_second_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(MAX_RECONNECT_BACKOFF_ENV, raising=False)
    assert max_reconnect_backoff_ms() == DEFAULT_MAX_RECONNECT_BACKOFF_MS == 1000

    monkeypatch.setenv(MAX_RECONNECT_BACKOFF_ENV, "250")
    assert dict(channel_options())["grpc.max_reconnect_backoff_ms"] == 250

    monkeypatch.setenv(MAX_RECONNECT_BACKOFF_ENV, "soon")
    with pytest.raises(ConfigurationError, match=r"CAIRN_GRPC_MAX_RECONNECT_BACKOFF_MS='soon'"):
        max_reconnect_backoff_ms()
