"""CancelRun against the real store: a person stops their run. The model call in
flight is cancelled (on this orchestrator, or on another one working the run,
which notices through the run's state); a pending confirmation can no longer be
approved; a write already approved and begun finishes or not, exactly once, and
the trajectory says which. Only the run's own person may cancel; a run that has
ended cannot be, and says its state. A cancelled run's pending write is
abandoned, and ForgetCopies still reaches what it copied (I9)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from cairn_libs.db import Database
from cairn_libs.errors import InvalidInput
from cairn_libs.identity import Principal
from cairn_orchestrator.domain import Run, RunState, Step, StepKind
from cairn_orchestrator.errors import ConfirmationClosed, RunEnded, RunNotVisible
from cairn_orchestrator.memory_tools import memory_tools
from cairn_orchestrator.postgres import SCHEMA, migrations
from cairn_orchestrator.run_scope import Caller
from cairn_orchestrator.testing import (
    FakeMemory,
    HeldReply,
    ScriptedGateway,
    answer,
    tool_calls,
)
from services.orchestrator.tests.test_orchestrator_confirmations import (
    Harness,
    confirmation_state,
    until,
)

NOTE = ("note", '{"text":"likes tea"}')


@pytest.fixture(scope="module")
async def database(pg_url: str) -> AsyncIterator[Database]:
    db = Database(url=pg_url, schema=SCHEMA, migrations=migrations())
    assert await db.ready()
    yield db
    await db.close()


async def _lease_owner(harness: Harness, run_id: str) -> str | None:
    async with harness.database.pool.acquire() as conn:
        owner: str | None = await conn.fetchval(
            "SELECT lease_owner FROM runs WHERE run_id = $1", run_id
        )
    return owner


def _holding(harness: Harness) -> HeldReply:
    """The harness's next model call never answers by itself."""
    held = HeldReply()
    harness.gateway.replies.append(held)
    return held


async def _pending(harness: Harness) -> Run:
    harness.gateway.replies.append(tool_calls(NOTE))
    run = await harness.ask()
    assert run.state is RunState.CONFIRMATION_PENDING
    return run


def _cancel_steps(steps: list[Step]) -> list[Step]:
    return [
        s
        for s in steps
        if s.kind is StepKind.CONFIRMATION_RESOLVED and s.detail["decision"] == "CANCELLED"
    ]


# ---------------------------------------------------------------- during a model call


async def test_cancelling_during_a_model_call_cancels_the_call_and_ends_the_run_cancelled(
    database: Database, new_org: str
) -> None:
    harness = Harness(database, ScriptedGateway([]), new_org)
    held = _holding(harness)
    asking = asyncio.create_task(harness.ask())
    await asyncio.wait_for(held.started.wait(), 10)
    (run_id,) = harness.loop.active_run_ids()

    cancelled = await harness.orchestrator.cancel_run(
        harness.alice, run_id, reason="  I asked the wrong question  "
    )
    assert cancelled.state is RunState.CANCELLED and cancelled.cancelled_by == "alice"
    assert cancelled.reason == "cancelled by alice: I asked the wrong question"

    ended = await asyncio.wait_for(asking, 10)
    assert held.cancelled.is_set()
    assert ended.state is RunState.CANCELLED and ended.cancelled_by == "alice"
    last = (await harness.steps(ended))[-1]
    assert last.kind is StepKind.MODEL_CALL and last.error is not None
    assert last.error.code == "run.cancelled"
    assert await _lease_owner(harness, run_id) is None
    assert harness.loop.active_run_ids() == ()


async def test_a_cancel_through_another_orchestrator_reaches_the_one_working_the_run(
    database: Database, new_org: str
) -> None:
    working = Harness(database, ScriptedGateway([]), new_org)
    held = _holding(working)
    asking = asyncio.create_task(working.ask())
    await asyncio.wait_for(held.started.wait(), 10)
    (run_id,) = working.loop.active_run_ids()
    other = Harness(database, ScriptedGateway([]), new_org)

    await other.orchestrator.cancel_run(other.alice, run_id, reason="")

    ended = await asyncio.wait_for(asking, 10)
    assert held.cancelled.is_set()
    assert ended.state is RunState.CANCELLED and ended.reason == "cancelled by alice"
    assert [s.error.code for s in await working.steps(ended) if s.error] == ["run.cancelled"]


