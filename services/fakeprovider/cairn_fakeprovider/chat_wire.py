"""Is this a valid OpenAI chat-completions request, and how does a reply look on the wire?

Parsing is strict where the real vendor is strict (roles, tool-call pairing,
`stream_options` without `stream`), so a caller bug that OpenAI would answer with 400
fails here too instead of first showing up in production. Unknown top-level keys
(temperature, user, seed, ...) are ignored, as the vendor accepts many we do not
model. Rendering is pure: ids and timestamps are passed in, so a test can compare
whole objects.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from cairn_libs.token_estimate import tokens_for_chars

from .errors import RequestRejected
from .reply import Reply

Role = Literal["system", "developer", "user", "assistant", "tool"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
ToolChoice = Literal["auto", "none", "required"]

_ROLES: tuple[str, ...] = get_args(Role)
_REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SYSTEM_FINGERPRINT = "fp_cairn_offline"
# A handful of chunks is enough to exercise a client's reassembly; one chunk per word
# would make long answers needlessly chatty.
_MAX_CONTENT_PIECES = 8
_MAX_ARGUMENT_PIECES = 4


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: Mapping[str, object]


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = "auto"
    forced_tool: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    reasoning_effort: ReasoningEffort | None = None

    def offers_tool(self, name: str) -> bool:
        return any(tool.name == name for tool in self.tools)


@dataclass(frozen=True)
class ReplyIds:
    """The parts of a response that differ on every call, chosen by the caller."""

    completion_id: str
    created: int
    tool_call_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChunkStream:
    """A streamed reply, split where a cut can happen: after some `body` chunks."""

    opening: dict[str, Any]
    body: tuple[dict[str, Any], ...]
    closing: dict[str, Any]
    usage: dict[str, Any] | None

    def all_chunks(self) -> list[dict[str, Any]]:
        tail = [self.closing] if self.usage is None else [self.closing, self.usage]
        return [self.opening, *self.body, *tail]


DONE_EVENT = b"data: [DONE]\n\n"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def parse_chat_request(body: object) -> ChatRequest:
    """Validate a decoded JSON body; raise RequestRejected the way the vendor would."""
    if not isinstance(body, dict):
        raise RequestRejected(
            f"The request body must be a JSON object, got {_type_name(body)}.",
            code="invalid_type",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestRejected(
            f"'model' must be a non-empty string, got {_shown(model)}.",
            param="model",
            code="missing_required_parameter" if model is None else "invalid_type",
        )
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RequestRejected(
            f"'messages' must be a non-empty array of message objects, got {_shown(raw_messages)}.",
            param="messages",
            code="missing_required_parameter" if raw_messages is None else "invalid_type",
        )
    messages = tuple(
        _parse_message(raw, param=f"messages[{index}]") for index, raw in enumerate(raw_messages)
    )
    _check_tool_call_pairing(messages)
    tools = _parse_tools(body.get("tools"))
    tool_choice, forced_tool = _parse_tool_choice(body.get("tool_choice"), tools)
    max_tokens = _optional_positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_positive_int(body, "max_tokens")
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestRejected(
            f"'stream' must be a boolean, got {_shown(stream)}.",
            param="stream",
            code="invalid_type",
        )
    include_usage = _parse_stream_options(body.get("stream_options"), stream=stream)
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in _REASONING_EFFORTS:
        raise RequestRejected(
            f"'reasoning_effort' must be one of {', '.join(_REASONING_EFFORTS)}, got {_shown(effort)}.",
            param="reasoning_effort",
        )
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        forced_tool=forced_tool,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        reasoning_effort=effort,
    )


def _parse_message(raw: object, *, param: str) -> ChatMessage:
    if not isinstance(raw, dict):
        raise RequestRejected(
            f"'{param}' must be a message object, got {_type_name(raw)}.",
            param=param,
            code="invalid_type",
        )
    role = raw.get("role")
    if role not in _ROLES:
        raise RequestRejected(
            f"'{param}.role' must be one of {', '.join(_ROLES)}, got {_shown(role)}.",
            param=f"{param}.role",
        )
    tool_calls = _parse_tool_calls(raw.get("tool_calls"), param=f"{param}.tool_calls", role=role)
    content = _parse_content(
        raw.get("content"), param=f"{param}.content", nullable=role == "assistant"
    )
    tool_call_id: str | None = None
    if role == "tool":
        tool_call_id = raw.get("tool_call_id")
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise RequestRejected(
                f"'{param}.tool_call_id' must be the id of the call this message answers, "
                f"got {_shown(tool_call_id)}.",
                param=f"{param}.tool_call_id",
                code="missing_required_parameter",
            )
    return ChatMessage(role=role, content=content, tool_calls=tool_calls, tool_call_id=tool_call_id)


def _parse_content(raw: object, *, param: str, nullable: bool) -> str:
    if raw is None and nullable:
        return ""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        texts: list[str] = []
        for index, part in enumerate(raw):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestRejected(
                    f"'{param}[{index}]' must be a content part with a 'type', got {_shown(part)}.",
                    param=f"{param}[{index}]",
                    code="invalid_type",
                )
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise RequestRejected(
                        f"'{param}[{index}].text' must be a string, got {_shown(text)}.",
                        param=f"{param}[{index}].text",
                        code="invalid_type",
                    )
                texts.append(text)
        return "\n".join(texts)
    raise RequestRejected(
        f"'{param}' must be a string or an array of content parts, got {_type_name(raw)}.",
        param=param,
        code="invalid_type",
    )


def _parse_tool_calls(raw: object, *, param: str, role: object) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if role != "assistant":
        raise RequestRejected(
            f"'{param}' is only allowed on assistant messages, not on role {_shown(role)}.",
            param=param,
        )
    if not isinstance(raw, list) or not raw:
        raise RequestRejected(
            f"'{param}' must be a non-empty array of tool calls, got {_shown(raw)}.",
            param=param,
            code="invalid_type",
        )
    calls: list[ToolCall] = []
    for index, call in enumerate(raw):
        where = f"{param}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise RequestRejected(
                f"'{where}' must be {{'id': str, 'type': 'function', 'function': "
                f"{{'name': str, 'arguments': str}}}}, got {_shown(call)}.",
                param=where,
                code="invalid_type",
            )
        calls.append(
            ToolCall(id=call["id"], name=function["name"], arguments=function["arguments"])
        )
    return tuple(calls)


def _check_tool_call_pairing(messages: tuple[ChatMessage, ...]) -> None:
    # The vendor insists every call is answered before the conversation moves on and
    # every tool message answers a call; an orchestrator that drops a result must fail.
    unanswered: list[str] = []
    for index, message in enumerate(messages):
        if message.role == "tool":
            if message.tool_call_id not in unanswered:
                raise RequestRejected(
                    f"'messages[{index}]' with role 'tool' must answer a tool call of the "
                    f"preceding assistant message; {message.tool_call_id!r} is not one of "
                    f"the unanswered ids {unanswered!r}.",
                    param=f"messages[{index}].tool_call_id",
                )
            unanswered.remove(message.tool_call_id)
            continue
        if unanswered:
            raise RequestRejected(
                "An assistant message with 'tool_calls' must be followed by tool messages "
                f"responding to each 'tool_call_id'; {unanswered!r} got no response before "
                f"messages[{index}].",
                param=f"messages[{index}].role",
            )
        unanswered = [call.id for call in message.tool_calls]
    if unanswered:
        raise RequestRejected(
            "An assistant message with 'tool_calls' must be followed by tool messages "
            f"responding to each 'tool_call_id'; {unanswered!r} got no response.",
            param="messages",
        )


def _parse_tools(raw: object) -> tuple[ToolSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestRejected(
            f"'tools' must be an array of function tools, got {_type_name(raw)}.",
            param="tools",
            code="invalid_type",
        )
    tools: list[ToolSpec] = []
    for index, tool in enumerate(raw):
        where = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
        ):
            raise RequestRejected(
                f"'{where}' must be {{'type': 'function', 'function': {{...}}}}, got {_shown(tool)}.",
                param=where,
                code="invalid_type",
            )
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise RequestRejected(
                f"'{where}.function.name' must match {_TOOL_NAME.pattern}, got {_shown(name)}.",
                param=f"{where}.function.name",
            )
        description = function.get("description", "")
        parameters = function.get("parameters", {})
        if not isinstance(description, str) or not isinstance(parameters, dict):
            raise RequestRejected(
                f"'{where}.function' needs a string 'description' and an object 'parameters', "
                f"got {_shown(function)}.",
                param=f"{where}.function",
                code="invalid_type",
            )
        tools.append(ToolSpec(name=name, description=description, parameters=parameters))
    return tuple(tools)


def _parse_tool_choice(raw: object, tools: tuple[ToolSpec, ...]) -> tuple[ToolChoice, str | None]:
    if raw is None:
        return "auto", None
    if raw == "auto" or raw == "none" or raw == "required":
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and any(tool.name == name for tool in tools):
            return "required", name
    raise RequestRejected(
        "'tool_choice' must be 'auto', 'none', 'required' or "
        f"{{'type': 'function', 'function': {{'name': <an offered tool>}}}}, got {_shown(raw)}.",
        param="tool_choice",
    )


def _optional_positive_int(body: Mapping[str, object], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestRejected(
            f"'{key}' must be a positive integer, got {_shown(value)}.", param=key
        )
    return value


def _parse_stream_options(raw: object, *, stream: bool) -> bool:
    if raw is None:
        return False
    if not stream:
        raise RequestRejected(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    include_usage = raw.get("include_usage", False) if isinstance(raw, dict) else None
    if not isinstance(include_usage, bool):
        raise RequestRejected(
            f"'stream_options' must be {{'include_usage': bool}}, got {_shown(raw)}.",
            param="stream_options",
            code="invalid_type",
        )
    return include_usage


# --- token accounting -------------------------------------------------------------


def token_estimate(text_length: int) -> int:
    """Four characters to a token (cairn_libs.token_estimate), never zero, as a vendor
    never reports a call that read or wrote nothing: close enough for budgets and ceilings."""
    return max(1, tokens_for_chars(text_length))


def prompt_tokens(request: ChatRequest) -> int:
    length = sum(
        len(message.content) + sum(len(call.arguments) for call in message.tool_calls)
        for message in request.messages
    )
    return token_estimate(length)


def usage_for(request: ChatRequest, reply: Reply) -> dict[str, Any]:
    prompt = prompt_tokens(request)
    completion = token_estimate(len(reply.completion_text))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


# --- rendering --------------------------------------------------------------------


def _wire_tool_calls(reply: Reply, ids: ReplyIds) -> list[dict[str, Any]]:
    return [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call, call_id in zip(reply.tool_calls, ids.tool_call_ids, strict=True)
    ]


def render_completion(request: ChatRequest, reply: Reply, *, ids: ReplyIds) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = _wire_tool_calls(reply, ids)
    return {
        "id": ids.completion_id,
        "object": "chat.completion",
        "created": ids.created,
        "model": request.model,
        "system_fingerprint": _SYSTEM_FINGERPRINT,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish_reason}
        ],
        "usage": usage_for(request, reply),
    }


def _even_groups(pieces: list[str], limit: int) -> list[str]:
    size = max(1, math.ceil(len(pieces) / limit))
    return ["".join(pieces[start : start + size]) for start in range(0, len(pieces), size)]


def content_pieces(text: str) -> list[str]:
    """Split text at word boundaries into a handful of pieces that join back to it."""
    words = re.findall(r"\s*\S+\s*", text)
    if not words:
        return [text] if text else []
    return _even_groups(words, _MAX_CONTENT_PIECES)


def argument_pieces(arguments: str) -> list[str]:
    if not arguments:
        return []
    return _even_groups(list(arguments), _MAX_ARGUMENT_PIECES)


def render_chunks(request: ChatRequest, reply: Reply, *, ids: ReplyIds) -> ChunkStream:
    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": ids.completion_id,
            "object": "chat.completion.chunk",
            "created": ids.created,
            "model": request.model,
            "system_fingerprint": _SYSTEM_FINGERPRINT,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if request.include_usage:
            payload["usage"] = None
        return payload

    opening_delta: dict[str, Any] = {"role": "assistant", "refusal": None}
    body: list[dict[str, Any]] = []
    if reply.content is not None or not reply.tool_calls:
        opening_delta["content"] = ""
        body.extend(chunk({"content": piece}) for piece in content_pieces(reply.content or ""))
    else:
        opening_delta["content"] = None
    for index, wire_call in enumerate(_wire_tool_calls(reply, ids)):
        header = {
            "index": index,
            "id": wire_call["id"],
            "type": "function",
            "function": {"name": wire_call["function"]["name"], "arguments": ""},
        }
        if index == 0 and not body:
            opening_delta["tool_calls"] = [header]
        else:
            body.append(chunk({"tool_calls": [header]}))
        body.extend(
            chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            for piece in argument_pieces(wire_call["function"]["arguments"])
        )
    usage: dict[str, Any] | None = None
    if request.include_usage:
        usage = {
            "id": ids.completion_id,
            "object": "chat.completion.chunk",
            "created": ids.created,
            "model": request.model,
            "system_fingerprint": _SYSTEM_FINGERPRINT,
            "choices": [],
            "usage": usage_for(request, reply),
        }
    return ChunkStream(
        opening=chunk(opening_delta),
        body=tuple(body),
        closing=chunk({}, reply.finish_reason),
        usage=usage,
    )


def sse_event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def error_body(
    message: str, *, error_type: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
