"""Confirmed writes through the loop, against the real PostgreSQL store: a write
stops the run for its person, an approval runs it once and resumes the run with
nothing replayed, a denial reaches the model as data, only the run's own person
may decide, confirmations expire, and a run an orchestrator stopped in is given
back to its person (an approval in flight) or ended with the reason.

The model, retrieval and memory are in-memory fakes; the store is real, because
what is being tested is mostly what the store's transactions guarantee."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from cairn_libs.clock import FakeClock
from cairn_libs.db import Database
from cairn_libs.errors import InvalidInput
from cairn_libs.fence import block_body as tool_data
from cairn_libs.identity import Principal
from cairn_orchestrator.confirmations import ResolutionRecord, looks_like_token
from cairn_orchestrator.domain import (
    AgentSpec,
    Budgets,
    CardDetail,
    ConfirmationCard,
    ConfirmationState,
    Run,
    RunEventKind,
    RunState,
    Step,
    StepKind,
)
from cairn_orchestrator.errors import (
    ConfirmationClosed,
    DependencyFailed,
    RunNotVisible,
    RunTakenOver,
)
from cairn_orchestrator.knowledge_tool import search_knowledge_tool
from cairn_orchestrator.loop import LoopSettings, RunLoop
from cairn_orchestrator.orchestrator import Orchestrator
from cairn_orchestrator.postgres import SCHEMA, PostgresRunStore, migrations
from cairn_orchestrator.run_scope import Caller
from cairn_orchestrator.specs import AgentCatalog
from cairn_orchestrator.testing import (
    FakeMemory,
    FakeRetrieval,
    HeldReply,
    ScriptedGateway,
    answer,
    chunk,
    handbook_spec,
    tool_calls,
)
from cairn_orchestrator.tools import DENIED, Tool, ToolContext, ToolRegistry, ToolResult

NOTE = ("note", '{"text":"likes tea"}')
SEARCH = ("search_knowledge", '{"query":"tea"}')


def rate_limited(detail: str = "provider 'first' is rate limited") -> DependencyFailed:
    return DependencyFailed("gateway", "RESOURCE_EXHAUSTED", detail, reason="PROVIDERRATELIMITED")


@pytest.fixture(scope="module")
async def database(pg_url: str) -> AsyncIterator[Database]:
    db = Database(url=pg_url, schema=SCHEMA, migrations=migrations())
    assert await db.ready()
    yield db
    await db.close()


class CountingRunStore(PostgresRunStore):
    """The real store, counting the resolutions it answered (a test can wait until
    every request it sent has been decided)."""

    resolutions = 0

    async def resolve_confirmation(self, **arguments: Any) -> ResolutionRecord:
        record = await super().resolve_confirmation(**arguments)
        self.resolutions += 1
        return record


@dataclass
class Harness:
    """One orchestrator "process": a loop over its own store (its own lease owner)."""

    database: Database
    gateway: ScriptedGateway
    org: str
    ttl_seconds: float = 3600.0
    lease_seconds: float = 30.0
    clock: FakeClock = field(default_factory=FakeClock)
    written: list[tuple[Mapping[str, Any], str | None]] = field(default_factory=list)
    write_gate: asyncio.Event | None = None
    # More tools to register, and the names the agent is offered.
    extra_tools: Sequence[Tool] = ()
    offered: tuple[str, ...] = ("search_knowledge", "note")

    def __post_init__(self) -> None:
        self.store = CountingRunStore(self.database, lease_seconds=self.lease_seconds)
        self.retrieval = FakeRetrieval(results=[chunk(1)])
        self.registry = ToolRegistry()
        self.registry.register(search_knowledge_tool(self.retrieval))
        for tool in self.extra_tools:
            self.registry.register(tool)

        async def note(arguments: Mapping[str, Any], context: ToolContext) -> ToolResult:
            self.written.append((arguments, context.confirmation_token))
            if self.write_gate is not None:
                await self.write_gate.wait()
            return ToolResult(content={"noted": arguments["text"]})

        self.registry.register(
            Tool(
                name="note",
                description="Keep a note.",
                parameters={
                    "type": "object",
                    "properties": {"text": {"type": "string", "minLength": 1}},
                    "required": ["text"],
                },
                effect="write",
                handler=note,
                card=lambda arguments, context: ConfirmationCard(
                    summary=f"Keep the note {arguments['text']!r}",
                    details=(CardDetail("About", "you"),),
                    warnings=("Kept for 90 days.",),
                ),
            )
        )
        self.loop = RunLoop(
            store=self.store,
            gateway=self.gateway,
            retrieval=self.retrieval,
            memory=FakeMemory(),
            registry=self.registry,
            mint_actor_token=lambda run_id, agent: f"actor-{run_id}",
            clock=self.clock,
            settings=LoopSettings(
                confirmation_ttl_seconds=self.ttl_seconds, settle_poll_seconds=0.02
            ),
            confirmations=self.store,
        )
        self.spec = handbook_spec(tools=self.offered, reads_memory=False)
        self.orchestrator = Orchestrator(
            catalog=AgentCatalog([self.spec]),
            loop=self.loop,
            store=self.store,
            confirmations=self.store,
            stream_poll_seconds=0.02,
            confirmation_ttl_seconds=self.ttl_seconds,
        )
        self.alice = Caller(Principal(org_id=self.org, user_id="alice"), token="alice-token")

    async def ask(self, spec: AgentSpec | None = None) -> Run:
        return await self.loop.start(
            spec=spec or self.spec,
            caller=self.alice,
            question="Please remember that I like tea.",
            conversation_id="",
            earlier=[],
        )

    async def resolve(
        self, run: Run, decision: str = "approve", *, note: str = "", caller: Caller | None = None
    ) -> Run:
        assert run.pending_confirmation is not None
        return await self.orchestrator.resolve_confirmation(
            caller or self.alice,
            run.pending_confirmation.confirmation_token,
            decision="approve" if decision == "approve" else "deny",
            note=note,
        )

    async def steps(self, run: Run) -> list[Step]:
        return await self.store.list_steps(org_id=self.org, run_id=run.run_id)

    async def kinds(self, run: Run) -> list[str]:
        return [s.kind.value for s in await self.steps(run)]


@pytest.fixture
def harness(database: Database, new_org: str) -> Harness:
    return Harness(database, ScriptedGateway([]), new_org)


async def until(predicate: Callable[[], Awaitable[bool] | bool], *, seconds: float = 10) -> None:
    """Wait on an event the code under test causes, never longer than `seconds`."""
    async with asyncio.timeout(seconds):
        while True:
            value = predicate()
            if value if isinstance(value, bool) else await value:
                return
            await asyncio.sleep(0.01)


def script(harness: Harness, *replies: Any) -> None:
    harness.gateway.replies.extend(replies)


async def confirmation_expired(harness: Harness, token: str) -> bool:
    """Whether the store's clock is past the confirmation's expiry."""
    async with harness.database.pool.acquire() as conn:
        expired: bool = await conn.fetchval(
            "SELECT expires_at <= clock_timestamp() FROM confirmations "
            "WHERE confirmation_token = $1",
            token,
        )
    return expired


async def lease_ran_out(harness: Harness, run_id: str) -> bool:
    """Whether the store's clock is past the run's lease (no lease: ran out)."""
    async with harness.database.pool.acquire() as conn:
        ran_out: bool = await conn.fetchval(
            "SELECT coalesce(lease_until <= clock_timestamp(), true) FROM runs WHERE run_id = $1",
            run_id,
        )
    return ran_out


def token_of(run: Run) -> str:
    assert run.pending_confirmation is not None
    return run.pending_confirmation.confirmation_token


async def confirmation_state(harness: Harness, token: str) -> str:
    async with harness.database.pool.acquire() as conn:
        state: str = await conn.fetchval(
            "SELECT state FROM confirmations WHERE confirmation_token = $1", token
        )
    return state


# ---------------------------------------------------------------- proposing


async def test_a_proposed_write_stops_the_run_for_its_person_after_the_reads_beside_it_ran(
    harness: Harness,
) -> None:
    script(harness, tool_calls(NOTE, SEARCH))
    run = await harness.ask()

    assert run.state is RunState.CONFIRMATION_PENDING
    assert harness.written == []
    pending = run.pending_confirmation
    assert pending is not None and looks_like_token(pending.confirmation_token)
    assert pending.tool_name == "note" and pending.card.summary == "Keep the note 'likes tea'"
    assert pending.card.warnings == ("Kept for 90 days.",)
    assert (pending.expires_at - pending.created_at).total_seconds() == pytest.approx(3600, abs=1)
    # The read of the same turn ran first; the write waits.
    assert await harness.kinds(run) == [
        "RETRIEVAL",
        "MODEL_CALL",
        "TOOL_CALL",
        "CONFIRMATION_REQUESTED",
    ]
    requested = (await harness.steps(run))[-1]
    assert requested.detail["card"]["summary"] == "Keep the note 'likes tea'"
    assert requested.detail["arguments"] == {"text": "likes tea"}
    assert requested.detail["tool_call_id"] == "call-0"
    listed = await harness.orchestrator.pending_confirmations(harness.alice.principal)
    assert [p.confirmation_token for p in listed] == [pending.confirmation_token]
    assert (await harness.orchestrator.get_run(harness.alice.principal, run.run_id)).state is (
        RunState.CONFIRMATION_PENDING
    )


async def test_a_write_with_invalid_arguments_goes_back_to_the_model_without_asking_anyone(
    harness: Harness,
) -> None:
    script(harness, tool_calls(("note", '{"text": ""}')), answer("Sorry, nothing to keep."))
    run = await harness.ask()
    assert run.state is RunState.COMPLETED
    assert await harness.orchestrator.pending_confirmations(harness.alice.principal) == []
    tool_step = (await harness.steps(run))[2]
    assert tool_step.kind is StepKind.TOOL_CALL and tool_step.error is not None
    assert tool_step.error.code == "tool.invalid_input"


# ---------------------------------------------------------------- approving


async def test_an_approval_runs_the_write_once_and_resumes_the_run_replaying_nothing(
    harness: Harness,
) -> None:
    script(harness, tool_calls(NOTE, SEARCH), answer("Noted that you like tea."))
    run = await harness.ask()
    token = run.pending_confirmation.confirmation_token  # type: ignore[union-attr]
    harness.clock.advance(600)  # the person took ten minutes

    done = await harness.resolve(run, note="yes please")

    assert done.state is RunState.COMPLETED and done.answer == "Noted that you like tea."
    assert done.pending_confirmation is None
    assert harness.written == [({"text": "likes tea"}, token)]
    # Two model calls in all: the first one was not made again.
    assert len(harness.gateway.requests) == 2
    second = harness.gateway.requests[1].messages
    assert [m.role for m in second[-3:]] == ["assistant", "tool", "tool"]
    assert {m.tool_call_id for m in second[-2:]} == {"call-0", "call-1"}
    assert json.loads(tool_data(next(m for m in second if m.tool_call_id == "call-0").content)) == {
        "noted": "likes tea"
    }
    assert len(harness.retrieval.calls) == 2  # the prefetch and the one search: not replayed
    assert await harness.kinds(done) == [
        "RETRIEVAL",
        "MODEL_CALL",
        "TOOL_CALL",
        "CONFIRMATION_REQUESTED",
        "CONFIRMATION_RESOLVED",
        "TOOL_CALL",
        "MODEL_CALL",
    ]
    steps = await harness.steps(done)
    assert [s.seq for s in steps] == list(range(1, 8))
    resolved, executed = steps[4], steps[5]
    assert resolved.detail["decision"] == "APPROVE" and resolved.detail["resolved_by"] == "alice"
    assert resolved.detail["note"] == "yes please" and resolved.detail["resolved_at"]
    assert resolved.detail["card"]["summary"] == "Keep the note 'likes tea'"
    assert executed.name == "note" and executed.detail["result"] == {"noted": "likes tea"}
    assert executed.detail["confirmed"] is True and executed.detail["attempt"] == 1
    assert await confirmation_state(harness, token) == "EXECUTED"
    assert await harness.orchestrator.pending_confirmations(harness.alice.principal) == []


async def test_two_approvals_at_the_same_moment_run_the_write_once_and_both_see_the_outcome(
    harness: Harness,
) -> None:
    script(harness, tool_calls(NOTE), answer("Noted."))
    run = await harness.ask()
    harness.write_gate = asyncio.Event()

    first = asyncio.create_task(harness.resolve(run))
    second = asyncio.create_task(harness.resolve(run))
    await until(lambda: bool(harness.written))
    await until(lambda: harness.store.resolutions == 2)  # both decided; one holds the run
    harness.write_gate.set()
    outcomes = await asyncio.gather(first, second)

    assert len(harness.written) == 1
    assert [o.state for o in outcomes] == [RunState.COMPLETED, RunState.COMPLETED]
    assert len(harness.gateway.requests) == 2
    assert (await harness.kinds(run)).count("CONFIRMATION_RESOLVED") == 1


async def test_approving_again_after_the_run_finished_runs_nothing_and_returns_the_run(
    harness: Harness,
) -> None:
    script(harness, tool_calls(NOTE), answer("Noted."))
    run = await harness.ask()
    await harness.resolve(run)
    again = await harness.resolve(run)
    assert again.state is RunState.COMPLETED and len(harness.written) == 1
    with pytest.raises(ConfirmationClosed, match="already approved by 'alice'"):
        await harness.resolve(run, "deny")


async def test_two_writes_in_one_turn_are_asked_about_one_after_the_other(
    harness: Harness,
) -> None:
    script(
        harness,
        tool_calls(NOTE, ("note", '{"text":"likes coffee"}')),
        answer("Noted both."),
    )
    run = await harness.ask()
    first = run.pending_confirmation
    second_run = await harness.resolve(run)
    assert second_run.state is RunState.CONFIRMATION_PENDING
    second = second_run.pending_confirmation
    assert first is not None and second is not None
    assert second.confirmation_token != first.confirmation_token
    assert second.card.summary == "Keep the note 'likes coffee'"
    assert len(harness.gateway.requests) == 1  # the model waits for both answers
    done = await harness.resolve(second_run, "deny")
    assert done.state is RunState.COMPLETED
    assert [w for w, _ in harness.written] == [{"text": "likes tea"}]
    last = harness.gateway.requests[1].messages
    assert [m.tool_call_id for m in last if m.role == "tool"] == ["call-0", "call-1"]


async def test_a_later_turn_may_propose_a_write_whose_call_id_repeats_an_earlier_one(
    harness: Harness,
) -> None:
    # Some providers number the calls of every reply from zero.
    script(
        harness, tool_calls(NOTE), tool_calls(("note", '{"text":"likes cake"}')), answer("Both.")
    )
    run = await harness.ask()
    again = await harness.resolve(run)
    assert again.state is RunState.CONFIRMATION_PENDING
    assert again.pending_confirmation is not None
    assert again.pending_confirmation.card.summary == "Keep the note 'likes cake'"
    done = await harness.resolve(again)
    assert done.state is RunState.COMPLETED
    assert [w for w, _ in harness.written] == [{"text": "likes tea"}, {"text": "likes cake"}]


# ---------------------------------------------------------------- denying


async def test_a_denial_reaches_the_model_as_a_tool_message_with_the_persons_note(
    harness: Harness,
) -> None:
    script(harness, tool_calls(NOTE), answer("Understood, I will not keep it."))
    run = await harness.ask()
    done = await harness.resolve(run, "deny", note="not this one")

    assert done.state is RunState.COMPLETED
    assert harness.written == []
    tool_message = harness.gateway.requests[1].messages[-1]
    assert tool_message.role == "tool" and tool_message.tool_call_id == "call-0"
    error = json.loads(tool_data(tool_message.content))["error"]
    assert error["code"] == DENIED and "not this one" in error["message"]
    steps = await harness.steps(done)
    resolved, denied = steps[-3], steps[-2]
    assert resolved.kind is StepKind.CONFIRMATION_RESOLVED
    assert resolved.detail["decision"] == "DENY" and resolved.detail["note"] == "not this one"
    assert denied.kind is StepKind.TOOL_CALL and denied.error is not None
    assert denied.error.code == DENIED


# ---------------------------------------------------------------- who may decide


async def test_only_the_runs_own_person_may_resolve_and_everyone_else_gets_the_one_denial(
    harness: Harness,
) -> None:
    script(harness, tool_calls(NOTE), answer("Noted."))
    run = await harness.ask()
    org = harness.org
    strangers = [
        Caller(Principal(org_id=org, user_id="bob"), token="t"),
        Caller(Principal(org_id=org, user_id="root", roles=("admin",)), token="t"),
        Caller(Principal(org_id=f"{org}-x", user_id="alice"), token="t"),
        # alice's own token, but carried by a service acting: not a person deciding.
        Caller(Principal(org_id=org, user_id="alice"), token="t", is_person=False),
    ]
    for caller in strangers:
        with pytest.raises(RunNotVisible):
            await harness.resolve(run, caller=caller)
    with pytest.raises(RunNotVisible):
        await harness.orchestrator.resolve_confirmation(
            harness.alice, "cnf_" + "x" * 43, decision="approve"
        )
    assert harness.written == []
    admin = Principal(org_id=org, user_id="root", roles=("admin",))
    assert len(await harness.orchestrator.pending_confirmations(admin)) == 1
    bob = Principal(org_id=org, user_id="bob")
    assert await harness.orchestrator.pending_confirmations(bob) == []
    assert (await harness.resolve(run)).state is RunState.COMPLETED


async def test_a_note_longer_than_accepted_is_invalid_input(harness: Harness) -> None:
    script(harness, tool_calls(NOTE))
    run = await harness.ask()
    with pytest.raises(InvalidInput, match="at most 2000"):
        await harness.resolve(run, note="x" * 2001)


# ---------------------------------------------------------------- expiry


async def test_an_expired_confirmation_cannot_be_approved_and_its_run_ends_with_the_reason(
    database: Database, new_org: str
) -> None:
    harness = Harness(database, ScriptedGateway([tool_calls(NOTE)]), new_org, ttl_seconds=0.2)
    run = await harness.ask()
    await until(lambda: confirmation_expired(harness, token_of(run)))
    with pytest.raises(ConfirmationClosed, match="expired at .* without a decision"):
        await harness.resolve(run)
    assert harness.written == []
    ended = await harness.orchestrator.get_run(harness.alice.principal, run.run_id)
    assert ended.state is RunState.FAILED and "expired" in ended.reason
    assert "the write did not run" in ended.reason
    last = (await harness.steps(run))[-1]
    assert last.kind is StepKind.CONFIRMATION_RESOLVED and last.detail["decision"] == "EXPIRED"
    with pytest.raises(ConfirmationClosed, match="expired"):
        await harness.resolve(run)


async def test_the_upkeep_ends_runs_whose_confirmation_expired_unanswered(
    database: Database, new_org: str
) -> None:
    harness = Harness(database, ScriptedGateway([tool_calls(NOTE)]), new_org, ttl_seconds=0.2)
    run = await harness.ask()
    await until(lambda: confirmation_expired(harness, token_of(run)))
    await harness.orchestrator.keep_up()
    ended = await harness.orchestrator.get_run(harness.alice.principal, run.run_id)
    assert ended.state is RunState.FAILED and "expired" in ended.reason
    assert await harness.orchestrator.pending_confirmations(harness.alice.principal) == []


# ---------------------------------------------------------------- budgets and failover


async def test_waiting_for_a_person_does_not_count_against_the_wall_time_budget(
    harness: Harness,
) -> None:
    spec = replace(harness.spec, budgets=Budgets(tokens=20_000, model_calls=6, wall_seconds=30))
    script(harness, tool_calls(NOTE), answer("Noted."))
    run = await harness.loop.start(
        spec=spec, caller=harness.alice, question="q", conversation_id="", earlier=[]
    )
    harness.clock.advance(3000)
    assert (await harness.resolve(run)).state is RunState.COMPLETED


async def test_a_rate_limit_after_tools_reruns_the_turn_from_the_question_on_the_next_provider(
    harness: Harness,
) -> None:
    script(harness, tool_calls(SEARCH), rate_limited(), answer("Tea is fine [S1]."))
    run = await harness.ask()

    assert run.state is RunState.COMPLETED and run.answer == "Tea is fine [S1]."
    first, refused, rerun = harness.gateway.requests
    assert refused.pinned_provider == "scripted"
    # The re-run carries the opening messages only, and pins no provider.
    assert rerun.messages == first.messages and len(rerun.messages) == 2
    assert rerun.pinned_provider == ""
    steps = await harness.steps(run)
    failed = [s for s in steps if s.kind is StepKind.MODEL_CALL and s.error is not None]
    assert len(failed) == 1 and "re-run from the question" in failed[0].detail["rerun"]


async def test_a_run_that_carried_a_confirmation_is_never_replayed_after_a_rate_limit(
    harness: Harness,
) -> None:
    script(harness, tool_calls(NOTE), rate_limited())
    run = await harness.ask()
    done = await harness.resolve(run)

    assert done.state is RunState.FAILED
    assert "carried a confirmed write" in done.reason and "not replayed" in done.reason
    assert len(harness.gateway.requests) == 2 and len(harness.written) == 1


async def test_the_turn_is_rerun_only_once(harness: Harness) -> None:
    script(harness, tool_calls(SEARCH), rate_limited(), tool_calls(SEARCH), rate_limited())
    run = await harness.ask()
    assert run.state is RunState.FAILED and "re-run once" in run.reason
    assert len(harness.gateway.requests) == 4


async def test_a_call_that_cannot_fit_the_runs_token_budget_ends_it_budget_exhausted(
    harness: Harness,
) -> None:
    refusal = DependencyFailed(
        "gateway",
        "RESOURCE_EXHAUSTED",
        "run 'r' has 40 tokens left, and this call may use 900",
        reason="RUNBUDGETEXCEEDED",
    )
    script(harness, refusal)
    run = await harness.ask()
    assert run.state is RunState.BUDGET_EXHAUSTED and "40 tokens left" in run.reason


# ---------------------------------------------------------------- an orchestrator that stopped


async def _interrupted(
    database: Database, new_org: str, *, stop_when: str
) -> tuple[Harness, Harness, Run]:
    """Alice approves on orchestrator A, which stops (its task is cancelled, its
    lease runs out) at `stop_when`; orchestrator B's upkeep finds the run."""
    a = Harness(database, ScriptedGateway([tool_calls(NOTE)]), new_org, lease_seconds=0.3)
    run = await a.ask()
    a.write_gate = asyncio.Event()
    if stop_when == "after_write":
        a.write_gate.set()
    # What A asks the model after the write never comes back.
    held = HeldReply()
    a.gateway.replies.append(held)
    approving = asyncio.create_task(a.resolve(run))
    token = run.pending_confirmation.confirmation_token  # type: ignore[union-attr]
    wanted = {"executing": "EXECUTING", "after_write": "EXECUTED"}[stop_when]

    async def reached() -> bool:
        return await confirmation_state(a, token) == wanted

    await until(reached)
    # A got as far as it will: into the write, or into the call after it.
    if stop_when == "executing":
        await until(lambda: bool(a.written))
    else:
        await asyncio.wait_for(held.started.wait(), 10)
    await _die(a)
    approving.cancel()
    await asyncio.gather(approving, return_exceptions=True)
    await until(lambda: lease_ran_out(a, run.run_id))
    b = Harness(database, ScriptedGateway([answer("Noted.")]), new_org)
    b.written = a.written
    await b.orchestrator.keep_up()
    return a, b, await b.orchestrator.get_run(b.alice.principal, run.run_id)


