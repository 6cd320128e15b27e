"""A database connection error that escapes a servicer untranslated (a connection
the restart broke, released twice) still reaches the caller as UNAVAILABLE, not
INTERNAL, and is not retried on another replica; any other escape stays INTERNAL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import grpc
import pytest

from cairn_libs.clients import channel
from cairn_libs.server import RETRY_PUSHBACK_KEY, error_mapping_interceptor
from cairn_libs.stack import free_port

METHOD = "/cairn.memory.v1.MemoryService/Recall"


@asynccontextmanager
async def _raising(exc: BaseException, calls: list[int]) -> AsyncIterator[str]:
    async def answer(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        calls.append(1)
        raise exc

    server = grpc.aio.server(
        interceptors=[error_mapping_interceptor()], options=[("grpc.so_reuseport", 0)]
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "cairn.memory.v1.MemoryService",
                {"Recall": grpc.unary_unary_rpc_method_handler(answer)},
            ),
        )
    )
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    try:
        yield address
    finally:
        await server.stop(None)


async def _refusal(address: str) -> grpc.aio.AioRpcError:
    async with channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await ch.unary_unary(METHOD)(b"", timeout=10)
    return caught.value


async def test_an_untranslated_database_connection_error_is_unavailable_and_not_retried() -> None:
    calls: list[int] = []
    released = asyncpg.InterfaceError("connection has been released back to the pool")
    async with _raising(released, calls) as address:
        refusal = await _refusal(address)
    assert refusal.code() == grpc.StatusCode.UNAVAILABLE
    assert "InterfaceError" in (refusal.details() or "")
    assert (RETRY_PUSHBACK_KEY, "-1") in tuple(refusal.trailing_metadata() or ())
    assert calls == [1]


async def test_any_other_escaped_exception_is_still_internal() -> None:
    calls: list[int] = []
    async with _raising(FileNotFoundError("agents/missing.yaml"), calls) as address:
        refusal = await _refusal(address)
    assert refusal.code() == grpc.StatusCode.INTERNAL
