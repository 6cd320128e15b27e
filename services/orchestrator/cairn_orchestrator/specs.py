"""Which agents exist: YAML spec files in one folder, validated when loaded.

A spec is configuration a deployment writes by hand, so every refusal names the
file and the field and says what would be accepted; a bad spec stops the service
at start-up rather than failing a caller's run later. Unknown fields are refused
too, because a misspelt `reads_memroy: true` silently meaning "false" is worse
than a start-up error. The fields are declared as pydantic models (SpecFields,
BudgetFields) with unknown keys forbidden; their validators carry the sentences.

`tool_sources` imports tools from a company's own systems (tool_sources.py
parses that part); the imported tools join the agent's `tools`, and the catalog
keeps every declared source, merged across specs, for the app to connect.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cairn_orchestrator.domain import TIERS, AgentSpec, Budgets, Tier
from cairn_orchestrator.errors import AgentSpecInvalid, UnknownAgent
from cairn_orchestrator.tool_sources import DeclaredSource, merge_sources, parse_tool_sources

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
SOURCE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


class AgentCatalog:
    """The loaded specs, by name."""

    def __init__(
        self, specs: Collection[AgentSpec], *, tool_sources: Sequence[DeclaredSource] = ()
    ) -> None:
        self._specs = {spec.name: spec for spec in specs}
        # Every source any spec imports from, one per name.
        self.tool_sources = tuple(tool_sources)

    def get(self, name: str) -> AgentSpec:
        spec = self._specs.get(name)
        if spec is None:
            raise UnknownAgent(name, self.names())
        return spec

    def names(self) -> list[str]:
        return sorted(self._specs)

    def all(self) -> list[AgentSpec]:
        return [self._specs[name] for name in self.names()]


def parse_agent_spec(
    document: object,
    *,
    file: str,
    known_tools: Collection[str],
    env: Mapping[str, str] | None = None,
) -> AgentSpec:
    """One YAML document to an AgentSpec, or AgentSpecInvalid naming file and field."""
    return parse_agent_document(document, file=file, known_tools=known_tools, env=env)[0]


def parse_agent_document(
    document: object,
    *,
    file: str,
    known_tools: Collection[str],
    env: Mapping[str, str] | None = None,
) -> tuple[AgentSpec, tuple[DeclaredSource, ...]]:
    """One YAML document to its AgentSpec (imported tools included in `tools`) and
    the tool sources it declares."""
    if not isinstance(document, Mapping):
        raise AgentSpecInvalid(
            file, "<document>", f"expected a mapping of fields, got {type(document).__name__}"
        )
    try:
        fields = SpecFields.model_validate(document, context={"known_tools": known_tools})
    except ValidationError as exc:
        raise _refusal(file, exc) from exc
    tool_sources = parse_tool_sources(
        fields.tool_sources or [], file=file, builtin_tools=tuple(known_tools), env=env
    )
    imported = tuple(name for source in tool_sources for name in source.tools)
    spec = AgentSpec(
        name=fields.name,
        description=fields.description,
        tier=fields.tier,
        system_prompt=fields.system_prompt,
        tools=(*fields.tools, *imported),
        sources=fields.sources,
        budgets=Budgets(
            tokens=fields.budgets.tokens,
            model_calls=fields.budgets.model_calls,
            wall_seconds=fields.budgets.wall_seconds,
        ),
        reads_memory=fields.reads_memory,
        file=file,
    )
    return spec, tool_sources


def load_agent_specs(
    folder: Path, *, known_tools: Collection[str], env: Mapping[str, str] | None = None
) -> AgentCatalog:
    """Every `*.yaml`/`*.yml` file in `folder` (one spec each); names must be unique."""
    if not folder.is_dir():
        raise AgentSpecInvalid(
            str(folder), "<folder>", "the agents folder does not exist (set CAIRN_AGENTS_DIR)"
        )
    specs: dict[str, AgentSpec] = {}
    declared: list[DeclaredSource] = []
    for path in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        try:
            document = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise AgentSpecInvalid(str(path), "<document>", f"is not valid YAML: {exc}") from exc
        spec, tool_sources = parse_agent_document(
            document, file=str(path), known_tools=known_tools, env=env
        )
        declared.extend(tool_sources)
        if spec.name in specs:
            raise AgentSpecInvalid(
                str(path),
                "name",
                f"{spec.name!r} is already the name of the agent in {specs[spec.name].file}",
            )
        specs[spec.name] = spec
    return AgentCatalog(list(specs.values()), tool_sources=merge_sources(declared))


# ---------------------------------------------------------------- the declared shape
#
# The fields are pydantic models (unknown keys refused); each check raises the
# sentence a person fixing the file needs, and _refusal turns the first error into
# `file: field 'x': problem` with the field's path (`tools[1]`, `budgets.tokens`).


def _non_empty(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{value!r} must be a non-empty string")
    return value.strip()


def _names(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{value!r} must be a list of names (an empty list is allowed)")
    names: list[str] = []
    for index, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise _ItemProblem(index, f"{item!r} must be a non-empty string")
        if item.strip() in names:
            raise _ItemProblem(index, f"{item!r} is listed twice")
        names.append(item.strip())
    return tuple(names)


def _positive_whole(value: object) -> int:
    # bool is an int in Python; `tokens: true` is a typo, not a budget of 1.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{value!r} must be a positive whole number")
    return value


def _known_tier(value: object) -> str:
    tier = _non_empty(value)
    if tier not in TIERS:
        raise ValueError(f"{tier!r} is not one of {', '.join(TIERS)}")
    return tier


class _ItemProblem(ValueError):
    """A problem with one item of a list field, so the refusal names `field[index]`."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(problem)
        self.index = index
        self.problem = problem


