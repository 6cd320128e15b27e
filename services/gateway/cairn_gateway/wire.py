"""How a call looks in OpenAI chat-completions JSON, both ways, for every vendor.

Pure functions and one small assembler: a request body from a ChatRequest, a
Completion from a response body, a Completion from streamed chunks. No I/O here,
so each vendor quirk is a tested line rather than a branch in the HTTP code. The
one provider that speaks this protocol (`openai_compatible.py`) is its only user on
the call path; the failover loop never sees these bodies.
Tool-call arguments travel as the exact text the model produced; they are never
parsed and re-serialised, so nothing a caller relies on changes on the way.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, TypeGuard

from cairn_gateway.config import MaxTokensField
from cairn_gateway.domain import (
    ChatMessage,
    ChatRequest,
    Completion,
    ReasoningEffort,
    Route,
    ToolCall,
    Usage,
    estimate_prompt_tokens,
)

DONE_SENTINEL = "[DONE]"
_FLOAT32_MAX = 3.4028234663852886e38


class MalformedResponse(ValueError):
    """The provider answered, but not with the chat-completions shape."""


# --- reading a vendor's JSON -----------------------------------------------------

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def loads_vendor_json(raw: str | bytes) -> Any:
    """json.loads, with every lone UTF-16 surrogate a vendor escaped into a string
    (`"\\ud800"`, legal JSON) replaced by U+FFFD. Such a string cannot be encoded as
    UTF-8, so it would fail the gRPC response (INTERNAL) after the call succeeded; it
    never carried a character, so tool-call arguments lose nothing by the change.
    Only an escape can make one, so text without `\\ud` is not walked at all."""
    payload = json.loads(raw)
    escaped = (
        ("\\ud" in raw or "\\uD" in raw)
        if isinstance(raw, str)
        else (b"\\ud" in raw or b"\\uD" in raw)
    )
    if not escaped:
        return payload
    return _without_lone_surrogates(payload)


def _without_lone_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v) for k, v in value.items()}
    return value


# --- request ---------------------------------------------------------------------


def chat_body(
    request: ChatRequest,
    route: Route,
    *,
    stream: bool,
    reasoning_effort: ReasoningEffort | None,
    max_tokens_field: MaxTokensField,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": route.model,
        "messages": [message_to_wire(m) for m in request.messages],
        max_tokens_field: request.output_tokens,
    }
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": dict(tool.parameters),
                },
            }
            for tool in request.tools
        ]
    if request.temperature is not None:
        body["temperature"] = request.temperature
    if reasoning_effort is not None:
        body["reasoning_effort"] = reasoning_effort
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def message_to_wire(message: ChatMessage) -> dict[str, Any]:
    wire: dict[str, Any] = {"role": message.role}
    if message.role == "assistant" and message.tool_calls:
        # The vendor's own shape for "only tool calls": content null, not "".
        wire["content"] = message.content or None
        wire["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json},
            }
            for call in message.tool_calls
        ]
    else:
        wire["content"] = message.content
    if message.role == "tool":
        wire["tool_call_id"] = message.tool_call_id
    elif message.name:
        wire["name"] = message.name
    return wire


def embeddings_body(texts: Sequence[str], model: str) -> dict[str, Any]:
    return {"model": model, "input": list(texts)}


# --- unary response --------------------------------------------------------------


def parse_completion(payload: object, *, requested_model: str) -> Completion:
    if not isinstance(payload, dict):
        raise MalformedResponse(f"the body is {_kind(payload)}, not a completion object")
    if "error" in payload:
        raise MalformedResponse(f"a 200 response carried an error: {error_text(payload)}")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedResponse("the completion has no choices")
    choice = choices[0]
    raw_message = choice.get("message")
    if not isinstance(raw_message, dict):
        raise MalformedResponse("choices[0] has no message object")
    content = raw_message.get("content")
    if content is not None and not isinstance(content, str):
        raise MalformedResponse(f"choices[0].message.content is {_kind(content)}, not text")
    raw_calls = raw_message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise MalformedResponse("choices[0].message.tool_calls is not a list")
    tool_calls = tuple(_tool_call(raw, index=i) for i, raw in enumerate(raw_calls))
    finish_reason = choice.get("finish_reason")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise MalformedResponse(f"finish_reason is {_kind(finish_reason)}, not text")
    if content is None and not tool_calls and finish_reason in (None, "stop", "tool_calls"):
        raise MalformedResponse("the message has neither content nor tool calls")
    message = ChatMessage(role="assistant", content=content or "", tool_calls=tool_calls)
    usage = parse_usage(payload.get("usage"))
    model = payload.get("model")
    return Completion(
        message=message,
        finish_reason=finish_reason or ("tool_calls" if tool_calls else "stop"),
        usage=usage or estimate_usage(message),
        model=model if isinstance(model, str) and model else requested_model,
        usage_estimated=usage is None,
    )


def _tool_call(raw: object, *, index: int) -> ToolCall:
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise MalformedResponse(f"tool_calls[{index}] has no function object")
    function = raw["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedResponse(f"tool_calls[{index}] has no function name")
    return ToolCall(
        id=_call_id(raw.get("id")), name=name, arguments_json=_arguments(function.get("arguments"))
    )


def _arguments(raw: object) -> str:
    if raw is None:
        return "{}"
    if isinstance(raw, str):
        return raw
    if isinstance(raw, dict):
        # A few OpenAI-compatible servers send an object; the protocol says text.
        return json.dumps(raw, ensure_ascii=False, separators=(",", ":"))
    raise MalformedResponse(f"tool call arguments are {_kind(raw)}, not JSON text")


def _call_id(raw: object) -> str:
    # Some vendors omit ids; the caller must be able to answer the call, so give one.
    return raw if isinstance(raw, str) and raw else f"call_{uuid.uuid4().hex[:24]}"


# More tokens than any call could use, and well inside int64 (the proto's and the
# ledger's column type): a count beyond it is a vendor's bug, not a count.
MAX_USAGE_TOKENS = 2**40


def parse_usage(raw: object) -> Usage | None:
    """The vendor's counts, or None (then estimated) when they are not counts: a
    negative number, a boolean or a number past any real call would otherwise fail
    the response's conversion (INTERNAL) or the ledger's arithmetic."""
    if not isinstance(raw, dict):
        return None
    prompt = raw.get("prompt_tokens")
    completion = raw.get("completion_tokens")
    if not _token_count(prompt) or not _token_count(completion):
        return None
    total = raw.get("total_tokens")
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=total if _token_count(total) else prompt + completion,
    )


def _token_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_USAGE_TOKENS


def estimate_usage(message: ChatMessage, *, prompt_tokens: int = 0) -> Usage:
    """Stands in when a provider reports no usage, so budgets never see zero."""
    completion = estimate_prompt_tokens([message])
    return Usage(prompt_tokens, completion, prompt_tokens + completion)


# --- streamed response -----------------------------------------------------------


@dataclass
class SseDecoder:
    """Server-sent events, line by line: returns an event's data when it ends."""

    _data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> str | None:
        if line == "":
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None  # a comment, e.g. OpenRouter's keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