# ---------------------------------------------------------------- a pending confirmation


async def test_a_cancelled_runs_pending_confirmation_can_no_longer_be_approved(
    harness: Harness,
) -> None:
    run = await _pending(harness)
    token = run.pending_confirmation.confirmation_token  # type: ignore[union-attr]

    cancelled = await harness.orchestrator.cancel_run(harness.alice, run.run_id, reason="no")
    assert cancelled.state is RunState.CANCELLED and cancelled.pending_confirmation is None
    assert "the note it waited on was abandoned and did not run" in cancelled.reason
    assert await confirmation_state(harness, token) == "ABANDONED"
    (step,) = _cancel_steps(await harness.steps(run))
    assert step.detail["write"] == "not_run" and step.detail["resolved_by"] == "alice"
    assert await harness.orchestrator.pending_confirmations(harness.alice.principal) == []

    with pytest.raises(
        ConfirmationClosed,
        match="was cancelled, so this confirmation for note can no longer be approved; its write did not run",
    ):
        await harness.resolve(run)
    with pytest.raises(ConfirmationClosed, match="can no longer be denied"):
        await harness.resolve(run, "deny")
    assert harness.written == []
    assert harness.gateway.requests[1:] == []


async def test_a_write_already_being_carried_out_finishes_once_and_the_trajectory_says_so(
    harness: Harness,
) -> None:
    run = await _pending(harness)
    token = run.pending_confirmation.confirmation_token  # type: ignore[union-attr]
    harness.write_gate = asyncio.Event()
    approving = asyncio.create_task(harness.resolve(run))
    await until(lambda: bool(harness.written))

    cancelled = await harness.orchestrator.cancel_run(harness.alice, run.run_id)
    assert "was being carried out; it completes or not, at most once" in cancelled.reason
    harness.write_gate.set()
    approved = await asyncio.wait_for(approving, 10)

    assert approved.state is RunState.CANCELLED
    assert len(harness.written) == 1 and await confirmation_state(harness, token) == "EXECUTED"
    steps = await harness.steps(run)
    (cancel,) = _cancel_steps(steps)
    assert cancel.detail["write"] == "in_flight"
    write = steps[-1]
    assert write.kind is StepKind.TOOL_CALL and write.detail["after_cancel"] is True
    assert write.detail["result"] == {"noted": "likes tea"} and write.seq > cancel.seq
    assert len(harness.gateway.requests) == 1  # the run went no further
    assert await _lease_owner(harness, run.run_id) is None


async def test_approvals_racing_a_cancel_have_one_outcome_and_the_write_happens_at_most_once(
    database: Database, new_org: str
) -> None:
    rng = random.Random(14)
    outcomes: set[str] = set()
    for _ in range(12):
        harness = Harness(database, ScriptedGateway([]), new_org)
        run = await _pending(harness)
        harness.gateway.replies.append(answer("Noted."))

        async def later(work: Any) -> Any:
            await asyncio.sleep(rng.random() * 0.03)
            return await work

        results = await asyncio.gather(
            *(later(harness.resolve(run)) for _ in range(4)),
            later(harness.orchestrator.cancel_run(harness.alice, run.run_id, reason="stop")),
            return_exceptions=True,
        )
        approvals, cancel = results[:4], results[4]
        for result in approvals:
            assert isinstance(result, Run | ConfirmationClosed), result
        final = await harness.orchestrator.get_run(harness.alice.principal, run.run_id)
        steps = await harness.steps(run)
        writes = [s for s in steps if s.kind is StepKind.TOOL_CALL and s.detail.get("confirmed")]
        assert len(harness.written) <= 1 and len(writes) == len(harness.written)
        if final.state is RunState.COMPLETED:
            assert isinstance(cancel, RunEnded) and len(harness.written) == 1
            outcomes.add("completed")
            continue
        assert final.state is RunState.CANCELLED and isinstance(cancel, Run)
        (record,) = _cancel_steps(steps)
        if harness.written:
            assert record.detail["write"] in ("in_flight", "done")
            outcomes.add("written then cancelled")
        else:
            assert record.detail["write"] == "not_run"
            outcomes.add("cancelled unwritten")
        for result in approvals:
            if isinstance(result, Run):
                assert result.state is RunState.CANCELLED
    assert outcomes  # each round came out as exactly one of the outcomes above


