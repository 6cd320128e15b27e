"""What an agent spec may say about imported tools, the cards it templates, and
the rules the dispatcher applies to an imported tool, without a network: a
source here is a fake that answers from memory."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cairn_libs.identity import Principal
from cairn_orchestrator.domain import CallCredentials, ErrorValue, LabelBook, ToolCallRequest
from cairn_orchestrator.errors import AgentSpecInvalid, ToolContractViolation
from cairn_orchestrator.specs import load_agent_specs
from cairn_orchestrator.tool_sources import (
    CardText,
    ImportedTool,
    ListedTool,
    ToolSources,
    Transport,
    imported_tool,
    interpolate,
    render_card,
)
from cairn_orchestrator.tools import ToolContext, ToolRegistry, ToolResult, dispatch

BUILTINS = ("search_knowledge",)
SCHEMA = {"type": "object", "properties": {"days": {"type": "integer"}}}


def spec(tools: str, *, address: str = "127.0.0.1:1", extra: str = "") -> str:
    return f"""\
name: people
description: d
tier: balanced
system_prompt: p
tools: [search_knowledge]
budgets: {{tokens: 100, model_calls: 2, wall_seconds: 10}}
tool_sources:
  - name: directory
    transport: grpc
    address: "{address}"
{extra}    tools:
{tools}"""


def load(tmp_path: Path, text: str, env: Mapping[str, str] | None = None) -> Any:
    (tmp_path / "people.yaml").write_text(text)
    return load_agent_specs(tmp_path, known_tools=BUILTINS, env=env or {})


CARD = """\
        card:
          en: {summary: "Book {days} days", details: {Days: "{days}"}, warnings: ["Taken at once."]}
          zh-Hans: {summary: "请假 {days} 天"}
