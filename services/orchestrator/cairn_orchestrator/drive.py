"""The resumable loop: call the model, act on its reply, until the run is at rest.

Every decision is a pure function in `phases.py` (what to ask the model, what
its reply means, which budget ran out) or `failover.py` (what a refused call
becomes); this module only sequences the calls. `drive` can be entered from any
phase of a persisted `LoopState`: at the start of a run, after a re-run of the
turn, and after a person resolved a write.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import structlog

from cairn_orchestrator.approvals import Approvals
from cairn_orchestrator.cancellation import CancelWatch
from cairn_orchestrator.domain import (
    ErrorValue,
    LoopState,
    ModelCallDetail,
    ModelReply,
    ModelRequest,
    Run,
    RunState,
    StepKind,
    StepRecord,
    unstorable_in_reply,
)
from cairn_orchestrator.errors import DependencyFailed, RunCancelled
from cairn_orchestrator.failover import RerunTurn, after_refused_call
from cairn_orchestrator.phases import (
    FinalAnswer,
    RunToolCalls,
    StopRun,
    after_model_reply,
    budget_exhaustion,
    model_request,
    plan_after_reply,
    plan_tool_call,
    resolve_citations,
    wall_time_exhaustion,
)
from cairn_orchestrator.ports import ModelGateway
from cairn_orchestrator.recording import StepRecorder
from cairn_orchestrator.run_scope import RunClock, RunScope
from cairn_orchestrator.tool_execution import ToolExecution
from cairn_orchestrator.tools import ToolRegistry

log = structlog.get_logger(__name__)


class TurnDriver:
    def __init__(
        self,
        *,
        gateway: ModelGateway,
        registry: ToolRegistry,
        tools: ToolExecution,
        approvals: Approvals,
        recorder: StepRecorder,
        cancels: CancelWatch,
        clock: RunClock,
        max_completion_tokens: int,
        model_timeout_seconds: float,
    ) -> None:
        self._gateway = gateway
        self._registry = registry
        self._tools = tools
        self._approvals = approvals
        self._recorder = recorder
        self._cancels = cancels
        self._clock = clock
        self._max_completion_tokens = max_completion_tokens
        self._model_timeout_seconds = model_timeout_seconds

    async def drive(self, scope: RunScope, state: LoopState) -> Run:
        spec = scope.spec
        confirmable = self._approvals.confirmable
        while True:
            if state.next_phase == "confirm_writes":
                proposed = await self._approvals.propose(scope, state)
                if isinstance(proposed, Run):
                    return proposed
                state = proposed
                continue
            if state.next_phase == "execute_tools":
                exhausted = wall_time_exhaustion(
                    spec.budgets, elapsed_seconds=self._clock.elapsed(scope)
                )
                if exhausted is not None:
                    return await self._recorder.finish(
                        scope, RunState.BUDGET_EXHAUSTED, state, reason=exhausted
                    )
                planned = tuple(
                    plan_tool_call(c, spec=spec, registry=self._registry, confirmable=confirmable)
                    for c in state.pending_calls
                )
                state = await self._tools.execute(scope, state, planned)
                continue

            exhausted = budget_exhaustion(
                spec.budgets, state.usage, elapsed_seconds=self._clock.elapsed(scope)
            )
            if exhausted is not None:
                return await self._recorder.finish(
                    scope, RunState.BUDGET_EXHAUSTED, state, reason=exhausted
                )
            request = model_request(
                state,
                spec=spec,
                registry=self._registry,
                run_id=scope.run.run_id,
                max_completion_tokens=self._max_completion_tokens,
            )
            called = await self._call_model(scope, request)
            reply, record, failure = called.reply, called.record, called.failure
            if reply is None:
                assert failure is not None
                # A call cut short by the run's own deadline is the budget, not the gateway.
                wall = wall_time_exhaustion(
                    spec.budgets, elapsed_seconds=self._clock.elapsed(scope)
                )
                refusal = (
                    None
                    if wall is not None
                    else after_refused_call(state, request.messages, failure)
                )
                if isinstance(refusal, RerunTurn):
                    state = refusal.state
                    await self._recorder.record(
                        scope,
                        replace(
                            record, detail=replace(called.detail, rerun=refusal.note).to_json()
                        ),
                        state,
                    )
                    log.info("run.turn_rerun", provider=request.pinned_provider)
                    continue
                ended = (record,)
                if wall is not None:
                    return await self._recorder.finish(
                        scope, RunState.BUDGET_EXHAUSTED, state, reason=wall, steps=ended
                    )
                if isinstance(refusal, StopRun):
                    return await self._recorder.finish(
                        scope, refusal.state, state, reason=refusal.reason, steps=ended
                    )
                return await self._recorder.finish(
                    scope,
                    RunState.FAILED,
                    state,
                    reason=f"the model call failed: {failure.message}",
                    steps=ended,
                )
            unstorable = unstorable_in_reply(reply)
            if unstorable is not None:
                # The reply cannot be kept, so it is not acted on either: the run ends
                # with the true reason instead of failing to store its own state.
                error = ErrorValue(
                    "gateway.unstorable_text",
                    f"the model's reply held U+0000 in {unstorable}, which cannot be stored",
                )
                failed = replace(record, error=error)
                return await self._recorder.finish(
                    scope,
                    RunState.FAILED,
                    state,
                    reason=f"{error.message}; the reply was not used",
                    steps=(failed,),
                )
            state = after_model_reply(state, reply)
            decision = plan_after_reply(
                reply,
                state=state,
                spec=spec,
                registry=self._registry,
                elapsed_seconds=self._clock.elapsed(scope),
                confirmable=confirmable,
            )
            if isinstance(decision, FinalAnswer):
                citations = resolve_citations(decision.text, state.knowledge)
                return await self._recorder.finish(
                    scope,
                    RunState.COMPLETED,
                    state,
                    answer=decision.text,
                    citations=citations,
                    steps=(record,),
                )
            if isinstance(decision, StopRun):
                return await self._recorder.finish(
                    scope, decision.state, state, reason=decision.reason, steps=(record,)
                )
            assert isinstance(decision, RunToolCalls)
            await self._recorder.record(scope, record, state)
            state = await self._tools.execute(scope, state, decision.calls)

    async def _call_model(self, scope: RunScope, request: ModelRequest) -> _ModelCalled:
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.max_tokens": request.max_tokens,
            "cairn.tier": request.tier,
        }
        with self._recorder.step(
            scope,
            StepKind.MODEL_CALL,
            f"tier:{request.tier}",
            span_name=f"chat {request.tier}",
            attributes=attributes,
        ) as step:
            detail = ModelCallDetail(
                tier=request.tier,
                max_tokens=request.max_tokens,
                remaining_budget_tokens=request.remaining_budget_tokens,
                messages=len(request.messages),
                tools_offered=tuple(t.name for t in request.tools),
            )
            try:
                reply = await self._cancels.unless_cancelled(
                    scope,
                    self._gateway.chat(
                        request,
                        scope.credentials,
                        deadline_seconds=self._clock.timeout(
                            scope, ceiling=self._model_timeout_seconds
                        ),
                    ),
                )
            except RunCancelled as exc:
                error = ErrorValue(
                    "run.cancelled",
                    "a person cancelled the run while the model was answering; the call was "
                    "cancelled and its answer, if any, was not used",
                )
                step.mark(error)
                raise RunCancelled(exc.run_id, steps=(step.record(detail, error),)) from None
            except DependencyFailed as exc:
                error = ErrorValue(f"gateway.{exc.status_code.lower()}", exc.message)
                step.mark(error)
                return _ModelCalled(None, step.record(detail, error), detail, exc)
            step.span.set_attributes(
                {
                    "gen_ai.provider.name": reply.provider,
                    "gen_ai.response.model": reply.model,
                    "gen_ai.response.finish_reasons": [reply.finish_reason],
                    "gen_ai.usage.input_tokens": reply.usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": reply.usage.completion_tokens,
                }
            )
            detail = replace(detail, reply=reply)
        # Named for the model that answered, once there is one.
        return _ModelCalled(
            reply, step.record(detail, None, name=reply.model or None), detail, None
        )


class _ModelCalled(NamedTuple):
    """A model call's reply (None: refused, with the `failure`) and its step."""

    reply: ModelReply | None
    record: StepRecord
    detail: ModelCallDetail
    failure: DependencyFailed | None