async def test_a_run_stopped_while_its_write_ran_goes_back_to_its_person_and_finishes_once(
    database: Database, new_org: str
) -> None:
    _, b, run = await _interrupted(database, new_org, stop_when="executing")
    assert run.state is RunState.CONFIRMATION_PENDING
    pending = run.pending_confirmation
    assert pending is not None and pending.state is ConfirmationState.EXECUTING
    assert "may already have taken effect" in pending.card.warnings[0]
    listed = await b.orchestrator.pending_confirmations(b.alice.principal)
    assert [p.confirmation_token for p in listed] == [pending.confirmation_token]
    with pytest.raises(ConfirmationClosed, match="has begun"):
        await b.resolve(run, "deny")

    done = await b.resolve(run)
    assert done.state is RunState.COMPLETED and done.answer == "Noted."
    # Handed over twice with the same idempotency key: the target applies it once.
    assert [token for _, token in b.written] == [pending.confirmation_token] * 2
    executed = [s for s in await b.steps(done) if s.kind is StepKind.TOOL_CALL]
    assert [s.detail["attempt"] for s in executed] == [2]
    resolved = [s for s in await b.steps(done) if s.kind is StepKind.CONFIRMATION_RESOLVED]
    assert [s.detail["resumed_after_interruption"] for s in resolved] == [False, True]