"""


# ---------------------------------------------------------------- the spec


def test_imported_tools_join_the_agents_tools_and_the_source_is_kept(tmp_path: Path) -> None:
    catalog = load(
        tmp_path,
        spec(
            "      count_open_positions: {effect: read}\n      request_leave:\n        effect: write\n"
            + CARD
        ),
    )

    assert catalog.get("people").tools == (
        "search_knowledge",
        "count_open_positions",
        "request_leave",
    )
    [source] = catalog.tool_sources
    assert (source.name, source.transport, source.address) == ("directory", "grpc", "127.0.0.1:1")
    assert source.tools["request_leave"].effect == "write"


def test_a_write_tool_without_a_card_does_not_load_and_the_message_names_it(tmp_path: Path) -> None:
    with pytest.raises(AgentSpecInvalid) as refused:
        load(tmp_path, spec("      request_leave: {effect: write}\n"))

    assert "request_leave" in str(refused.value)
    assert "confirmation card" in str(refused.value)
    assert "tool_sources[0].tools.request_leave.card" in str(refused.value)


def test_a_card_without_english_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AgentSpecInvalid, match=r"card\.en.*English card is required"):
        load(
            tmp_path,
            spec(
                "      request_leave:\n        effect: write\n        card: {zh-Hans: {summary: x}}\n"
            ),
        )


def test_an_unknown_key_of_an_imported_tool_is_refused_with_its_path_and_the_known_fields(
    tmp_path: Path,
) -> None:
    with pytest.raises(AgentSpecInvalid) as refused:
        load(tmp_path, spec("      count_open_positions: {effect: read, timeout: 5}\n"))

    message = str(refused.value)
    assert "tool_sources[0].tools.count_open_positions.timeout" in message
    assert "is not a field here" in message
    assert "timeout_seconds" in message


def test_an_unknown_key_of_a_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AgentSpecInvalid, match=r"tool_sources\[0\]\.url.*known fields: name"):
        load(tmp_path, spec("      x: {effect: read}\n", extra="    url: http://x\n"))


def test_an_effect_that_is_neither_read_nor_write_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AgentSpecInvalid, match=r"effect.*'delete'"):
        load(tmp_path, spec("      x: {effect: delete}\n"))


def test_an_imported_tool_may_not_take_a_built_in_name(tmp_path: Path) -> None:
    with pytest.raises(AgentSpecInvalid, match="name of a built-in tool"):
        load(tmp_path, spec("      search_knowledge: {effect: read}\n"))


def test_a_card_template_may_name_arguments_only(tmp_path: Path) -> None:
    with pytest.raises(AgentSpecInvalid, match=r"is not allowed; name an argument"):
        load(
            tmp_path,
            spec(
                "      w:\n        effect: write\n        card: {en: {summary: '{days.__class__}'}}\n"
            ),
        )


def test_the_address_reads_the_environment_and_a_missing_variable_is_named(tmp_path: Path) -> None:
    text = spec("      x: {effect: read}\n", address="${PEOPLE_ADDR:-127.0.0.1:9}")
    assert load(tmp_path, text).tool_sources[0].address == "127.0.0.1:9"
    assert load(tmp_path, text, {"PEOPLE_ADDR": "dir:1"}).tool_sources[0].address == "dir:1"
    with pytest.raises(AgentSpecInvalid, match=r"\$\{NOWHERE\}, which is not set"):
        load(tmp_path, spec("      x: {effect: read}\n", address="${NOWHERE}"))


def test_two_specs_may_not_declare_one_tool_differently(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(spec("      x: {effect: read}\n"))
    (tmp_path / "b.yaml").write_text(
        spec("      x: {effect: read, timeout_seconds: 3}\n").replace("name: people", "name: other")
    )
    with pytest.raises(AgentSpecInvalid, match="declared differently"):
        load_agent_specs(tmp_path, known_tools=BUILTINS, env={})


def test_interpolation_leaves_an_address_without_variables_alone() -> None:
    assert interpolate("http://dir:8080/mcp", {}) == "http://dir:8080/mcp"


# ---------------------------------------------------------------- cards


CARDS = {
    "en": CardText(summary="Book {days} days", details={"Days": "{days}"}, warnings=("At once.",)),
    "zh-Hans": CardText(summary="请假 {days} 天", details={"天数": "{days}"}),
}


def test_a_card_renders_in_the_runs_language_with_the_arguments_filled_in() -> None:
    card = render_card(CARDS, {"days": 3}, language="zh-Hans")

    assert card.summary == "请假 3 天"
    assert [(d.label, d.value) for d in card.details] == [("天数", "3")]
    assert (card.language, card.language_fallback) == ("zh-Hans", False)


def test_a_card_without_the_runs_language_falls_back_to_english_and_says_so() -> None:
    card = render_card({"en": CARDS["en"]}, {"days": 2}, language="zh-Hans")

    assert card.summary == "Book 2 days"
    assert card.warnings == ("At once.",)
    assert (card.language, card.language_fallback) == ("en", True)


def test_an_argument_the_model_left_out_reads_as_a_dash_not_as_the_template() -> None:
    assert render_card(CARDS, {}, language="en").summary == "Book — days"


# ---------------------------------------------------------------- the dispatcher


class FakeSource:
    name = "directory"
    transport: Transport = "grpc"

    def __init__(self, listed: tuple[ListedTool, ...] | ErrorValue = ()) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.listed = listed

    async def list_tools(self, *, deadline_seconds: float) -> tuple[ListedTool, ...] | ErrorValue:
        return self.listed

    async def invoke(
        self,
        *,
        tool: str,
        arguments: Mapping[str, Any],
        context: ToolContext,
        deadline_seconds: float,
    ) -> ToolResult | ErrorValue:
        self.calls.append((tool, dict(arguments)))
        return ToolResult(content={"ok": True})

    async def close(self) -> None:
        return None


def context(run_calls: tuple[ToolCallRequest, ...] = (), **extra: Any) -> ToolContext:
    return ToolContext(
        principal=Principal(org_id="org-a", user_id="tom"),
        run_id="run_1",
        agent="people",
        remaining_tokens=1000,
        sources=(),
        credentials=CallCredentials(caller_token="caller", actor_token="actor"),
        labels=LabelBook(),
        run_calls=run_calls,
        **extra,
    )


LISTED = ListedTool(
    name="count", description="count things", parameters=SCHEMA, read_only_hint=True
)


async def test_an_imported_tool_beyond_its_call_budget_is_refused_as_data() -> None:
    source = FakeSource()
    registry = ToolRegistry()
    registry.register(
        imported_tool(source, "count", ImportedTool(effect="read", calls_per_run=2), LISTED)
    )
    calls = tuple(ToolCallRequest(id=f"c{i}", name="count", arguments_json="{}") for i in range(3))

    outcomes = [await dispatch(registry, call, context(calls)) for call in calls]

    assert [o.error.code if o.error else "ok" for o in outcomes] == [
        "ok",
        "ok",
        "tool.call_budget_exhausted",
    ]
    assert len(source.calls) == 2
    assert "at most 2 times" in (outcomes[2].error.message if outcomes[2].error else "")


async def test_a_server_hint_of_read_only_does_not_make_a_declared_write_run_unconfirmed() -> None:
    source = FakeSource()
    registry = ToolRegistry()
    declared = ImportedTool(effect="write", card={"en": CardText(summary="Count {days}")})
    registry.register(imported_tool(source, "count", declared, LISTED))
    call = ToolCallRequest(id="c1", name="count", arguments_json="{}")

    outcome = await dispatch(registry, call, context((call,)))

    assert registry.get("count") is not None and registry.get("count").confirmation_required  # type: ignore[union-attr]
    assert outcome.error is not None and outcome.error.code == "tool.confirmation_unavailable"
    assert source.calls == []


def test_the_registry_refuses_an_imported_write_without_a_card_naming_it() -> None:
    registry = ToolRegistry()
    with pytest.raises(ToolContractViolation, match="'request_leave'.*no confirmation card"):
        registry.register(
            imported_tool(FakeSource(), "request_leave", ImportedTool(effect="write"), LISTED)
        )


async def test_an_imported_tools_step_and_span_name_its_source() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = ToolRegistry()
    registry.register(imported_tool(FakeSource(), "count", ImportedTool(effect="read"), LISTED))
    call = ToolCallRequest(id="c1", name="count", arguments_json='{"days": 1}')

    with provider.get_tracer("test").start_as_current_span("execute_tool count"):
        outcome = await dispatch(registry, call, context((call,)))

    [span] = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["gen_ai.tool.type"] == "extension"
    assert span.attributes["cairn.tool.source"] == "directory"
    assert span.attributes["cairn.tool.transport"] == "grpc"
    assert outcome.detail()["source"] == "directory"
    assert json.loads(outcome.content) == {"ok": True}


async def test_a_source_that_does_not_list_is_retried_and_its_tools_registered_when_it_answers(
    tmp_path: Path,
) -> None:
    catalog = load(tmp_path, spec("      count: {effect: read}\n"))
    source = FakeSource(ErrorValue("tool.unavailable", "down"))
    registry = ToolRegistry()
    sources = ToolSources(
        catalog.tool_sources, connect=lambda _: source, registry=registry, retry_seconds=3600
    )

    await sources.start()
    assert registry.get("count") is None and sources.unlisted == {"directory"}
    source.listed = (LISTED,)
    await sources.list_pending()
    await sources.close()

    tool = registry.get("count")
    assert tool is not None and tool.source == "directory" and sources.unlisted == set()
