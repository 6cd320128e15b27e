"""How every cairn service is served: one aio gRPC server with health, reflection
and the same interceptors, stopped gracefully on SIGTERM.

Interceptors, outermost first: OpenTelemetry (the server span, W3C context from
metadata), error mapping (CairnError -> status with google.rpc details), identity
(verify the caller's token before any work), access logging (one line per call,
carrying org, user and run), and the door (decode the request, then refuse what
`cairn_libs.door` refuses). A servicer method never parses a token: it calls
`current_identity()`.

grpcio would decode a request before any interceptor runs, so a body of garbage
bytes was answered UNKNOWN with the parser's exception text even without a
token. Every wrapped method therefore receives raw bytes, and the door decodes
them after identity: authentication comes first, and a body that does not decode
is INVALID_ARGUMENT with a plain message.

Health reports SERVING only while the service's own readiness check passes (its
database reachable and migrated), re-checked every few seconds.

An UNAVAILABLE the service answers itself carries server pushback "do not retry"
(`grpc-retry-pushback-ms: -1`): clients retry UNAVAILABLE only when a replica is
gone, not when a live one reports a dependency down (cairn_libs.service_config).

Connections have a maximum age (CAIRN_GRPC_MAX_CONNECTION_AGE_SECONDS): a client
balancing round robin over a headless Service keeps its subchannels for as long as
they live, so without an age the replicas an autoscaler adds would get no traffic
from clients already connected. At the age the server sends GOAWAY; new calls go
over a fresh connection (re-resolving the name), and calls in flight get
CAIRN_GRPC_MAX_CONNECTION_AGE_GRACE_SECONDS to finish.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, runtime_checkable

import grpc
import structlog
from google.protobuf import duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from opentelemetry.instrumentation.grpc import aio_server_interceptor

from cairn_libs import door
from cairn_libs.clients import max_reconnect_backoff_ms
from cairn_libs.db import CONNECTION_ERRORS
from cairn_libs.errors import (
    DENIAL_CODE,
    DENIAL_MESSAGE,
    CairnError,
    ConfigurationError,
    Denied,
    DependencyUnavailable,
    InvalidInput,
    Unauthenticated,
    status_for,
)
from cairn_libs.identity import (
    ACTOR_METADATA_KEY,
    CALLER_METADATA_KEY,
    CallIdentity,
    TokenVerifier,
)
from cairn_libs.settings import positive_number
from cairn_libs.telemetry import (
    configure_logging,
    configure_tracing,
    current_run_id,
    shutdown_tracing,
)

log = structlog.get_logger("cairn.server")

_identity: contextvars.ContextVar[CallIdentity | None] = contextvars.ContextVar(
    "cairn_identity", default=None
)
_raw_tokens: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar(
    "cairn_raw_tokens", default=("", "")
)

UNAUTHENTICATED_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def current_identity() -> CallIdentity:
    identity = _identity.get()
    if identity is None:
        # Only reachable if a method was served without the identity interceptor.
        raise Unauthenticated("no verified caller")
    return identity


def current_caller_token() -> str:
    """The caller's own token, so an acting service can call others with it (I1)."""
    return _raw_tokens.get()[0]


class ServiceApp(Protocol):
    """What a service gives the bootstrap: its servicers and its readiness."""

    name: str

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        """Add servicers; return their full service names (for health and reflection)."""
        ...

    async def start(self) -> None:
        """Begin connecting to dependencies; must not block on them being up."""
        ...

    async def ready(self) -> bool:
        """True only when every dependency this service needs is usable right now."""
        ...

    async def stop(self) -> None: ...


@runtime_checkable
class ChecksItemsItself(Protocol):
    """A service that checks some repeated request fields item by item, so one bad
    item fails alone (a batch of documents) instead of the whole call. The door
    skips those fields; the servicer calls `cairn_libs.door.violations` per item."""

    per_item_fields: Mapping[str, Collection[str]]
    """Full method name (`/pkg.Service/Method`) -> top-level request field names."""


Around = Callable[
    [grpc.HandlerCallDetails, grpc.aio.ServicerContext[Any, Any]], AbstractAsyncContextManager[None]
]


def _wrap_handler(
    handler: grpc.RpcMethodHandler[Any, Any], details: grpc.HandlerCallDetails, around: Around
) -> grpc.RpcMethodHandler[Any, Any]:
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            async with around(details, context):
                return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            async with around(details, context):
                async for item in inner_us(request, context):  # type: ignore[attr-defined]
                    yield item

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(request_iterator: Any, context: Any) -> Any:
            async with around(details, context):
                return await inner_su(request_iterator, context)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary, handler.request_deserializer, handler.response_serializer
        )
    inner_ss = handler.stream_stream
    assert inner_ss is not None

    async def stream_stream(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async with around(details, context):
            async for item in inner_ss(request_iterator, context):  # type: ignore[attr-defined]
                yield item

    return grpc.stream_stream_rpc_method_handler(
        stream_stream, handler.request_deserializer, handler.response_serializer
    )


class _AroundInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, around: Around) -> None:
        self._around = around

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(
            UNAUTHENTICATED_METHOD_PREFIXES
        ):
            return handler
        return _wrap_handler(handler, handler_call_details, self._around)