NonEmpty = Annotated[str, BeforeValidator(_non_empty)]
Names = Annotated[tuple[str, ...], BeforeValidator(_names)]
PositiveWhole = Annotated[int, BeforeValidator(_positive_whole)]


class _Declared(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BudgetFields(_Declared):
    tokens: PositiveWhole
    model_calls: PositiveWhole
    wall_seconds: PositiveWhole

    @model_validator(mode="before")
    @classmethod
    def _a_mapping(cls, value: object) -> object:
        if not isinstance(value, Mapping):
            raise ValueError(f"{value!r} must be a mapping with {', '.join(cls.model_fields)}")
        return value


class SpecFields(_Declared):
    """One agent spec file as declared; `known_tools` comes in the validation context."""

    name: NonEmpty
    description: NonEmpty
    tier: Annotated[Tier, BeforeValidator(_known_tier)]
    system_prompt: NonEmpty
    budgets: BudgetFields
    tools: Names = ()
    sources: Names = ()
    reads_memory: bool = False
    tool_sources: object = None

    @field_validator("name")
    @classmethod
    def _agent_name(cls, name: str) -> str:
        if not NAME_PATTERN.match(name):
            raise ValueError(
                f"{name!r} must be lower-case letters, digits, '-' or '_', starting with a letter"
            )
        return name

    @field_validator("tools")
    @classmethod
    def _registered_tools(cls, tools: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        known: Collection[str] = (info.context or {}).get("known_tools", ())
        for index, tool in enumerate(tools):
            if tool not in known:
                raise _ItemProblem(
                    index,
                    f"{tool!r} is not a registered tool; known tools: {', '.join(sorted(known))}",
                )
        return tools

    @field_validator("sources")
    @classmethod
    def _source_names(cls, sources: tuple[str, ...]) -> tuple[str, ...]:
        for index, source in enumerate(sources):
            if not SOURCE_PATTERN.match(source):
                raise _ItemProblem(
                    index, f"{source!r} must be letters, digits, '_', '.', ':' or '-'"
                )
        return sources

    @field_validator("reads_memory", mode="before")
    @classmethod
    def _true_or_false(cls, value: object) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} must be true or false")
        return value


_KNOWN: Mapping[str, tuple[str, str]] = {
    "": ("is not a spec field; known fields", ", ".join(SpecFields.model_fields)),
    "budgets": ("is not a budget; known budgets", ", ".join(BudgetFields.model_fields)),
}


def _refusal(file: str, exc: ValidationError) -> AgentSpecInvalid:
    """The first problem pydantic found, as the loader's `file: field: problem`."""
    first = exc.errors()[0]
    path = [str(part) for part in first["loc"]]
    field = ".".join(path)
    if first["type"] == "missing":
        return AgentSpecInvalid(file, field, "is required")
    if first["type"] == "extra_forbidden":
        said, known = _KNOWN[".".join(path[:-1])]
        return AgentSpecInvalid(file, field, f"{said}: {known}")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, _ItemProblem):
        return AgentSpecInvalid(file, f"{field}[{cause.index}]", cause.problem)
    return AgentSpecInvalid(file, field, first["msg"].removeprefix("Value error, "))
