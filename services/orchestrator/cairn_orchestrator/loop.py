"""The agent loop: one run, from the caller's question to a run at rest.

`RunLoop` is the door the orchestrator uses; it only wires the loop's parts,
one module per concern (the way openai-agents-python splits its runner):

    start.py           a run's root span and row, then opening and drive
    opening.py         read memory, retrieve, compact the conversation
    drive.py           the resumable loop and the model call
    tool_execution.py  the reads of a turn, concurrently
    approvals.py       asking a person before a write, carrying it out once
    resume.py          a person's answer, and the run going on from its state
    recording.py       a step's span and record; ordered writes behind the run
    cancellation.py    a person's cancel reaching the work in flight
    lifecycle.py       runs as tasks of their own, leases, coming to rest

    read memory ─┐
                 ├─ prepare the turn ─ call the model ─┬─ answer ─ resolve citations ─ COMPLETED
    retrieve ────┘          ▲                          └─ tools ─ execute ─┐
                            └──────────────────────────────────────────────┘

Every decision is a pure function in `phases.py`, `confirmations.py` and
`failover.py`. Failures of memory, retrieval and tools are recorded as data and
the run goes on (I3, I11); a failed model call ends the run FAILED with the
reason. Writes (I4) wait for their person: the run stops at
CONFIRMATION_PENDING with the write's card and its state persisted, and
ResolveConfirmation continues it from that state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cairn_libs.clock import Clock, SystemClock
from cairn_orchestrator.approvals import Approvals
from cairn_orchestrator.confirmations import DEFAULT_CONFIRMATION_TTL_SECONDS
from cairn_orchestrator.conversation import ConversationArchiver
from cairn_orchestrator.domain import (
    ENGLISH,
    AgentSpec,
    ConversationTurn,
    Decision,
    Run,
    RunLanguage,
)
from cairn_orchestrator.drive import TurnDriver
from cairn_orchestrator.events import RunSignals
from cairn_orchestrator.lifecycle import RunLifecycle
from cairn_orchestrator.opening import Opening
from cairn_orchestrator.phases import DEFAULT_MAX_COMPLETION_TOKENS
from cairn_orchestrator.ports import (
    ConfirmationStore,
    KnowledgeSearch,
    MemoryRecall,
    ModelGateway,
    RunStore,
)
from cairn_orchestrator.recording import StepRecorder
from cairn_orchestrator.resume import Resumption
from cairn_orchestrator.run_scope import ActorTokenMinter, Caller, RunClock
from cairn_orchestrator.start import RunStarter
from cairn_orchestrator.tool_execution import ToolExecution
from cairn_orchestrator.tools import ToolRegistry


@dataclass(frozen=True, slots=True)
class LoopSettings:
    memory_k: int = 5
    retrieval_k: int = 4
    max_completion_tokens: int = DEFAULT_MAX_COMPLETION_TOKENS
    dependency_timeout_seconds: float = 15.0
    model_timeout_seconds: float = 120.0
    confirmation_ttl_seconds: float = DEFAULT_CONFIRMATION_TTL_SECONDS
    # A second approval of a write already being carried out waits this long for
    # the run to come to rest, so both callers see the same outcome.
    settle_seconds: float = 30.0
    settle_poll_seconds: float = 0.2
    # How often a process working on runs asks the store whether a person cancelled
    # one of them (through any replica): the most a cancelled model call runs on.
    cancel_poll_seconds: float = 0.25


class RunLoop:
    def __init__(
        self,
        *,
        store: RunStore,
        gateway: ModelGateway,
        retrieval: KnowledgeSearch | None,
        memory: MemoryRecall | None,
        registry: ToolRegistry,
        mint_actor_token: ActorTokenMinter,
        clock: Clock | None = None,
        settings: LoopSettings | None = None,
        conversation: ConversationArchiver | None = None,
        confirmations: ConfirmationStore | None = None,
        signals: RunSignals | None = None,
    ) -> None:
        settings = settings or LoopSettings()
        self.signals = signals or RunSignals()
        run_clock = RunClock(
            clock or SystemClock(), dependency_timeout_seconds=settings.dependency_timeout_seconds
        )
        recorder = StepRecorder(store=store, signals=self.signals, clock=run_clock)
        self._lifecycle = RunLifecycle(
            store=store,
            confirmations=confirmations,
            recorder=recorder,
            signals=self.signals,
            cancel_poll_seconds=settings.cancel_poll_seconds,
        )
        cancels = self._lifecycle.cancels
        approvals = Approvals(
            # Without a confirmation store no person can be asked, so writes are refused.
            confirmations=confirmations,
            registry=registry,
            recorder=recorder,
            signals=self.signals,
            clock=run_clock,
            ttl_seconds=settings.confirmation_ttl_seconds,
        )
        driver = TurnDriver(
            gateway=gateway,
            registry=registry,
            tools=ToolExecution(registry=registry, recorder=recorder, cancels=cancels),
            approvals=approvals,
            recorder=recorder,
            cancels=cancels,
            clock=run_clock,
            max_completion_tokens=settings.max_completion_tokens,
            model_timeout_seconds=settings.model_timeout_seconds,
        )
        opening = Opening(
            store=store,
            retrieval=retrieval,
            memory=memory,
            conversation=conversation or ConversationArchiver(None),
            recorder=recorder,
            cancels=cancels,
            clock=run_clock,
            memory_k=settings.memory_k,
            retrieval_k=settings.retrieval_k,
        )
        self._starter = RunStarter(
            store=store,
            lifecycle=self._lifecycle,
            opening=opening,
            driver=driver,
            clock=run_clock,
            mint_actor_token=mint_actor_token,
        )
        self._resumption = Resumption(
            store=store,
            confirmations=confirmations,
            lifecycle=self._lifecycle,
            approvals=approvals,
            driver=driver,
            signals=self.signals,
            clock=run_clock,
            mint_actor_token=mint_actor_token,
            settle_seconds=settings.settle_seconds,
            settle_poll_seconds=settings.settle_poll_seconds,
        )

    def active_run_ids(self) -> tuple[str, ...]:
        """The runs this process is driving right now (their leases are renewed)."""
        return self._lifecycle.active_run_ids()

    async def stop(self) -> None:
        """Stop driving: cancel the runs in flight and give up their leases, so the
        recovery sweep (of this or another process) deals with them at once."""
        await self._lifecycle.stop()

    async def abandon(self) -> None:
        """Cancel the runs in flight and do nothing else (no lease given up): what a
        process that is killed leaves behind, for the recovery sweep to find."""
        await self._lifecycle.abandon()

    def cancelled(self, run_id: str) -> None:
        """A person cancelled the run: if this process works on it, cut its model call
        (and the reads in flight) short; the writes after would be refused anyway."""
        self._lifecycle.cancels.cancelled(run_id)

    async def settle_unsettled(self) -> list[str]:
        """End, with their true reason, the runs whose store failed under them; a run
        the store still cannot take waits for the next round. Returns the runs ended."""
        return await self._lifecycle.settle_unsettled()

    async def start(
        self,
        *,
        spec: AgentSpec,
        caller: Caller,
        question: str,
        conversation_id: str,
        earlier: Sequence[ConversationTurn],
        language: RunLanguage = ENGLISH,
        return_when_started: bool = False,
    ) -> Run:
        """The run as it ends or waits for a person; with `return_when_started`, as
        soon as its row exists (RUNNING), while its own task drives it on."""
        return await self._starter.start(
            spec=spec,
            caller=caller,
            question=question,
            conversation_id=conversation_id,
            earlier=earlier,
            language=language,
            return_when_started=return_when_started,
        )

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
        return await self._resumption.resolve(
            caller=caller, token=token, decision=decision, note=note, spec_for=spec_for
        )
