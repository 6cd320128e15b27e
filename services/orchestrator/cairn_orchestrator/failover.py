"""What the loop does when the gateway refuses a model call with RESOURCE_EXHAUSTED.

Two refusals read alike on the wire and mean different things, so the gateway's
ErrorInfo reason tells them apart:

- the run's own token budget cannot fit the call (RUNBUDGETEXCEEDED): the run
  ends BUDGET_EXHAUSTED, with the gateway's sentence as the reason;
- the provider is rate limited and the gateway would not fail over, because the
  conversation holds tool calls only the provider that made them can continue
  (PROVIDERRATELIMITED with tool history): the loop re-runs the whole turn from
  the original question, without the tool history, so the gateway's failover may
  pick another provider. Once per run, and never for a run that carried a
  confirmation: a person approved a write in that conversation, and replaying it
  elsewhere would ask a different model to decide again over a write already
  made (I4). That run ends FAILED with the reason and nothing is replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from cairn_orchestrator.domain import ChatMessage, LoopState, RunState
from cairn_orchestrator.errors import DependencyFailed
from cairn_orchestrator.phases import StopRun

RATE_LIMITED = "PROVIDERRATELIMITED"
RUN_BUDGET_EXCEEDED = "RUNBUDGETEXCEEDED"


@dataclass(frozen=True, slots=True)
class RerunTurn:
    """Start the turn again from its opening messages; `note` goes in the trajectory."""

    state: LoopState
    note: str


def has_tool_history(messages: Sequence[ChatMessage]) -> bool:
    return any(m.tool_calls or m.role == "tool" for m in messages)


def after_refused_call(
    state: LoopState, messages: Sequence[ChatMessage], failure: DependencyFailed
) -> RerunTurn | StopRun | None:
    """A decision for the refusals above, or None for any other failure."""
    if failure.status_code != "RESOURCE_EXHAUSTED":
        return None
    if failure.reason == RUN_BUDGET_EXCEEDED:
        return StopRun(
            RunState.BUDGET_EXHAUSTED, f"the gateway refused the next model call: {failure.detail}"
        )
    if failure.reason != RATE_LIMITED or not has_tool_history(messages):
        return None
    provider = state.last_provider or "the provider"
    if state.carried_confirmation:
        return StopRun(
            RunState.FAILED,
            f"{provider} is rate limited and the gateway may not move a turn holding tool "
            "calls to another provider; this run carried a confirmed write, so it is not "
            f"replayed anywhere else and nothing was run again ({failure.detail})",
        )
    if state.reran_turn:
        return StopRun(
            RunState.FAILED,
            f"{provider} is rate limited again after the turn was already re-run once from "
            f"the question ({failure.detail})",
        )
    rerun = replace(
        state,
        messages=state.messages[: state.opening],
        pending_calls=(),
        next_phase="call_model",
        last_provider="",
        reran_turn=True,
    )
    return RerunTurn(
        rerun,
        note=(
            f"{provider} is rate limited and would not continue a turn holding tool calls; "
            "the turn is re-run from the question without its tool history, so the "
            "gateway may fail over to another provider"
        ),
    )
