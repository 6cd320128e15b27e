"""Confirmed writes (I4), as pure decisions: what a proposed write becomes, who
may resolve it and what each resolution does, what a denial tells the model,
and what happens to a run the orchestrator stopped in the middle of.

The store applies these decisions inside one transaction that holds the
confirmation's and the run's row locks, which is what makes "approved twice at
the same moment" and "killed around the execution" come out as one execution:

    PENDING ─approve─▶ APPROVED ─▶ EXECUTING ─▶ EXECUTED      (run resumes)
       │                  (the write was handed    (its result is recorded,
       │                   to its target)            with the run's state)
       ├─deny──▶ DENIED                              (the model is told, as data)
       └─time──▶ EXPIRED                             (the run ends FAILED)

A run is only ever continued inside a request of its own caller (StartRun, or
ResolveConfirmation by that same person), because every call it makes carries
that person's own token (I1) and the orchestrator never stores tokens. So a run
stopped by a crash after an approval goes back to its person (CONFIRMATION_PENDING,
the card saying what happened); their next approval finishes the write, at most
once because the confirmation token is the write's idempotency key, and the run
continues from its recorded state. A run stopped with no approval in flight ends
FAILED with the reason; nothing is silently lost.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from cairn_orchestrator.domain import (
    CardDetail,
    Confirmation,
    ConfirmationCard,
    ConfirmationProposal,
    ConfirmationState,
    Decision,
    ErrorValue,
    JSONValue,
    LoopState,
    PendingConfirmation,
    Run,
    RunState,
    ToolCallRequest,
)
from cairn_orchestrator.phases import PlannedCall, tool_reply
from cairn_orchestrator.tools import (
    DENIED,
    TOOL_FAILED,
    Tool,
    ToolCallOutcome,
    ToolContext,
    ToolRegistry,
    error_content,
    parse_arguments,
    refused,
)

TOKEN_PREFIX = "cnf_"
_TOKEN_SHAPE = re.compile(r"^cnf_[A-Za-z0-9_-]{43}$")
MAX_NOTE_CHARS = 2000
DEFAULT_CONFIRMATION_TTL_SECONDS = 3600
# A confirmation the panel lists: waiting for a first decision, or for the person
# to approve again after an interruption.
OPEN_STATES = (
    ConfirmationState.PENDING,
    ConfirmationState.APPROVED,
    ConfirmationState.EXECUTING,
    ConfirmationState.EXECUTED,
)


def new_confirmation_token() -> str:
    """256 random bits: the token is a capability, so it must not be guessable."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def looks_like_token(token: str) -> bool:
    return bool(_TOKEN_SHAPE.match(token))


# ---------------------------------------------------------------- proposing a write


@dataclass(frozen=True, slots=True)
class ProposalRefused:
    """The proposed write never reaches a person; the model reads `outcome`."""

    outcome: ToolCallOutcome


def split_planned(
    planned: Sequence[PlannedCall],
) -> tuple[tuple[PlannedCall, ...], tuple[ToolCallRequest, ...]]:
    """Calls to run now (reads and refusals), and writes that wait for a person,
    in the order the model asked for them."""
    now = tuple(p for p in planned if not p.needs_confirmation)
    writes = tuple(p.call for p in planned if p.needs_confirmation)
    return now, writes


def render_card(
    tool: Tool,
    arguments: Mapping[str, Any],
    context: ToolContext,
    *,
    language_fallback: bool = False,
) -> ConfirmationCard:
    """The tool's own card; a renderer that fails or says nothing is a broken tool,
    and a person is never asked to approve what they cannot read.

    The card says whether it is in the language the person asked for: it is a
    fallback when the run's language is itself one (they asked for a language
    cairn has no text in) or when the tool wrote in another language than the
    run's, whatever the renderer claimed."""
    if tool.card is None:
        raise ValueError(f"tool {tool.name!r} needs confirmation but has no card renderer")
    card = tool.card(arguments, context)
    if not card.summary.strip():
        raise ValueError(f"tool {tool.name!r} rendered a card with an empty summary")
    fallback = card.language_fallback or language_fallback or card.language != context.language
    return replace(card, language_fallback=fallback) if fallback != card.language_fallback else card