class _DoorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Innermost: takes the bytes every outer layer passed through untouched,
    decodes them with the method's own deserializer, and checks the message."""

    def __init__(self, per_item_fields: Mapping[str, Collection[str]]) -> None:
        self._per_item_fields = per_item_fields

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler.request_deserializer is None
            or handler_call_details.method.startswith(UNAUTHENTICATED_METHOD_PREFIXES)
        ):
            return handler
        skip = frozenset(self._per_item_fields.get(handler_call_details.method, ()))
        return _decoding_handler(handler, handler.request_deserializer, skip)


def _request_type_name(deserializer: Callable[[bytes], Any]) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return str(descriptor.full_name) if descriptor is not None else "request"


def _decoder(deserializer: Callable[[bytes], Any], skip: Collection[str]) -> Callable[[bytes], Any]:
    type_name = _request_type_name(deserializer)

    def decode(raw: bytes) -> Any:
        try:
            request = deserializer(raw)
        except Exception:
            # The parser's own text names internals; the caller needs only this.
            raise InvalidInput(
                f"the request body is not a valid {type_name} message; "
                f"send a serialized {type_name}"
            ) from None
        if isinstance(request, Message):
            door.check(request, skip=skip)
        return request

    return decode


def _decoding_handler(
    handler: grpc.RpcMethodHandler[Any, Any],
    deserializer: Callable[[bytes], Any],
    skip: Collection[str],
) -> grpc.RpcMethodHandler[Any, Any]:
    decode = _decoder(deserializer, skip)

    async def decoded(request_iterator: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        # Each streamed message is decoded and checked as it arrives.
        async for raw in request_iterator:
            yield decode(raw)

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(raw: bytes, context: Any) -> Any:
            return await inner_uu(decode(raw), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(raw: bytes, context: Any) -> AsyncIterator[Any]:
            request = decode(raw)
            async for item in inner_us(request, context):  # type: ignore[attr-defined]
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, None, handler.response_serializer)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(request_iterator: Any, context: Any) -> Any:
            return await inner_su(decoded(request_iterator), context)  # type: ignore[arg-type]

        return grpc.stream_unary_rpc_method_handler(stream_unary, None, handler.response_serializer)
    inner_ss = handler.stream_stream
    assert inner_ss is not None

    async def stream_stream(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async for item in inner_ss(decoded(request_iterator), context):  # type: ignore[attr-defined,arg-type]
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, None, handler.response_serializer)


def door_interceptor(
    per_item_fields: Mapping[str, Collection[str]] | None = None,
) -> grpc.aio.ServerInterceptor:  # type: ignore[type-arg]
    return _DoorInterceptor(per_item_fields or {})


def _metadata_value(context: grpc.aio.ServicerContext[Any, Any], key: str) -> str:
    for item in context.invocation_metadata() or ():
        item_key, value = item[0], item[1]
        if item_key == key:
            return value.decode() if isinstance(value, bytes) else value
    return ""


def _bearer(value: str, *, key: str) -> str:
    """The token of `Bearer <token>`; "" when the metadata is absent."""
    if not value:
        return ""
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        # Say what was wrong: a bare token is the common mistake, and "missing"
        # sent people looking for a header they had set.
        raise Unauthenticated(f"{key} metadata must be 'Bearer <token>'")
    return token.strip()


def identity_interceptor(verifier: TokenVerifier) -> grpc.aio.ServerInterceptor:  # type: ignore[type-arg]
    @asynccontextmanager
    async def around(
        _details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[None]:
        caller_token = _bearer(
            _metadata_value(context, CALLER_METADATA_KEY), key=CALLER_METADATA_KEY
        )
        if not caller_token:
            raise Unauthenticated(
                f"missing bearer token: send {CALLER_METADATA_KEY!r} metadata as 'Bearer <token>'"
            )
        principal = verifier.verify_caller(caller_token)
        actor = None
        # A malformed actor credential is refused, not ignored: ignoring it would
        # record an agent's write as the person's own.
        actor_token = _bearer(_metadata_value(context, ACTOR_METADATA_KEY), key=ACTOR_METADATA_KEY)
        if actor_token:
            actor = verifier.verify_actor(actor_token)
        identity_token = _identity.set(CallIdentity(principal=principal, actor=actor))
        raw_token = _raw_tokens.set((caller_token, actor_token))
        structlog.contextvars.bind_contextvars(org_id=principal.org_id, user_id=principal.user_id)
        # A call made inside a run carries the run in its actor token; every log line
        # of this call then names the run (STYLE: trace_id and run_id on every line).
        run_token = current_run_id.set(actor.run_id) if actor is not None else None
        try:
            yield
        finally:
            if run_token is not None:
                current_run_id.reset(run_token)
            structlog.contextvars.unbind_contextvars("org_id", "user_id")
            _raw_tokens.reset(raw_token)
            _identity.reset(identity_token)

    return _AroundInterceptor(around)


DENIAL_REASON = "DENIED"


def to_rpc_status(exc: BaseException) -> grpc.Status:
    if isinstance(exc, Denied):
        # I6: whichever subclass a service raised, and whatever it carries, a
        # denial reads the same everywhere, google.rpc details included.
        status = status_pb2.Status(code=getattr(code_pb2, DENIAL_CODE.name), message=DENIAL_MESSAGE)
        status.details.add().Pack(error_details_pb2.ErrorInfo(reason=DENIAL_REASON, domain="cairn"))
        return rpc_status.to_status(status)
    code, message = status_for(exc)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    info = error_details_pb2.ErrorInfo(
        reason=type(exc).__name__.upper() if isinstance(exc, CairnError) else "INTERNAL",
        domain="cairn",
    )
    status.details.add().Pack(info)
    if isinstance(exc, CairnError) and exc.retry_after_seconds is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(exc.retry_after_seconds * 1e9))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    mapped = rpc_status.to_status(status)
    if mapped.code is grpc.StatusCode.UNAVAILABLE:
        # Said by a live replica about a dependency its peers share: a client's retry
        # policy (cairn_libs.service_config) must not send it again to another one.
        return _Status(
            mapped.code,
            mapped.details,
            (*mapped.trailing_metadata, (RETRY_PUSHBACK_KEY, NO_RETRY_PUSHBACK)),
        )
    return mapped


RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
# Negative: "do not retry" (gRFC A6, server pushback).
NO_RETRY_PUSHBACK = "-1"


class _Status(grpc.Status):
    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing_metadata: tuple[tuple[str, str | bytes], ...],
    ) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


