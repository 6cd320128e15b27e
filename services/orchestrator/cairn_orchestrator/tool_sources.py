"""Tools from a company's own systems: what an agent spec says about them, and how
a declared import becomes a Tool under the same rules as a built-in one (I12).

An agent spec lists its tool sources (a `ToolService` over gRPC or an MCP server
over streamable HTTP) and, for every tool it imports, the effect, the byte cap,
the timeout, the per-run call budget and, for a write, the confirmation card. The
spec decides: a server's own read-only hint is never read, so it cannot lower a
write to a read. A write without a card is refused when the spec loads (I4).

The source itself is only asked two things: which tools it offers (their
descriptions and argument schemas, at start-up) and to run one. Each transport's
adapter (grpc_tool_source.py, mcp_tool_source.py) turns everything that can go
wrong on the wire into error data: a timeout, an unreachable server, an answer
that is not JSON. Calls carry the caller's own token (I1); the source never gets
anything cairn's own services would accept as cairn: the actor token beside the
caller's, and the token the listing is made with, are minted for the audience
`cairn-tools`, which no cairn service accepts.

Like the rest of the spec (specs.py), a tool import is declared as pydantic
models: a nested structure (per tool, per language) where hand-written checks
would be most of the module; the models refuse unknown keys and wrong types with
the path of the bad value, which the loader turns into the same
`file: field 'x': problem` message as every other spec error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import structlog
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cairn_orchestrator.domain import CardDetail, ConfirmationCard, ErrorValue, JSONValue
from cairn_orchestrator.errors import AgentSpecInvalid, ToolContractViolation
from cairn_orchestrator.tools import (
    DEFAULT_RESULT_BYTE_CAP,
    TOOL_NAME_PATTERN,
    Tool,
    ToolContext,
    ToolRegistry,
    ToolResult,
)

log = structlog.get_logger(__name__)

Transport = Literal["grpc", "mcp"]
CardLanguage = Literal["en", "zh-Hans"]
CARD_LANGUAGES: tuple[CardLanguage, ...] = ("en", "zh-Hans")
# The audience of every token a tool source receives from cairn besides the
# caller's own: no cairn service accepts it, so a tool server cannot act as cairn.
TOOL_AUDIENCE = "cairn-tools"
SOURCE_NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,63}$"
DEFAULT_TOOL_TIMEOUT_SECONDS = 10.0
DEFAULT_CALLS_PER_RUN = 8
MAX_LIST_RETRY_SECONDS = 300.0
# The most error text from a source a model reads; a server's stack trace is not data.
ERROR_MESSAGE_CHARS = 500
ERROR_CODE_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")

# Error codes of failures on the way to a source (the source's own errors keep theirs).
TIMEOUT = "tool.timeout"
UNAVAILABLE = "tool.unavailable"
INVALID_RESULT = "tool.invalid_result"
SOURCE_FAILED = "tool.source_failed"

_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


# ---------------------------------------------------------------- the spec's part


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class CardText(_Strict):
    """A confirmation card in one language; `{argument}` is replaced by the value
    the model gave for that argument."""

    summary: str = Field(min_length=1)
    details: dict[str, str] = Field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @field_validator("summary", "details", "warnings")
    @classmethod
    def _templates_name_arguments_only(cls, value: Any) -> Any:
        texts = (
            [value]
            if isinstance(value, str)
            else [*value.keys(), *value.values()]
            if isinstance(value, dict)
            else list(value)
        )
        for text in texts:
            template_fields(text)
        return value


class ImportedTool(_Strict):
    """What the spec says about one tool it imports from a source."""

    effect: Literal["read", "write"]
    # The tool's name on its server, when the agent calls it by another (the key):
    # two sources may offer tools of one name, and a registry holds one of each.
    remote_name: str | None = Field(default=None, min_length=1)
    # Replaces the server's description in what the model reads.
    description: str | None = Field(default=None, min_length=1)
    card: dict[CardLanguage, CardText] | None = None
    timeout_seconds: float = Field(default=DEFAULT_TOOL_TIMEOUT_SECONDS, gt=0, le=300)
    calls_per_run: int = Field(default=DEFAULT_CALLS_PER_RUN, ge=1, le=1000)
    result_byte_cap: int = Field(default=DEFAULT_RESULT_BYTE_CAP, ge=64, le=16 * 1024 * 1024)


class ToolSourceSpec(_Strict):
    """One source an agent imports tools from."""

    name: str = Field(pattern=SOURCE_NAME_PATTERN)
    transport: Transport
    # A gRPC target (host:port, dns:///...) or an MCP endpoint URL; `${VAR}` and
    # `${VAR:-default}` are read from the orchestrator's environment.
    address: str = Field(min_length=1)
    tools: dict[str, ImportedTool] = Field(min_length=1)

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, value: dict[str, ImportedTool]) -> dict[str, ImportedTool]:
        for name in value:
            if not TOOL_NAME_PATTERN.match(name):
                raise ValueError(f"{name!r} is not a tool name ({TOOL_NAME_PATTERN.pattern})")
        return value


def template_fields(text: str) -> tuple[str, ...]:
    """The argument names a card template uses; anything but a plain `{name}`
    (attribute or index access, a conversion, a format spec) is refused, since a
    card is written by a deployment and filled with what a model wrote."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ValueError(
            f"{text!r} is not a template: {exc} (write {{{{ and }}}} for literal braces)"
        ) from exc
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or spec or conversion:
            raise ValueError(
                f"{text!r}: {{{name}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} is not allowed; name an argument as {{argument}}"
            )
        names.append(name)
    return tuple(names)


