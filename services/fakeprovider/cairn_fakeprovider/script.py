"""Which misbehaviours can a test queue up, and what does each step look like?

Steps arrive as JSON on POST /_control/script and are parsed here into frozen
dataclasses, so the server dispatches on a closed set of types instead of on free
strings. Each chat request spends one step; an empty queue means default behaviour.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from .errors import ScriptRejected
from .reply import PlannedToolCall, Reply

Action = Literal["answer", "tool_call", "status", "hang", "cut_stream", "malformed"]


@dataclass(frozen=True)
class AnswerStep:
    content: str
    action: Literal["answer"] = "answer"

    def reply(self) -> Reply:
        return Reply(content=self.content)


@dataclass(frozen=True)
class ToolCallStep:
    # The tool need not be among those offered: a test may check that the caller
    # refuses a call to a tool it never offered.
    calls: tuple[PlannedToolCall, ...]
    action: Literal["tool_call"] = "tool_call"

    def reply(self) -> Reply:
        return Reply(content=None, tool_calls=self.calls)


@dataclass(frozen=True)
class StatusStep:
    status: int
    retry_after: int | None = None
    retry_after_ms: int | None = None
    code: str | None = None
    message: str | None = None
    # Refuse only after this long, like a vendor that queues a request before refusing it.
    after_seconds: float = 0.0
    action: Literal["status"] = "status"


@dataclass(frozen=True)
class HangStep:
    seconds: float
    action: Literal["hang"] = "hang"


@dataclass(frozen=True)
class CutStreamStep:
    after_chunks: int
    action: Literal["cut_stream"] = "cut_stream"


@dataclass(frozen=True)
class MalformedStep:
    action: Literal["malformed"] = "malformed"


Step = AnswerStep | ToolCallStep | StatusStep | HangStep | CutStreamStep | MalformedStep

_ACTIONS = ("answer", "tool_call", "status", "hang", "cut_stream", "malformed")


def parse_script(body: object) -> list[Step]:
    """Parse `{"steps": [...]}`; reject the whole script if any step is bad."""
    steps = body.get("steps") if isinstance(body, dict) else None
    if not isinstance(steps, list):
        raise ScriptRejected(
            f'The script must be {{"steps": [<step>, ...]}}, got {body!r:.80}.', param="steps"
        )
    return [parse_step(raw, where=f"steps[{index}]") for index, raw in enumerate(steps)]


def parse_step(raw: object, *, where: str = "step") -> Step:
    if not isinstance(raw, dict):
        raise ScriptRejected(f"'{where}' must be an object, got {raw!r:.80}.", param=where)
    action = raw.get("action")
    if action == "answer":
        content = raw.get("content")
        if not isinstance(content, str):
            raise ScriptRejected(
                f"'{where}.content' must be a string, got {content!r:.80}.", param=where
            )
        return AnswerStep(content=content)
    if action == "tool_call":
        return ToolCallStep(calls=_planned_calls(raw, where=where))
    if action == "status":
        return _status_step(raw, where=where)
    if action == "hang":
        return HangStep(seconds=_seconds(raw, "seconds", where=where, default=None))
    if action == "cut_stream":
        return CutStreamStep(after_chunks=_non_negative_int(raw, "after_chunks", where=where) or 0)
    if action == "malformed":
        return MalformedStep()
    raise ScriptRejected(
        f"'{where}.action' must be one of {', '.join(_ACTIONS)}, got {action!r:.80}.", param=where
    )


def _planned_calls(raw: dict[str, object], *, where: str) -> tuple[PlannedToolCall, ...]:
    # Either one call ({"name", "arguments"}) or parallel calls ({"calls": [...]}).
    listed = raw.get("calls")
    specs = listed if isinstance(listed, list) and listed else [raw]
    calls: list[PlannedToolCall] = []
    for spec in specs:
        name = spec.get("name") if isinstance(spec, dict) else None
        arguments = spec.get("arguments", {}) if isinstance(spec, dict) else None
        if not isinstance(name, str) or not name:
            raise ScriptRejected(
                f"'{where}' needs a tool 'name' (or a non-empty 'calls' list), got {spec!r:.80}.",
                param=where,
            )
        if isinstance(arguments, dict):
            # Compact, as vendors emit it; a string is passed through untouched so a
            # test can send arguments that are not valid JSON.
            text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        elif isinstance(arguments, str):
            text = arguments
        else:
            raise ScriptRejected(
                f"'{where}.arguments' must be an object or a string, got {arguments!r:.80}.",
                param=where,
            )
        calls.append(PlannedToolCall(name=name, arguments=text))
    return tuple(calls)


def _status_step(raw: dict[str, object], *, where: str) -> StatusStep:
    status = raw.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
        raise ScriptRejected(
            f"'{where}.status' must be an HTTP error status 400-599, got {status!r:.80}.",
            param=where,
        )
    code = raw.get("code")
    message = raw.get("message")
    if code is not None and not isinstance(code, str):
        raise ScriptRejected(f"'{where}.code' must be a string, got {code!r:.80}.", param=where)
    if message is not None and not isinstance(message, str):
        raise ScriptRejected(
            f"'{where}.message' must be a string, got {message!r:.80}.", param=where
        )
    return StatusStep(
        status=status,
        retry_after=_non_negative_int(raw, "retry_after", where=where),
        retry_after_ms=_non_negative_int(raw, "retry_after_ms", where=where),
        code=code,
        message=message,
        after_seconds=_seconds(raw, "after_seconds", where=where, default=0.0),
    )


def _seconds(raw: dict[str, object], key: str, *, where: str, default: float | None) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ScriptRejected(
            f"'{where}.{key}' must be a number of seconds >= 0, got {value!r:.80}.",
            param=where,
        )
    return float(value)


def _non_negative_int(raw: dict[str, object], key: str, *, where: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScriptRejected(
            f"'{where}.{key}' must be a whole number >= 0, got {value!r:.80}.", param=where
        )
    return value