# The database connection errors of CONNECTION_ERRORS; not every OSError, which a
# bug reading a file raises too.
_DATABASE_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError,
    *(e for e in CONNECTION_ERRORS if e not in (OSError, TimeoutError)),
)


def error_mapping_interceptor() -> grpc.aio.ServerInterceptor:  # type: ignore[type-arg]
    @asynccontextmanager
    async def around(
        details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[None]:
        try:
            yield
        except grpc.aio.AbortError:
            raise
        except CairnError as exc:
            status = to_rpc_status(exc)
            if isinstance(exc, Unauthenticated):
                # Refused before identity: the access log (inside identity) never saw it.
                log.info(
                    "rpc.refused",
                    method=details.method,
                    code=status.code.name,
                    reason="Unauthenticated",
                )
            await context.abort(status.code, status.details, status.trailing_metadata)
        except _DATABASE_CONNECTION_ERRORS as exc:
            # An adapter should have translated this; left untranslated it is still a
            # dependency that did not answer, which a caller must hear as UNAVAILABLE
            # (a database restart is not a bug of ours), and the log keeps the trace.
            log.exception("rpc.dependency_error_untranslated", method=details.method)
            status = to_rpc_status(
                DependencyUnavailable(
                    f"a dependency of this service did not answer ({type(exc).__name__}); "
                    "retry shortly"
                )
            )
            await context.abort(status.code, status.details, status.trailing_metadata)
        except Exception as exc:
            log.exception("rpc.failed", method=details.method)
            status = to_rpc_status(exc)
            await context.abort(status.code, status.details, status.trailing_metadata)

    return _AroundInterceptor(around)


def access_log_interceptor() -> grpc.aio.ServerInterceptor:  # type: ignore[type-arg]
    """One line per call, inside identity so it carries org, user and run."""

    @asynccontextmanager
    async def around(
        details: grpc.HandlerCallDetails, _context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[None]:
        started = time.perf_counter()
        try:
            yield
        except CairnError as exc:
            log.info(
                "rpc.refused",
                method=details.method,
                code=exc.code.name,
                reason=type(exc).__name__,
                duration_ms=round((time.perf_counter() - started) * 1000, 2),
            )
            raise
        else:
            log.info(
                "rpc.ok",
                method=details.method,
                duration_ms=round((time.perf_counter() - started) * 1000, 2),
            )

    return _AroundInterceptor(around)


def listen_address(default_port: int) -> str:
    host = os.environ.get("CAIRN_HOST", "127.0.0.1")
    raw = os.environ.get("CAIRN_PORT", str(default_port))
    if not raw.strip().isdigit() or not 0 < int(raw) < 65536:
        raise ConfigurationError(f"CAIRN_PORT={raw!r} is not a port; give a number from 1 to 65535")
    return f"{host}:{int(raw)}"


def seconds_setting(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable `name`."""
    return positive_number(name, default, unit="number of seconds")


MAX_CONNECTION_AGE_ENV = "CAIRN_GRPC_MAX_CONNECTION_AGE_SECONDS"
MAX_CONNECTION_AGE_GRACE_ENV = "CAIRN_GRPC_MAX_CONNECTION_AGE_GRACE_SECONDS"
DEFAULT_MAX_CONNECTION_AGE_SECONDS = 300.0
# Long enough for a run's event stream to finish on the old connection.
DEFAULT_MAX_CONNECTION_AGE_GRACE_SECONDS = 600.0


def server_options() -> list[tuple[str, int]]:
    """The options of every cairn gRPC server; a bad setting is a ConfigurationError."""
    age = seconds_setting(MAX_CONNECTION_AGE_ENV, DEFAULT_MAX_CONNECTION_AGE_SECONDS)
    grace = seconds_setting(MAX_CONNECTION_AGE_GRACE_ENV, DEFAULT_MAX_CONNECTION_AGE_GRACE_SECONDS)
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_connection_age_ms", max(1, round(age * 1000))),
        ("grpc.max_connection_age_grace_ms", max(1, round(grace * 1000))),
    ]


async def serve(app: ServiceApp, *, address: str, verifier: TokenVerifier) -> None:
    """Serve until SIGTERM/SIGINT; then report NOT_SERVING, drain, and stop."""
    server = grpc.aio.server(
        interceptors=[
            aio_server_interceptor(),  # type: ignore[no-untyped-call]
            error_mapping_interceptor(),
            identity_interceptor(verifier),
            access_log_interceptor(),
            door_interceptor(app.per_item_fields if isinstance(app, ChecksItemsItself) else None),
        ],
        options=server_options(),
    )
    interval = seconds_setting("CAIRN_HEALTH_INTERVAL_SECONDS", 1.0)
    grace = seconds_setting("CAIRN_SHUTDOWN_GRACE_SECONDS", 5.0)
    names = list(app.register(server))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    # grpcio's HealthServicer starts with the server itself SERVING; nothing is ready
    # until the first readiness check says so.
    for name in ["", *names]:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ConfigurationError(
            f"could not listen on {address!r} (in use, or not an address of this host); "
            "set CAIRN_HOST and CAIRN_PORT"
        )
    await app.start()
    await server.start()
    log.info("service.listening", service=app.name, address=address)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    refused: list[ConfigurationError] = []

    async def watch_readiness() -> None:
        last: bool | None = None
        while True:
            try:
                ok = await asyncio.wait_for(app.ready(), timeout=max(interval, 1.0) * 2)
            except ConfigurationError as exc:
                # Found only once the database answers (an edited migration): the
                # service cannot serve as configured, so it stops and says why.
                refused.append(exc)
                stop.set()
                return
            except Exception:
                ok = False
            if ok != last:
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if ok
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for name in ["", *names]:
                    await health.set(name, status)
                log.info("service.health", service=app.name, serving=ok)
                last = ok
            await asyncio.sleep(interval)

    watcher = asyncio.create_task(watch_readiness())
    await stop.wait()
    log.info("service.stopping", service=app.name)
    watcher.cancel()
    await health.enter_graceful_shutdown()
    await server.stop(grace=grace)
    await app.stop()
    if refused:
        raise refused[0]
    shutdown_tracing()
    log.info("service.stopped", service=app.name)


CONFIG_INVALID_EXIT_CODE = 2


def run_service(app_factory: Callable[[], ServiceApp], *, default_port: int) -> None:
    """The body of every service's `__main__`.

    A configuration error (a misspelt key, a missing file) is one JSON line like
    every other event, `service.config_invalid` with its message, and the process
    exits 2: an operator reads what to fix, not a traceback through our start-up.
    Any other exception is one `service.start_failed` line (traceback inside) and
    exit 1.
    """
    probe = app_factory.__module__.split(".")[0]
    configure_logging(probe)
    configure_tracing(probe)
    try:
        address = listen_address(default_port)
        max_reconnect_backoff_ms()  # read lazily by channels; refused here, at start-up
        server_options()
        verifier = TokenVerifier.from_env()
        app = app_factory()
        asyncio.run(serve(app, address=address, verifier=verifier))
    except ConfigurationError as exc:
        log.error("service.config_invalid", error=str(exc))
        shutdown_tracing()
        sys.exit(CONFIG_INVALID_EXIT_CODE)
    except Exception:
        # Not a known configuration error (a service that still raises RuntimeError
        # for a setting, or a bug): still one JSON line, with the traceback inside it.
        log.exception("service.start_failed")
        shutdown_tracing()
        sys.exit(1)
