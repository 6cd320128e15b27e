"""The pure rules of confirmed writes and of refused failover, without a database:
who may resolve, what each resolution does in each state, what a person reads
after an interruption, and when a turn is re-run on another provider."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from cairn_orchestrator.confirmations import (
    AlreadyDecided,
    BackToPerson,
    Claim,
    EndRun,
    Expire,
    Refuse,
    Reject,
    Resolver,
    after_interruption,
    after_resolved_write,
    decide_resolution,
    denial_outcome,
    looks_like_token,
    new_confirmation_token,
    shown_card,
    split_planned,
)
from cairn_orchestrator.domain import (
    ChatMessage,
    Confirmation,
    ConfirmationCard,
    ConfirmationState,
    LoopState,
    RunState,
    RunUsage,
    ToolCallRequest,
)
from cairn_orchestrator.errors import DependencyFailed
from cairn_orchestrator.failover import RerunTurn, after_refused_call
from cairn_orchestrator.phases import PlannedCall, StopRun
from cairn_orchestrator.tools import DENIED, ToolCallOutcome

NOW = datetime(2025, 6, 1, 12, tzinfo=UTC)
ALICE = Resolver(org_id="org-a", user_id="alice", is_person=True)
WRITE = ToolCallRequest(id="call-1", name="remember", arguments_json='{"text":"likes tea"}')


def confirmation(
    state: ConfirmationState = ConfirmationState.PENDING, **changes: object
) -> Confirmation:
    value = Confirmation(
        token=new_confirmation_token(),
        org_id="org-a",
        run_id="run_1",
        user_id="alice",
        call=WRITE,
        card=ConfirmationCard(summary="Remember that you like tea", warnings=("personal data",)),
        state=state,
        created_at=NOW - timedelta(minutes=5),
        expires_at=NOW + timedelta(hours=1),
        resolved_by="alice" if state is not ConfirmationState.PENDING else "",
        resolved_at=NOW - timedelta(minutes=1) if state is not ConfirmationState.PENDING else None,
    )
    return replace(value, **changes)  # type: ignore[arg-type]


def decide(
    conf: Confirmation,
    *,
    run_state: RunState = RunState.CONFIRMATION_PENDING,
    lease_live: bool = False,
    resolver: Resolver = ALICE,
    decision: str = "approve",
) -> object:
    return decide_resolution(
        conf,
        run_state=run_state,
        run_lease_live=lease_live,
        resolver=resolver,
        decision="approve" if decision == "approve" else "deny",
        now=NOW,
    )


def test_tokens_are_unguessable_and_recognisable() -> None:
    tokens = {new_confirmation_token() for _ in range(100)}
    assert len(tokens) == 100 and all(looks_like_token(t) for t in tokens)
    assert not looks_like_token("cnf_short") and not looks_like_token("run_" + "a" * 43)


@pytest.mark.parametrize(
    "resolver",
    [
        Resolver(org_id="org-a", user_id="bob", is_person=True),
        Resolver(org_id="org-b", user_id="alice", is_person=True),
        Resolver(org_id="org-a", user_id="alice", is_person=False),
    ],
    ids=["another person", "another org", "a service acting"],
)
def test_anyone_but_the_runs_own_person_is_refused_whatever_the_state(resolver: Resolver) -> None:
    for state in ConfirmationState:
        assert decide(confirmation(state), resolver=resolver) == Refuse()


def test_a_pending_confirmation_is_claimed_by_either_decision() -> None:
    assert decide(confirmation()) == Claim("approve", resumed=False)
    assert decide(confirmation(), decision="deny") == Claim("deny", resumed=False)


def test_a_pending_confirmation_past_its_expiry_expires_instead() -> None:
    outcome = decide(confirmation(expires_at=NOW))
    assert isinstance(outcome, Expire) and outcome.state is ConfirmationState.EXPIRED
    assert "without a decision" in outcome.reason and "did not run" in outcome.reason


def test_an_approval_in_progress_is_not_claimed_again_while_its_run_is_being_driven() -> None:
    for state in (
        ConfirmationState.APPROVED,
        ConfirmationState.EXECUTING,
        ConfirmationState.EXECUTED,
    ):
        conf = confirmation(state)
        assert decide(conf, run_state=RunState.RUNNING, lease_live=True) == AlreadyDecided()
        assert decide(conf, run_state=RunState.COMPLETED) == AlreadyDecided()
        denied = decide(conf, run_state=RunState.RUNNING, lease_live=True, decision="deny")
        assert isinstance(denied, Reject) and "already approved by 'alice'" in denied.message


def test_after_an_interruption_approving_again_continues_the_run() -> None:
    for state in (
        ConfirmationState.APPROVED,
        ConfirmationState.EXECUTING,
        ConfirmationState.EXECUTED,
    ):
        conf = confirmation(state)
        assert decide(conf) == Claim("approve", resumed=True)
        # A run still RUNNING under a lease that ran out is as good as interrupted.
        assert decide(conf, run_state=RunState.RUNNING) == Claim("approve", resumed=True)


def test_after_an_interruption_a_write_that_never_began_may_still_be_denied_but_not_one_that_did() -> (
    None
):
    assert decide(confirmation(ConfirmationState.APPROVED), decision="deny") == Claim(
        "deny", resumed=True
    )
    for state in (ConfirmationState.EXECUTING, ConfirmationState.EXECUTED):
        outcome = decide(confirmation(state), decision="deny")
        assert isinstance(outcome, Reject) and "at most once" in outcome.message


def test_decided_confirmations_keep_their_decision() -> None:
    denied = confirmation(ConfirmationState.DENIED)
    assert decide(denied, run_state=RunState.COMPLETED, decision="deny") == AlreadyDecided()
    outcome = decide(denied, run_state=RunState.COMPLETED)
    assert isinstance(outcome, Reject) and "already denied" in outcome.message
    for state in (ConfirmationState.EXPIRED, ConfirmationState.ABANDONED):
        assert isinstance(decide(confirmation(state), run_state=RunState.FAILED), Reject)


def test_an_interrupted_confirmation_past_its_new_expiry_ends_saying_what_is_known() -> None:
    started = decide(confirmation(ConfirmationState.EXECUTING, expires_at=NOW))
    assert isinstance(started, Expire) and started.state is ConfirmationState.ABANDONED
    assert "may have taken effect once" in started.reason
    never = decide(confirmation(ConfirmationState.APPROVED, expires_at=NOW))
    assert isinstance(never, Expire) and "it did not run" in never.reason
    done = decide(confirmation(ConfirmationState.EXECUTED, expires_at=NOW))
    assert isinstance(done, Expire) and done.state is ConfirmationState.EXECUTED
    assert "ran once" in done.reason


def test_a_stopped_run_goes_back_to_its_person_only_when_an_approval_was_in_flight() -> None:
    for state in (
        ConfirmationState.APPROVED,
        ConfirmationState.EXECUTING,
        ConfirmationState.EXECUTED,
    ):
        back = after_interruption(confirmation(state), last_seq=7, now=NOW, ttl_seconds=60)
        assert back == BackToPerson(expires_at=NOW + timedelta(seconds=60))
    for latest in (None, confirmation(ConfirmationState.DENIED)):
        ended = after_interruption(latest, last_seq=7, now=NOW, ttl_seconds=60)
        assert isinstance(ended, EndRun) and "after step 7" in ended.reason


def test_after_an_interruption_the_card_says_what_happened_and_what_approving_does() -> None:
    assert shown_card(confirmation()).warnings == ("personal data",)
    executing = shown_card(confirmation(ConfirmationState.EXECUTING))
    assert "may already have taken effect" in executing.warnings[0]
    assert executing.warnings[1:] == ("personal data",)
    assert "not made again" in shown_card(confirmation(ConfirmationState.EXECUTED)).warnings[0]
    assert (
        "before the change was made"
        in shown_card(confirmation(ConfirmationState.APPROVED)).warnings[0]
    )


def test_a_denial_answers_its_call_with_the_note_and_the_next_write_is_asked_next() -> None:
    second = ToolCallRequest(id="call-2", name="remember", arguments_json="{}")
    state = LoopState(
        messages=(ChatMessage("system", "s"), ChatMessage("user", "u")),
        knowledge=(),
        usage=RunUsage(),
        next_phase="confirm_writes",
        pending_calls=(WRITE, second),
    )
    outcome = denial_outcome(confirmation(), resolved_by="alice", note="not now")
    after = after_resolved_write(state, outcome)
    assert outcome.error is not None and outcome.error.code == DENIED
    assert "not now" in outcome.error.message
    assert after.messages[-1].role == "tool" and after.messages[-1].tool_call_id == "call-1"
    assert after.pending_calls == (second,) and after.next_phase == "confirm_writes"
    assert after.carried_confirmation is True
    last = after_resolved_write(after, outcome_for(second))
    assert last.pending_calls == () and last.next_phase == "call_model"


def outcome_for(call: ToolCallRequest) -> ToolCallOutcome:
    return ToolCallOutcome(call=call, content="{}")


def test_reads_run_now_and_writes_wait_in_the_order_the_model_asked() -> None:
    read = ToolCallRequest(id="r", name="search_knowledge", arguments_json="{}")
    other = replace(WRITE, id="call-9")
    now, writes = split_planned(
        [
            PlannedCall(WRITE, needs_confirmation=True),
            PlannedCall(read),
            PlannedCall(other, needs_confirmation=True),
        ]
    )
    assert [p.call.id for p in now] == ["r"] and [w.id for w in writes] == ["call-1", "call-9"]


# ---------------------------------------------------------------- refused failover


def opened_state(**changes: object) -> LoopState:
    state = LoopState(
        messages=(
            ChatMessage("system", "s"),
            ChatMessage("user", "u"),
            ChatMessage("assistant", "", tool_calls=(WRITE,)),
            ChatMessage("tool", "{}", tool_call_id="call-1"),
        ),
        knowledge=(),
        usage=RunUsage(total_tokens=300, model_calls=1),
        next_phase="call_model",
        last_provider="first",
    )
    return replace(state, **changes)  # type: ignore[arg-type]


def refusal(reason: str) -> DependencyFailed:
    return DependencyFailed(
        "gateway", "RESOURCE_EXHAUSTED", "provider 'first' is rate limited", reason=reason
    )


def test_a_rate_limit_on_a_turn_holding_tool_calls_reruns_it_from_the_opening_messages() -> None:
    state = opened_state()
    decision = after_refused_call(state, state.messages, refusal("PROVIDERRATELIMITED"))
    assert isinstance(decision, RerunTurn)
    assert decision.state.messages == state.messages[:2]
    assert decision.state.last_provider == "" and decision.state.reran_turn is True
    assert decision.state.usage == state.usage  # what was spent stays spent
    assert "first" in decision.note


def test_a_run_that_carried_a_confirmation_is_not_rerun_and_neither_is_a_second_refusal() -> None:
    carried = opened_state(carried_confirmation=True)
    stop = after_refused_call(carried, carried.messages, refusal("PROVIDERRATELIMITED"))
    assert isinstance(stop, StopRun) and stop.state is RunState.FAILED
    assert "confirmed write" in stop.reason
    again = opened_state(reran_turn=True)
    stop = after_refused_call(again, again.messages, refusal("PROVIDERRATELIMITED"))
    assert isinstance(stop, StopRun) and "re-run once" in stop.reason


def test_other_refusals_are_not_reruns() -> None:
    state = opened_state()
    budget = after_refused_call(state, state.messages, refusal("RUNBUDGETEXCEEDED"))
    assert isinstance(budget, StopRun) and budget.state is RunState.BUDGET_EXHAUSTED
    # Without tool history the gateway already failed over: nothing left to try.
    assert after_refused_call(state, state.messages[:2], refusal("PROVIDERRATELIMITED")) is None
    down = DependencyFailed("gateway", "UNAVAILABLE", "down")
    assert after_refused_call(state, state.messages, down) is None
