"""Running the tool calls of a turn that may run now.

Reads the model asks for in a turn, and refusals answered as data, are
independent, so they run concurrently (`plan_tool_call` and `split_planned`
decide which are which); their results are folded back by `after_tool_calls`
and their steps recorded in the order the model asked. Writes of the same turn
wait for a person afterwards (approvals.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from cairn_orchestrator.cancellation import CancelWatch
from cairn_orchestrator.confirmations import split_planned
from cairn_orchestrator.domain import LabelBook, LoopState, StepKind, StepRecord
from cairn_orchestrator.phases import PlannedCall, after_tool_calls, remaining_tokens
from cairn_orchestrator.recording import StepRecorder
from cairn_orchestrator.remote import reused_searches
from cairn_orchestrator.run_scope import RunScope
from cairn_orchestrator.tools import ToolCallOutcome, ToolContext, ToolRegistry, dispatch, refused


def tool_context(
    scope: RunScope,
    state: LoopState,
    *,
    labels: LabelBook | None = None,
    confirmation_token: str | None = None,
) -> ToolContext:
    return ToolContext(
        principal=scope.principal,
        run_id=scope.run.run_id,
        agent=scope.spec.name,
        remaining_tokens=remaining_tokens(scope.spec.budgets, state.usage),
        sources=scope.spec.sources,
        credentials=scope.credentials,
        labels=labels if labels is not None else LabelBook(state.knowledge),
        confirmation_token=confirmation_token,
        run_calls=tuple(c for m in state.messages for c in m.tool_calls),
        language=scope.run.language,
    )


class ToolExecution:
    def __init__(
        self,
        *,
        registry: ToolRegistry,
        recorder: StepRecorder,
        cancels: CancelWatch,
    ) -> None:
        self._registry = registry
        self._recorder = recorder
        self._cancels = cancels

    async def execute(
        self, scope: RunScope, state: LoopState, planned: Sequence[PlannedCall]
    ) -> LoopState:
        """Run the calls that may run now (reads, and refusals answered as data;
        independent, so concurrently) and fold their results back. Writes of the
        same turn wait for a person afterwards, in the order the model asked.
        Steps are recorded in the order the model asked."""
        now_calls, writes = split_planned(planned)
        book = LabelBook(state.knowledge)
        context = tool_context(scope, state, labels=book)
        observed = await self._cancels.unless_cancelled(
            scope, asyncio.gather(*(self._run_tool(scope, call, context) for call in now_calls))
        )
        state = after_tool_calls(
            state, [outcome for outcome, _ in observed], knowledge=book.entries
        )
        if writes:
            state = replace(state, pending_calls=writes, next_phase="confirm_writes")
        await self._recorder.record_many(scope, [record for _, record in observed], state)
        return state

    async def _run_tool(
        self, scope: RunScope, planned: PlannedCall, context: ToolContext
    ) -> tuple[ToolCallOutcome, StepRecord]:
        call = planned.call
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id,
        }
        with self._recorder.step(
            scope,
            StepKind.TOOL_CALL,
            call.name,
            span_name=f"execute_tool {call.name}",
            attributes=attributes,
        ) as step:
            # Searches this call had answered from the run's prefetch (remote.py).
            reused: list[str] = []
            marked = reused_searches.set(reused)
            try:
                if planned.refusal is not None:
                    outcome = refused(call, planned.refusal)
                else:
                    outcome = await dispatch(self._registry, call, context)
            finally:
                reused_searches.reset(marked)
            step.mark(outcome.error)
            detail = outcome.step_detail()
            if reused:
                step.span.set_attribute("cairn.reused_prefetch", True)
                detail = replace(detail, reused_prefetch=True)
        return outcome, replace(step.record(detail, outcome.error), copies=outcome.copies)