def propose_write(
    call: ToolCallRequest,
    *,
    registry: ToolRegistry,
    context: ToolContext,
    ttl_seconds: float,
    token: str,
    language_fallback: bool = False,
) -> ConfirmationProposal | ProposalRefused:
    """Validate the arguments and render the card before anybody is asked: invalid
    arguments go back to the model as tool.invalid_input, like any tool call."""
    tool = registry.get(call.name)
    if tool is None or not tool.confirmation_required:
        raise ValueError(f"{call.name!r} is not a registered tool that needs confirmation")
    arguments = parse_arguments(registry.validator(tool.name), call.arguments_json)
    if isinstance(arguments, ErrorValue):
        return ProposalRefused(refused(call, arguments))
    try:
        card = render_card(tool, arguments, context, language_fallback=language_fallback)
    except Exception as exc:  # I3: a broken renderer is the tool's bug, not the run's.
        error = ErrorValue(
            TOOL_FAILED,
            f"the {tool.name} tool could not describe this change for a person "
            f"({type(exc).__name__}); it was not run",
        )
        return ProposalRefused(
            ToolCallOutcome(
                call=call, content=error_content(error), arguments=arguments, error=error
            )
        )
    try:
        copies = tool.copies_of(arguments, context) if tool.copies_of is not None else ()
    except Exception as exc:  # the same: a tool that cannot say what it copies is not run
        error = ErrorValue(
            TOOL_FAILED,
            f"the {tool.name} tool could not name what this change keeps "
            f"({type(exc).__name__}); it was not run",
        )
        return ProposalRefused(
            ToolCallOutcome(
                call=call, content=error_content(error), arguments=arguments, error=error
            )
        )
    return ConfirmationProposal(
        token=token, call=call, card=card, ttl_seconds=ttl_seconds, copies=copies
    )


def requested_detail(
    proposal: ConfirmationProposal, *, expires_at: datetime
) -> dict[str, JSONValue]:
    return {
        "tool": proposal.call.name,
        "tool_call_id": proposal.call.id,
        "arguments": _arguments(proposal.call),
        "card": proposal.card.to_json(),
        "expires_at": expires_at.isoformat(),
    }


def _arguments(call: ToolCallRequest) -> JSONValue:
    try:
        return json.loads(call.arguments_json or "{}")
    except ValueError:
        return call.arguments_json


# ---------------------------------------------------------------- resolving it


@dataclass(frozen=True, slots=True)
class Resolver:
    """Who is resolving: a person (no actor token), of some org."""

    org_id: str
    user_id: str
    is_person: bool


@dataclass(frozen=True, slots=True)
class Refuse:
    """The one denial (I6): not a person, not theirs, or no such confirmation."""


@dataclass(frozen=True, slots=True)
class Expire:
    """Nobody decided in time: mark it, end the run, and tell the caller why."""

    state: ConfirmationState
    reason: str


@dataclass(frozen=True, slots=True)
class Reject:
    """The decision contradicts one already taken; nothing changes."""

    message: str


@dataclass(frozen=True, slots=True)
class AlreadyDecided:
    """The same decision again (a retry, or two clicks at once): nothing runs twice;
    the caller gets the run as it stands."""


@dataclass(frozen=True, slots=True)
class Claim:
    """This request takes the run: it records the decision and continues the run.
    `resumed` when an earlier approval was interrupted by a stop of the orchestrator."""

    decision: Decision
    resumed: bool


Resolution = Refuse | Expire | Reject | AlreadyDecided | Claim


@dataclass(frozen=True, slots=True)
class ResolutionRecord:
    """What the store did with a resolution: the decision, and (unless refused) the
    confirmation and run as they now stand; `loop_state` when this request claimed
    the run and continues it."""

    resolution: Resolution
    confirmation: Confirmation | None = None
    run: Run | None = None
    loop_state: LoopState | None = None


