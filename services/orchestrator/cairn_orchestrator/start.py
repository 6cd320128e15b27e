"""Starting a run: its root span and row, its opening reads, then the drive loop.

The run's root span (`invoke_agent {agent}`) is opened here; every step is a
child of it. The run's row is written while recall and the prefetch already
read (they need nothing from it); a run the store refuses has changed nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import structlog
from opentelemetry import trace

from cairn_libs.telemetry import bound_run, span_id_hex, trace_id_hex
from cairn_orchestrator.domain import (
    ENGLISH,
    AgentSpec,
    CallCredentials,
    ConversationTurn,
    LabelBook,
    Run,
    RunLanguage,
    RunState,
    new_run_id,
)
from cairn_orchestrator.drive import TurnDriver
from cairn_orchestrator.lifecycle import RunLifecycle
from cairn_orchestrator.opening import Opening, OpeningReads
from cairn_orchestrator.ports import RunStore
from cairn_orchestrator.remote import RunSearches, run_searches
from cairn_orchestrator.run_scope import ActorTokenMinter, Caller, RunClock, RunScope

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)


class RunStarter:
    def __init__(
        self,
        *,
        store: RunStore,
        lifecycle: RunLifecycle,
        opening: Opening,
        driver: TurnDriver,
        clock: RunClock,
        mint_actor_token: ActorTokenMinter,
    ) -> None:
        self._store = store
        self._lifecycle = lifecycle
        self._opening = opening
        self._driver = driver
        self._clock = clock
        self._mint_actor_token = mint_actor_token

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
        created: asyncio.Future[Run] | None = (
            asyncio.get_running_loop().create_future() if return_when_started else None
        )
        work = self._start(
            spec=spec,
            caller=caller,
            question=question,
            conversation_id=conversation_id,
            earlier=earlier,
            language=language,
            created=created,
        )
        if created is None:
            return await self._lifecycle.own(work)
        task = self._lifecycle.spawn(work)
        await asyncio.wait({task, created}, return_when=asyncio.FIRST_COMPLETED)
        if created.done():
            return created.result()
        return await task  # refused, or failed, before the run existed

    async def _start(
        self,
        *,
        spec: AgentSpec,
        caller: Caller,
        question: str,
        conversation_id: str,
        earlier: Sequence[ConversationTurn],
        language: RunLanguage = ENGLISH,
        created: asyncio.Future[Run] | None = None,
    ) -> Run:
        run_id = new_run_id()
        attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": spec.name,
            "cairn.run_id": run_id,
        }
        with (
            tracer.start_as_current_span(
                f"invoke_agent {spec.name}", attributes=attributes
            ) as span,
            bound_run(run_id),
        ):
            started = self._clock.now()
            credentials = CallCredentials(
                caller_token=caller.token, actor_token=self._mint_actor_token(run_id, spec.name)
            )
            # Recall and the prefetch read for the caller and need nothing from the
            # run's row: they start now, while it is written (a read, never a write,
            # so a run the store refuses has changed nothing).
            reading = RunScope(
                run=Run(
                    run_id=run_id,
                    org_id=caller.principal.org_id,
                    user_id=caller.principal.user_id,
                    agent=spec.name,
                    state=RunState.RUNNING,
                    input=question,
                    conversation_id=conversation_id,
                    trace_id=trace_id_hex(span),
                    created_at=started,
                    updated_at=started,
                    root_span_id=span_id_hex(span),
                    language=language.language,
                    language_fallback=language.fallback,
                ),
                spec=spec,
                principal=caller.principal,
                credentials=credentials,
                started=started,
            )
            # Shared with the retrieval door for the rest of this run (this task and
            # the tasks it starts): a search_knowledge call with the question reuses
            # the prefetch.
            searches = RunSearches()
            run_searches.set(searches)
            book = LabelBook()
            reads = asyncio.create_task(self._opening.reads(reading, question, book, searches))
            try:
                run = await self._store.create_run(
                    run_id=run_id,
                    org_id=caller.principal.org_id,
                    user_id=caller.principal.user_id,
                    agent=spec.name,
                    input=question,
                    conversation_id=conversation_id,
                    earlier_turns=earlier,
                    trace_id=trace_id_hex(span),
                    root_span_id=span_id_hex(span),
                    language=language,
                )
            except BaseException:
                reads.cancel()
                await asyncio.gather(reads, return_exceptions=True)
                raise
            log.info("run.started", agent=spec.name)
            scope = replace(reading, run=run)
            self._lifecycle.activate(run_id)
            if created is not None and not created.done():
                created.set_result(run)
            try:
                return await self._lifecycle.guarded(
                    scope,
                    span,
                    self._open_and_drive(scope, reads, question=question, earlier=earlier),
                )
            finally:
                self._lifecycle.release(run_id)

    async def _open_and_drive(
        self,
        scope: RunScope,
        reads: asyncio.Task[OpeningReads],
        *,
        question: str,
        earlier: Sequence[ConversationTurn],
    ) -> Run:
        state = await self._opening.open(scope, reads, question=question, earlier=earlier)
        # A re-run of the turn starts again from exactly these messages.
        return await self._driver.drive(scope, replace(state, opening=len(state.messages)))
