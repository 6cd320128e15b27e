"""A person resolves a proposed write, and its run goes on from its recorded state.

The decision (what an approval, a denial, a late or a second answer becomes) is
pure in confirmations.py and taken inside the store's transaction; this module
continues the run it was about. An approval hands the write to its target once
(approvals.py) and drives on; a denial reaches the model as a tool message. No
earlier model or tool call is made again. The resumed part joins the run's own
trace, linked to the request of the person who resolved it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, TraceFlags

from cairn_libs.telemetry import bound_run, span_id_hex
from cairn_orchestrator.approvals import Approvals
from cairn_orchestrator.confirmations import (
    AlreadyDecided,
    Claim,
    Expire,
    Refuse,
    Reject,
    Resolver,
    looks_like_token,
)
from cairn_orchestrator.domain import (
    AgentSpec,
    CallCredentials,
    Confirmation,
    Decision,
    LoopState,
    Run,
    RunState,
)
from cairn_orchestrator.drive import TurnDriver
from cairn_orchestrator.errors import ConfirmationClosed, RunNotVisible
from cairn_orchestrator.events import RunSignals
from cairn_orchestrator.lifecycle import RunLifecycle
from cairn_orchestrator.ports import ConfirmationStore, RunStore
from cairn_orchestrator.run_scope import ActorTokenMinter, Caller, RunClock, RunScope

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)


class Resumption:
    def __init__(
        self,
        *,
        store: RunStore,
        confirmations: ConfirmationStore | None,
        lifecycle: RunLifecycle,
        approvals: Approvals,
        driver: TurnDriver,
        signals: RunSignals,
        clock: RunClock,
        mint_actor_token: ActorTokenMinter,
        settle_seconds: float,
        settle_poll_seconds: float,
    ) -> None:
        self._store = store
        self._confirmations = confirmations
        self._lifecycle = lifecycle
        self._approvals = approvals
        self._driver = driver
        self._signals = signals
        self._clock = clock
        self._mint_actor_token = mint_actor_token
        self._settle_seconds = settle_seconds
        self._settle_poll_seconds = settle_poll_seconds

    async def resolve(
        self,
        *,
        caller: Caller,
        token: str,
        decision: Decision,
        note: str,
        spec_for: Callable[[str], AgentSpec | None],
    ) -> Run:
        """Approve or deny a proposed write, then continue its run from its recorded
        state; the run is at rest again when this returns."""
        return await self._lifecycle.own(
            self._resolve(
                caller=caller, token=token, decision=decision, note=note, spec_for=spec_for
            )
        )

    async def _resolve(
        self,
        *,
        caller: Caller,
        token: str,
        decision: Decision,
        note: str,
        spec_for: Callable[[str], AgentSpec | None],
    ) -> Run:
        confirmations = self._confirmations
        if confirmations is None or not looks_like_token(token):
            raise RunNotVisible()
        resolver = Resolver(
            org_id=caller.principal.org_id,
            user_id=caller.principal.user_id,
            is_person=caller.is_person,
        )
        with tracer.start_as_current_span(
            "resolve_confirmation", attributes={"cairn.decision": decision}
        ) as span:
            record = await confirmations.resolve_confirmation(
                org_id=caller.principal.org_id,
                token=token,
                resolver=resolver,
                decision=decision,
                note=note,
                span_id=span_id_hex(span),
                started_at=self._clock.now(),
            )
            link = Link(span.get_span_context())
        outcome = record.resolution
        if isinstance(outcome, Refuse):
            raise RunNotVisible()
        assert record.run is not None and record.confirmation is not None
        run = record.run
        if isinstance(outcome, Expire):
            self._signals.changed(run.run_id)
            log.info("confirmation.expired", run_id=run.run_id)
            raise ConfirmationClosed(outcome.reason)
        if isinstance(outcome, Reject):
            raise ConfirmationClosed(outcome.message)
        if isinstance(outcome, AlreadyDecided):
            return await self._settled(run)
        assert isinstance(outcome, Claim) and record.loop_state is not None
        self._signals.changed(run.run_id)
        return await self._continue(
            run, record.confirmation, outcome, record.loop_state, caller, spec_for(run.agent), link
        )

    async def _continue(
        self,
        run: Run,
        confirmation: Confirmation,
        claim: Claim,
        state: LoopState,
        caller: Caller,
        spec: AgentSpec | None,
        link: Link,
    ) -> Run:
        attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": run.agent,
            "cairn.run_id": run.run_id,
            "cairn.resumed": True,
        }
        # The resumed part joins the run's own trace (one run, one trace), linked to
        # the request of the person who resolved it.
        with (
            tracer.start_as_current_span(
                f"invoke_agent {run.agent}",
                context=_run_trace_context(run),
                links=[link],
                attributes=attributes,
            ) as span,
            bound_run(run.run_id),
        ):
            log.info(
                "run.resumed",
                decision=claim.decision,
                after_interruption=claim.resumed,
                tool=confirmation.tool_name,
            )
            if spec is None:
                return await self._store.finish_run(
                    org_id=run.org_id,
                    run_id=run.run_id,
                    state=RunState.FAILED,
                    loop_state=state,
                    usage=state.usage,
                    reason=f"agent {run.agent!r} is no longer loaded by this orchestrator, so "
                    "the run could not continue; the write did not run",
                )
            scope = RunScope(
                run=run,
                spec=spec,
                principal=caller.principal,
                credentials=CallCredentials(
                    caller_token=caller.token,
                    actor_token=self._mint_actor_token(run.run_id, spec.name),
                ),
                # Time spent waiting for the person does not count against the budget.
                started=self._clock.now() - timedelta(seconds=state.active_seconds),
            )
            self._lifecycle.activate(run.run_id)
            try:
                return await self._lifecycle.guarded(
                    scope, span, self._carry_out_and_drive(scope, state, confirmation, claim)
                )
            finally:
                self._lifecycle.release(run.run_id)

    async def _carry_out_and_drive(
        self, scope: RunScope, state: LoopState, confirmation: Confirmation, claim: Claim
    ) -> Run:
        if claim.decision == "approve":
            state = await self._approvals.carry_out(scope, state, confirmation)
        return await self._driver.drive(scope, state)

    async def _settled(self, run: Run) -> Run:
        """A run another request is driving, once it is at rest (or as it stands
        when the wait runs out)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settle_seconds
        with self._signals.follow(run.run_id) as wake:
            while not run.state.at_rest and loop.time() < deadline:
                with suppress(TimeoutError):
                    await asyncio.wait_for(wake.get(), timeout=self._settle_poll_seconds)
                current = await self._store.get_run(
                    org_id=run.org_id, run_id=run.run_id, user_id=None
                )
                if current is None:
                    break
                run = current
        return run


def _run_trace_context(run: Run) -> otel_context.Context | None:
    """The context of the run's root span, so a resumed run's spans join its trace."""
    try:
        trace_id, span_id = int(run.trace_id, 16), int(run.root_span_id, 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    root = SpanContext(
        trace_id=trace_id,
        span_id=span_id,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(root))
