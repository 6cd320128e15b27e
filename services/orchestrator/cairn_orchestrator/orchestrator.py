"""What a caller can ask the orchestrator, as use cases over the loop and the store:
start a run, read runs and trajectories, follow a run as it happens, resolve and
list confirmations, list agents; and the upkeep every process does in the
background (renew the leases of its runs, recover runs whose orchestrator
stopped, expire confirmations nobody decided).

Who may see a run is decided here and enforced in SQL: the caller's own runs, or
every run of the caller's org for the `admin` role; anything else (someone else's
run, another org's, one that never existed) is the same denial (I6). The same
holds for confirmations, except that only the run's own caller may resolve one
(confirmations.decide_resolution says why).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog
from opentelemetry import trace

from cairn_libs.errors import InvalidInput
from cairn_libs.identity import Principal
from cairn_libs.page_token import UnreadablePageToken
from cairn_libs.page_token import decode_page_token as decode_token_fields
from cairn_libs.page_token import encode_page_token as encode_token_fields
from cairn_libs.subject_access import may_handle_subject_records
from cairn_libs.telemetry import span_id_hex
from cairn_orchestrator.confirmations import check_cancel_reason, check_note, pending_view
from cairn_orchestrator.domain import (
    ADMIN_ROLE,
    AgentSpec,
    ConversationTurn,
    Decision,
    PageCursor,
    PendingConfirmation,
    Run,
    RunEvent,
    RunEventKind,
    RunState,
    StepStart,
    Trajectory,
    card_language,
)
from cairn_orchestrator.erasure import ErasedCopies
from cairn_orchestrator.errors import (
    BadPageToken,
    RunEnded,
    RunNotVisible,
    StoreUnavailable,
    UnknownAgent,
)
from cairn_orchestrator.events import Signal
from cairn_orchestrator.loop import RunLoop
from cairn_orchestrator.ports import ConfirmationStore, CopyStore, RunStore
from cairn_orchestrator.run_scope import Caller
from cairn_orchestrator.specs import AgentCatalog

log = structlog.get_logger(__name__)
tracer = trace.get_tracer(__name__)

DEFAULT_PAGE_SIZE = 20
# With tracing switched off every span id reads as zeros: nothing to match by.
_NO_SPAN = "0" * 16
MAX_PAGE_SIZE = 100
MAX_INPUT_CHARS = 20_000
MAX_EARLIER_TURNS = 200


def viewer_scope(principal: Principal) -> str | None:
    """The owner a caller's reads are narrowed to; None means the whole org (admin)."""
    return None if principal.has_role(ADMIN_ROLE) else principal.user_id


def encode_page_token(cursor: PageCursor) -> str:
    return encode_token_fields(
        {
            "c": cursor.created_at.isoformat(),
            "r": cursor.run_id,
            # The filter the token was issued under: a token is only good for it.
            "s": cursor.state.value if cursor.state is not None else "",
        }
    )


_RUN_ID_SHAPE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def decode_page_token(token: str, *, state: RunState | None = None) -> PageCursor | None:
    """The cursor a token names, refused (BadPageToken) unless encode_page_token made
    it for this same filter: the next page of another listing is not this one's."""
    if not token:
        return None
    try:
        value = decode_token_fields(token, fields=("c", "r", "s"))
        created_at = datetime.fromisoformat(value["c"])
        run_id = value["r"]
        issued_for = value["s"]
        # A time whose UTC form leaves the calendar (0001-01-01+14:00) is not ours.
        if created_at.utcoffset() is not None:
            created_at.astimezone(UTC)
    except (UnreadablePageToken, ValueError, OverflowError) as exc:
        raise BadPageToken(token) from exc
    # A token decodes only to what encode_page_token makes: a time with its zone and a
    # run id of ours; anything else would reach the database and fail there instead.
    if created_at.utcoffset() is None or not _RUN_ID_SHAPE.fullmatch(run_id):
        raise BadPageToken(token)
    wanted = state.value if state is not None else ""
    if issued_for != wanted:
        raise BadPageToken(token, filtered=wanted or "every state")
    return PageCursor(created_at=created_at, run_id=run_id, state=state)


def page_size(requested: int) -> int:
    if requested < 0:
        raise InvalidInput(
            f"page_size {requested!r} must be between 0 (the default of {DEFAULT_PAGE_SIZE}) and {MAX_PAGE_SIZE}"
        )
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


@dataclass(frozen=True, slots=True)
class RunPage:
    runs: tuple[Run, ...]
    next_page_token: str


