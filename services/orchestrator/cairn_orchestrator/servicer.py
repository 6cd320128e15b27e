"""OrchestratorService over gRPC: protos in, protos out, converted at this door.

Nothing is decided here. The identity interceptor has verified the caller before
a method runs; the methods read it with `current_identity()` (and the raw token,
which the loop passes on to retrieval and memory, I1) and hand plain values to
the Orchestrator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import Any

import grpc
from google.protobuf import struct_pb2, timestamp_pb2

from cairn.gateway.v1 import gateway_pb2
from cairn.memory.v1 import memory_pb2
from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn.orchestrator.v1 import orchestrator_pb2_grpc
from cairn_libs.errors import InvalidInput
from cairn_libs.server import current_caller_token, current_identity
from cairn_orchestrator.domain import (
    AgentSpec,
    Citation,
    ConversationTurn,
    PendingConfirmation,
    Run,
    RunEvent,
    RunState,
    Step,
)
from cairn_orchestrator.orchestrator import Orchestrator
from cairn_orchestrator.run_scope import Caller

Context = grpc.aio.ServicerContext[Any, Any]

_TIERS = {
    "fast": gateway_pb2.TIER_FAST,
    "balanced": gateway_pb2.TIER_BALANCED,
    "deep": gateway_pb2.TIER_DEEP,
}


# ---------------------------------------------------------------- to proto


def timestamp_to_proto(moment: datetime) -> timestamp_pb2.Timestamp:
    value = timestamp_pb2.Timestamp()
    value.FromDatetime(moment)
    return value


def struct_to_proto(detail: Mapping[str, Any]) -> struct_pb2.Struct:
    value = struct_pb2.Struct()
    value.update(dict(detail))
    return value


def citation_to_proto(citation: Citation) -> pb.Citation:
    return pb.Citation(
        label=citation.label,
        document_id=citation.document_id,
        chunk_id=citation.chunk_id,
        source=citation.source,
        title=citation.title,
        char_start=citation.char_start,
        char_end=citation.char_end,
    )


def run_to_proto(run: Run) -> pb.Run:
    return pb.Run(
        run_id=run.run_id,
        agent=run.agent,
        state=pb.RunState.Value(f"RUN_STATE_{run.state.value}"),
        input=run.input,
        answer=run.answer,
        citations=[citation_to_proto(c) for c in run.citations],
        reason=run.reason,
        conversation_id=run.conversation_id,
        user_id=run.user_id,
        trace_id=run.trace_id,
        usage=pb.RunUsage(
            prompt_tokens=run.usage.prompt_tokens,
            completion_tokens=run.usage.completion_tokens,
            total_tokens=run.usage.total_tokens,
            model_calls=run.usage.model_calls,
        ),
        created_at=timestamp_to_proto(run.created_at),
        updated_at=timestamp_to_proto(run.updated_at),
        pending_confirmation=(
            pending_to_proto(run.pending_confirmation)
            if run.pending_confirmation is not None
            else None
        ),
        language=run.language,
        cancelled_by=run.cancelled_by,
    )


def step_to_proto(step: Step) -> pb.Step:
    message = pb.Step(
        seq=step.seq,
        kind=pb.StepKind.Value(f"STEP_KIND_{step.kind.value}"),
        name=step.name,
        span_id=step.span_id,
        started_at=timestamp_to_proto(step.started_at),
        finished_at=timestamp_to_proto(step.finished_at),
        detail=struct_to_proto(step.detail),
    )
    if step.error is not None:
        message.error.CopyFrom(pb.StepError(code=step.error.code, message=step.error.message))
    return message


def agent_to_proto(spec: AgentSpec) -> pb.Agent:
    return pb.Agent(
        name=spec.name,
        description=spec.description,
        tier=_TIERS[spec.tier],
        tools=list(spec.tools),
        sources=list(spec.sources),
        budgets=pb.AgentBudgets(
            tokens=spec.budgets.tokens,
            model_calls=spec.budgets.model_calls,
            wall_seconds=spec.budgets.wall_seconds,
        ),
        reads_memory=spec.reads_memory,
    )


def event_to_proto(event: RunEvent) -> pb.StreamRunResponse:
    message = pb.StreamRunResponse(
        kind=pb.RunEventKind.Value(f"RUN_EVENT_KIND_{event.kind.value}"),
        answer_delta=event.answer_delta,
    )
    if event.step is not None:
        message.step.CopyFrom(step_to_proto(event.step))
    if event.started is not None:
        # Not numbered yet: seq 0, no finished_at; the span id ties it to its STEP_FINISHED.
        message.step.CopyFrom(
            pb.Step(
                kind=pb.StepKind.Value(f"STEP_KIND_{event.started.kind.value}"),
                name=event.started.name,
                span_id=event.started.span_id,
                started_at=timestamp_to_proto(event.started.started_at),
            )
        )
    if event.run is not None:
        message.run.CopyFrom(run_to_proto(event.run))
    return message


def pending_to_proto(pending: PendingConfirmation) -> pb.PendingConfirmation:
    return pb.PendingConfirmation(
        confirmation_token=pending.confirmation_token,
        run_id=pending.run_id,
        tool_name=pending.tool_name,
        card=pb.ConfirmationCard(
            summary=pending.card.summary,
            details=[pb.CardDetail(label=d.label, value=d.value) for d in pending.card.details],
            warnings=list(pending.card.warnings),
            language=pending.card.language,
            language_fallback=pending.card.language_fallback,
        ),
        created_at=timestamp_to_proto(pending.created_at),
        expires_at=timestamp_to_proto(pending.expires_at),
    )


# ---------------------------------------------------------------- from proto


def _enum_label(enum: Any, value: int) -> str:
    """How a refusal names an enum value: its name, or its number when the schema
    defines none (building the message must never be what fails)."""
    try:
        return repr(enum.Name(value))
    except ValueError:
        return f"{value!r} (not a value the schema defines)"


def run_state_from_proto(state: int) -> RunState | None:
    """A ListRuns filter: None for UNSPECIFIED (every state), refusing numbers the
    schema lacks."""
    if state == pb.RUN_STATE_UNSPECIFIED:
        return None
    try:
        return RunState(pb.RunState.Name(pb.RunState.ValueType(state)).removeprefix("RUN_STATE_"))
    except ValueError as exc:
        raise InvalidInput(
            f"state {_enum_label(pb.RunState, state)} is not a run state; use one of "
            + ", ".join(f"RUN_STATE_{s.value}" for s in RunState)
            + ", or RUN_STATE_UNSPECIFIED for every state"
        ) from exc


def turn_from_proto(turn: pb.ConversationTurn, index: int) -> ConversationTurn:
    if turn.role == pb.TURN_ROLE_USER:
        return ConversationTurn(role="user", content=turn.content)
    if turn.role == pb.TURN_ROLE_ASSISTANT:
        return ConversationTurn(role="assistant", content=turn.content)
    raise InvalidInput(
        f"messages[{index}].role {_enum_label(pb.TurnRole, turn.role)} is not accepted; "
        "use TURN_ROLE_USER or TURN_ROLE_ASSISTANT"
    )


def _caller() -> Caller:
    identity = current_identity()
    return Caller(
        principal=identity.principal,
        token=current_caller_token(),
        # An actor token means a service is acting, not a person deciding.
        is_person=identity.actor is None,
    )


def subject_kind_from_proto(kind: int) -> str:
    """The subject kind's name (`USER`, ...), refusing numbers the schema lacks."""
    names: dict[int, str] = {
        int(number): name.removeprefix("SUBJECT_KIND_")
        for name, number in memory_pb2.SubjectKind.items()
        if number != memory_pb2.SUBJECT_KIND_UNSPECIFIED
    }
    if kind not in names:
        raise InvalidInput(
            f"subject.kind {kind!r} is not a subject kind; use one of "
            + ", ".join(f"SUBJECT_KIND_{n}" for n in names.values())
        )
    return names[kind]


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator

    async def StartRun(self, request: pb.StartRunRequest, context: Context) -> pb.StartRunResponse:
        earlier = [turn_from_proto(turn, i) for i, turn in enumerate(request.messages)]
        run = await self._orchestrator.start_run(
            _caller(),
            agent=request.agent,
            question=request.input,
            conversation_id=request.conversation_id,
            earlier=earlier,
            language=request.language,
            return_when_started=request.return_when_started,
        )
        return pb.StartRunResponse(run=run_to_proto(run))

    async def StreamRun(
        self, request: pb.StreamRunRequest, context: Context
    ) -> AsyncIterator[pb.StreamRunResponse]:
        async for event in self._orchestrator.follow(current_identity().principal, request.run_id):
            yield event_to_proto(event)

    async def GetRun(self, request: pb.GetRunRequest, context: Context) -> pb.GetRunResponse:
        run = await self._orchestrator.get_run(current_identity().principal, request.run_id)
        return pb.GetRunResponse(run=run_to_proto(run))

    async def ListRuns(self, request: pb.ListRunsRequest, context: Context) -> pb.ListRunsResponse:
        page = await self._orchestrator.list_runs(
            current_identity().principal,
            requested_size=request.page_size,
            page_token=request.page_token,
            state=run_state_from_proto(request.state),
        )
        return pb.ListRunsResponse(
            runs=[run_to_proto(r) for r in page.runs], next_page_token=page.next_page_token
        )

    async def GetTrajectory(
        self, request: pb.GetTrajectoryRequest, context: Context
    ) -> pb.GetTrajectoryResponse:
        trajectory = await self._orchestrator.trajectory(
            current_identity().principal, request.run_id
        )
        return pb.GetTrajectoryResponse(
            run_id=trajectory.run_id,
            trace_id=trajectory.trace_id,
            steps=[step_to_proto(s) for s in trajectory.steps],
        )

    async def ResolveConfirmation(
        self, request: pb.ResolveConfirmationRequest, context: Context
    ) -> pb.ResolveConfirmationResponse:
        if request.decision not in (pb.DECISION_APPROVE, pb.DECISION_DENY):
            raise InvalidInput(
                f"decision {_enum_label(pb.Decision, request.decision)} is not accepted; "
                "use DECISION_APPROVE or DECISION_DENY"
            )
        run = await self._orchestrator.resolve_confirmation(
            _caller(),
            request.confirmation_token,
            decision="approve" if request.decision == pb.DECISION_APPROVE else "deny",
            note=request.note,
        )
        return pb.ResolveConfirmationResponse(run=run_to_proto(run))

    async def CancelRun(
        self, request: pb.CancelRunRequest, context: Context
    ) -> pb.CancelRunResponse:
        run = await self._orchestrator.cancel_run(_caller(), request.run_id, reason=request.reason)
        return pb.CancelRunResponse(run=run_to_proto(run))

    async def ListPendingConfirmations(
        self, request: pb.ListPendingConfirmationsRequest, context: Context
    ) -> pb.ListPendingConfirmationsResponse:
        pending = await self._orchestrator.pending_confirmations(current_identity().principal)
        return pb.ListPendingConfirmationsResponse(
            confirmations=[pending_to_proto(p) for p in pending]
        )

    async def ForgetCopies(
        self, request: pb.ForgetCopiesRequest, context: Context
    ) -> pb.ForgetCopiesResponse:
        kind = subject_kind_from_proto(request.subject.kind)
        erased = await self._orchestrator.forget_copies(
            current_identity().principal, subject_kind=kind, subject_id=request.subject.id
        )
        return pb.ForgetCopiesResponse(
            runs_erased=erased.runs, confirmations_abandoned=erased.confirmations_abandoned
        )

    async def ListAgents(
        self, request: pb.ListAgentsRequest, context: Context
    ) -> pb.ListAgentsResponse:
        return pb.ListAgentsResponse(
            agents=[agent_to_proto(spec) for spec in self._orchestrator.agents()]
        )