def decide_resolution(
    confirmation: Confirmation,
    *,
    run_state: RunState,
    run_lease_live: bool,
    resolver: Resolver,
    decision: Decision,
    now: datetime,
) -> Resolution:
    """What one ResolveConfirmation does, given the locked confirmation and run.

    Only the run's own caller may resolve: the run continues with the resolver's
    token, so anyone else (an org admin included) would change whose rights the
    agent reads with (I1). An actor token is a service acting, not a person."""
    if (
        not resolver.is_person
        or resolver.org_id != confirmation.org_id
        or resolver.user_id != confirmation.user_id
    ):
        return Refuse()
    state = confirmation.state
    if run_state is RunState.CANCELLED and state in (
        ConfirmationState.PENDING,
        ConfirmationState.APPROVED,
        ConfirmationState.ABANDONED,
    ):
        return Reject(cancelled_message(confirmation, decision=decision))
    # Someone is on the run right now only if it is RUNNING under a live lease.
    interrupted = run_state is RunState.CONFIRMATION_PENDING or (
        run_state is RunState.RUNNING and not run_lease_live
    )
    if state is ConfirmationState.PENDING:
        if now >= confirmation.expires_at:
            return Expire(ConfirmationState.EXPIRED, expiry_reason(confirmation))
        if run_state is not RunState.CONFIRMATION_PENDING:
            return Reject(
                f"run {confirmation.run_id!r} is {run_state.value}, not waiting for this "
                "confirmation; nothing was run"
            )
        return Claim(decision, resumed=False)
    if state in (
        ConfirmationState.APPROVED,
        ConfirmationState.EXECUTING,
        ConfirmationState.EXECUTED,
    ):
        if interrupted and now >= confirmation.expires_at:
            return Expire(*_interrupted_expiry(confirmation))
        if decision == "approve":
            return Claim("approve", resumed=True) if interrupted else AlreadyDecided()
        if interrupted and state is ConfirmationState.APPROVED:
            # Approved, then the orchestrator stopped before the write began: it never
            # ran, so the person may still change their mind.
            return Claim("deny", resumed=True)
        return Reject(
            f"this confirmation was already approved by {confirmation.resolved_by!r}"
            f"{_at(confirmation.resolved_at)} and its write "
            + (
                "has begun; approve it again to finish it (it takes effect at most once)"
                if interrupted
                else "cannot be denied any more"
            )
        )
    if state is ConfirmationState.DENIED:
        if decision == "deny":
            return AlreadyDecided()
        return Reject(
            f"this confirmation was already denied by {confirmation.resolved_by!r}"
            f"{_at(confirmation.resolved_at)}; the write did not run"
        )
    if state is ConfirmationState.EXPIRED:
        return Reject(expiry_reason(confirmation))
    return Reject(
        f"run {confirmation.run_id!r} ended before this write could finish; "
        "see the run's reason and trajectory"
    )


def cancelled_message(confirmation: Confirmation, *, decision: Decision) -> str:
    verb = "approved" if decision == "approve" else "denied"
    effect = (
        "it may have taken effect once before the orchestrator stopped, and it is not "
        "carried out again"
        if confirmation.executions
        else "its write did not run"
    )
    return (
        f"run {confirmation.run_id!r} was cancelled, so this confirmation for "
        f"{confirmation.tool_name} can no longer be {verb}; {effect}"
    )


def _at(moment: datetime | None) -> str:
    return f" at {moment.isoformat()}" if moment is not None else ""


def expiry_reason(confirmation: Confirmation) -> str:
    return (
        f"the confirmation for {confirmation.tool_name} expired at "
        f"{confirmation.expires_at.isoformat()} without a decision; the write did not run "
        "and the run ended"
    )


def _interrupted_expiry(confirmation: Confirmation) -> tuple[ConfirmationState, str]:
    when = confirmation.expires_at.isoformat()
    if confirmation.state is ConfirmationState.EXECUTED:
        return ConfirmationState.EXECUTED, (
            f"the approved {confirmation.tool_name} ran once, then the orchestrator stopped "
            f"and nobody let the run continue before {when}; the run ended"
        )
    if confirmation.state is ConfirmationState.EXECUTING:
        return ConfirmationState.ABANDONED, (
            f"the orchestrator stopped while the approved {confirmation.tool_name} was being "
            f"carried out, and nobody approved it again before {when}; it may have taken "
            f"effect once (idempotency key {confirmation.token[:12]}…); the run ended"
        )
    return ConfirmationState.ABANDONED, (
        f"the orchestrator stopped after {confirmation.tool_name} was approved and before "
        f"it ran, and nobody approved it again before {when}; it did not run; the run ended"
    )


def expiry_on_sweep(confirmation: Confirmation) -> tuple[ConfirmationState, str]:
    """What the periodic sweep does with an open confirmation past its expiry."""
    if confirmation.state is ConfirmationState.PENDING:
        return ConfirmationState.EXPIRED, expiry_reason(confirmation)
    return _interrupted_expiry(confirmation)