class Orchestrator:
    def __init__(
        self,
        *,
        catalog: AgentCatalog,
        loop: RunLoop,
        store: RunStore,
        confirmations: ConfirmationStore | None = None,
        copies: CopyStore | None = None,
        stream_poll_seconds: float = 0.2,
        confirmation_ttl_seconds: float = 3600.0,
    ) -> None:
        self._copies = copies
        self._catalog = catalog
        self._loop = loop
        self._store = store
        self._confirmations = confirmations
        self._poll = stream_poll_seconds
        self._ttl = confirmation_ttl_seconds

    def agents(self) -> list[AgentSpec]:
        return self._catalog.all()

    async def forget_copies(
        self, principal: Principal, *, subject_kind: str, subject_id: str
    ) -> ErasedCopies:
        """Erase what runs copied about a subject (I9). The same people may do it as
        may call Forget; anyone else gets the one denial, so nobody learns whether
        runs held anything about the subject."""
        if not may_handle_subject_records(
            subject_kind, subject_id, user_id=principal.user_id, roles=principal.roles
        ):
            raise RunNotVisible()
        if self._copies is None:
            return ErasedCopies(runs=0, confirmations_abandoned=0)
        with tracer.start_as_current_span("forget_copies"):
            erased = await self._copies.erase_copies(
                org_id=principal.org_id, subject_kind=subject_kind, subject_id=subject_id
            )
        log.info(
            "copies.erased",
            subject_kind=subject_kind,
            runs=erased.runs,
            confirmations_abandoned=erased.confirmations_abandoned,
        )
        return erased

    async def start_run(
        self,
        caller: Caller,
        *,
        agent: str,
        question: str,
        conversation_id: str,
        earlier: Sequence[ConversationTurn],
        language: str = "",
        return_when_started: bool = False,
    ) -> Run:
        spec = self._catalog.get(agent)
        try:
            run_language = card_language(language)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        if not question.strip():
            raise InvalidInput("input must hold the question to answer; it was empty")
        if len(question) > MAX_INPUT_CHARS:
            raise InvalidInput(
                f"input has {len(question)} characters; at most {MAX_INPUT_CHARS} are accepted"
            )
        if len(earlier) > MAX_EARLIER_TURNS:
            raise InvalidInput(
                f"messages has {len(earlier)} turns; at most {MAX_EARLIER_TURNS} are accepted"
            )
        return await self._loop.start(
            spec=spec,
            caller=caller,
            question=question,
            conversation_id=conversation_id,
            earlier=earlier,
            language=run_language,
            return_when_started=return_when_started,
        )

    async def get_run(self, principal: Principal, run_id: str) -> Run:
        run = await self._store.get_run(
            org_id=principal.org_id, run_id=run_id, user_id=viewer_scope(principal)
        )
        if run is None:
            raise RunNotVisible()
        return run

    async def list_runs(
        self,
        principal: Principal,
        *,
        requested_size: int,
        page_token: str,
        state: RunState | None = None,
    ) -> RunPage:
        """The caller's runs (an admin: the org's), newest first, in `state` only
        when given; the next page's token is bound to the same filter."""
        size = page_size(requested_size)
        runs = await self._store.list_runs(
            org_id=principal.org_id,
            user_id=viewer_scope(principal),
            limit=size + 1,
            after=decode_page_token(page_token, state=state),
            state=state,
        )
        page = tuple(runs[:size])
        next_token = ""
        if len(runs) > size:
            last = page[-1]
            next_token = encode_page_token(
                PageCursor(created_at=last.created_at, run_id=last.run_id, state=state)
            )
        return RunPage(runs=page, next_page_token=next_token)

    async def trajectory(self, principal: Principal, run_id: str) -> Trajectory:
        run = await self.get_run(principal, run_id)
        steps = await self._store.list_steps(org_id=principal.org_id, run_id=run.run_id)
        return Trajectory(run_id=run.run_id, trace_id=run.trace_id, steps=tuple(steps))

    async def follow(self, principal: Principal, run_id: str) -> AsyncIterator[RunEvent]:
        """A run's events as they happen: the steps already recorded, then each step
        as it starts (STEP_STARTED, when this process drives the run) and as it is
        recorded (STEP_FINISHED, in seq order); CONFIRMATION_PENDING when the run
        waits for its person, after which the stream goes on (the run continues
        when they decide); and, once the run has ended, its answer and the run."""
        run = await self.get_run(principal, run_id)
        last_seq = 0
        finished_spans: set[str] = set()
        announced = ""
        with self._loop.signals.follow(run.run_id) as wake:
            while True:
                # Read the run's state before its steps: a run seen ended has no steps
                # left to come, so the steps read after it are all of them.
                ended = run.state.terminal
                for step in await self._store.list_steps(
                    org_id=principal.org_id, run_id=run.run_id, after_seq=last_seq
                ):
                    last_seq = step.seq
                    finished_spans.add(step.span_id)
                    yield RunEvent(kind=RunEventKind.STEP_FINISHED, step=step)
                pending = run.pending_confirmation
                if (
                    run.state is RunState.CONFIRMATION_PENDING
                    and pending is not None
                    and pending.confirmation_token != announced
                ):
                    announced = pending.confirmation_token
                    yield RunEvent(kind=RunEventKind.CONFIRMATION_PENDING, run=run)
                if ended:
                    break
                waiting = run.state is RunState.CONFIRMATION_PENDING
                for signal in await _next_signals(wake, self._poll * (10 if waiting else 1)):
                    if isinstance(signal, StepStart) and (
                        signal.span_id not in finished_spans or signal.span_id == _NO_SPAN
                    ):
                        yield RunEvent(kind=RunEventKind.STEP_STARTED, started=signal)
                run = await self.get_run(principal, run_id)
        if run.answer:
            yield RunEvent(kind=RunEventKind.ANSWER, answer_delta=run.answer)
        yield RunEvent(kind=RunEventKind.RUN_FINISHED, run=run)

    async def resolve_confirmation(
        self, caller: Caller, confirmation_token: str, *, decision: Decision, note: str = ""
    ) -> Run:
        problem = check_note(note)
        if problem is not None:
            raise InvalidInput(problem)
        return await self._loop.resolve(
            caller=caller,
            token=confirmation_token,
            decision=decision,
            note=note.strip(),
            spec_for=self._spec_or_none,
        )

    async def cancel_run(self, caller: Caller, run_id: str, *, reason: str = "") -> Run:
        """A person stops their run. Only the run's own person may, as only they may
        resolve its confirmations (a service acting, an admin, anyone else: the one
        denial, I6). A run that has ended is FAILED_PRECONDITION naming its state.

        The store decides under the run's lock (postgres.cancel_run); the process
        working on the run hears of it at once when it is this one, and within the
        loop's cancel_poll_seconds when it is another replica."""
        words = reason.strip()
        problem = check_cancel_reason(words)
        if problem is not None:
            raise InvalidInput(problem)
        confirmations = self._confirmations
        if not caller.is_person or confirmations is None or not _RUN_ID_SHAPE.fullmatch(run_id):
            raise RunNotVisible()
        with tracer.start_as_current_span(
            "cancel_run", attributes={"cairn.run_id": run_id}
        ) as span:
            outcome = await confirmations.cancel_run(
                org_id=caller.principal.org_id,
                run_id=run_id,
                user_id=caller.principal.user_id,
                words=words,
                span_id=span_id_hex(span),
            )
        if outcome is None:
            raise RunNotVisible()
        if isinstance(outcome, RunState):
            raise RunEnded(run_id, outcome.value)
        self._loop.cancelled(run_id)
        self._loop.signals.changed(run_id)
        log.info("run.cancel_requested", run_id=run_id)
        return outcome

    def _spec_or_none(self, name: str) -> AgentSpec | None:
        try:
            return self._catalog.get(name)
        except UnknownAgent:
            return None

    async def pending_confirmations(self, principal: Principal) -> list[PendingConfirmation]:
        """The caller's own open confirmations; an org admin sees the org's (and still
        may resolve only their own)."""
        if self._confirmations is None:
            return []
        confirmations = await self._confirmations.pending_confirmations(
            org_id=principal.org_id, user_id=viewer_scope(principal)
        )
        return [pending_view(c) for c in confirmations]

    # ------------------------------------------------------------ upkeep

    async def keep_up(self) -> None:
        """One round of upkeep; each part on its own, so one failing (the database
        away) does not stop the others, and the next round tries again."""
        confirmations = self._confirmations
        if confirmations is None:
            return
        try:
            await confirmations.renew_leases(self._loop.active_run_ids())
        except StoreUnavailable as exc:
            log.warning("runs.leases_not_renewed", error=exc.message)
        # Before the recovery sweep: a run this process still holds ends with the
        # reason that is true, not as a run whose orchestrator stopped.
        for run_id in await self._loop.settle_unsettled():
            log.warning("run.ended_after_store_failure", run_id=run_id)
        try:
            for recovered in await confirmations.recover_stopped_runs(ttl_seconds=self._ttl):
                self._loop.signals.changed(recovered.run_id)
                log.warning(
                    "run.recovered",
                    run_id=recovered.run_id,
                    org_id=recovered.org_id,
                    outcome=recovered.outcome,
                )
        except StoreUnavailable as exc:
            log.warning("runs.not_recovered", error=exc.message)
        try:
            ended = []
            if await confirmations.confirmations_due():
                with tracer.start_as_current_span("expire_confirmations") as span:
                    ended = await confirmations.expire_confirmations(span_id=span_id_hex(span))
            for run_id in ended:
                self._loop.signals.changed(run_id)
                log.info("confirmation.expired", run_id=run_id)
        except StoreUnavailable as exc:
            log.warning("confirmations.not_expired", error=exc.message)


async def _next_signals(wake: asyncio.Queue[Signal], wait_seconds: float) -> list[Signal]:
    """Whatever the loop signalled, waiting at most `wait_seconds` for the first one."""
    try:
        first = await asyncio.wait_for(wake.get(), timeout=wait_seconds)
    except TimeoutError:
        return []
    signals = [first]
    while not wake.empty():
        signals.append(wake.get_nowait())
    return signals