def interpolate(address: str, env: Mapping[str, str]) -> str:
    """`${VAR}` / `${VAR:-default}` in an address, from `env`; a variable that is
    unset and has no default is refused by name."""

    def value(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        found = env.get(name)
        if found:
            return found
        if default is not None:
            return default
        raise ValueError(
            f"{address!r} names ${{{name}}}, which is not set; set {name} or write "
            f"${{{name}:-default}}"
        )

    return _ENV_REFERENCE.sub(value, address)


@dataclass(frozen=True, slots=True)
class DeclaredSource:
    """A source as the specs declare it, addresses resolved, with every tool any
    spec imports from it."""

    name: str
    transport: Transport
    address: str
    tools: Mapping[str, ImportedTool]
    file: str


def parse_tool_sources(
    value: object, *, file: str, builtin_tools: Sequence[str], env: Mapping[str, str] | None = None
) -> tuple[DeclaredSource, ...]:
    """The `tool_sources` field of one spec, or AgentSpecInvalid naming the field."""
    env = os.environ if env is None else env
    if not isinstance(value, list):
        raise AgentSpecInvalid(file, "tool_sources", f"{value!r} must be a list of sources")
    declared: list[DeclaredSource] = []
    seen_tools: dict[str, str] = {}
    for index, item in enumerate(value):
        where = f"tool_sources[{index}]"
        try:
            source = ToolSourceSpec.model_validate(item)
        except ValidationError as exc:
            raise _spec_error(file, where, exc) from exc
        try:
            address = interpolate(source.address, env)
        except ValueError as exc:
            raise AgentSpecInvalid(file, f"{where}.address", str(exc)) from exc
        if any(d.name == source.name for d in declared):
            raise AgentSpecInvalid(file, f"{where}.name", f"{source.name!r} is listed twice")
        for tool_name, tool in source.tools.items():
            field = f"{where}.tools.{tool_name}"
            if tool_name in builtin_tools:
                raise AgentSpecInvalid(
                    file, field, f"{tool_name!r} is the name of a built-in tool; import another"
                )
            if tool_name in seen_tools:
                raise AgentSpecInvalid(
                    file, field, f"{tool_name!r} is imported from {seen_tools[tool_name]!r} too"
                )
            seen_tools[tool_name] = source.name
            _check_card(tool_name, tool, file=file, field=field)
        declared.append(
            DeclaredSource(
                name=source.name,
                transport=source.transport,
                address=address,
                tools=dict(source.tools),
                file=file,
            )
        )
    return tuple(declared)


def _check_card(name: str, tool: ImportedTool, *, file: str, field: str) -> None:
    if tool.effect == "write" and not tool.card:
        # I4 at load time: a person must be able to read what they approve.
        raise AgentSpecInvalid(
            file,
            f"{field}.card",
            f"{name!r} is a write tool and has no confirmation card; give card.en "
            "(summary, details, warnings) and card.zh-Hans",
        )
    if tool.card and "en" not in tool.card:
        raise AgentSpecInvalid(
            file, f"{field}.card.en", f"{name!r}: the English card is required (the fallback)"
        )
    if tool.card and tool.effect == "read":
        raise AgentSpecInvalid(
            file, f"{field}.card", f"{name!r} is a read tool; only a write has a card"
        )


def _spec_error(file: str, where: str, exc: ValidationError) -> AgentSpecInvalid:
    first = exc.errors()[0]
    path = ".".join(str(p) for p in first["loc"])
    field = f"{where}.{path}" if path else where
    if first["type"] == "extra_forbidden":
        return AgentSpecInvalid(file, field, "is not a field here; " + _known_fields(first["loc"]))
    return AgentSpecInvalid(
        file, field, f"{first.get('input')!r}: {first['msg'].removeprefix('Value error, ')}"
    )


def _known_fields(loc: Sequence[int | str]) -> str:
    depth = [p for p in loc[:-1] if isinstance(p, str)]
    if not depth:
        model: type[BaseModel] = ToolSourceSpec
    elif "card" in depth:
        model = CardText
    else:
        model = ImportedTool
    return "known fields: " + ", ".join(model.model_fields)


def merge_sources(declared: Sequence[DeclaredSource]) -> tuple[DeclaredSource, ...]:
    """One source per name across every spec. Two specs may import from one source
    and may import the same tool, but only with the same declaration: a tool is
    one thing in the registry, whichever agent calls it."""
    merged: dict[str, DeclaredSource] = {}
    for source in declared:
        known = merged.get(source.name)
        if known is None:
            merged[source.name] = source
            continue
        if (known.transport, known.address) != (source.transport, source.address):
            raise AgentSpecInvalid(
                source.file,
                "tool_sources",
                f"source {source.name!r} is {source.transport} at {source.address!r} here but "
                f"{known.transport} at {known.address!r} in {known.file}; one name, one source",
            )
        tools = dict(known.tools)
        for name, tool in source.tools.items():
            if name in tools and tools[name] != tool:
                raise AgentSpecInvalid(
                    source.file,
                    f"tool_sources.{source.name}.tools.{name}",
                    f"is declared differently in {known.file}; a tool has one declaration",
                )
            tools[name] = tool
        merged[source.name] = DeclaredSource(
            name=known.name,
            transport=known.transport,
            address=known.address,
            tools=tools,
            file=known.file,
        )
    names: dict[str, str] = {}
    for source in merged.values():
        for name in source.tools:
            if name in names:
                raise AgentSpecInvalid(
                    source.file,
                    f"tool_sources.{source.name}.tools.{name}",
                    f"{name!r} is imported from source {names[name]!r} by another spec too",
                )
            names[name] = source.name
    return tuple(merged.values())


# ---------------------------------------------------------------- cards


def _filled(template: str, arguments: Mapping[str, Any]) -> str:
    def value(name: str) -> str:
        if name not in arguments:
            return "—"
        given = arguments[name]
        return given if isinstance(given, str) else json.dumps(given, ensure_ascii=False)

    return "".join(
        literal + (value(name) if name is not None else "")
        for literal, name, _, _ in string.Formatter().parse(template)
    )


def render_card(
    cards: Mapping[CardLanguage, CardText], arguments: Mapping[str, Any], *, language: str
) -> ConfirmationCard:
    """The card in the run's language, or in English marked as a fallback."""
    chosen: CardLanguage = "zh-Hans" if language == "zh-Hans" and "zh-Hans" in cards else "en"
    text = cards[chosen]
    return ConfirmationCard(
        summary=_filled(text.summary, arguments),
        details=tuple(
            CardDetail(label=_filled(label, arguments), value=_filled(value, arguments))
            for label, value in text.details.items()
        ),
        warnings=tuple(_filled(w, arguments) for w in text.warnings),
        language=chosen,
        language_fallback=chosen != language,
    )


# ---------------------------------------------------------------- the sources


@dataclass(frozen=True, slots=True)
class ListedTool:
    """A tool as its source describes it."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    # Recorded for the operator's log only: the spec decides the effect.
    read_only_hint: bool = False


class ToolSource(Protocol):
    """One system cairn reaches for tools. Both methods return data for every
    failure a source can have; only a bug of cairn's own raises."""

    name: str
    transport: Transport

    async def list_tools(self, *, deadline_seconds: float) -> tuple[ListedTool, ...] | ErrorValue:
        """The tools the source offers now."""
        ...

    async def invoke(
        self,
        *,
        tool: str,
        arguments: Mapping[str, Any],
        context: ToolContext,
        deadline_seconds: float,
    ) -> ToolResult | ErrorValue:
        """Run one tool as the caller in `context`."""
        ...

    async def close(self) -> None: ...


# Mints the token the source gets beside the caller's: (run_id, agent) -> JWT for
# TOOL_AUDIENCE; with empty run and agent, the token a listing is made with.
MintToolToken = Callable[[str, str], str]


def result_from_json(source: str, tool: str, text: str) -> ToolResult | ErrorValue:
    """A source's result text as JSON content, or error data saying it was not JSON."""
    try:
        content: JSONValue = json.loads(text)
    except ValueError as exc:
        return ErrorValue(
            INVALID_RESULT,
            f"the {source!r} source answered {tool} with a result that is not JSON "
            f"({type(exc).__name__} at position {getattr(exc, 'pos', '?')}); it was dropped",
        )
    return ToolResult(content=content)


def source_error(code: str, message: str) -> ErrorValue:
    """A tool's own error as the source sent it, bounded; a code that is not a
    short identifier is replaced, the message kept."""
    safe = code if ERROR_CODE_PATTERN.match(code) else SOURCE_FAILED
    return ErrorValue(safe, message[:ERROR_MESSAGE_CHARS] or "the tool failed")


def listed_schema(source: str, name: str, text: str) -> Mapping[str, Any] | None:
    """A listed tool's argument schema, or None (logged) when it cannot be used."""
    try:
        schema = json.loads(text or '{"type": "object"}')
        Draft202012Validator.check_schema(schema)
    except (ValueError, SchemaError) as exc:
        log.warning("tool_source.bad_schema", source=source, tool=name, error=type(exc).__name__)
        return None
    if not isinstance(schema, dict) or schema.get("type") != "object":
        log.warning("tool_source.bad_schema", source=source, tool=name, error="not an object")
        return None
    return schema


def imported_tool(
    source: ToolSource, name: str, declared: ImportedTool, listed: ListedTool
) -> Tool:
    """The Tool a declared import becomes: the spec's effect, card, cap, timeout and
    budget; the server's description (unless the spec gives one) and schema."""
    timeout = declared.timeout_seconds

    async def handler(
        arguments: Mapping[str, Any], context: ToolContext
    ) -> ToolResult | ErrorValue:
        return await source.invoke(
            tool=listed.name, arguments=arguments, context=context, deadline_seconds=timeout
        )

    cards = declared.card

    def card(arguments: Mapping[str, Any], context: ToolContext) -> ConfirmationCard:
        assert cards is not None
        return render_card(cards, arguments, language=context.language)

    return Tool(
        name=name,
        description=declared.description or listed.description or name,
        parameters=listed.parameters,
        effect=declared.effect,
        handler=handler,
        card=card if cards else None,
        result_byte_cap=declared.result_byte_cap,
        source=source.name,
        transport=source.transport,
        call_budget=declared.calls_per_run,
    )


class ToolSources:
    """Every declared source: listed at start-up (and again, in the background,
    until each has answered), its declared tools registered as they are found."""

    def __init__(
        self,
        declared: Sequence[DeclaredSource],
        *,
        connect: Callable[[DeclaredSource], ToolSource],
        registry: ToolRegistry,
        list_deadline_seconds: float = 5.0,
        retry_seconds: float = 5.0,
    ) -> None:
        self._declared = {d.name: d for d in declared}
        self._sources = {d.name: connect(d) for d in declared}
        self._registry = registry
        self._list_deadline = list_deadline_seconds
        self._retry = retry_seconds
        self._pending = set(self._declared)
        self._retrying: asyncio.Task[None] | None = None

    @property
    def unlisted(self) -> frozenset[str]:
        """Sources that have not answered ListTools yet."""
        return frozenset(self._pending)

    async def start(self) -> None:
        await self.list_pending()
        if self._pending:
            self._retrying = asyncio.create_task(self._keep_listing())

    async def list_pending(self) -> None:
        await asyncio.gather(*(self._list(name) for name in sorted(self._pending)))

    async def _keep_listing(self) -> None:
        # Doubling up to a cap: a source that is not deployed is asked (and logged)
        # a few times an hour, not every few seconds for ever.
        wait = self._retry
        while self._pending:
            await asyncio.sleep(wait)
            await self.list_pending()
            wait = min(wait * 2, max(self._retry, MAX_LIST_RETRY_SECONDS))

    async def _list(self, name: str) -> None:
        source, declared = self._sources[name], self._declared[name]
        listed = await source.list_tools(deadline_seconds=self._list_deadline)
        if isinstance(listed, ErrorValue):
            log.warning(
                "tool_source.unlisted",
                source=name,
                transport=declared.transport,
                code=listed.code,
                reason=listed.message,
                tools=sorted(declared.tools),
            )
            return
        offered = {t.name: t for t in listed}
        for tool_name, tool in declared.tools.items():
            found = offered.get(tool.remote_name or tool_name)
            if found is None:
                # Said out loud: the agents that import it run without it.
                log.warning(
                    "tool_source.tool_missing",
                    source=name,
                    tool=tool_name,
                    offered=sorted(offered),
                )
                continue
            if found.read_only_hint and tool.effect == "write":
                log.info("tool_source.hint_overruled", source=name, tool=tool_name, effect="write")
            try:
                self._registry.register(imported_tool(source, tool_name, tool, found))
            except ToolContractViolation as exc:
                log.warning(
                    "tool_source.tool_refused", source=name, tool=tool_name, reason=str(exc)
                )
        self._pending.discard(name)
        log.info(
            "tool_source.listed", source=name, transport=declared.transport, tools=sorted(offered)
        )

    async def close(self) -> None:
        if self._retrying is not None:
            self._retrying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retrying
        await asyncio.gather(*(s.close() for s in self._sources.values()))
