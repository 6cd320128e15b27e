"""The loop end to end against in-memory ports: what it calls, with whose
credentials, what it records, and how each budget and each failure ends a run."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from cairn_libs.clock import FakeClock
from cairn_libs.fence import block_body as tool_data
from cairn_libs.identity import Principal
from cairn_orchestrator.domain import (
    AgentSpec,
    Budgets,
    ConfirmationCard,
    ConversationTurn,
    ModelReply,
    ModelRequest,
    Run,
    RunEventKind,
    RunState,
    StepKind,
)
from cairn_orchestrator.errors import BadPageToken, DependencyFailed, RunNotVisible, UnknownAgent
from cairn_orchestrator.knowledge_tool import search_knowledge_tool
from cairn_orchestrator.loop import RunLoop
from cairn_orchestrator.orchestrator import Orchestrator
from cairn_orchestrator.run_scope import Caller
from cairn_orchestrator.specs import AgentCatalog
from cairn_orchestrator.testing import (
    ALICE,
    FakeMemory,
    FakeRetrieval,
    MemoryRunStore,
    ScriptedGateway,
    answer,
    chunk,
    handbook_spec,
    memory,
    tool_calls,
)
from cairn_orchestrator.tools import (
    CONFIRMATION_UNAVAILABLE,
    TOOL_FAILED,
    Tool,
    ToolContext,
    ToolRegistry,
    ToolResult,
)

CALLER = Caller(principal=ALICE, token="alice-own-token")
SEARCH = ("search_knowledge", '{"query":"parental leave","sources":["payroll"]}')


@dataclass
class Harness:
    gateway: ScriptedGateway
    retrieval: FakeRetrieval = field(
        default_factory=lambda: FakeRetrieval(results=[chunk(1), chunk(2)])
    )
    memory: FakeMemory | None = field(default_factory=lambda: FakeMemory(memories=[memory(1)]))
    clock: FakeClock = field(default_factory=FakeClock)
    minted: list[tuple[str, str]] = field(default_factory=list)
    write_runs: list[Mapping[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store = MemoryRunStore(self.clock)
        self.registry = ToolRegistry()
        self.registry.register(search_knowledge_tool(self.retrieval))

        async def flaky(arguments: Mapping[str, Any], context: ToolContext) -> ToolResult:
            raise ValueError("boom")

        async def remember(arguments: Mapping[str, Any], context: ToolContext) -> ToolResult:
            self.write_runs.append(arguments)
            return ToolResult(content={"kept": True})

        self.registry.register(
            Tool(
                name="flaky",
                description="Breaks.",
                parameters={"type": "object"},
                effect="read",
                handler=flaky,
            )
        )
        self.registry.register(
            Tool(
                name="remember",
                description="Keep a note.",
                parameters={"type": "object"},
                effect="write",
                handler=remember,
                card=lambda arguments, context: ConfirmationCard(summary="Keep a note"),
            )
        )

        def mint(run_id: str, agent: str) -> str:
            self.minted.append((run_id, agent))
            return f"actor-token-for-{run_id}"

        self.loop = RunLoop(
            store=self.store,
            gateway=self.gateway,
            retrieval=self.retrieval,
            memory=self.memory,
            registry=self.registry,
            mint_actor_token=mint,
            clock=self.clock,
        )

    async def run(
        self, spec: AgentSpec | None = None, *, question: str = "How much parental leave?"
    ) -> Run:
        return await self.loop.start(
            spec=spec or handbook_spec(),
            caller=CALLER,
            question=question,
            conversation_id="conv-1",
            earlier=[ConversationTurn("user", "hello")],
        )

    def kinds(self, run: Run) -> list[str]:
        return [s.kind.value for s in self.store.runs[run.run_id].steps]

    def steps(self, run: Run) -> list[Any]:
        return self.store.runs[run.run_id].steps


async def test_a_run_recalls_retrieves_searches_and_answers_citing_only_what_it_retrieved() -> None:
    harness = Harness(
        ScriptedGateway([tool_calls(SEARCH), answer("Sixteen weeks [S3]; see also [S9].")]),
        retrieval=FakeRetrieval(results=[chunk(1), chunk(2)], later_results=[chunk(2), chunk(3)]),
    )
    run = await harness.run()

    assert run.state is RunState.COMPLETED
    assert run.answer == "Sixteen weeks [S3]; see also [S9]."
    assert [(c.label, c.document_id) for c in run.citations] == [("S3", "doc-3")]
    assert (run.usage.model_calls, run.usage.total_tokens) == (2, 200)
    assert harness.kinds(run) == [
        "MEMORY_READ",
        "RETRIEVAL",
        "MODEL_CALL",
        "TOOL_CALL",
        "MODEL_CALL",
    ]
    memory_step, retrieval_step, _, tool_step, _ = harness.steps(run)
    assert memory_step.detail["mode"] == "SEMANTIC" and memory_step.detail["memory_ids"] == ["m1"]
    assert [r["label"] for r in retrieval_step.detail["results"]] == ["S1", "S2"]
    assert tool_step.detail["labels"] == ["S2", "S3"]
    # The tool's result went back to the model as role tool, answering its call id.
    second = harness.gateway.requests[1]
    assert second.messages[-1].role == "tool" and second.messages[-1].tool_call_id == "call-0"
    assert [r["label"] for r in json.loads(tool_data(second.messages[-1].content))["results"]] == [
        "S2",
        "S3",
    ]
    assert harness.store.runs[run.run_id].loop_state is not None
    assert harness.store.runs[run.run_id].loop_state.next_phase == "finished"  # type: ignore[union-attr]


async def test_retrieval_and_memory_are_called_with_the_callers_own_token_and_the_runs_actor_token() -> (
    None
):
    harness = Harness(ScriptedGateway([tool_calls(SEARCH), answer("Done [S1].")]))
    run = await harness.run()
    assert harness.minted == [(run.run_id, "handbook")]
    actor = f"actor-token-for-{run.run_id}"
    seen = [c.credentials for c in harness.retrieval.calls]
    seen += [credentials for _, _, credentials in harness.memory.calls]  # type: ignore[union-attr]
    seen += harness.gateway.credentials
    assert len(seen) == 5
    assert {(c.caller_token, c.actor_token) for c in seen} == {("alice-own-token", actor)}
    # The model named a source; only the spec's sources were searched.
    assert [c.sources for c in harness.retrieval.calls] == [("handbook",), ("handbook",)]


async def test_the_prefetch_uses_k_four_and_memory_k_five_with_the_question() -> None:
    harness = Harness(ScriptedGateway([answer("Done.")]))
    await harness.run(question="Where is the office?")
    assert [(c.query, c.k) for c in harness.retrieval.calls] == [("Where is the office?", 4)]
    assert [(q, k) for q, k, _ in harness.memory.calls] == [("Where is the office?", 5)]  # type: ignore[union-attr]


async def test_unreachable_memory_and_retrieval_are_recorded_as_error_data_and_the_run_goes_on() -> (
    None
):
    harness = Harness(
        ScriptedGateway([answer("I could not read the handbook.")]),
        retrieval=FakeRetrieval(
            failure=DependencyFailed("retrieval", "UNAVAILABLE", "connection refused")
        ),
        memory=FakeMemory(failure=DependencyFailed("memory", "DEADLINE_EXCEEDED", "too slow")),
    )
    run = await harness.run(handbook_spec(tools=()))
    assert run.state is RunState.COMPLETED
    memory_step, retrieval_step, _ = harness.steps(run)
    assert memory_step.error.code == "memory.deadline_exceeded"
    assert retrieval_step.error.code == "retrieval.unavailable"
    assert "connection refused" in retrieval_step.error.message
    assert retrieval_step.detail["count"] == 0


async def test_a_deployment_without_memory_records_that_it_keeps_none() -> None:
    harness = Harness(ScriptedGateway([answer("Done.")]), memory=None)
    run = await harness.run(handbook_spec(tools=()))
    assert harness.steps(run)[0].kind is StepKind.MEMORY_READ
    assert harness.steps(run)[0].error.code == "memory.not_configured"
    assert run.state is RunState.COMPLETED


async def test_an_agent_with_no_sources_and_no_memory_reads_nothing() -> None:
    harness = Harness(ScriptedGateway([tool_calls(SEARCH), answer("Nothing to go on.")]))
    run = await harness.run(handbook_spec(sources=(), reads_memory=False))
    assert harness.retrieval.calls == []
    assert harness.memory.calls == []  # type: ignore[union-attr]
    assert harness.kinds(run) == ["MODEL_CALL", "TOOL_CALL", "MODEL_CALL"]
    assert run.citations == ()


async def test_a_failed_model_call_ends_the_run_failed_with_the_reason() -> None:
    harness = Harness(
        ScriptedGateway([DependencyFailed("gateway", "UNAVAILABLE", "every provider is down")])
    )
    run = await harness.run()
    assert run.state is RunState.FAILED
    assert "model call failed" in run.reason and "every provider is down" in run.reason
    assert harness.kinds(run) == ["MEMORY_READ", "RETRIEVAL", "MODEL_CALL"]
    assert harness.steps(run)[-1].error.code == "gateway.unavailable"


async def test_the_model_call_budget_ends_the_run_budget_exhausted_with_its_trajectory() -> None:
    harness = Harness(ScriptedGateway([tool_calls(SEARCH, tokens=10) for _ in range(5)]))
    spec = handbook_spec(budgets=Budgets(tokens=20_000, model_calls=2, wall_seconds=60))
    run = await harness.run(spec)
    assert run.state is RunState.BUDGET_EXHAUSTED
    assert "model-call budget of 2" in run.reason
    assert len(harness.gateway.requests) == 2
    assert harness.kinds(run) == [
        "MEMORY_READ",
        "RETRIEVAL",
        "MODEL_CALL",
        "TOOL_CALL",
        "MODEL_CALL",
    ]
    assert run.usage.model_calls == 2


async def test_the_token_budget_ends_the_run_and_the_gateway_is_told_what_remains() -> None:
    harness = Harness(ScriptedGateway([tool_calls(SEARCH, tokens=100) for _ in range(5)]))
    spec = handbook_spec(budgets=Budgets(tokens=150, model_calls=6, wall_seconds=60))
    run = await harness.run(spec)
    assert run.state is RunState.BUDGET_EXHAUSTED
    assert "token budget of 150" in run.reason
    assert [r.remaining_budget_tokens for r in harness.gateway.requests] == [150, 50]
    assert [r.max_tokens for r in harness.gateway.requests] == [150, 50]


async def test_the_wall_time_budget_stops_the_run_between_steps() -> None:
    gateway = ScriptedGateway([tool_calls(SEARCH), answer("late")])
    harness = Harness(gateway)
    gateway.on_call = lambda: harness.clock.advance(45)
    spec = handbook_spec(budgets=Budgets(tokens=20_000, model_calls=6, wall_seconds=30))
    run = await harness.run(spec)
    assert run.state is RunState.BUDGET_EXHAUSTED
    assert "wall-time budget of 30 s" in run.reason
    assert len(gateway.requests) == 1
    assert harness.kinds(run)[-1] == "MODEL_CALL"


async def test_a_model_call_cut_off_by_the_wall_budget_is_budget_not_failure() -> None:
    harness = Harness(ScriptedGateway([]))

    def too_slow(request: ModelRequest) -> ModelReply:
        harness.clock.advance(61)
        raise DependencyFailed("gateway", "DEADLINE_EXCEEDED", "deadline exceeded")

    harness.gateway.replies.append(too_slow)
    run = await harness.run()
    assert run.state is RunState.BUDGET_EXHAUSTED


async def test_a_tool_that_raises_is_recorded_as_error_data_and_the_run_goes_on() -> None:
    harness = Harness(ScriptedGateway([tool_calls(("flaky", "{}")), answer("Carried on.")]))
    run = await harness.run(handbook_spec(tools=("search_knowledge", "flaky")))
    assert run.state is RunState.COMPLETED
    tool_step = harness.steps(run)[3]
    assert tool_step.kind is StepKind.TOOL_CALL and tool_step.error.code == TOOL_FAILED
    assert (
        json.loads(tool_data(harness.gateway.requests[1].messages[-1].content))["error"]["code"]
        == TOOL_FAILED
    )


async def test_a_write_tool_never_runs_without_a_confirmation() -> None:
    harness = Harness(
        ScriptedGateway(
            [tool_calls(("remember", '{"text":"likes tea"}'), SEARCH), answer("Noted nothing.")]
        )
    )
    run = await harness.run(handbook_spec(tools=("search_knowledge", "remember")))
    assert harness.write_runs == []
    write_step, read_step = harness.steps(run)[3:5]
    assert write_step.name == "remember" and write_step.error.code == CONFIRMATION_UNAVAILABLE
    assert read_step.name == "search_knowledge" and read_step.error is None
    assert run.state is RunState.COMPLETED


async def test_an_unexpected_error_in_the_loop_fails_the_run_instead_of_losing_it() -> None:
    def crash(request: ModelRequest) -> ModelReply:
        raise RuntimeError("a bug")

    harness = Harness(ScriptedGateway([crash]))
    run = await harness.run()
    assert run.state is RunState.FAILED and "RuntimeError" in run.reason
    assert harness.store.runs[run.run_id].run.state is RunState.FAILED


async def test_an_unexpected_error_while_opening_the_run_fails_it_with_the_reason() -> None:
    class BrokenMemory(FakeMemory):
        async def recall(self, **kwargs: Any) -> Any:
            raise RuntimeError("a bug in the adapter")

    harness = Harness(ScriptedGateway([answer("never asked")]), memory=BrokenMemory())
    run = await harness.run()
    assert run.state is RunState.FAILED and "RuntimeError" in run.reason
    assert harness.gateway.requests == []


# ---------------------------------------------------------------- the use cases around the loop


def orchestrator_for(harness: Harness) -> Orchestrator:
    return Orchestrator(
        catalog=AgentCatalog([handbook_spec()]),
        loop=harness.loop,
        store=harness.store,
        stream_poll_seconds=0.01,
    )


async def test_an_unknown_agent_is_refused_naming_it_and_the_known_ones() -> None:
    orchestrator = orchestrator_for(Harness(ScriptedGateway([])))
    with pytest.raises(UnknownAgent, match="'helpdesk'.*'handbook'"):
        await orchestrator.start_run(
            CALLER, agent="helpdesk", question="q", conversation_id="", earlier=[]
        )


async def test_someone_elses_run_reads_exactly_like_a_missing_one_but_an_admin_sees_it() -> None:
    harness = Harness(ScriptedGateway([answer("Done.")]))
    orchestrator = orchestrator_for(harness)
    run = await orchestrator.start_run(
        CALLER, agent="handbook", question="q", conversation_id="", earlier=[]
    )
    bob = Principal(org_id=ALICE.org_id, user_id="bob")
    outsider = Principal(org_id="org-b", user_id="alice", roles=("admin",))
    admin = Principal(org_id=ALICE.org_id, user_id="carol", roles=("admin",))
    for principal, run_id in [(bob, run.run_id), (outsider, run.run_id), (ALICE, "run_missing")]:
        with pytest.raises(RunNotVisible) as refused:
            await orchestrator.get_run(principal, run_id)
        assert refused.value.message == "not found or not permitted"
    assert (await orchestrator.get_run(admin, run.run_id)).run_id == run.run_id
    assert (await orchestrator.trajectory(ALICE, run.run_id)).steps


async def test_list_runs_pages_newest_first_through_the_callers_own_runs() -> None:
    harness = Harness(ScriptedGateway([answer(f"Answer {i}.") for i in range(5)]))
    orchestrator = orchestrator_for(harness)
    started = [
        (
            await orchestrator.start_run(
                CALLER, agent="handbook", question=f"q{i}", conversation_id="", earlier=[]
            )
        ).run_id
        for i in range(3)
    ]
    bob = Caller(Principal(org_id=ALICE.org_id, user_id="bob"), token="bob-token")
    bobs = await orchestrator.start_run(
        bob, agent="handbook", question="b", conversation_id="", earlier=[]
    )
    first = await orchestrator.list_runs(ALICE, requested_size=2, page_token="")
    second = await orchestrator.list_runs(ALICE, requested_size=2, page_token=first.next_page_token)
    assert [r.run_id for r in first.runs + second.runs] == list(reversed(started))
    assert second.next_page_token == ""
    admin = Principal(org_id=ALICE.org_id, user_id="carol", roles=("admin",))
    everyone = await orchestrator.list_runs(admin, requested_size=0, page_token="")
    assert [r.run_id for r in everyone.runs] == [bobs.run_id, *reversed(started)]
    with pytest.raises(BadPageToken):
        await orchestrator.list_runs(ALICE, requested_size=2, page_token="garbage!")


async def test_following_a_finished_run_replays_its_steps_then_its_answer_and_the_run() -> None:
    harness = Harness(ScriptedGateway([answer("Done [S1].")]))
    orchestrator = orchestrator_for(harness)
    run = await orchestrator.start_run(
        CALLER, agent="handbook", question="q", conversation_id="", earlier=[]
    )
    events = [event async for event in orchestrator.follow(ALICE, run.run_id)]
    assert [e.kind for e in events] == [
        RunEventKind.STEP_FINISHED,
        RunEventKind.STEP_FINISHED,
        RunEventKind.STEP_FINISHED,
        RunEventKind.ANSWER,
        RunEventKind.RUN_FINISHED,
    ]
    assert [e.step.seq for e in events[:3]] == [1, 2, 3]  # type: ignore[union-attr]
    assert events[-1].run is not None and events[-1].run.state is RunState.COMPLETED
