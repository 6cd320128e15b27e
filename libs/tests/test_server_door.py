"""The bootstrap's door over real gRPC: identity before the body is decoded, a body
that does not decode or carries what cannot be stored refused as INVALID_ARGUMENT
with a plain message, for all four kinds of method."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cairn.gateway.v1 import gateway_pb2
from cairn_libs.clients import call_metadata
from cairn_libs.identity import TokenIssuer, TokenVerifier
from cairn_libs.server import serve
from cairn_libs.stack import free_port

SERVICE = "cairn.test.v1.Probe"
Request = gateway_pb2.ChatRequest


class ProbeApp:
    """One method of each kind, all taking a ChatRequest; it records what reached it."""

    name = "probe"

    def __init__(self) -> None:
        self.seen: list[Request] = []
        self.per_item_fields = {f"/{SERVICE}/EchoPerItem": ("messages",)}

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        async def echo(request: Request, _context: Any) -> Request:
            self.seen.append(request)
            return request

        async def split(request: Request, _context: Any) -> AsyncIterator[Request]:
            self.seen.append(request)
            for message in request.messages:
                yield Request(messages=[message])

        async def collect(requests: AsyncIterator[Request], _context: Any) -> Request:
            combined = Request()
            async for request in requests:
                self.seen.append(request)
                combined.messages.extend(request.messages)
            return combined

        async def relay(requests: AsyncIterator[Request], _context: Any) -> AsyncIterator[Request]:
            async for request in requests:
                self.seen.append(request)
                yield request

        decode, encode = Request.FromString, Request.SerializeToString
        handlers = {
            "Echo": grpc.unary_unary_rpc_method_handler(echo, decode, encode),
            "EchoPerItem": grpc.unary_unary_rpc_method_handler(echo, decode, encode),
            "Split": grpc.unary_stream_rpc_method_handler(split, decode, encode),
            "Collect": grpc.stream_unary_rpc_method_handler(collect, decode, encode),
            "Relay": grpc.stream_stream_rpc_method_handler(relay, decode, encode),
        }
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        return []

    async def start(self) -> None:
        return None

    async def ready(self) -> bool:
        return True

    async def stop(self) -> None:
        return None


@pytest.fixture(scope="module")
async def probe(dev_keys: tuple[Path, Path]) -> AsyncIterator[tuple[ProbeApp, str]]:
    app = ProbeApp()
    address = f"127.0.0.1:{free_port()}"
    server = asyncio.create_task(
        serve(app, address=address, verifier=TokenVerifier(key=dev_keys[1].read_bytes()))
    )
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=10)
    try:
        yield app, address
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


@pytest.fixture
async def channel(probe: tuple[ProbeApp, str]) -> AsyncIterator[grpc.aio.Channel]:
    probe[0].seen.clear()
    async with grpc.aio.insecure_channel(probe[1]) as ch:
        yield ch


@pytest.fixture(scope="module")
def token(issuer: TokenIssuer) -> str:
    return issuer.caller_token(org_id="acme", user_id="ana")


GARBAGE = b"\xff\xff\xff\xff\x0f"


def _raw(channel: grpc.aio.Channel, kind: str, method: str) -> Any:
    # No serializers: the bytes go on the wire exactly as given.
    path = f"/{SERVICE}/{method}"
    factory = {
        "unary": channel.unary_unary,
        "server-stream": channel.unary_stream,
        "client-stream": channel.stream_unary,
        "bidi": channel.stream_stream,
    }[kind]
    return factory(path)


KINDS = [
    ("unary", "Echo"),
    ("server-stream", "Split"),
    ("client-stream", "Collect"),
    ("bidi", "Relay"),
]


async def _call(
    channel: grpc.aio.Channel, kind: str, method: str, bodies: list[bytes], metadata: Any
) -> grpc.aio.AioRpcError:
    stub = _raw(channel, kind, method)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if kind in ("unary", "server-stream"):
            call = stub(bodies[0], metadata=metadata, timeout=10)
        else:
            call = stub(iter(bodies), metadata=metadata, timeout=10)
        if kind in ("server-stream", "bidi"):
            async for _ in call:
                pass
        else:
            await call
    return caught.value


@pytest.mark.parametrize(("kind", "method"), KINDS)
async def test_garbage_bytes_without_a_token_are_unauthenticated_before_anything_is_decoded(
    channel: grpc.aio.Channel, kind: str, method: str
) -> None:
    error = await _call(channel, kind, method, [GARBAGE], metadata=())

    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "missing bearer token" in (error.details() or "")


@pytest.mark.parametrize(("kind", "method"), KINDS)
async def test_garbage_bytes_with_a_token_are_invalid_argument_with_a_plain_message(
    channel: grpc.aio.Channel, token: str, kind: str, method: str
) -> None:
    error = await _call(channel, kind, method, [GARBAGE], metadata=call_metadata(token))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "the request body is not a valid cairn.gateway.v1.ChatRequest message; "
        "send a serialized cairn.gateway.v1.ChatRequest"
    )


@pytest.mark.parametrize(
    ("kind", "method"), [k for k in KINDS if k[0] in ("client-stream", "bidi")]
)
async def test_each_streamed_message_is_decoded_as_it_arrives(
    channel: grpc.aio.Channel,
    probe: tuple[ProbeApp, str],
    token: str,
    kind: str,
    method: str,
) -> None:
    good = Request(model="first").SerializeToString()

    error = await _call(channel, kind, method, [good, GARBAGE], metadata=call_metadata(token))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [r.model for r in probe[0].seen] == ["first"]


def _nul_in_nested_string() -> bytes:
    return Request(
        messages=[
            gateway_pb2.Message(role=gateway_pb2.MESSAGE_ROLE_USER, content="fine"),
            gateway_pb2.Message(role=gateway_pb2.MESSAGE_ROLE_USER, content="a\x00b"),
        ]
    ).SerializeToString()


@pytest.mark.parametrize(("kind", "method"), KINDS)
async def test_a_nul_in_a_nested_string_is_refused_naming_its_path_and_reaches_no_servicer(
    channel: grpc.aio.Channel,
    probe: tuple[ProbeApp, str],
    token: str,
    kind: str,
    method: str,
) -> None:
    error = await _call(
        channel, kind, method, [_nul_in_nested_string()], metadata=call_metadata(token)
    )

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "messages[1].content contains U+0000, which cannot be stored; remove it"
    )
    assert probe[0].seen == []


async def test_an_undefined_enum_number_is_refused_naming_the_field_and_the_accepted_names(
    channel: grpc.aio.Channel, token: str
) -> None:
    body = Request(messages=[gateway_pb2.Message(role=77)]).SerializeToString()

    error = await _call(channel, "unary", "Echo", [body], metadata=call_metadata(token))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "messages[0].role is 77, which is not a MessageRole; use one of "
        "MESSAGE_ROLE_UNSPECIFIED, MESSAGE_ROLE_SYSTEM, MESSAGE_ROLE_USER, "
        "MESSAGE_ROLE_ASSISTANT, MESSAGE_ROLE_TOOL"
    )


async def test_a_field_the_service_checks_per_item_is_left_to_the_service(
    channel: grpc.aio.Channel, probe: tuple[ProbeApp, str], token: str
) -> None:
    echoed = await _raw(channel, "unary", "EchoPerItem")(
        _nul_in_nested_string(), metadata=call_metadata(token), timeout=10
    )

    assert Request.FromString(echoed).messages[1].content == "a\x00b"
    assert len(probe[0].seen) == 1


async def test_the_rest_of_a_per_item_request_is_still_checked(
    channel: grpc.aio.Channel, probe: tuple[ProbeApp, str], token: str
) -> None:
    body = Request(model="m\x00").SerializeToString()

    error = await _call(channel, "unary", "EchoPerItem", [body], metadata=call_metadata(token))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith("model contains U+0000")
    assert probe[0].seen == []


async def test_a_token_without_the_bearer_prefix_is_told_what_the_metadata_must_look_like(
    channel: grpc.aio.Channel, token: str
) -> None:
    body = Request().SerializeToString()

    error = await _call(channel, "unary", "Echo", [body], metadata=(("authorization", token),))

    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.details() == "authorization metadata must be 'Bearer <token>'"


async def test_a_malformed_actor_credential_is_refused_not_ignored(
    channel: grpc.aio.Channel, probe: tuple[ProbeApp, str], token: str
) -> None:
    body = Request().SerializeToString()
    metadata = (*call_metadata(token), ("x-cairn-actor", "not-a-bearer"))

    error = await _call(channel, "unary", "Echo", [body], metadata=metadata)

    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error.details() == "x-cairn-actor metadata must be 'Bearer <token>'"
    assert probe[0].seen == []


async def test_a_valid_request_still_reaches_every_kind_of_method(
    channel: grpc.aio.Channel, probe: tuple[ProbeApp, str], token: str
) -> None:
    body = Request(
        messages=[gateway_pb2.Message(role=gateway_pb2.MESSAGE_ROLE_USER, content="hi")]
    ).SerializeToString()
    metadata = call_metadata(token)

    unary = await _raw(channel, "unary", "Echo")(body, metadata=metadata, timeout=10)
    split = [r async for r in _raw(channel, "server-stream", "Split")(body, metadata=metadata)]
    collected = await _raw(channel, "client-stream", "Collect")(
        iter([body, body]), metadata=metadata
    )
    relayed = [r async for r in _raw(channel, "bidi", "Relay")(iter([body]), metadata=metadata)]

    assert unary == body
    assert len(split) == 1
    assert len(Request.FromString(collected).messages) == 2
    assert relayed == [body]
    assert len(probe[0].seen) == 5


async def test_health_and_reflection_answer_without_a_token(
    probe: tuple[ProbeApp, str],
) -> None:
    async with grpc.aio.insecure_channel(probe[1]) as ch:
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        reflection = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        answers = [a async for a in reflection]

    assert health.status in (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert "grpc.health.v1.Health" in names
