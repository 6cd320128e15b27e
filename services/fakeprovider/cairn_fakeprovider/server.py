"""How does the fake provider answer HTTP, and how do tests steer it?

Handlers stay thin: read the body, check the key, parse it (chat_wire), take the next
scripted step or the default plan (demo_model), and write. The misbehaviours that
need the socket itself (hanging, cutting a body short, sending broken JSON) live here
because they are I/O by nature; everything they send is rendered by pure code.

A scripted step is spent only by a chat request that passed the key check and
validation, so a test's deliberately bad request never swallows the fault it queued
for the next call.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import structlog
from aiohttp import web

from .chat_wire import (
    DONE_EVENT,
    ChatRequest,
    ReplyIds,
    error_body,
    parse_chat_request,
    render_chunks,
    render_completion,
    sse_event,
)
from .demo_model import plan_reply
from .embeddings import parse_embeddings_request, render_embeddings
from .errors import FakeProviderError, RequestRejected, ScriptRejected
from .reply import MODEL_ID, Reply
from .script import (
    AnswerStep,
    CutStreamStep,
    HangStep,
    MalformedStep,
    StatusStep,
    Step,
    ToolCallStep,
    parse_script,
)

_log: structlog.typing.FilteringBoundLogger = structlog.get_logger("cairn_fakeprovider")

HandledAs = Literal[
    "pending",
    "unauthorized",
    "rejected",
    "default",
    "answer",
    "tool_call",
    "status",
    "hang",
    "cut_stream",
    "malformed",
    "embeddings",
]

# Long benchmark runs would otherwise grow the log without bound; tests never come
# near this many requests between resets.
_REQUEST_LOG_LIMIT = 10_000
_SENSITIVE_HEADERS = frozenset({"authorization", "api-key", "x-api-key", "cookie"})
_MODEL_CREATED = 1_767_225_600

# (type, code, message) per status, in the vendor's own words where it has them.
_STATUS_ERRORS: dict[int, tuple[str, str, str]] = {
    400: ("invalid_request_error", "invalid_request", "The request was invalid."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("permission_error", "permission_denied", "You are not allowed to use this model."),
    404: (
        "invalid_request_error",
        "model_not_found",
        "The model does not exist or you do not have access to it.",
    ),
    408: ("timeout_error", "request_timeout", "The request timed out."),
    409: ("conflict_error", "conflict", "The request conflicts with another request."),
    422: ("invalid_request_error", "unprocessable_entity", "The request could not be processed."),
    429: (
        "requests",
        "rate_limit_exceeded",
        "Rate limit reached for requests. Please try again later.",
    ),
    500: (
        "server_error",
        "server_error",
        "The server had an error while processing your request. Sorry about that!",
    ),
    502: ("server_error", "bad_gateway", "Bad gateway."),
    503: (
        "server_error",
        "service_unavailable",
        "The engine is currently overloaded, please try again later.",
    ),
    504: ("server_error", "gateway_timeout", "The upstream model timed out."),
}

# Cut mid-object on purpose: the HTTP exchange is fine, only the JSON is not.
_BROKEN_COMPLETION = (
    b'{"id": "chatcmpl-malformed", "object": "chat.completion", "choices": '
    b'[{"index": 0, "message": {"role": "assistant", "content": "[offline demo'
)
_BROKEN_CHUNK = (
    b'data: {"id": "chatcmpl-malformed", "object": "chat.completion.chunk", '
    b'"choices": [{"index": 0, "delta": {"content": "[offline\n\n'
)


@dataclass(frozen=True)
class ProviderSettings:
    name: str = "fakeprovider"
    require_key: str | None = None
    latency_seconds: float = 0.0


@dataclass
class ReceivedRequest:
    seq: int
    method: str
    path: str
    received_at: float
    headers: dict[str, str]
    authorization_present: bool
    body: object
    body_is_json: bool
    body_text: str | None
    handled_as: HandledAs = "pending"

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "seq": self.seq,
            "method": self.method,
            "path": self.path,
            "received_at": self.received_at,
            "headers": self.headers,
            "authorization_present": self.authorization_present,
            "body": self.body if self.body_is_json else None,
            "handled_as": self.handled_as,
        }
        if not self.body_is_json:
            entry["body_text"] = self.body_text
        return entry


@dataclass
class ProviderState:
    settings: ProviderSettings
    script: deque[Step] = field(default_factory=deque)
    received: deque[ReceivedRequest] = field(
        default_factory=lambda: deque(maxlen=_REQUEST_LOG_LIMIT)
    )
    _sequence: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def next_step(self) -> Step | None:
        return self.script.popleft() if self.script else None

    def record(self, request: web.Request, raw: bytes) -> ReceivedRequest:
        headers: dict[str, str] = {}
        for name, value in request.headers.items():
            key = name.lower()
            shown = "[redacted]" if key in _SENSITIVE_HEADERS else value
            headers[key] = f"{headers[key]}, {shown}" if key in headers else shown
        body: object = None
        body_is_json = True
        try:
            body = json.loads(raw)
        except ValueError:
            body_is_json = False
        entry = ReceivedRequest(
            seq=next(self._sequence),
            method=request.method,
            path=request.path,
            received_at=time.time(),
            headers=headers,
            authorization_present="Authorization" in request.headers,
            body=body,
            body_is_json=body_is_json,
            body_text=None if body_is_json else raw[:4096].decode("utf-8", "replace"),
        )
        self.received.append(entry)
        return entry


STATE_KEY = web.AppKey("provider_state", ProviderState)
T = TypeVar("T")


def openai_error(
    status: int,
    message: str,
    *,
    error_type: str,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.json_response(
        error_body(message, error_type=error_type, code=code, param=param),
        status=status,
        headers=headers,
    )


def _rejection(exc: FakeProviderError, *, code: str) -> web.Response:
    return openai_error(
        400, exc.message, error_type="invalid_request_error", code=code, param=exc.param
    )


def _refuse_key(request: web.Request, settings: ProviderSettings) -> web.Response | None:
    if settings.require_key is None:
        return None
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), settings.require_key.encode()
    ):
        return None
    # Never echo the key back: the request log and error bodies end up in test output.
    message = (
        "Incorrect API key provided."
        if header
        else "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
    )
    return openai_error(401, message, error_type="invalid_request_error", code="invalid_api_key")


def _fresh_ids(reply: Reply) -> ReplyIds:
    return ReplyIds(
        completion_id=f"chatcmpl-{secrets.token_hex(12)}",
        created=int(time.time()),
        tool_call_ids=tuple(f"call_{secrets.token_hex(12)}" for _ in reply.tool_calls),
    )


async def _latency(settings: ProviderSettings) -> None:
    if settings.latency_seconds > 0:
        await asyncio.sleep(settings.latency_seconds)


def _scripted_status(step: StatusStep) -> web.Response:
    fallback = (
        ("server_error", "server_error", "The server had an error.")
        if step.status >= 500
        else ("invalid_request_error", f"http_{step.status}", "The request failed.")
    )
    error_type, code, message = _STATUS_ERRORS.get(step.status, fallback)
    headers: dict[str, str] = {}
    if step.retry_after is not None:
        headers["Retry-After"] = str(step.retry_after)
    if step.retry_after_ms is not None:
        headers["retry-after-ms"] = str(step.retry_after_ms)
    return openai_error(
        step.status,
        step.message or message,
        error_type=error_type,
        code=step.code or code,
        headers=headers,
    )


async def _open_event_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers={"Cache-Control": "no-cache"})
    response.content_type = "text/event-stream"
    await response.prepare(request)
    return response


async def _stream(
    request: web.Request, chat: ChatRequest, reply: Reply, ids: ReplyIds
) -> web.StreamResponse:
    response = await _open_event_stream(request)
    try:
        for chunk in render_chunks(chat, reply, ids=ids).all_chunks():
            await response.write(sse_event(chunk))
        await response.write(DONE_EVENT)
    except ConnectionResetError:
        pass  # the client left mid-stream; there is nobody to tell
    return response


def _drop_connection(request: web.Request) -> None:
    # close() (not abort()) so the partial body already written reaches the client
    # before the FIN; aiohttp's own write_eof then fails quietly on the closed socket.
    transport = request.transport
    if transport is not None:
        transport.close()


async def _cut(
    request: web.Request, chat: ChatRequest, reply: Reply, ids: ReplyIds, *, after_chunks: int
) -> web.StreamResponse:
    if chat.stream:
        stream = render_chunks(chat, reply, ids=ids)
        response = await _open_event_stream(request)
        pieces = [sse_event(chunk) for chunk in (stream.opening, *stream.body[:after_chunks])]
    else:
        payload = json.dumps(render_completion(chat, reply, ids=ids)).encode()
        response = web.StreamResponse(status=200)
        response.content_type = "application/json"
        response.content_length = len(payload)
        await response.prepare(request)
        pieces = [payload[: len(payload) // 2]]
    try:
        for piece in pieces:
            await response.write(piece)
    except ConnectionResetError:
        pass
    _drop_connection(request)
    return response


async def _malformed(request: web.Request, chat: ChatRequest) -> web.StreamResponse:
    if not chat.stream:
        return web.Response(status=200, body=_BROKEN_COMPLETION, content_type="application/json")
    response = await _open_event_stream(request)
    try:
        await response.write(_BROKEN_CHUNK)
        await response.write(DONE_EVENT)
    except ConnectionResetError:
        pass
    return response


async def _admitted(
    request: web.Request, parse: Callable[[Any], T]
) -> tuple[ProviderState, ReceivedRequest, T] | web.Response:
    """Every vendor endpoint's start: record the request, check its key, parse its
    JSON body; or the refusal a vendor would send."""
    state = request.app[STATE_KEY]
    entry = state.record(request, await request.read())
    refusal = _refuse_key(request, state.settings)
    if refusal is not None:
        entry.handled_as = "unauthorized"
        return refusal
    try:
        if not entry.body_is_json:
            raise RequestRejected(
                "We could not parse the JSON body of your request; send a JSON object.",
                code="invalid_json",
            )
        return state, entry, parse(entry.body)
    except RequestRejected as exc:
        entry.handled_as = "rejected"
        return _rejection(exc, code=exc.code)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    admitted = await _admitted(request, parse_chat_request)
    if isinstance(admitted, web.Response):
        return admitted
    state, entry, chat = admitted

    step = state.next_step()
    entry.handled_as = "default" if step is None else step.action
    _log.info("chat_request", handled_as=entry.handled_as, stream=chat.stream, model=chat.model)
    await _latency(state.settings)

    if isinstance(step, StatusStep):
        if step.after_seconds:
            await asyncio.sleep(step.after_seconds)
        return _scripted_status(step)
    if isinstance(step, MalformedStep):
        return await _malformed(request, chat)
    if isinstance(step, HangStep):
        # The client is meant to time out first; when it disconnects the handler is
        # cancelled (handler_cancellation in __main__), so nothing keeps sleeping.
        await asyncio.sleep(step.seconds)
    planned = step.reply() if isinstance(step, AnswerStep | ToolCallStep) else plan_reply(chat)
    reply = planned.limited_to(chat.max_tokens)
    ids = _fresh_ids(reply)
    if isinstance(step, CutStreamStep):
        return await _cut(request, chat, reply, ids, after_chunks=step.after_chunks)
    if chat.stream:
        return await _stream(request, chat, reply, ids)
    return web.json_response(render_completion(chat, reply, ids=ids))


async def embeddings(request: web.Request) -> web.StreamResponse:
    admitted = await _admitted(request, parse_embeddings_request)
    if isinstance(admitted, web.Response):
        return admitted
    state, entry, parsed = admitted
    entry.handled_as = "embeddings"
    await _latency(state.settings)
    return web.json_response(render_embeddings(parsed))


def _model_object(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": _MODEL_CREATED, "owned_by": "cairn"}


async def list_models(request: web.Request) -> web.StreamResponse:
    refusal = _refuse_key(request, request.app[STATE_KEY].settings)
    if refusal is not None:
        return refusal
    return web.json_response({"object": "list", "data": [_model_object(MODEL_ID)]})


async def retrieve_model(request: web.Request) -> web.StreamResponse:
    refusal = _refuse_key(request, request.app[STATE_KEY].settings)
    if refusal is not None:
        return refusal
    # Any model name is accepted in requests, so any name "exists".
    return web.json_response(_model_object(request.match_info["model"]))


def _script_summary(state: ProviderState) -> dict[str, Any]:
    return {"queued": len(state.script), "actions": [step.action for step in state.script]}


async def queue_script(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        try:
            body: object = json.loads(await request.read())
        except ValueError as exc:
            raise ScriptRejected(f"The script is not valid JSON: {exc}.") from exc
        steps = parse_script(body)
    except ScriptRejected as exc:
        return _rejection(exc, code="invalid_script")
    state.script.extend(steps)
    return web.json_response(_script_summary(state))


async def show_script(request: web.Request) -> web.StreamResponse:
    return web.json_response(_script_summary(request.app[STATE_KEY]))


async def reset(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    state.script.clear()
    state.received.clear()
    return web.json_response(_script_summary(state))


async def received_requests(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    return web.json_response({"requests": [entry.to_json() for entry in state.received]})


def build_app(settings: ProviderSettings) -> web.Application:
    # Fenced knowledge can make prompts large; the vendor takes far more than
    # aiohttp's 1 MiB default.
    app = web.Application(client_max_size=32 * 1024 * 1024)
    app[STATE_KEY] = ProviderState(settings=settings)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_post("/_control/script", queue_script)
    app.router.add_get("/_control/script", show_script)
    app.router.add_post("/_control/reset", reset)
    app.router.add_get("/_control/requests", received_requests)
    return app