@dataclass
class _CallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class StreamAssembler:
    """Turns chat.completion.chunk objects into content deltas and, at the end, one
    Completion with the tool calls reassembled from their fragments."""

    requested_model: str
    content: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    model: str = ""
    _calls: dict[int, _CallParts] = field(default_factory=dict)

    def feed(self, chunk: object) -> str:
        """Take one chunk; return the content it adds ("" if none)."""
        if not isinstance(chunk, dict):
            raise MalformedResponse(f"a stream chunk is {_kind(chunk)}, not an object")
        model = chunk.get("model")
        if isinstance(model, str) and model:
            self.model = model
        usage = parse_usage(chunk.get("usage"))
        if usage is not None:
            self.usage = usage
        choices = chunk.get("choices")
        if choices is None:
            choices = []
        if not isinstance(choices, list):
            raise MalformedResponse("a stream chunk's choices is not a list")
        added = []
        for choice in choices:
            if not isinstance(choice, dict):
                raise MalformedResponse("a stream chunk's choice is not an object")
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise MalformedResponse("a stream chunk's delta is not an object")
            text = delta.get("content")
            if text is not None and not isinstance(text, str):
                raise MalformedResponse(f"a content delta is {_kind(text)}, not text")
            if text:
                added.append(text)
            for raw_call in delta.get("tool_calls") or []:
                self._feed_call(raw_call)
            finish = choice.get("finish_reason")
            if isinstance(finish, str) and finish:
                self.finish_reason = finish
        text = "".join(added)
        if text:
            self.content.append(text)
        return text

    def _feed_call(self, raw: object) -> None:
        if not isinstance(raw, dict):
            raise MalformedResponse("a tool call delta is not an object")
        raw_id = raw.get("id")
        index = raw.get("index")
        if not isinstance(index, int):
            # Vendors that omit the index send each call whole, or fragments after
            # an id: a new id starts a new call.
            known = {parts.id for parts in self._calls.values()}
            if (isinstance(raw_id, str) and raw_id and raw_id not in known) or not self._calls:
                index = len(self._calls)
            else:
                index = max(self._calls)
        parts = self._calls.setdefault(index, _CallParts())
        if isinstance(raw_id, str) and raw_id:
            parts.id = raw_id
        function = raw.get("function") or {}
        if not isinstance(function, dict):
            raise MalformedResponse("a tool call delta's function is not an object")
        name = function.get("name")
        if isinstance(name, str) and name and name != parts.name:
            parts.name += name
        arguments = function.get("arguments")
        if arguments is not None:
            parts.arguments.append(_arguments(arguments))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, *, prompt_tokens_estimate: int = 0) -> Completion:
        calls = []
        for index in sorted(self._calls):
            parts = self._calls[index]
            if not parts.name:
                raise MalformedResponse(f"streamed tool call {index} never named its function")
            calls.append(
                ToolCall(
                    id=_call_id(parts.id),
                    name=parts.name,
                    arguments_json="".join(parts.arguments) or "{}",
                )
            )
        message = ChatMessage(
            role="assistant", content="".join(self.content), tool_calls=tuple(calls)
        )
        return Completion(
            message=message,
            finish_reason=self.finish_reason or ("tool_calls" if calls else "stop"),
            usage=self.usage or estimate_usage(message, prompt_tokens=prompt_tokens_estimate),
            model=self.model or self.requested_model,
            usage_estimated=self.usage is None,
        )


