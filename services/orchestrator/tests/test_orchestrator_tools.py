"""The tool contract and dispatcher: every way a tool call can go wrong comes back
as data, results are capped and marked, writes cannot be registered without a
card, and search_knowledge reads only the spec's sources."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from cairn_libs.identity import Principal
from cairn_orchestrator.domain import (
    CallCredentials,
    ConfirmationCard,
    ErrorValue,
    LabelBook,
    ToolCallRequest,
)
from cairn_orchestrator.errors import DependencyFailed, ToolContractViolation
from cairn_orchestrator.knowledge_tool import KNOWLEDGE_UNAVAILABLE, search_knowledge_tool
from cairn_orchestrator.testing import FakeRetrieval, chunk
from cairn_orchestrator.tools import (
    INVALID_INPUT,
    TOOL_FAILED,
    UNKNOWN_TOOL,
    Tool,
    ToolContext,
    ToolRegistry,
    ToolResult,
    dispatch,
    render_result,
)

CREDENTIALS = CallCredentials(caller_token="caller-token", actor_token="actor-token")
ECHO_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}, "times": {"type": "integer", "minimum": 1}},
    "required": ["text"],
    "additionalProperties": False,
}


def context(
    *, sources: tuple[str, ...] = ("handbook",), labels: LabelBook | None = None
) -> ToolContext:
    return ToolContext(
        principal=Principal(org_id="org-a", user_id="alice"),
        run_id="run_1",
        agent="handbook",
        remaining_tokens=1000,
        sources=sources,
        credentials=CREDENTIALS,
        labels=labels or LabelBook(),
    )


def read_tool(handler: Any, *, name: str = "echo", cap: int = 256 * 1024) -> Tool:
    return Tool(
        name=name,
        description="Echo.",
        parameters=ECHO_SCHEMA,
        effect="read",
        handler=handler,
        result_byte_cap=cap,
    )


async def echo(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    return ToolResult(content={"echo": arguments["text"] * int(arguments.get("times", 1))})


def call(arguments: str, *, name: str = "echo") -> ToolCallRequest:
    return ToolCallRequest(id="call-1", name=name, arguments_json=arguments)


def registry_with(*tools: Tool) -> ToolRegistry:
    registry = ToolRegistry()
    for tool in tools:
        registry.register(tool)
    return registry


# ---------------------------------------------------------------- dispatcher


async def test_valid_arguments_reach_the_handler_and_its_result_goes_back_as_json() -> None:
    outcome = await dispatch(
        registry_with(read_tool(echo)), call('{"text":"hi","times":2}'), context()
    )
    assert outcome.error is None
    assert json.loads(outcome.content) == {"echo": "hihi"}
    assert outcome.detail()["arguments"] == {"text": "hi", "times": 2}
    assert outcome.truncated is False


@pytest.mark.parametrize(
    ("arguments", "mentions"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"times": 2}', "'text' is a required property"),
        ('{"text": "hi", "times": 0}', "argument times"),
        ('{"text": "hi", "sources": ["payroll"]}', "Additional properties"),
    ],
)
async def test_arguments_the_schema_refuses_never_reach_the_handler(
    arguments: str, mentions: str
) -> None:
    reached = []

    async def handler(args: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        reached.append(args)
        return ToolResult(content={})

    outcome = await dispatch(registry_with(read_tool(handler)), call(arguments), context())
    assert reached == []
    assert outcome.error is not None and outcome.error.code == INVALID_INPUT
    assert mentions in outcome.error.message
    assert json.loads(outcome.content) == {"error": outcome.error.to_json()}


async def test_a_handler_that_raises_becomes_error_data_not_an_exception() -> None:
    async def broken(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        raise RuntimeError("database password is hunter2")

    outcome = await dispatch(registry_with(read_tool(broken)), call('{"text":"x"}'), context())
    assert outcome.error is not None and outcome.error.code == TOOL_FAILED
    assert "RuntimeError" in outcome.error.message
    assert "hunter2" not in outcome.content  # the model reads the code, not internals


async def test_an_error_value_from_the_handler_is_passed_on_as_data() -> None:
    async def refusing(arguments: Mapping[str, Any], ctx: ToolContext) -> ErrorValue:
        return ErrorValue("echo.too_loud", "that is too loud")

    outcome = await dispatch(registry_with(read_tool(refusing)), call('{"text":"x"}'), context())
    assert outcome.error == ErrorValue("echo.too_loud", "that is too loud")


async def test_an_unknown_tool_is_answered_with_error_data() -> None:
    outcome = await dispatch(
        registry_with(read_tool(echo)), call("{}", name="format_disk"), context()
    )
    assert outcome.error is not None and outcome.error.code == UNKNOWN_TOOL


async def test_a_result_above_the_byte_cap_is_cut_at_the_cap_and_marked_truncated() -> None:
    tool = read_tool(echo, cap=1024)
    outcome = await dispatch(registry_with(tool), call('{"text":"é","times":5000}'), context())
    assert outcome.truncated is True
    assert len(outcome.content.encode("utf-8")) <= 1024
    assert "[truncated: this result was cut at 1024 bytes" in outcome.content
    assert outcome.result_bytes > 1024
    assert outcome.detail()["truncated"] is True


def test_a_result_exactly_at_the_cap_is_not_truncated() -> None:
    rendered = render_result("x" * 300, byte_cap=300)
    assert rendered.truncated is False and rendered.text == "x" * 300
    cut = render_result("x" * 301, byte_cap=300)
    assert cut.truncated is True and len(cut.text.encode()) <= 300


# ---------------------------------------------------------------- registration


def test_registering_a_write_tool_without_a_card_is_refused() -> None:
    write = Tool(
        name="remember",
        description="Keep.",
        parameters={"type": "object"},
        effect="write",
        handler=echo,
    )
    with pytest.raises(ToolContractViolation, match="confirmation card"):
        ToolRegistry().register(write)


def test_a_write_tool_with_a_card_registers_and_always_needs_confirmation() -> None:
    write = Tool(
        name="remember",
        description="Keep.",
        parameters={"type": "object"},
        effect="write",
        handler=echo,
        card=lambda arguments, ctx: ConfirmationCard(summary="Keep a note"),
        needs_confirmation=False,
    )
    registry = registry_with(write)
    tool = registry.get("remember")
    assert tool is not None and tool.confirmation_required is True


@pytest.mark.parametrize(
    "tool",
    [
        Tool(
            name="bad name",
            description="",
            parameters={"type": "object"},
            effect="read",
            handler=echo,
        ),
        Tool(name="t", description="", parameters={"type": 12}, effect="read", handler=echo),
        Tool(name="t", description="", parameters={"type": "string"}, effect="read", handler=echo),
        Tool(
            name="t",
            description="",
            parameters={"type": "object"},
            effect="read",
            handler=echo,
            needs_confirmation=True,
        ),
    ],
)
def test_a_tool_that_breaks_the_contract_is_refused_at_registration(tool: Tool) -> None:
    with pytest.raises(ToolContractViolation):
        ToolRegistry().register(tool)


def test_one_name_cannot_be_registered_twice() -> None:
    registry = registry_with(read_tool(echo))
    with pytest.raises(ToolContractViolation, match="already registered"):
        registry.register(read_tool(echo))


# ---------------------------------------------------------------- search_knowledge


async def test_search_knowledge_ignores_sources_the_model_names_and_uses_the_specs() -> None:
    retrieval = FakeRetrieval(results=[chunk(1)])
    registry = registry_with(search_knowledge_tool(retrieval))
    outcome = await dispatch(
        registry,
        call('{"query":"salaries","sources":["payroll","hr-private"]}', name="search_knowledge"),
        context(sources=("handbook",)),
    )
    assert outcome.error is None
    assert [c.sources for c in retrieval.calls] == [("handbook",)]
    assert retrieval.calls[0].credentials == CREDENTIALS


async def test_search_knowledge_with_no_sources_reads_nothing_and_calls_nobody() -> None:
    retrieval = FakeRetrieval(results=[chunk(1)])
    outcome = await dispatch(
        registry_with(search_knowledge_tool(retrieval)),
        call('{"query":"anything"}', name="search_knowledge"),
        context(sources=()),
    )
    assert retrieval.calls == []
    assert json.loads(outcome.content)["results"] == []


async def test_search_results_are_labelled_after_the_prefetched_passages() -> None:
    labels = LabelBook()
    labels.label(chunk(1))
    labels.label(chunk(2))
    retrieval = FakeRetrieval(results=[chunk(2), chunk(3)])
    outcome = await dispatch(
        registry_with(search_knowledge_tool(retrieval)),
        call('{"query":"leave"}', name="search_knowledge"),
        context(labels=labels),
    )
    content = json.loads(outcome.content)
    assert [(r["label"], r["document_id"]) for r in content["results"]] == [
        ("S2", "doc-2"),
        ("S3", "doc-3"),
    ]
    assert set(content["results"][0]) == {
        "label",
        "title",
        "text",
        "source",
        "document_id",
        "chunk_id",
    }
    assert content["mode"] == "HYBRID"
    assert [e.label for e in outcome.knowledge] == ["S2", "S3"]


async def test_a_failed_search_is_error_data_for_the_model() -> None:
    retrieval = FakeRetrieval(
        failure=DependencyFailed("retrieval", "UNAVAILABLE", "connection refused")
    )
    outcome = await dispatch(
        registry_with(search_knowledge_tool(retrieval)),
        call('{"query":"leave"}', name="search_knowledge"),
        context(),
    )
    assert outcome.error is not None and outcome.error.code == KNOWLEDGE_UNAVAILABLE
