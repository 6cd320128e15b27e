"""What a caller can ask the orchestrator, as use cases over the loop and the store:
start a run, read runs and trajectories, follow a run as it happens, list agents.

Who may see a run is decided here and enforced in SQL: the caller's own runs, or
every run of the caller's org for the `admin` role; anything else (someone else's
run, another org's, one that never existed) is the same denial (I6).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from cairn_libs.errors import InvalidInput
from cairn_libs.identity import Principal
from cairn_orchestrator.domain import (
    ADMIN_ROLE,
    AgentSpec,
    ConversationTurn,
    PageCursor,
    PendingConfirmation,
    Run,
    RunEvent,
    RunEventKind,
    RunState,
    Trajectory,
)
from cairn_orchestrator.errors import BadPageToken, ConfirmationsNotYetAvailable, RunNotVisible
from cairn_orchestrator.loop import Caller, RunLoop
from cairn_orchestrator.ports import RunStore
from cairn_orchestrator.specs import AgentCatalog

DEFAULT_PAGE_SIZE = 20
MAX_PAGE_SIZE = 100
MAX_INPUT_CHARS = 20_000
MAX_EARLIER_TURNS = 200


def viewer_scope(principal: Principal) -> str | None:
    """The owner a caller's reads are narrowed to; None means the whole org (admin)."""
    return None if principal.has_role(ADMIN_ROLE) else principal.user_id


def encode_page_token(cursor: PageCursor) -> str:
    raw = json.dumps(
        {"c": cursor.created_at.isoformat(), "r": cursor.run_id}, separators=(",", ":")
    )
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_page_token(token: str) -> PageCursor | None:
    if not token:
        return None
    try:
        padded = token + "=" * (-len(token) % 4)
        value = json.loads(base64.urlsafe_b64decode(padded.encode()))
        return PageCursor(created_at=datetime.fromisoformat(value["c"]), run_id=str(value["r"]))
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise BadPageToken(token) from exc


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
        stream_poll_seconds: float = 0.2,
    ) -> None:
        self._catalog = catalog
        self._loop = loop
        self._store = store
        self._poll = stream_poll_seconds

    def agents(self) -> list[AgentSpec]:
        return self._catalog.all()

    async def start_run(
        self,
        caller: Caller,
        *,
        agent: str,
        question: str,
        conversation_id: str,
        earlier: Sequence[ConversationTurn],
    ) -> Run:
        spec = self._catalog.get(agent)
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
        )

    async def get_run(self, principal: Principal, run_id: str) -> Run:
        run = await self._store.get_run(
            org_id=principal.org_id, run_id=run_id, user_id=viewer_scope(principal)
        )
        if run is None:
            raise RunNotVisible()
        return run

    async def list_runs(
        self, principal: Principal, *, requested_size: int, page_token: str
    ) -> RunPage:
        size = page_size(requested_size)
        runs = await self._store.list_runs(
            org_id=principal.org_id,
            user_id=viewer_scope(principal),
            limit=size + 1,
            after=decode_page_token(page_token),
        )
        page = tuple(runs[:size])
        next_token = ""
        if len(runs) > size:
            last = page[-1]
            next_token = encode_page_token(
                PageCursor(created_at=last.created_at, run_id=last.run_id)
            )
        return RunPage(runs=page, next_page_token=next_token)

    async def trajectory(self, principal: Principal, run_id: str) -> Trajectory:
        run = await self.get_run(principal, run_id)
        steps = await self._store.list_steps(org_id=principal.org_id, run_id=run.run_id)
        return Trajectory(run_id=run.run_id, trace_id=run.trace_id, steps=tuple(steps))

    async def follow(self, principal: Principal, run_id: str) -> AsyncIterator[RunEvent]:
        """The steps already recorded, then new ones as they land, until the run is
        at rest; then its answer (if any) and the run itself."""
        run = await self.get_run(principal, run_id)
        last_seq = 0
        while True:
            # Read the run's state before its steps: a run seen at rest has no
            # steps left to come, so the steps read after it are all of them.
            at_rest = run.state.at_rest
            for step in await self._store.list_steps(
                org_id=principal.org_id, run_id=run.run_id, after_seq=last_seq
            ):
                last_seq = step.seq
                yield RunEvent(kind=RunEventKind.STEP_FINISHED, step=step)
            if at_rest:
                break
            await asyncio.sleep(self._poll)
            run = await self.get_run(principal, run_id)
        if run.state is RunState.CONFIRMATION_PENDING:
            yield RunEvent(kind=RunEventKind.CONFIRMATION_PENDING, run=run)
        if run.answer:
            yield RunEvent(kind=RunEventKind.ANSWER, answer_delta=run.answer)
        yield RunEvent(kind=RunEventKind.RUN_FINISHED, run=run)

    async def resolve_confirmation(
        self, principal: Principal, confirmation_token: str, *, approve: bool
    ) -> Run:
        raise ConfirmationsNotYetAvailable()

    async def pending_confirmations(self, principal: Principal) -> list[PendingConfirmation]:
        # No tool can propose a write yet, so there is truthfully nothing pending.
        return []