async def test_a_run_stopped_after_its_write_was_recorded_continues_without_running_it_again(
    database: Database, new_org: str
) -> None:
    _, b, run = await _interrupted(database, new_org, stop_when="after_write")
    assert run.state is RunState.CONFIRMATION_PENDING
    assert run.pending_confirmation is not None
    assert run.pending_confirmation.state is ConfirmationState.EXECUTED
    done = await b.resolve(run)
    assert done.state is RunState.COMPLETED
    assert len(b.written) == 1
    assert len(b.gateway.requests) == 1  # B made only the call that never came back on A


async def test_a_run_stopped_with_no_approval_in_flight_is_ended_with_the_reason(
    database: Database, new_org: str
) -> None:
    a = Harness(database, ScriptedGateway([]), new_org, lease_seconds=0.3)
    held = HeldReply()
    a.gateway.replies.append(held)
    asking = asyncio.create_task(a.ask())
    await asyncio.wait_for(held.started.wait(), 10)
    (run_id,) = a.loop.active_run_ids()
    await _die(a)
    await asyncio.gather(asking, return_exceptions=True)
    await until(lambda: lease_ran_out(a, run_id))
    b = Harness(database, ScriptedGateway([]), new_org)
    await b.orchestrator.keep_up()
    runs = await b.orchestrator.list_runs(b.alice.principal, requested_size=5, page_token="")
    (ended,) = runs.runs
    assert ended.state is RunState.FAILED
    assert "orchestrator stopped while this run was working" in ended.reason


