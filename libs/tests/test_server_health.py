from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cairn_libs.identity import TokenVerifier
from cairn_libs.server import serve
from cairn_libs.stack import free_port


class SlowToBeReady:
    """A service whose dependencies take a while: health must not say SERVING early."""

    name = "slow"

    def __init__(self) -> None:
        self.allowed = asyncio.Event()

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        return []

    async def start(self) -> None:
        return None

    async def ready(self) -> bool:
        # Like a first database connection: the check itself takes a while.
        await self.allowed.wait()
        return True

    async def stop(self) -> None:
        return None


async def _status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        return int(response.status)


async def test_health_is_not_serving_until_the_first_readiness_check_passes(
    dev_keys: tuple[Path, Path],
) -> None:
    app = SlowToBeReady()
    address = f"127.0.0.1:{free_port()}"
    server = asyncio.create_task(
        serve(app, address=address, verifier=TokenVerifier(key=dev_keys[1].read_bytes()))
    )
    try:
        for _ in range(200):
            try:
                status = await _status(address)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.01)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        app.allowed.set()
        for _ in range(300):
            if await _status(address) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.02)
        assert await _status(address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
