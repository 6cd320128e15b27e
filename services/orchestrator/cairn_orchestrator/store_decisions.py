"""What the run store writes when it applies a decision, decided in pure code: the
steps a claimed, expired or cancelled confirmation records, the state a denial
leaves the loop in, and what a fenced write that found no run means.

The decisions themselves (who may resolve, what a cancel does to a write in
flight, when a confirmation expires) are confirmations.py's; this module turns
each into the records the PostgreSQL adapters (pg/) then write, so the adapters
only run statements and nothing about a run's meaning hides in SQL code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from cairn_orchestrator.confirmations import (
    CancelEffect,
    Claim,
    after_resolved_write,
    denial_outcome,
    resolved_detail,
)
from cairn_orchestrator.domain import (
    Confirmation,
    ConfirmationState,
    LoopState,
    StepKind,
    StepRecord,
)
from cairn_orchestrator.errors import RunCancelled, RunTakenOver

# Why a run waiting on a write about an erased subject ends CANCELLED.
ERASED_WRITE_REASON = (
    "the write this run waited on was about a subject whose records were "
    "erased, so it was abandoned unapproved and nothing was written"
)


@dataclass(frozen=True, slots=True)
class WriteAfterErasure:
    """What becomes of a proposed write that held a copy of an erased subject's text:
    the state it takes, whether it was abandoned, and, when its run waited on it,
    why the run ends CANCELLED (None: the run is left as it is)."""

    state: ConfirmationState
    abandoned: bool
    run_reason: str | None


def write_after_erasure(state: ConfirmationState, *, waited_on: bool) -> WriteAfterErasure:
    """A write about the erased subject that nobody approved yet is never made:
    approving it now would keep the tombstone, or worse, bring the text back. One
    already decided keeps its state (its copies are erased all the same)."""
    if state is not ConfirmationState.PENDING:
        return WriteAfterErasure(state, abandoned=False, run_reason=None)
    return WriteAfterErasure(
        ConfirmationState.ABANDONED,
        abandoned=True,
        run_reason=ERASED_WRITE_REASON if waited_on else None,
    )


def why_lost(run_id: str, state: str | None) -> RunTakenOver | RunCancelled:
    """Why a write fenced on this process's lease found no run to write to, from the
    run's state now: a person cancelled it, or another orchestrator took it over."""
    return RunCancelled(run_id) if state == "CANCELLED" else RunTakenOver(run_id)


def claimed_state(claim: Claim) -> ConfirmationState:
    """The state a confirmation takes when its person's decision claims the run."""
    return ConfirmationState.APPROVED if claim.decision == "approve" else ConfirmationState.DENIED


def claim_records(
    confirmation: Confirmation,
    claim: Claim,
    *,
    loop_state: LoopState,
    resolved_by: str,
    note: str,
    now: datetime,
    span_id: str,
    started_at: datetime,
) -> tuple[list[StepRecord], LoopState]:
    """The steps a claim records (CONFIRMATION_RESOLVED; for a denial also the
    TOOL_CALL the model reads as data) and the loop state the run resumes from."""
    steps = [
        StepRecord(
            kind=StepKind.CONFIRMATION_RESOLVED,
            name=confirmation.tool_name,
            span_id=span_id,
            started_at=started_at,
            finished_at=now,
            detail=resolved_detail(
                confirmation,
                decision=claim.decision.upper(),
                resolved_by=resolved_by,
                resolved_at=now,
                note=note,
                resumed=claim.resumed,
            ),
        )
    ]
    if claim.decision == "deny":
        denial = denial_outcome(confirmation, resolved_by=resolved_by, note=note)
        loop_state = after_resolved_write(loop_state, denial)
        steps.append(
            StepRecord(
                kind=StepKind.TOOL_CALL,
                name=confirmation.tool_name,
                span_id=span_id,
                started_at=started_at,
                finished_at=now,
                detail=denial.detail(),
                error=denial.error,
            )
        )
    return steps, loop_state


def expiry_step(
    confirmation: Confirmation, *, reason: str, span_id: str, now: datetime
) -> StepRecord:
    """The CONFIRMATION_RESOLVED step of a confirmation that expired."""
    detail = resolved_detail(
        confirmation,
        decision="EXPIRED",
        resolved_by="",
        resolved_at=now,
        note="",
        resumed=False,
    )
    return StepRecord(
        kind=StepKind.CONFIRMATION_RESOLVED,
        name=confirmation.tool_name,
        span_id=span_id,
        started_at=now,
        finished_at=now,
        detail={**detail, "reason": reason},
    )


def cancel_step(
    confirmation: Confirmation,
    effect: CancelEffect,
    *,
    cancelled_by: str,
    words: str,
    span_id: str,
    now: datetime,
) -> StepRecord:
    """The CONFIRMATION_RESOLVED step of a write its run's cancel reached: what
    became of the write (`effect.write`) and why."""
    detail = resolved_detail(
        confirmation,
        decision="CANCELLED",
        resolved_by=cancelled_by,
        resolved_at=now,
        note=words,
        resumed=False,
    )
    return StepRecord(
        kind=StepKind.CONFIRMATION_RESOLVED,
        name=confirmation.tool_name,
        span_id=span_id,
        started_at=now,
        finished_at=now,
        detail={**detail, "write": effect.write, "write_note": effect.note},
    )


def write_step_after_cancel(step: StepRecord) -> StepRecord:
    """A write's TOOL_CALL step when its run was cancelled while it was carried out."""
    return replace(step, detail={**step.detail, "after_cancel": True})