def resolved_detail(
    confirmation: Confirmation,
    *,
    decision: str,
    resolved_by: str,
    resolved_at: datetime,
    note: str,
    resumed: bool,
) -> dict[str, JSONValue]:
    return {
        "tool": confirmation.tool_name,
        "tool_call_id": confirmation.call.id,
        "card": confirmation.card.to_json(),
        "decision": decision,
        "resolved_by": resolved_by,
        "resolved_at": resolved_at.isoformat(),
        "note": note,
        "resumed_after_interruption": resumed,
    }


# ---------------------------------------------------------------- a person cancels the run

CancelledWrite = Literal["none", "not_run", "in_flight", "done", "may_have_run"]


@dataclass(frozen=True, slots=True)
class CancelEffect:
    """What a CancelRun does to the write its run was on. `new_state`: what the
    confirmation becomes (None: it stays as it is); `write`: what the trajectory
    says of the write; `note`: the same in words, for the run's reason."""

    write: CancelledWrite
    new_state: ConfirmationState | None = None
    note: str = ""


def cancel_effect(
    confirmation: Confirmation | None, *, run_state: RunState, run_lease_live: bool
) -> CancelEffect:
    """A write not yet handed to its target never will be (ABANDONED); one being
    carried out by a live orchestrator is left to finish and record its outcome
    (it takes effect at most once: the token is its idempotency key); one whose
    orchestrator stopped half way may have taken effect and is not tried again."""
    if confirmation is None or confirmation.state not in OPEN_STATES:
        return CancelEffect("none")
    tool = confirmation.tool_name
    if confirmation.state in (ConfirmationState.PENDING, ConfirmationState.APPROVED):
        return CancelEffect(
            "not_run",
            ConfirmationState.ABANDONED,
            f"the {tool} it waited on was abandoned and did not run",
        )
    if confirmation.state is ConfirmationState.EXECUTED:
        return CancelEffect("done", None, f"the approved {tool} had already been carried out once")
    if run_state is RunState.RUNNING and run_lease_live:
        return CancelEffect(
            "in_flight",
            None,
            f"the approved {tool} was being carried out; it completes or not, at most once, "
            "and the trajectory records which",
        )
    return CancelEffect(
        "may_have_run",
        ConfirmationState.ABANDONED,
        f"the approved {tool} was being carried out when the orchestrator stopped; it may "
        "have taken effect once and is not carried out again",
    )


def cancel_reason(cancelled_by: str, words: str, effect: CancelEffect) -> str:
    """The run's reason: who cancelled, in their own words, and what became of the write."""
    said = f": {words}" if words else ""
    done = f"; {effect.note}" if effect.note else ""
    return f"cancelled by {cancelled_by}{said}{done}"


def check_cancel_reason(reason: str) -> str | None:
    """Why a cancel's reason is refused, or None."""
    if len(reason) > MAX_NOTE_CHARS:
        return f"reason has {len(reason)} characters; at most {MAX_NOTE_CHARS} are accepted"
    if "\x00" in reason:
        return "reason holds U+0000, which cannot be stored; send the text without it"
    return None


# ---------------------------------------------------------------- what the model reads


def denial_outcome(confirmation: Confirmation, *, resolved_by: str, note: str) -> ToolCallOutcome:
    said = f" Their note: {note}" if note.strip() else ""
    error = ErrorValue(
        DENIED,
        f"the person ({resolved_by}) declined this {confirmation.tool_name} call; it was not "
        f"run and nothing changed.{said}",
    )
    return ToolCallOutcome(
        call=confirmation.call,
        content=error_content(error),
        arguments=_object_arguments(confirmation.call),
        error=error,
    )


def _object_arguments(call: ToolCallRequest) -> Mapping[str, Any] | None:
    value = _arguments(call)
    return value if isinstance(value, dict) else None


def after_resolved_write(state: LoopState, outcome: ToolCallOutcome) -> LoopState:
    """The write's result (or its denial) answers its call id; the next write of the
    same turn, if any, is asked about next; otherwise the model reads the results."""
    reply = tool_reply(outcome)
    pending = list(state.pending_calls)
    # The first pending call with this id: ids may repeat across turns, never mind
    # within a turn, so the position the write was asked about is what counts.
    for index, call in enumerate(pending):
        if call.id == outcome.call.id and call.name == outcome.call.name:
            del pending[index]
            break
    rest = tuple(pending)
    return replace(
        state,
        messages=(*state.messages, reply),
        pending_calls=rest,
        next_phase="confirm_writes" if rest else "call_model",
        carried_confirmation=True,
    )