async def _die(harness: Harness) -> None:
    """What a killed process leaves: its runs' tasks gone, nothing written after."""
    await harness.loop.abandon()


async def test_an_orchestrator_whose_run_was_taken_over_writes_nothing_more(
    database: Database, new_org: str
) -> None:
    a = Harness(database, ScriptedGateway([]), new_org, lease_seconds=0.2)
    held = HeldReply()
    a.gateway.replies.append(held)
    asking = asyncio.create_task(a.ask())
    await asyncio.wait_for(held.started.wait(), 10)
    run_id = a.loop.active_run_ids()[0]
    await until(lambda: lease_ran_out(a, run_id))  # A is alive, with no upkeep here
    b = Harness(database, ScriptedGateway([]), new_org)
    await b.orchestrator.keep_up()
    steps_before = await b.store.list_steps(org_id=new_org, run_id=run_id)
    await _die(a)
    await asyncio.gather(asking, return_exceptions=True)
    with pytest.raises(RunTakenOver):
        await a.store.finish_run(
            org_id=new_org,
            run_id=run_id,
            state=RunState.COMPLETED,
            loop_state=None,
            usage=(await b.orchestrator.get_run(b.alice.principal, run_id)).usage,
        )
    assert await b.store.list_steps(org_id=new_org, run_id=run_id) == steps_before