# ---------------------------------------------------------------- who may, and when


async def test_only_the_runs_own_person_may_cancel_it(harness: Harness) -> None:
    run = await _pending(harness)
    org = harness.org
    strangers = [
        Caller(Principal(org_id=org, user_id="bob"), token="t"),
        Caller(Principal(org_id=org, user_id="root", roles=("admin",)), token="t"),
        Caller(Principal(org_id=f"{org}-x", user_id="alice"), token="t"),
        Caller(Principal(org_id=org, user_id="alice"), token="t", is_person=False),
    ]
    for caller in strangers:
        with pytest.raises(RunNotVisible):
            await harness.orchestrator.cancel_run(caller, run.run_id)
    with pytest.raises(RunNotVisible):
        await harness.orchestrator.cancel_run(harness.alice, "run_does_not_exist")
    still = await harness.orchestrator.get_run(harness.alice.principal, run.run_id)
    assert still.state is RunState.CONFIRMATION_PENDING


async def test_cancelling_a_run_that_has_ended_is_refused_naming_its_state(
    harness: Harness,
) -> None:
    harness.gateway.replies.append(answer("Done."))
    done = await harness.ask()
    with pytest.raises(RunEnded, match=r"has already ended \(COMPLETED\)"):
        await harness.orchestrator.cancel_run(harness.alice, done.run_id)
    run = await _pending(harness)
    await harness.orchestrator.cancel_run(harness.alice, run.run_id)
    with pytest.raises(RunEnded, match=r"\(CANCELLED\)"):
        await harness.orchestrator.cancel_run(harness.alice, run.run_id)
    assert (await harness.kinds(done))[-1] == "MODEL_CALL"


async def test_a_reason_too_long_or_unstorable_is_invalid_input(harness: Harness) -> None:
    run = await _pending(harness)
    with pytest.raises(InvalidInput, match="at most 2000"):
        await harness.orchestrator.cancel_run(harness.alice, run.run_id, reason="x" * 2001)
    with pytest.raises(InvalidInput, match="U\\+0000"):
        await harness.orchestrator.cancel_run(harness.alice, run.run_id, reason="a\x00b")
    still = await harness.orchestrator.get_run(harness.alice.principal, run.run_id)
    assert still.state is RunState.CONFIRMATION_PENDING


# ---------------------------------------------------------------- erasure (I9)


async def test_forget_copies_still_reaches_a_cancelled_runs_abandoned_write(
    harness: Harness,
) -> None:
    for tool in memory_tools(FakeMemory(), clock=harness.clock):
        harness.registry.register(tool)
    spec = replace(harness.spec, tools=(*harness.spec.tools, "remember"))
    secret = "Is interviewing with a competitor."
    harness.gateway.replies.append(
        tool_calls(("remember", f'{{"text":"{secret}","subject":{{"kind":"USER"}}}}'))
    )
    run = await harness.ask(spec)
    token = run.pending_confirmation.confirmation_token  # type: ignore[union-attr]
    await harness.orchestrator.cancel_run(harness.alice, run.run_id, reason="never mind")
    assert await confirmation_state(harness, token) == "ABANDONED"

    erased = await harness.store.erase_copies(
        org_id=harness.org, subject_kind="USER", subject_id="alice"
    )

    assert erased.runs == 1 and erased.confirmations_abandoned == 0
    async with harness.database.pool.acquire() as conn:
        kept = await conn.fetchval(
            "SELECT concat_ws(' ', arguments_json, card::text) FROM confirmations "
            "WHERE confirmation_token = $1",
            token,
        )
    assert secret not in kept
    assert all(secret not in str(s.detail) for s in await harness.steps(run))
    ended = await harness.orchestrator.get_run(harness.alice.principal, run.run_id)
    assert ended.state is RunState.CANCELLED and ended.cancelled_by == "alice"


@pytest.fixture
def harness(database: Database, new_org: str) -> Harness:
    return Harness(database, ScriptedGateway([]), new_org)
