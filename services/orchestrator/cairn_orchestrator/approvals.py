"""Writes and their person (I4): asking before a write, carrying it out once after.

The decisions are pure in confirmations.py (`propose_write`,
`after_resolved_write`); this module does their I/O. A write the model proposes
parks the run at CONFIRMATION_PENDING with its card and state (`propose`); an
approved write is handed to its target once, the confirmation token being its
idempotency key, and recorded with the state after it (`carry_out`).
"""

from __future__ import annotations

from dataclasses import replace

import structlog

from cairn_orchestrator.confirmations import (
    ProposalRefused,
    after_resolved_write,
    new_confirmation_token,
    propose_write,
)
from cairn_orchestrator.domain import (
    Confirmation,
    ConfirmationRequestedDetail,
    ConfirmationState,
    LoopState,
    Run,
    StepKind,
)
from cairn_orchestrator.errors import RunCancelled
from cairn_orchestrator.events import RunSignals
from cairn_orchestrator.ports import ConfirmationStore
from cairn_orchestrator.recording import StepRecorder
from cairn_orchestrator.run_scope import RunClock, RunScope
from cairn_orchestrator.tool_execution import tool_context
from cairn_orchestrator.tools import ToolRegistry, dispatch

log = structlog.get_logger(__name__)


class Approvals:
    def __init__(
        self,
        *,
        confirmations: ConfirmationStore | None,
        registry: ToolRegistry,
        recorder: StepRecorder,
        signals: RunSignals,
        clock: RunClock,
        ttl_seconds: float,
    ) -> None:
        # Without a confirmation store no person can be asked, so writes are refused.
        self._confirmations = confirmations
        self._registry = registry
        self._recorder = recorder
        self._signals = signals
        self._clock = clock
        self._ttl_seconds = ttl_seconds

    @property
    def confirmable(self) -> bool:
        """Whether a person can be asked at all (writes are planned only then)."""
        return self._confirmations is not None

    async def propose(self, scope: RunScope, state: LoopState) -> Run | LoopState:
        """Ask the person about the next write of the turn: validate its arguments,
        render its card, and park the run at CONFIRMATION_PENDING with its state.
        Arguments that fail validation go back to the model without asking anyone."""
        confirmations = self._confirmations
        assert confirmations is not None, "writes are only planned where a person can be asked"
        call = state.pending_calls[0]
        attributes = {
            "gen_ai.operation.name": "request_confirmation",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id,
        }
        with self._recorder.step(
            scope,
            StepKind.CONFIRMATION_REQUESTED,
            call.name,
            span_name=f"request_confirmation {call.name}",
            attributes=attributes,
        ) as step:
            proposal = propose_write(
                call,
                registry=self._registry,
                context=tool_context(scope, state),
                ttl_seconds=self._ttl_seconds,
                token=new_confirmation_token(),
                language_fallback=scope.run.language_fallback,
            )
            if isinstance(proposal, ProposalRefused):
                step.mark(proposal.outcome.error)
        if isinstance(proposal, ProposalRefused):
            outcome = proposal.outcome
            # Nobody was asked, so the run did not carry a confirmation for this one.
            state = replace(
                after_resolved_write(state, outcome),
                carried_confirmation=state.carried_confirmation,
            )
            # The arguments went back to the model: a tool call, not a request.
            record = step.record(outcome.step_detail(), outcome.error, kind=StepKind.TOOL_CALL)
            await self._recorder.record(scope, record, state)
            return state
        await self._recorder.written(scope)
        at_rest = replace(
            state, carried_confirmation=True, active_seconds=self._clock.elapsed(scope)
        )
        run = await confirmations.request_confirmation(
            org_id=scope.run.org_id,
            run_id=scope.run.run_id,
            user_id=scope.run.user_id,
            proposal=proposal,
            step=replace(step.record(ConfirmationRequestedDetail(), None), copies=proposal.copies),
            loop_state=at_rest,
        )
        self._signals.changed(run.run_id)
        log.info("run.waiting_for_confirmation", tool=call.name)
        return run

    async def carry_out(
        self, scope: RunScope, state: LoopState, confirmation: Confirmation
    ) -> LoopState:
        """Hand the approved write to its target, once: the store marks it EXECUTING
        first (a crash from here on leaves a trace of it) and records the result
        with the state after it in one transaction. A write already EXECUTED (a
        crash after it was recorded) is not run again; `state` already holds it."""
        confirmations = self._confirmations
        assert confirmations is not None
        call = confirmation.call
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id,
            "cairn.confirmed": True,
        }
        with self._recorder.step(
            scope,
            StepKind.TOOL_CALL,
            call.name,
            span_name=f"execute_tool {call.name}",
            attributes=attributes,
        ) as step:
            await self._recorder.written(scope)
            begun = await confirmations.begin_write(
                org_id=scope.run.org_id, run_id=scope.run.run_id, token=confirmation.token
            )
            if begun.state is ConfirmationState.EXECUTED:
                return state
            context = tool_context(scope, state, confirmation_token=confirmation.token)
            outcome = await dispatch(self._registry, call, context)
            step.mark(outcome.error)
        detail = replace(outcome.step_detail(), attempt=begun.executions)
        after = after_resolved_write(state, outcome)
        cancelled = await confirmations.record_write(
            org_id=scope.run.org_id,
            run_id=scope.run.run_id,
            token=confirmation.token,
            result=outcome.detail(),
            step=replace(step.record(detail, outcome.error), copies=outcome.copies),
            loop_state=after,
        )
        self._signals.changed(scope.run.run_id)
        log.info("confirmation.executed", tool=call.name, attempt=begun.executions)
        if cancelled:
            raise RunCancelled(scope.run.run_id)
        return after
