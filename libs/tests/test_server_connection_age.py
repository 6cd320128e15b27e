"""Servers close a connection at its maximum age, so clients balancing over a
headless Service re-resolve and reach the replicas added after they connected."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from cairn_libs.errors import ConfigurationError
from cairn_libs.server import (
    DEFAULT_MAX_CONNECTION_AGE_SECONDS,
    MAX_CONNECTION_AGE_ENV,
    MAX_CONNECTION_AGE_GRACE_ENV,
    server_options,
)
from cairn_libs.stack import free_port


async def test_a_connection_older_than_the_maximum_age_is_closed_by_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MAX_CONNECTION_AGE_ENV, "0.5")
    monkeypatch.setenv(MAX_CONNECTION_AGE_GRACE_ENV, "0.5")
    server = grpc.aio.server(options=server_options())
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as client:
            await health_pb2_grpc.HealthStub(client).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert client.get_state() is grpc.ChannelConnectivity.READY
            # The server's GOAWAY at the age is the event waited on: the channel
            # leaves READY without any call failing.
            await asyncio.wait_for(
                client.wait_for_state_change(grpc.ChannelConnectivity.READY), timeout=20
            )
            assert client.get_state() is not grpc.ChannelConnectivity.READY
            reply = await health_pb2_grpc.HealthStub(client).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


def test_without_the_setting_connections_live_five_minutes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(MAX_CONNECTION_AGE_ENV, raising=False)
    options = dict(server_options())
    assert DEFAULT_MAX_CONNECTION_AGE_SECONDS == 300
    assert options["grpc.max_connection_age_ms"] == 300_000


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "nan"])
def test_a_maximum_age_that_is_not_a_positive_number_of_seconds_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(MAX_CONNECTION_AGE_ENV, raw)
    with pytest.raises(ConfigurationError, match=f"{MAX_CONNECTION_AGE_ENV}={raw!r}"):
        server_options()
