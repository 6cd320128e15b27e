"""The run store's seams: the records a decision leaves are built in pure code
(store_decisions.py), and each PostgreSQL concern (pg/) works on its own over the
one schema, so a newcomer can change one without the others."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from cairn_libs.db import Database
from cairn_orchestrator.confirmations import CancelEffect, Claim, Recovered
from cairn_orchestrator.domain import (
    ChatMessage,
    Confirmation,
    ConfirmationCard,
    ConfirmationProposal,
    ConfirmationState,
    LoopState,
    RunState,
    RunUsage,
    StepKind,
    StepRecord,
    ToolCallRequest,
)
from cairn_orchestrator.errors import RunCancelled, RunTakenOver
from cairn_orchestrator.pg.confirmations import PgConfirmations
from cairn_orchestrator.pg.leases import PgLeases
from cairn_orchestrator.pg.runs import PgRuns
from cairn_orchestrator.postgres import SCHEMA, migrations
from cairn_orchestrator.store_decisions import (
    cancel_step,
    claim_records,
    claimed_state,
    expiry_step,
    why_lost,
    write_after_erasure,
    write_step_after_cancel,
)
from cairn_orchestrator.tools import DENIED

NOW = datetime(2025, 6, 1, 12, tzinfo=UTC)
WRITE = ToolCallRequest(id="call-1", name="remember", arguments_json='{"text":"likes tea"}')
CONFIRMATION = Confirmation(
    token="c_" + "a" * 32,
    org_id="org-a",
    run_id="run_1",
    user_id="alice",
    call=WRITE,
    card=ConfirmationCard(summary="Remember that you like tea"),
    state=ConfirmationState.PENDING,
    created_at=NOW - timedelta(minutes=5),
    expires_at=NOW + timedelta(hours=1),
)
WAITING = LoopState(
    messages=(ChatMessage("system", "s"), ChatMessage("user", "u")),
    knowledge=(),
    usage=RunUsage(),
    next_phase="confirm_writes",
    pending_calls=(WRITE,),
)


def claim(decision: str, *, resumed: bool = False) -> tuple[list[StepRecord], LoopState]:
    return claim_records(
        CONFIRMATION,
        Claim("approve" if decision == "approve" else "deny", resumed=resumed),
        loop_state=WAITING,
        resolved_by="alice",
        note="not now",
        now=NOW,
        span_id="span-1",
        started_at=NOW,
    )


def test_an_approval_records_one_resolved_step_and_leaves_the_loop_state_to_the_write() -> None:
    steps, state = claim("approve")
    assert [s.kind for s in steps] == [StepKind.CONFIRMATION_RESOLVED]
    assert steps[0].detail["decision"] == "APPROVE" and state == WAITING
    assert claimed_state(Claim("approve", resumed=False)) is ConfirmationState.APPROVED


def test_a_denial_records_the_answer_the_model_reads_as_data_and_moves_the_loop_on() -> None:
    steps, state = claim("deny")
    assert [s.kind for s in steps] == [StepKind.CONFIRMATION_RESOLVED, StepKind.TOOL_CALL]
    assert steps[1].error is not None and steps[1].error.code == DENIED
    assert "not now" in steps[1].error.message
    assert state.pending_calls == () and state.messages[-1].tool_call_id == "call-1"
    assert claimed_state(Claim("deny", resumed=False)) is ConfirmationState.DENIED


def test_an_expiry_and_a_cancel_say_why_in_their_resolved_step() -> None:
    expired = expiry_step(CONFIRMATION, reason="nobody decided", span_id="s", now=NOW)
    assert expired.detail["decision"] == "EXPIRED" and expired.detail["reason"] == "nobody decided"
    effect = CancelEffect(write="not_run", new_state=ConfirmationState.ABANDONED, note="dropped")
    cancelled = cancel_step(
        CONFIRMATION, effect, cancelled_by="alice", words="stop", span_id="s", now=NOW
    )
    assert cancelled.detail["decision"] == "CANCELLED" and cancelled.detail["note"] == "stop"
    assert (cancelled.detail["write"], cancelled.detail["write_note"]) == ("not_run", "dropped")
    step = StepRecord(StepKind.TOOL_CALL, "remember", "s", NOW, NOW, {"result": "ok"})
    assert write_step_after_cancel(step).detail == {"result": "ok", "after_cancel": True}


def test_a_fenced_write_that_found_no_run_was_cancelled_only_when_the_run_says_so() -> None:
    assert isinstance(why_lost("run_1", "CANCELLED"), RunCancelled)
    assert isinstance(why_lost("run_1", "RUNNING"), RunTakenOver)
    assert isinstance(why_lost("run_1", None), RunTakenOver)


def test_an_erasure_abandons_only_an_undecided_write_and_ends_only_the_run_waiting_on_it() -> None:
    waiting = write_after_erasure(ConfirmationState.PENDING, waited_on=True)
    assert waiting.state is ConfirmationState.ABANDONED and waiting.abandoned
    assert waiting.run_reason is not None and "erased" in waiting.run_reason
    elsewhere = write_after_erasure(ConfirmationState.PENDING, waited_on=False)
    assert elsewhere.abandoned and elsewhere.run_reason is None
    for decided in (ConfirmationState.APPROVED, ConfirmationState.EXECUTED):
        kept = write_after_erasure(decided, waited_on=True)
        assert (kept.state, kept.abandoned, kept.run_reason) == (decided, False, None)


@pytest.fixture(scope="module")
async def database(pg_url: str) -> AsyncIterator[Database]:
    db = Database(url=pg_url, schema=SCHEMA, migrations=migrations())
    assert await db.ready()
    yield db
    await db.close()


def step(name: str) -> StepRecord:
    now = datetime.now(UTC)
    return StepRecord(StepKind.MODEL_CALL, name, "0123456789abcdef", now, now, {})


async def test_the_runs_store_and_the_leases_store_each_work_on_their_own(
    database: Database,
) -> None:
    runs = PgRuns(database, owner="first", lease_seconds=0.05)
    org, run_id = f"org-{uuid.uuid4().hex[:8]}", f"run_{uuid.uuid4().hex}"
    await runs.create_run(
        run_id=run_id,
        org_id=org,
        user_id="alice",
        agent="handbook",
        input="hi",
        conversation_id="",
        earlier_turns=(),
        trace_id="t",
    )
    recorded = await runs.record_steps(
        org_id=org, run_id=run_id, steps=(step("a"), step("b")), loop_state=None
    )
    assert [s.seq for s in recorded] == [1, 2]

    sweeper = PgLeases(database, owner="second")
    deadline = datetime.now(UTC) + timedelta(seconds=10)
    recovered: list[Recovered] = []
    while not recovered and datetime.now(UTC) < deadline:
        await asyncio.sleep(0.02)  # polling, with a deadline, for the short lease to run out
        found = await sweeper.recover_stopped_runs(ttl_seconds=60)
        recovered = [r for r in found if r.run_id == run_id]
    assert [(r.run_id, r.outcome) for r in recovered] == [(run_id, "failed")]
    ended = await runs.get_run(org_id=org, run_id=run_id, user_id=None)
    assert ended is not None and ended.state is RunState.FAILED
    with pytest.raises(RunTakenOver):
        await runs.record_step(org_id=org, run_id=run_id, step=step("c"), loop_state=None)


async def test_a_write_proposed_by_a_process_that_lost_its_run_keeps_no_confirmation(
    database: Database,
) -> None:
    runs = PgRuns(database, owner="holder")
    org, run_id = f"org-{uuid.uuid4().hex[:8]}", f"run_{uuid.uuid4().hex}"
    await runs.create_run(
        run_id=run_id,
        org_id=org,
        user_id="alice",
        agent="handbook",
        input="hi",
        conversation_id="",
        earlier_turns=(),
        trace_id="t",
    )
    stranger = PgConfirmations(database, owner="not-the-holder")
    proposal = ConfirmationProposal(
        token="c_" + uuid.uuid4().hex, call=WRITE, card=CONFIRMATION.card, ttl_seconds=600
    )
    with pytest.raises(RunTakenOver):
        await stranger.request_confirmation(
            org_id=org,
            run_id=run_id,
            user_id="alice",
            proposal=proposal,
            step=step("ask"),
            loop_state=WAITING,
        )
    assert await stranger.pending_confirmations(org_id=org, user_id=None) == []
    kept = await runs.get_run(org_id=org, run_id=run_id, user_id=None)
    assert kept is not None and kept.state is RunState.RUNNING
    assert await runs.list_steps(org_id=org, run_id=run_id) == []