# --- errors and embeddings -------------------------------------------------------


def error_text(payload: object) -> str:
    """The vendor's own words for an error: message, with type/code when given."""
    if isinstance(payload, list) and payload:
        payload = payload[0]
    if not isinstance(payload, dict):
        return ""
    error = payload.get("error", payload)
    if isinstance(error, str):
        return error
    if not isinstance(error, dict):
        return ""
    message = error.get("message")
    labels = [str(error[k]) for k in ("type", "code", "param") if error.get(k) not in (None, "")]
    text = message if isinstance(message, str) else ""
    return f"{text} [{', '.join(labels)}]" if labels else text


def error_text_from_body(body: bytes) -> str:
    try:
        text = error_text(loads_vendor_json(body))
    except ValueError:
        text = ""
    if text:
        return text
    return body.decode("utf-8", errors="replace").strip()[:200]


def parse_retry_after(headers: Mapping[str, str], *, now: datetime | None = None) -> float | None:
    """Seconds to wait, from Retry-After-Ms, or Retry-After as seconds or a date."""
    lowered = {k.lower(): v for k, v in headers.items()}
    millis = lowered.get("retry-after-ms")
    if millis is not None:
        try:
            return max(float(millis) / 1000.0, 0.0)
        except ValueError:
            pass
    value = lowered.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - (now or datetime.now(UTC))).total_seconds(), 0.0)


def parse_embeddings(payload: object, *, count: int) -> list[list[float]]:
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise MalformedResponse("the embeddings response has no data list")
    rows = payload["data"]
    if len(rows) != count:
        raise MalformedResponse(f"asked for {count} embeddings, got {len(rows)}")
    indexed: list[tuple[int, list[float]]] = []
    for position, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("embedding"), list):
            raise MalformedResponse(f"data[{position}] has no embedding list")
        values = row["embedding"]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise MalformedResponse(f"data[{position}].embedding holds non-numbers")
        # Python's JSON reads NaN and Infinity, and a float32 cannot hold 1e300: no
        # vector index can store either, so one such value spoils the whole batch.
        if not all(math.isfinite(v) and abs(v) <= _FLOAT32_MAX for v in values):
            raise MalformedResponse(
                f"data[{position}].embedding holds a value that is not a finite float32"
            )
        index = row.get("index", position)
        indexed.append((index if isinstance(index, int) else position, [float(v) for v in values]))
    vectors = [v for _, v in sorted(indexed, key=lambda item: item[0])]
    if len({len(v) for v in vectors}) > 1:
        raise MalformedResponse("the embeddings have different dimensions")
    return vectors


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__
