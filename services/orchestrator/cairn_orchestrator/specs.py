"""Which agents exist: YAML spec files in one folder, validated when loaded.

A spec is configuration a deployment writes by hand, so every refusal names the
file and the field and says what would be accepted; a bad spec stops the service
at start-up rather than failing a caller's run later. Unknown fields are refused
too, because a misspelt `reads_memroy: true` silently meaning "false" is worse
than a start-up error.

`tool_sources` imports tools from a company's own systems (tool_sources.py
parses that part); the imported tools join the agent's `tools`, and the catalog
keeps every declared source, merged across specs, for the app to connect.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from cairn_orchestrator.domain import TIERS, AgentSpec, Budgets, Tier
from cairn_orchestrator.errors import AgentSpecInvalid, UnknownAgent
from cairn_orchestrator.tool_sources import DeclaredSource, merge_sources, parse_tool_sources

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
SOURCE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
REQUIRED_FIELDS = ("name", "description", "tier", "system_prompt", "budgets")
OPTIONAL_FIELDS = ("tools", "sources", "reads_memory", "tool_sources")
BUDGET_FIELDS = ("tokens", "model_calls", "wall_seconds")


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
    unknown = sorted(str(k) for k in document if k not in REQUIRED_FIELDS + OPTIONAL_FIELDS)
    if unknown:
        raise AgentSpecInvalid(
            file,
            unknown[0],
            f"is not a spec field; known fields: {', '.join(REQUIRED_FIELDS + OPTIONAL_FIELDS)}",
        )
    for name in REQUIRED_FIELDS:
        if name not in document:
            raise AgentSpecInvalid(file, name, "is required")

    name = _text(document, "name", file=file)
    if not NAME_PATTERN.match(name):
        raise AgentSpecInvalid(
            file,
            "name",
            f"{name!r} must be lower-case letters, digits, '-' or '_', starting with a letter",
        )
    tier_value = _text(document, "tier", file=file)
    if tier_value not in TIERS:
        raise AgentSpecInvalid(file, "tier", f"{tier_value!r} is not one of {', '.join(TIERS)}")
    tier: Tier = tier_value  # type: ignore[assignment]  # narrowed by the membership test above

    tools = _names(document, "tools", file=file)
    for index, tool in enumerate(tools):
        if tool not in known_tools:
            raise AgentSpecInvalid(
                file,
                f"tools[{index}]",
                f"{tool!r} is not a registered tool; known tools: {', '.join(sorted(known_tools))}",
            )
    sources = _names(document, "sources", file=file)
    for index, source in enumerate(sources):
        if not SOURCE_PATTERN.match(source):
            raise AgentSpecInvalid(
                file,
                f"sources[{index}]",
                f"{source!r} must be letters, digits, '_', '.', ':' or '-'",
            )

    reads_memory = document.get("reads_memory", False)
    if not isinstance(reads_memory, bool):
        raise AgentSpecInvalid(file, "reads_memory", f"{reads_memory!r} must be true or false")
    tool_sources = parse_tool_sources(
        document.get("tool_sources") or [], file=file, builtin_tools=tuple(known_tools), env=env
    )
    imported = tuple(name for source in tool_sources for name in source.tools)

    spec = AgentSpec(
        name=name,
        description=_text(document, "description", file=file),
        tier=tier,
        system_prompt=_text(document, "system_prompt", file=file),
        tools=(*tools, *imported),
        sources=sources,
        budgets=_budgets(document["budgets"], file=file),
        reads_memory=reads_memory,
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


def _text(document: Mapping[str, Any], field: str, *, file: str) -> str:
    value = document[field]
    if not isinstance(value, str) or not value.strip():
        raise AgentSpecInvalid(file, field, f"{value!r} must be a non-empty string")
    return value.strip()


def _names(document: Mapping[str, Any], field: str, *, file: str) -> tuple[str, ...]:
    value = document.get(field) or []
    if not isinstance(value, list):
        raise AgentSpecInvalid(
            file, field, f"{value!r} must be a list of names (an empty list is allowed)"
        )
    names: list[str] = []
    for index, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise AgentSpecInvalid(
                file, f"{field}[{index}]", f"{item!r} must be a non-empty string"
            )
        if item.strip() in names:
            raise AgentSpecInvalid(file, f"{field}[{index}]", f"{item!r} is listed twice")
        names.append(item.strip())
    return tuple(names)


def _budgets(value: object, *, file: str) -> Budgets:
    if not isinstance(value, Mapping):
        raise AgentSpecInvalid(
            file, "budgets", f"{value!r} must be a mapping with {', '.join(BUDGET_FIELDS)}"
        )
    unknown = sorted(str(k) for k in value if k not in BUDGET_FIELDS)
    if unknown:
        raise AgentSpecInvalid(
            file,
            f"budgets.{unknown[0]}",
            f"is not a budget; known budgets: {', '.join(BUDGET_FIELDS)}",
        )
    numbers: dict[str, int] = {}
    for name in BUDGET_FIELDS:
        if name not in value:
            raise AgentSpecInvalid(file, f"budgets.{name}", "is required")
        number = value[name]
        # bool is an int in Python; `tokens: true` is a typo, not a budget of 1.
        if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
            raise AgentSpecInvalid(
                file, f"budgets.{name}", f"{number!r} must be a positive whole number"
            )
        numbers[name] = number
    return Budgets(
        tokens=numbers["tokens"],
        model_calls=numbers["model_calls"],
        wall_seconds=numbers["wall_seconds"],
    )
