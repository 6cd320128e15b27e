"""The tool contract, the registry that enforces it, and the dispatcher that runs
one tool call and always comes back with data.

A tool is a name, a description, a JSON schema for its arguments, an effect
(read or write), a result byte cap, and a handler. Arguments are validated
against the schema before the handler runs; a handler returns a result or an
error value, and a handler that raises anyway is caught here and becomes error
data (I3). Results above the byte cap are cut and marked truncated (I10).

A tool imported from another system (tool_sources.py) is a Tool like any other,
with its `source` named: the dispatcher applies the same rules to it, counts its
per-run call budget, and names the source on the `execute_tool` span and in the
trajectory step, so a built-in and an imported tool read alike in both.

A write needs a person's yes before it runs (I4), so a write tool is registered
only with a confirmation card renderer, and the dispatcher refuses to run one
without the confirmation token of an approval. A write handler receives that
token as `context.confirmation_token` and must treat it as an idempotency key
(or be idempotent by nature): after a crash an approved write may be handed to
its target a second time, and it must take effect at most once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import structlog
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.exceptions import best_match as best_schema_error
from opentelemetry import trace

from cairn_libs.identity import Principal
from cairn_orchestrator.domain import (
    CallCredentials,
    ConfirmationCard,
    ErrorValue,
    HeldCopy,
    JSONValue,
    LabelBook,
    LabelledChunk,
    ToolCallDetail,
    ToolCallRequest,
    ToolDefinition,
    unstorable_at,
)
from cairn_orchestrator.errors import ToolContractViolation

log = structlog.get_logger(__name__)

Effect = Literal["read", "write"]
DEFAULT_RESULT_BYTE_CAP = 256 * 1024
TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")

# Error codes a model can read in a tool message.
INVALID_INPUT = "tool.invalid_input"
TOOL_FAILED = "tool.failed"
UNKNOWN_TOOL = "tool.unknown"
CONFIRMATION_UNAVAILABLE = "tool.confirmation_unavailable"
DENIED = "tool.denied"
UNSTORABLE_TEXT = "tool.unstorable_text"
CALL_BUDGET_EXHAUSTED = "tool.call_budget_exhausted"


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a handler may know about the call it serves. `sources` come from the
    agent's spec (I7); `credentials` are the caller's own (I1)."""

    principal: Principal
    run_id: str
    agent: str
    remaining_tokens: int
    sources: tuple[str, ...]
    credentials: CallCredentials
    labels: LabelBook
    confirmation_token: str | None = None
    # The run's preferred language (BCP 47, normalised to "en" or "zh-Hans"):
    # card renderers write in it where they have text in it.
    language: str = "en"
    # Every tool call the model has asked for in this run so far, in order (this
    # turn's included), from the run's persisted state: a per-tool call budget is
    # counted from it, so it holds across a resume on another replica.
    run_calls: tuple[ToolCallRequest, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A handler's success: content the model reads (JSON), and any knowledge chunks
    it labelled, so citations can point at them."""

    content: JSONValue
    knowledge: tuple[LabelledChunk, ...] = ()
    # Texts about people the content carries (memories, facts, blocks), so an
    # erasure of the person finds this copy (I9).
    copies: tuple[HeldCopy, ...] = ()


ToolHandler = Callable[[Mapping[str, Any], ToolContext], Awaitable[ToolResult | ErrorValue]]
CardRenderer = Callable[[Mapping[str, Any], ToolContext], ConfirmationCard]
# What a proposed write copies about people (the memory it would keep), from its arguments.
CopiesOf = Callable[[Mapping[str, Any], ToolContext], tuple[HeldCopy, ...]]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]
    effect: Effect
    handler: ToolHandler
    card: CardRenderer | None = None
    copies_of: CopiesOf | None = None
    result_byte_cap: int = DEFAULT_RESULT_BYTE_CAP
    needs_confirmation: bool = False
    # Where an imported tool comes from (its source's name and transport, "grpc" or
    # "mcp"); empty for a built-in.
    source: str = ""
    transport: str = ""
    # How many times one run may call it; None: no limit beyond the run's budgets.
    call_budget: int | None = None

    @property
    def confirmation_required(self) -> bool:
        """Forced for writes: no flag can make a write run unconfirmed (I4)."""
        return self.needs_confirmation or self.effect == "write"

    def definition(self) -> ToolDefinition:
        return ToolDefinition(
            name=self.name, description=self.description, parameters=self.parameters
        )


@dataclass(slots=True)
class ToolRegistry:
    _tools: dict[str, Tool] = field(default_factory=dict)
    _validators: dict[str, Draft202012Validator] = field(default_factory=dict)

    def register(self, tool: Tool) -> None:
        """Add a tool, or refuse one that breaks the contract."""
        if not TOOL_NAME_PATTERN.match(tool.name):
            raise ToolContractViolation(
                f"tool name {tool.name!r} must match {TOOL_NAME_PATTERN.pattern}"
            )
        if tool.name in self._tools:
            raise ToolContractViolation(f"a tool named {tool.name!r} is already registered")
        if tool.effect not in ("read", "write"):
            raise ToolContractViolation(
                f"tool {tool.name!r}: effect {tool.effect!r} is not 'read' or 'write'"
            )
        if tool.confirmation_required and tool.card is None:
            raise ToolContractViolation(
                f"tool {tool.name!r} needs confirmation ({tool.effect}) but has no confirmation card "
                "renderer; a person must be able to read what they approve"
            )
        if tool.call_budget is not None and tool.call_budget < 1:
            raise ToolContractViolation(
                f"tool {tool.name!r}: call_budget {tool.call_budget!r} must be at least 1"
            )
        if tool.result_byte_cap < 64:
            raise ToolContractViolation(
                f"tool {tool.name!r}: result_byte_cap {tool.result_byte_cap!r} is below 64 bytes"
            )
        try:
            Draft202012Validator.check_schema(tool.parameters)
        except SchemaError as exc:
            raise ToolContractViolation(
                f"tool {tool.name!r}: its argument schema is invalid: {exc.message}"
            ) from exc
        if tool.parameters.get("type") != "object":
            raise ToolContractViolation(
                f"tool {tool.name!r}: its argument schema must describe an object"
            )
        self._tools[tool.name] = tool
        self._validators[tool.name] = Draft202012Validator(tool.parameters)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def definitions(self, names: Sequence[str]) -> tuple[ToolDefinition, ...]:
        return tuple(self._tools[name].definition() for name in names if name in self._tools)

    def validator(self, name: str) -> Draft202012Validator:
        return self._validators[name]


# ---------------------------------------------------------------- pure parts of a call


def parse_arguments(
    validator: Draft202012Validator, arguments_json: str
) -> dict[str, Any] | ErrorValue:
    """The model's argument text as a dict the schema accepts, or tool.invalid_input."""
    try:
        arguments = json.loads(arguments_json or "{}")
    except json.JSONDecodeError as exc:
        return ErrorValue(
            INVALID_INPUT, f"arguments are not valid JSON: {exc.msg} at position {exc.pos}"
        )
    if not isinstance(arguments, dict):
        return ErrorValue(
            INVALID_INPUT, f"arguments must be a JSON object, got {type(arguments).__name__}"
        )
    error = best_schema_error(validator.iter_errors(arguments))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(the arguments object)"
        return ErrorValue(INVALID_INPUT, f"argument {where}: {error.message}")
    return arguments


@dataclass(frozen=True, slots=True)
class RenderedResult:
    """The text a tool message carries, and whether it had to be cut."""

    text: str
    truncated: bool
    full_bytes: int


def truncation_marker(full_bytes: int, cap: int) -> str:
    return (
        f"\n[truncated: this result was cut at {cap} bytes; the full result had {full_bytes} bytes]"
    )


def render_result(content: JSONValue, *, byte_cap: int) -> RenderedResult:
    """Serialise a result; above the cap, keep the head and say it was cut (I10)."""
    text = (
        content
        if isinstance(content, str)
        else json.dumps(content, ensure_ascii=False, separators=(",", ":"))
    )
    encoded = text.encode("utf-8")
    if len(encoded) <= byte_cap:
        return RenderedResult(text=text, truncated=False, full_bytes=len(encoded))
    marker = truncation_marker(len(encoded), byte_cap)
    room = max(byte_cap - len(marker.encode("utf-8")), 0)
    head = encoded[:room].decode("utf-8", errors="ignore")
    return RenderedResult(text=head + marker, truncated=True, full_bytes=len(encoded))


def error_content(error: ErrorValue) -> str:
    return json.dumps({"error": error.to_json()}, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolCallOutcome:
    """What one tool call came to; the loop records it and sends `content` back."""

    call: ToolCallRequest
    content: str
    arguments: Mapping[str, Any] | None = None
    result: JSONValue = None
    error: ErrorValue | None = None
    truncated: bool = False
    result_bytes: int = 0
    knowledge: tuple[LabelledChunk, ...] = ()
    copies: tuple[HeldCopy, ...] = ()
    # The source an imported tool came from (see Tool.source); empty for a built-in.
    source: str = ""
    transport: str = ""

    def step_detail(self) -> ToolCallDetail:
        """What the call's step says about it."""
        return ToolCallDetail(
            tool_call_id=self.call.id,
            arguments=dict(self.arguments)
            if self.arguments is not None
            else self.call.arguments_json,
            truncated=self.truncated,
            result_bytes=self.result_bytes,
            failed=self.error is not None,
            result=self.content if self.truncated else self.result,
            labels=tuple(entry.label for entry in self.knowledge),
            source=self.source,
            transport=self.transport,
        )

    def detail(self) -> dict[str, JSONValue]:
        """The step's detail as stored (a confirmation keeps it as the write's result)."""
        return self.step_detail().to_json()


def refused(call: ToolCallRequest, error: ErrorValue) -> ToolCallOutcome:
    return ToolCallOutcome(call=call, content=error_content(error), error=error)


def call_number(call: ToolCallRequest, run_calls: Sequence[ToolCallRequest]) -> int:
    """Which call of its tool this one is in the run (1 for the first), counted
    from the run's own record of the calls the model asked for."""
    earlier = [c.id for c in run_calls if c.name == call.name]
    return earlier.index(call.id) + 1 if call.id in earlier else len(earlier) + 1


def _describe_span(tool: Tool) -> None:
    """Name the tool's kind and source on the current `execute_tool` span
    (OpenTelemetry GenAI: gen_ai.tool.type is `function` for code of the agent's
    own, `extension` for a tool another system runs)."""
    attributes: dict[str, str] = {
        "gen_ai.tool.type": "extension" if tool.source else "function",
        "gen_ai.tool.description": tool.description[:256],
    }
    if tool.source:
        attributes |= {"cairn.tool.source": tool.source, "cairn.tool.transport": tool.transport}
    trace.get_current_span().set_attributes(attributes)


async def dispatch(
    registry: ToolRegistry, call: ToolCallRequest, context: ToolContext
) -> ToolCallOutcome:
    """Run one call of a registered tool; every way it can go wrong is data. A tool
    that needs confirmation runs only with the token of an approved confirmation."""
    tool = registry.get(call.name)
    if tool is None:
        return refused(call, ErrorValue(UNKNOWN_TOOL, f"no tool named {call.name!r} is available"))
    _describe_span(tool)
    outcome = await _dispatch_to(tool, registry, call, context)
    if tool.source:
        return replace(outcome, source=tool.source, transport=tool.transport)
    return outcome


async def _dispatch_to(
    tool: Tool, registry: ToolRegistry, call: ToolCallRequest, context: ToolContext
) -> ToolCallOutcome:
    if tool.call_budget is not None:
        number = call_number(call, context.run_calls)
        if number > tool.call_budget:
            return refused(
                call,
                ErrorValue(
                    CALL_BUDGET_EXHAUSTED,
                    f"the {call.name} tool may be called at most {tool.call_budget} times in "
                    f"one run and this was call {number}; answer with what you have",
                ),
            )
    if tool.confirmation_required and not context.confirmation_token:
        # I4, checked again at the last door: the loop never gets here unconfirmed.
        return refused(
            call,
            ErrorValue(
                CONFIRMATION_UNAVAILABLE,
                f"the {call.name} tool changes things and runs only after a person approves it",
            ),
        )
    arguments = parse_arguments(registry.validator(tool.name), call.arguments_json)
    if isinstance(arguments, ErrorValue):
        return refused(call, arguments)
    nul_in_arguments = unstorable_at(arguments)
    if nul_in_arguments is not None:
        return refused(
            call,
            ErrorValue(
                UNSTORABLE_TEXT,
                f"argument {nul_in_arguments} holds U+0000, which cannot be stored; "
                "call again without it",
            ),
        )
    try:
        outcome = await tool.handler(arguments, context)
    except Exception as exc:  # I3: a raising handler is a bug in the tool, not the run.
        log.warning("tool.raised", tool=tool.name, error=type(exc).__name__)
        error = ErrorValue(
            TOOL_FAILED, f"the {tool.name} tool failed unexpectedly ({type(exc).__name__})"
        )
        return ToolCallOutcome(
            call=call, content=error_content(error), arguments=arguments, error=error
        )
    if isinstance(outcome, ErrorValue):
        return ToolCallOutcome(
            call=call, content=error_content(outcome), arguments=arguments, error=outcome
        )
    nul_in_result = unstorable_at(outcome.content)
    if nul_in_result is not None:
        # The tool's own output: the run keeps the fact, not the text it cannot store.
        error = ErrorValue(
            UNSTORABLE_TEXT,
            f"the {tool.name} tool returned U+0000 at {nul_in_result}, which cannot be "
            "stored; its result was dropped",
        )
        return ToolCallOutcome(
            call=call, content=error_content(error), arguments=arguments, error=error
        )
    rendered = render_result(outcome.content, byte_cap=tool.result_byte_cap)
    return ToolCallOutcome(
        call=call,
        content=rendered.text,
        arguments=arguments,
        result=outcome.content,
        truncated=rendered.truncated,
        result_bytes=rendered.full_bytes,
        knowledge=outcome.knowledge,
        copies=outcome.copies,
    )