# ---------------------------------------------------------------- runs the orchestrator stopped in


@dataclass(frozen=True, slots=True)
class BackToPerson:
    """An approval was in flight: the run waits for its person again, until `expires_at`."""

    expires_at: datetime


@dataclass(frozen=True, slots=True)
class EndRun:
    reason: str


@dataclass(frozen=True, slots=True)
class Recovered:
    """What the recovery sweep did with one run whose orchestrator stopped."""

    run_id: str
    org_id: str
    outcome: Literal["back_to_person", "failed"]
    reason: str


def after_interruption(
    latest: Confirmation | None,
    *,
    last_seq: int,
    now: datetime,
    ttl_seconds: float,
) -> BackToPerson | EndRun:
    """A run left RUNNING by an orchestrator that stopped (its lease ran out)."""
    if latest is not None and latest.state in (
        ConfirmationState.APPROVED,
        ConfirmationState.EXECUTING,
        ConfirmationState.EXECUTED,
    ):
        return BackToPerson(expires_at=now + timedelta(seconds=ttl_seconds))
    return EndRun(
        "the orchestrator stopped while this run was working (after step "
        f"{last_seq}); a run continues only within its caller's own request, so it was "
        "ended here; everything recorded up to then is in its trajectory"
    )


_INTERRUPTED_WARNINGS: dict[str, dict[ConfirmationState, str]] = {
    "en": {
        ConfirmationState.APPROVED: (
            "{approved}, but the orchestrator stopped before the change was made. Approve "
            "again to make it, or deny it."
        ),
        ConfirmationState.EXECUTING: (
            "{approved}, and the orchestrator stopped while the change was being made; it "
            "may already have taken effect. Approve again to finish: it takes effect at "
            "most once."
        ),
        ConfirmationState.EXECUTED: (
            "{approved} and the change was made once; the orchestrator stopped before the "
            "run could continue. Approve again to let it continue; the change is not made "
            "again."
        ),
    },
    "zh-Hans": {
        ConfirmationState.APPROVED: (
            "{approved}，但在更改完成之前编排服务停止了。再次批准即可完成更改，也可以拒绝。"
        ),
        ConfirmationState.EXECUTING: (
            "{approved}，但编排服务在执行更改时停止了，更改可能已经生效。再次批准即可完成："
            "它最多只会生效一次。"
        ),
        ConfirmationState.EXECUTED: (
            "{approved}，更改已完成一次；编排服务在运行继续之前停止了。再次批准即可让运行继续，"
            "更改不会重复进行。"
        ),
    },
}


def _you_approved(language: str, moment: datetime | None) -> str:
    if language == "zh-Hans":
        return f"你已于 {moment.isoformat()} 批准此项" if moment is not None else "你已批准此项"
    return f"You approved this{_at(moment)}"


def shown_card(confirmation: Confirmation) -> ConfirmationCard:
    """The card as the person sees it now: after an interruption it says what
    happened and what approving again will do, in the card's own language."""
    card = confirmation.card
    if confirmation.state is ConfirmationState.PENDING:
        return card
    language = "zh-Hans" if card.language == "zh-Hans" else "en"
    texts = _INTERRUPTED_WARNINGS[language]
    template = texts.get(confirmation.state, texts[ConfirmationState.EXECUTED])
    warning = template.format(approved=_you_approved(language, confirmation.resolved_at))
    status = "状态" if language == "zh-Hans" else "Status"
    return replace(
        card,
        warnings=(warning, *card.warnings),
        details=(*card.details, CardDetail(label=status, value=confirmation.state.value)),
    )


def pending_view(confirmation: Confirmation) -> PendingConfirmation:
    return PendingConfirmation(
        confirmation_token=confirmation.token,
        run_id=confirmation.run_id,
        tool_name=confirmation.tool_name,
        card=shown_card(confirmation),
        created_at=confirmation.created_at,
        expires_at=confirmation.expires_at,
        user_id=confirmation.user_id,
        state=confirmation.state,
    )


def check_note(note: str) -> str | None:
    """Why a note is refused, or None."""
    if len(note) > MAX_NOTE_CHARS:
        return f"note has {len(note)} characters; at most {MAX_NOTE_CHARS} are accepted"
    return None