# ---------------------------------------------------------------- following a run


async def test_following_a_run_shows_steps_starting_the_pending_write_and_the_rest_after_approval(
    harness: Harness,
) -> None:
    script(harness, tool_calls(NOTE), answer("Noted."))
    run = await harness.ask()
    events: list[Any] = []

    async def follow() -> None:
        async for event in harness.orchestrator.follow(harness.alice.principal, run.run_id):
            events.append(event)

    following = asyncio.create_task(follow())
    await until(lambda: any(e.kind is RunEventKind.CONFIRMATION_PENDING for e in events))
    harness.write_gate = asyncio.Event()
    resolving = asyncio.create_task(harness.resolve(run))
    # The write is announced while it is still being carried out.
    await until(
        lambda: any(e.started is not None and e.started.kind is StepKind.TOOL_CALL for e in events)
    )
    harness.write_gate.set()
    done = await resolving
    await asyncio.wait_for(following, timeout=10)

    kinds = [e.kind.value for e in events]
    assert kinds[:4] == ["STEP_FINISHED"] * 3 + ["CONFIRMATION_PENDING"]
    assert kinds[-2:] == ["ANSWER", "RUN_FINISHED"]
    finished = [e.step for e in events if e.kind is RunEventKind.STEP_FINISHED]
    assert [s.seq for s in finished] == list(range(1, 7))
    assert [s.kind for s in finished] == [s.kind for s in await harness.steps(done)]
    write_started = next(
        i
        for i, e in enumerate(events)
        if e.started is not None and e.started.kind is StepKind.TOOL_CALL
    )
    write_finished = next(
        i for i, e in enumerate(events) if e.step is not None and e.step.kind is StepKind.TOOL_CALL
    )
    assert write_started < write_finished
    assert events[-1].run.state is RunState.COMPLETED
