"""Runs, steps and confirmations in PostgreSQL (schema `orchestrator`).

Every statement about a run or a confirmation narrows by org_id (I5); the two
maintenance sweeps (runs whose lease ran out, confirmations past their expiry)
scan across orgs by design and then act on each row by its own org and id.

Ownership. A run is driven by the one orchestrator process holding its lease
(`lease_owner`, `lease_until`, renewed as it records steps and by a heartbeat).
Every write a driver makes is fenced on that ownership: a process whose lease ran
out and whose run was taken over gets RunTakenOver and writes nothing more.

Steps. A step takes its seq from the run row (`step_count`) in the same
statement that appends it, so the steps of a run are numbered densely, in the
order recorded, with one round trip and no scan; the loop state written with a
step is always the state after that step.

Confirmations. Proposing, resolving, starting and recording a write each happen
in one transaction that holds the confirmation's and the run's row locks; the
decision taken inside it is a pure function (confirmations.py). asyncpg errors
become StoreUnavailable here.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import structlog

from cairn_libs.db import CONNECTION_ERRORS, Database, Migration, load_migrations
from cairn_libs.errors import DependencyUnavailable
from cairn_orchestrator.confirmations import (
    AlreadyDecided,
    BackToPerson,
    Claim,
    EndRun,
    Expire,
    Recovered,
    Refuse,
    Reject,
    ResolutionRecord,
    Resolver,
    after_interruption,
    after_resolved_write,
    cancel_effect,
    cancel_reason,
    decide_resolution,
    denial_outcome,
    expiry_on_sweep,
    pending_view,
    requested_detail,
    resolved_detail,
)
from cairn_orchestrator.domain import (
    ENGLISH,
    SUBJECT_KINDS,
    Citation,
    Confirmation,
    ConfirmationCard,
    ConfirmationProposal,
    ConfirmationState,
    ConversationTurn,
    Decision,
    ErrorValue,
    JSONValue,
    LoopState,
    MemorySubject,
    PageCursor,
    Run,
    RunLanguage,
    RunState,
    RunUsage,
    Step,
    StepKind,
    StepRecord,
    SubjectKindName,
    ToolCallRequest,
)
from cairn_orchestrator.erasure import ORG_WIDE_MIN_CHARS, ErasedCopies, Eraser, search_forms
from cairn_orchestrator.errors import (
    RunCancelled,
    RunTakenOver,
    StoreRefusedValue,
    StoreUnavailable,
)

log = structlog.get_logger(__name__)

SCHEMA = "orchestrator"
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
DEFAULT_LEASE_SECONDS = 30.0

_RUN_FIELDS = (
    "run_id",
    "org_id",
    "user_id",
    "agent",
    "state",
    "input",
    "conversation_id",
    "answer",
    "citations",
    "reason",
    "trace_id",
    "root_span_id",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "model_calls",
    "created_at",
    "updated_at",
    "language",
    "language_fallback",
    "cancelled_by",
)
_CONFIRMATION_FIELDS = (
    "confirmation_token",
    "org_id",
    "run_id",
    "user_id",
    "tool_name",
    "tool_call_id",
    "arguments_json",
    "card",
    "state",
    "created_at",
    "expires_at",
    "decision",
    "resolved_by",
    "resolved_at",
    "note",
    "interrupted_at",
    "executions",
    "result",
)
_RUN_COLUMNS = ", ".join(_RUN_FIELDS)
# A run with the confirmation it waits on, when it waits on one.
_RUN_WITH_PENDING = (
    "SELECT "
    + ", ".join(f"r.{f}" for f in _RUN_FIELDS)
    + ", "
    + ", ".join(f"c.{f} AS c_{f}" for f in _CONFIRMATION_FIELDS)
    + " FROM runs r LEFT JOIN confirmations c ON r.state = 'CONFIRMATION_PENDING'"
    " AND c.confirmation_token = r.current_confirmation AND c.org_id = r.org_id"
)


def migrations() -> list[Migration]:
    return load_migrations(MIGRATIONS_DIR)


def new_instance_id() -> str:
    """Who holds a lease: unique per process start, readable in the database."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _confirmation(row: asyncpg.Record, prefix: str = "") -> Confirmation:
    def col(name: str) -> Any:
        return row[prefix + name]

    result = col("result")
    decision = col("decision")
    return Confirmation(
        token=col("confirmation_token"),
        org_id=col("org_id"),
        run_id=col("run_id"),
        user_id=col("user_id"),
        call=ToolCallRequest(
            id=col("tool_call_id"), name=col("tool_name"), arguments_json=col("arguments_json")
        ),
        card=_card(col("card")),
        state=ConfirmationState(col("state")),
        created_at=col("created_at"),
        expires_at=col("expires_at"),
        resolved_by=col("resolved_by"),
        resolved_at=col("resolved_at"),
        decision="approve" if decision == "approve" else "deny" if decision == "deny" else None,
        note=col("note"),
        interrupted_at=col("interrupted_at"),
        executions=col("executions"),
        result=json.loads(result) if result is not None else None,
    )


def _card(raw: str) -> ConfirmationCard:
    return ConfirmationCard.from_json(json.loads(raw))


def _run(row: asyncpg.Record) -> Run:
    pending = None
    if row.get("c_confirmation_token") is not None:
        pending = pending_view(_confirmation(row, "c_"))
    return Run(
        run_id=row["run_id"],
        org_id=row["org_id"],
        user_id=row["user_id"],
        agent=row["agent"],
        state=RunState(row["state"]),
        input=row["input"],
        conversation_id=row["conversation_id"],
        trace_id=row["trace_id"],
        root_span_id=row["root_span_id"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        answer=row["answer"],
        citations=tuple(Citation.from_json(c) for c in json.loads(row["citations"])),
        reason=row["reason"],
        usage=RunUsage(
            prompt_tokens=row["prompt_tokens"],
            completion_tokens=row["completion_tokens"],
            total_tokens=row["total_tokens"],
            model_calls=row["model_calls"],
        ),
        pending_confirmation=pending,
        language="zh-Hans" if row["language"] == "zh-Hans" else "en",
        language_fallback=row["language_fallback"],
        cancelled_by=row["cancelled_by"],
    )


def _step(row: asyncpg.Record) -> Step:
    error = None
    if row["error_code"] is not None:
        error = ErrorValue(code=row["error_code"], message=row["error_message"] or "")
    return Step(
        seq=row["seq"],
        kind=StepKind(row["kind"]),
        name=row["name"],
        span_id=row["span_id"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        detail=json.loads(row["detail"]),
        error=error,
    )


def _json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if "\\u0000" not in text:
        return text
    # The last line of defence: jsonb cannot hold U+0000. The door refuses it from
    # callers and the loop turns a model's or tool's into error data, so reaching
    # here is a bug; a run must still be stored (a failed write would leave it
    # RUNNING until its lease ended), so the character becomes U+FFFD, said in a log.
    log.warning("store.unstorable_text_replaced")
    return json.dumps(_without_nul(value), ensure_ascii=False, separators=(",", ":"))


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nul(v) for v in value]
    return value


def _state_json(state: LoopState | None) -> str | None:
    return _json(state.to_json()) if state is not None else None


def _step_args(step: StepRecord) -> tuple[Any, ...]:
    return (
        step.kind.value,
        step.name,
        step.span_id,
        step.started_at,
        step.finished_at,
        _json(dict(step.detail)),
        step.error.code if step.error else None,
        step.error.message if step.error else None,
    )


def _steps_arrays(steps: Sequence[StepRecord]) -> tuple[list[Any], ...]:
    """The steps as parallel arrays, for one INSERT ... SELECT FROM unnest(...)."""
    return (
        [s.kind.value for s in steps],
        [s.name for s in steps],
        [s.span_id for s in steps],
        [s.started_at for s in steps],
        [s.finished_at for s in steps],
        [_json(dict(s.detail)) for s in steps],
        [s.error.code if s.error else None for s in steps],
        [s.error.message if s.error else None for s in steps],
    )


def _insert_steps_from_run(*, count: int, arrays: int) -> str:
    """Append steps numbered after the run's previous step_count: the CTE `run` has
    already added their count (parameter $count) to it; the eight arrays of
    `_steps_arrays` are parameters $arrays onwards."""
    a = [f"${arrays + i}" for i in range(8)]
    return f"""
    INSERT INTO steps (run_id, seq, org_id, kind, name, span_id, started_at, finished_at,
                       detail, error_code, error_message)
    SELECT run.run_id, run.step_count - ${count}::int + s.ord::int, run.org_id, s.kind, s.name,
           s.span_id, s.started_at, s.finished_at, s.detail::jsonb, s.error_code, s.error_message
    FROM run, unnest({a[0]}::text[], {a[1]}::text[], {a[2]}::text[], {a[3]}::timestamptz[],
                     {a[4]}::timestamptz[], {a[5]}::text[], {a[6]}::text[], {a[7]}::text[])
         WITH ORDINALITY AS s(kind, name, span_id, started_at, finished_at, detail,
                              error_code, error_message, ord)
    """


def _subject_kind(name: str) -> SubjectKindName:
    return next((k for k in SUBJECT_KINDS if k == name), "WORKSPACE")


def _erased_json(raw: str | None, eraser: Eraser) -> str | None:
    """A stored JSON document (as text) with every copy erased; the same text when
    it held none (PostgreSQL prints jsonb its own way, so compare values, not text)."""
    if raw is None:
        return None
    value = json.loads(raw)
    erased = eraser.value(value)
    return raw if erased == value else _json(erased)


def _keep_copies(*, first: int) -> str:
    """A CTE that keeps the copies the steps made (three arrays from parameter
    $first), in the statement that records them: fenced by the same `run` CTE."""
    return f"""
    , kept AS (
        INSERT INTO held_copies (org_id, subject_kind, subject_id, run_id, copied_text)
        SELECT DISTINCT run.org_id, c.kind, c.id, run.run_id, c.text
        FROM run, unnest(${first}::text[], ${first + 1}::text[], ${first + 2}::text[])
             AS c(kind, id, text)
        ON CONFLICT DO NOTHING
    )
    """


def _copies_arrays(steps: Sequence[StepRecord]) -> tuple[list[str], list[str], list[str]]:
    copies = [c for step in steps for c in step.copies]
    return (
        [c.subject_kind for c in copies],
        [c.subject_id for c in copies],
        [c.text for c in copies],
    )


_INSERT_STEP = """
    INSERT INTO steps (run_id, seq, org_id, kind, name, span_id, started_at, finished_at,
                       detail, error_code, error_message)
    SELECT $2, run.step_count, $1, $3, $4, $5, $6, $7, $8::jsonb, $9, $10 FROM run
    RETURNING *
"""


class PostgresRunStore:
    def __init__(
        self,
        database: Database,
        *,
        owner: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> None:
        self._db = database
        self.owner = owner or new_instance_id()
        self.lease_seconds = lease_seconds

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        try:
            async with self._db.pool.acquire(timeout=5) as conn:
                yield conn
        except asyncpg.DataError as exc:
            # A value PostgreSQL will not take (text it cannot encode, a number out of
            # range) is not an outage: retrying the same request cannot help.
            raise StoreRefusedValue(
                f"the run store refused a value ({type(exc).__name__}); nothing was changed"
            ) from exc
        except (*CONNECTION_ERRORS, asyncpg.PostgresError, DependencyUnavailable) as exc:
            raise StoreUnavailable(f"the run store is unavailable ({type(exc).__name__})") from exc

    # ------------------------------------------------------------ runs and steps

    async def create_run(
        self,
        *,
        run_id: str,
        org_id: str,
        user_id: str,
        agent: str,
        input: str,
        conversation_id: str,
        earlier_turns: Sequence[ConversationTurn],
        trace_id: str,
        root_span_id: str = "",
        language: RunLanguage = ENGLISH,
    ) -> Run:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                f"""
                INSERT INTO runs (run_id, org_id, user_id, agent, state, input, conversation_id,
                                  earlier_turns, trace_id, root_span_id, lease_owner, lease_until,
                                  language, language_fallback)
                VALUES ($1, $2, $3, $4, 'RUNNING', $5, $6, $7::jsonb, $8, $9, $10,
                        clock_timestamp() + make_interval(secs => $11), $12, $13)
                RETURNING {_RUN_COLUMNS}
                """,
                run_id,
                org_id,
                user_id,
                agent,
                input,
                conversation_id,
                _json([{"role": t.role, "content": t.content} for t in earlier_turns]),
                trace_id,
                root_span_id,
                self.owner,
                self.lease_seconds,
                language.language,
                language.fallback,
            )
        return _run(row)

    async def record_step(
        self, *, org_id: str, run_id: str, step: StepRecord, loop_state: LoopState | None
    ) -> Step:
        (recorded,) = await self.record_steps(
            org_id=org_id, run_id=run_id, steps=(step,), loop_state=loop_state
        )
        return recorded

    async def record_steps(
        self,
        *,
        org_id: str,
        run_id: str,
        steps: Sequence[StepRecord],
        loop_state: LoopState | None,
    ) -> list[Step]:
        """One statement: take the next seqs from the run (fenced on this process's
        lease, which it also extends), append the steps, keep the loop state."""
        if not steps:
            return []
        async with self._connection() as conn:
            rows = await conn.fetch(
                """
                WITH run AS (
                    UPDATE runs SET step_count = step_count + $3,
                           loop_state = coalesce($4::jsonb, loop_state),
                           lease_until = clock_timestamp() + make_interval(secs => $6),
                           updated_at = clock_timestamp()
                    WHERE org_id = $1 AND run_id = $2 AND state = 'RUNNING' AND lease_owner = $5
                    RETURNING run_id, org_id, step_count
                )
                """
                + _keep_copies(first=15)
                + _insert_steps_from_run(count=3, arrays=7)
                + " RETURNING *",
                org_id,
                run_id,
                len(steps),
                _state_json(loop_state),
                self.owner,
                self.lease_seconds,
                *_steps_arrays(steps),
                *_copies_arrays(steps),
            )
        if not rows:
            raise await self._lost(org_id, run_id)
        return sorted((_step(row) for row in rows), key=lambda step: step.seq)

    async def finish_run(
        self,
        *,
        org_id: str,
        run_id: str,
        state: RunState,
        loop_state: LoopState | None,
        usage: RunUsage,
        answer: str = "",
        citations: Sequence[Citation] = (),
        reason: str = "",
        steps: Sequence[StepRecord] = (),
    ) -> Run:
        """End the run, with its last steps in the same statement: a run is never
        seen ended without them."""
        async with self._connection() as conn:
            row = await conn.fetchrow(
                f"""
                WITH run AS (
                    UPDATE runs SET state = $3, answer = $4, citations = $5::jsonb, reason = $6,
                           prompt_tokens = $7, completion_tokens = $8, total_tokens = $9,
                           model_calls = $10, loop_state = coalesce($11::jsonb, loop_state),
                           updated_at = clock_timestamp(), lease_owner = NULL, lease_until = NULL,
                           step_count = step_count + $13
                    WHERE org_id = $1 AND run_id = $2 AND state = 'RUNNING' AND lease_owner = $12
                    RETURNING {_RUN_COLUMNS}, step_count
                ), added AS ({_insert_steps_from_run(count=13, arrays=14)})
                {_keep_copies(first=22)}
                SELECT * FROM run
                """,
                org_id,
                run_id,
                state.value,
                answer,
                _json([c.to_json() for c in citations]),
                reason,
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens,
                usage.model_calls,
                _state_json(loop_state),
                self.owner,
                len(steps),
                *_steps_arrays(steps),
                *_copies_arrays(steps),
            )
        if row is None:
            raise await self._lost(org_id, run_id)
        return _run(row)

    async def get_run(self, *, org_id: str, run_id: str, user_id: str | None) -> Run | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                _RUN_WITH_PENDING
                + " WHERE r.org_id = $1 AND r.run_id = $2 AND ($3::text IS NULL OR r.user_id = $3)",
                org_id,
                run_id,
                user_id,
            )
        return _run(row) if row is not None else None

    async def list_runs(
        self,
        *,
        org_id: str,
        user_id: str | None,
        limit: int,
        after: PageCursor | None,
        state: RunState | None = None,
    ) -> list[Run]:
        async with self._connection() as conn:
            rows = await conn.fetch(
                _RUN_WITH_PENDING
                + """
                WHERE r.org_id = $1 AND ($2::text IS NULL OR r.user_id = $2)
                  AND ($6::text IS NULL OR r.state = $6)
                  AND ($3::timestamptz IS NULL OR (r.created_at, r.run_id) < ($3, $4::text))
                ORDER BY r.created_at DESC, r.run_id DESC
                LIMIT $5
                """,
                org_id,
                user_id,
                after.created_at if after else None,
                after.run_id if after else "",
                limit,
                state.value if state is not None else None,
            )
        return [_run(row) for row in rows]

    async def list_steps(self, *, org_id: str, run_id: str, after_seq: int = 0) -> list[Step]:
        async with self._connection() as conn:
            rows = await conn.fetch(
                "SELECT * FROM steps WHERE org_id = $1 AND run_id = $2 AND seq > $3 ORDER BY seq",
                org_id,
                run_id,
                after_seq,
            )
        return [_step(row) for row in rows]

    async def load_loop_state(self, *, org_id: str, run_id: str) -> LoopState | None:
        async with self._connection() as conn:
            raw = await conn.fetchval(
                "SELECT loop_state FROM runs WHERE org_id = $1 AND run_id = $2", org_id, run_id
            )
        return LoopState.from_json(json.loads(raw)) if raw is not None else None

    # ------------------------------------------------------------ confirmations

    async def request_confirmation(
        self,
        *,
        org_id: str,
        run_id: str,
        user_id: str,
        proposal: ConfirmationProposal,
        step: StepRecord,
        loop_state: LoopState,
    ) -> Run:
        """Keep the proposed write, its CONFIRMATION_REQUESTED step and the state to
        resume from, and put the run at rest waiting for its person: all or nothing."""
        usage = loop_state.usage
        async with self._connection() as conn, conn.transaction():
            parked = await conn.fetchval(
                """
                UPDATE runs SET state = 'CONFIRMATION_PENDING', loop_state = $3::jsonb,
                       current_confirmation = $4, lease_owner = NULL, lease_until = NULL,
                       prompt_tokens = $6, completion_tokens = $7, total_tokens = $8,
                       model_calls = $9, updated_at = clock_timestamp()
                WHERE org_id = $1 AND run_id = $2 AND state = 'RUNNING' AND lease_owner = $5
                RETURNING run_id
                """,
                org_id,
                run_id,
                _json(loop_state.to_json()),
                proposal.token,
                self.owner,
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens,
                usage.model_calls,
            )
            if parked is None:
                raise await self._lost_in(conn, org_id, run_id)
            expires_at: datetime = await conn.fetchval(
                """
                INSERT INTO confirmations (confirmation_token, org_id, run_id, user_id, tool_name,
                                           tool_call_id, arguments_json, card, state, expires_at)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, 'PENDING',
                        clock_timestamp() + make_interval(secs => $9))
                RETURNING expires_at
                """,
                proposal.token,
                org_id,
                run_id,
                user_id,
                proposal.call.name,
                proposal.call.id,
                proposal.call.arguments_json,
                _json(proposal.card.to_json()),
                proposal.ttl_seconds,
            )
            detail = {**step.detail, **requested_detail(proposal, expires_at=expires_at)}
            await self._append_step(conn, org_id, run_id, replace(step, detail=detail))
            row = await conn.fetchrow(
                _RUN_WITH_PENDING + " WHERE r.org_id = $1 AND r.run_id = $2", org_id, run_id
            )
        return _run(row)

    async def resolve_confirmation(
        self,
        *,
        org_id: str,
        token: str,
        resolver: Resolver,
        decision: Decision,
        note: str,
        span_id: str,
        started_at: datetime,
    ) -> ResolutionRecord:
        """Decide (confirmations.decide_resolution) and apply, under the row locks of
        the confirmation and its run, so two resolutions at once serialise here and
        exactly one of them claims the run."""
        async with self._connection() as conn, conn.transaction():
            run_id = await conn.fetchval(
                "SELECT run_id FROM confirmations WHERE org_id = $1 AND confirmation_token = $2",
                org_id,
                token,
            )
            if run_id is None:
                return ResolutionRecord(Refuse())
            # Locks are always taken run first, then confirmation (as begin_write and
            # record_write do), so concurrent resolutions and executions never deadlock.
            run_row = await conn.fetchrow(
                """
                SELECT state, loop_state, coalesce(lease_until > clock_timestamp(), false) AS lease_live,
                       clock_timestamp() AS now
                FROM runs WHERE org_id = $1 AND run_id = $2 FOR UPDATE
                """,
                org_id,
                run_id,
            )
            conf_row = await conn.fetchrow(
                "SELECT * FROM confirmations WHERE org_id = $1 AND confirmation_token = $2 FOR UPDATE",
                org_id,
                token,
            )
            confirmation = _confirmation(conf_row)
            now: datetime = run_row["now"]
            outcome = decide_resolution(
                confirmation,
                run_state=RunState(run_row["state"]),
                run_lease_live=run_row["lease_live"],
                resolver=resolver,
                decision=decision,
                now=now,
            )
            if isinstance(outcome, Refuse):
                return ResolutionRecord(outcome)
            if isinstance(outcome, Expire):
                await self._expire(conn, confirmation, outcome.state, outcome.reason, span_id, now)
            elif isinstance(outcome, Claim):
                confirmation, state = await self._claim(
                    conn,
                    confirmation,
                    outcome,
                    loop_state=LoopState.from_json(json.loads(run_row["loop_state"])),
                    resolved_by=resolver.user_id,
                    note=note,
                    now=now,
                    span_id=span_id,
                    started_at=started_at,
                )
                run = await self._run_in(conn, org_id, confirmation.run_id)
                return ResolutionRecord(outcome, confirmation, run, state)
            else:
                assert isinstance(outcome, Reject | AlreadyDecided)
            run = await self._run_in(conn, org_id, confirmation.run_id)
            return ResolutionRecord(outcome, confirmation, run)

    async def _claim(
        self,
        conn: asyncpg.Connection,
        confirmation: Confirmation,
        claim: Claim,
        *,
        loop_state: LoopState,
        resolved_by: str,
        note: str,
        now: datetime,
        span_id: str,
        started_at: datetime,
    ) -> tuple[Confirmation, LoopState]:
        org_id, run_id = confirmation.org_id, confirmation.run_id
        if not claim.resumed or claim.decision == "deny":
            row = await conn.fetchrow(
                """
                UPDATE confirmations SET state = $3, decision = $4, resolved_by = $5,
                       resolved_at = $6, note = $7
                WHERE org_id = $1 AND confirmation_token = $2
                RETURNING *
                """,
                org_id,
                confirmation.token,
                "APPROVED" if claim.decision == "approve" else "DENIED",
                claim.decision,
                resolved_by,
                now,
                note,
            )
            confirmation = _confirmation(row)
        steps = [
            StepRecord(
                kind=StepKind.CONFIRMATION_RESOLVED,
                name=confirmation.tool_name,
                span_id=span_id,
                started_at=started_at,
                finished_at=now,
                detail=resolved_detail(
                    confirmation,
                    decision=claim.decision.upper(),
                    resolved_by=resolved_by,
                    resolved_at=now,
                    note=note,
                    resumed=claim.resumed,
                ),
            )
        ]
        if claim.decision == "deny":
            denial = denial_outcome(confirmation, resolved_by=resolved_by, note=note)
            loop_state = after_resolved_write(loop_state, denial)
            steps.append(
                StepRecord(
                    kind=StepKind.TOOL_CALL,
                    name=confirmation.tool_name,
                    span_id=span_id,
                    started_at=started_at,
                    finished_at=now,
                    detail=denial.detail(),
                    error=denial.error,
                )
            )
        await conn.execute(
            """
            UPDATE runs SET state = 'RUNNING', reason = '', loop_state = $3::jsonb,
                   lease_owner = $4, lease_until = clock_timestamp() + make_interval(secs => $5),
                   updated_at = clock_timestamp()
            WHERE org_id = $1 AND run_id = $2
            """,
            org_id,
            run_id,
            _json(loop_state.to_json()),
            self.owner,
            self.lease_seconds,
        )
        for step in steps:
            await self._append_step(conn, org_id, run_id, step)
        return confirmation, loop_state

    async def _expire(
        self,
        conn: asyncpg.Connection,
        confirmation: Confirmation,
        new_state: ConfirmationState,
        reason: str,
        span_id: str,
        now: datetime,
    ) -> None:
        await conn.execute(
            "UPDATE confirmations SET state = $3 WHERE org_id = $1 AND confirmation_token = $2",
            confirmation.org_id,
            confirmation.token,
            new_state.value,
        )
        await conn.execute(
            """
            UPDATE runs SET state = 'FAILED', reason = $3, lease_owner = NULL, lease_until = NULL,
                   updated_at = clock_timestamp()
            WHERE org_id = $1 AND run_id = $2
            """,
            confirmation.org_id,
            confirmation.run_id,
            reason,
        )
        detail = resolved_detail(
            confirmation,
            decision="EXPIRED",
            resolved_by="",
            resolved_at=now,
            note="",
            resumed=False,
        )
        await self._append_step(
            conn,
            confirmation.org_id,
            confirmation.run_id,
            StepRecord(
                kind=StepKind.CONFIRMATION_RESOLVED,
                name=confirmation.tool_name,
                span_id=span_id,
                started_at=now,
                finished_at=now,
                detail={**detail, "reason": reason},
            ),
        )

    async def begin_write(self, *, org_id: str, run_id: str, token: str) -> Confirmation:
        """Mark the approved write as handed to its target (EXECUTING, counting each
        attempt) before the handler runs; an EXECUTED one comes back unchanged, and
        the caller must not run it again."""
        async with self._connection() as conn, conn.transaction():
            await self._fence(conn, org_id, run_id)
            row = await conn.fetchrow(
                """
                UPDATE confirmations SET state = 'EXECUTING', executions = executions + 1
                WHERE org_id = $1 AND confirmation_token = $2 AND state IN ('APPROVED', 'EXECUTING')
                RETURNING *
                """,
                org_id,
                token,
            )
            if row is None:
                row = await conn.fetchrow(
                    "SELECT * FROM confirmations WHERE org_id = $1 AND confirmation_token = $2",
                    org_id,
                    token,
                )
        return _confirmation(row)

    async def record_write(
        self,
        *,
        org_id: str,
        run_id: str,
        token: str,
        result: dict[str, JSONValue],
        step: StepRecord,
        loop_state: LoopState,
    ) -> bool:
        """The write's outcome, its TOOL_CALL step and the state after it, together:
        once this commits the write is never handed to its target again.

        A person may have cancelled the run while the write was being carried out:
        its outcome is still recorded (the trajectory says it completed, and that the
        run was cancelled meanwhile), the run stays CANCELLED, and True is returned
        so the loop goes no further."""
        async with self._connection() as conn, conn.transaction():
            run = await conn.fetchrow(
                "SELECT state, lease_owner FROM runs WHERE org_id = $1 AND run_id = $2 FOR UPDATE",
                org_id,
                run_id,
            )
            held = run is not None and run["lease_owner"] == self.owner
            if not held or run["state"] not in ("RUNNING", "CANCELLED"):
                raise await self._lost_in(conn, org_id, run_id)
            cancelled: bool = run["state"] == "CANCELLED"
            done = await conn.fetchval(
                """
                UPDATE confirmations SET state = 'EXECUTED', result = $3::jsonb,
                       executed_at = clock_timestamp()
                WHERE org_id = $1 AND confirmation_token = $2 AND state = 'EXECUTING'
                RETURNING confirmation_token
                """,
                org_id,
                token,
                _json(result),
            )
            if done is None:
                raise RunTakenOver(run_id)
            if cancelled:
                step = replace(step, detail={**step.detail, "after_cancel": True})
            else:
                await conn.execute(
                    "UPDATE runs SET loop_state = $3::jsonb, updated_at = clock_timestamp() "
                    "WHERE org_id = $1 AND run_id = $2",
                    org_id,
                    run_id,
                    _json(loop_state.to_json()),
                )
            await self._append_step(conn, org_id, run_id, step)
        return cancelled

    # ------------------------------------------------------------ a person cancels a run

    async def cancel_run(
        self, *, org_id: str, run_id: str, user_id: str, words: str, span_id: str
    ) -> Run | RunState | None:
        """Stop the run of `user_id` (its owner; None when there is none such, the one
        denial), or return the state it already ended in. One transaction under the
        run's and its confirmation's row locks, taken in the order resolve_confirmation
        takes them, so an approval and a cancel at once serialise: a write not yet
        handed to its target is abandoned, one being carried out finishes and records
        itself (record_write), and the CONFIRMATION_RESOLVED step says which.

        The orchestrator working on the run finds out from the run's state: each of
        its writes is fenced on RUNNING, and its watcher (cancelled_runs) cuts the
        model call short. Its lease owner is kept, so it alone may add the last
        steps (record_cancelled)."""
        async with self._connection() as conn, conn.transaction():
            run_row = await conn.fetchrow(
                """
                SELECT state, current_confirmation,
                       coalesce(lease_until > clock_timestamp(), false) AS lease_live,
                       clock_timestamp() AS now
                FROM runs WHERE org_id = $1 AND run_id = $2 AND user_id = $3 FOR UPDATE
                """,
                org_id,
                run_id,
                user_id,
            )
            if run_row is None:
                return None
            run_state = RunState(run_row["state"])
            if run_state.terminal:
                return run_state
            confirmation = None
            if run_row["current_confirmation"] is not None:
                conf_row = await conn.fetchrow(
                    "SELECT * FROM confirmations WHERE org_id = $1 AND confirmation_token = $2 "
                    "FOR UPDATE",
                    org_id,
                    run_row["current_confirmation"],
                )
                confirmation = _confirmation(conf_row) if conf_row is not None else None
            effect = cancel_effect(
                confirmation, run_state=run_state, run_lease_live=run_row["lease_live"]
            )
            now: datetime = run_row["now"]
            await conn.execute(
                """
                UPDATE runs SET state = 'CANCELLED', reason = $3, cancelled_by = $4,
                       lease_until = NULL, updated_at = clock_timestamp()
                WHERE org_id = $1 AND run_id = $2
                """,
                org_id,
                run_id,
                cancel_reason(user_id, words, effect),
                user_id,
            )
            if confirmation is not None and effect.write != "none":
                if effect.new_state is not None:
                    await conn.execute(
                        "UPDATE confirmations SET state = $3 "
                        "WHERE org_id = $1 AND confirmation_token = $2",
                        org_id,
                        confirmation.token,
                        effect.new_state.value,
                    )
                detail = resolved_detail(
                    confirmation,
                    decision="CANCELLED",
                    resolved_by=user_id,
                    resolved_at=now,
                    note=words,
                    resumed=False,
                )
                await self._append_step(
                    conn,
                    org_id,
                    run_id,
                    StepRecord(
                        kind=StepKind.CONFIRMATION_RESOLVED,
                        name=confirmation.tool_name,
                        span_id=span_id,
                        started_at=now,
                        finished_at=now,
                        detail={**detail, "write": effect.write, "write_note": effect.note},
                    ),
                )
            return await self._run_in(conn, org_id, run_id)

    async def record_cancelled(
        self, *, org_id: str, run_id: str, steps: Sequence[StepRecord]
    ) -> None:
        """The last steps of a run a person cancelled while this process worked on it
        (the model call cut short), and this process's lease given up. Only the
        process that held the run may, and only once: a run taken over, finished
        or already wound up takes nothing."""
        async with self._connection() as conn:
            await conn.execute(
                """
                WITH run AS (
                    UPDATE runs SET step_count = step_count + $3, lease_owner = NULL,
                           updated_at = clock_timestamp()
                    WHERE org_id = $1 AND run_id = $2 AND state = 'CANCELLED'
                      AND lease_owner = $4
                    RETURNING run_id, org_id, step_count
                )
                """
                + _keep_copies(first=13)
                + _insert_steps_from_run(count=3, arrays=5),
                org_id,
                run_id,
                len(steps),
                self.owner,
                *_steps_arrays(steps),
                *_copies_arrays(steps),
            )

    async def cancelled_runs(self, run_ids: Sequence[str]) -> list[str]:
        """Which of the runs this process is working on a person has cancelled."""
        if not run_ids:
            return []
        async with self._connection() as conn:
            rows = await conn.fetch(
                "SELECT run_id FROM runs WHERE run_id = ANY($1::text[]) AND state = 'CANCELLED' "
                "AND lease_owner = $2",
                list(run_ids),
                self.owner,
            )
        return [row["run_id"] for row in rows]

    async def _lost(self, org_id: str, run_id: str) -> RunTakenOver | RunCancelled:
        async with self._connection() as conn:
            return await self._lost_in(conn, org_id, run_id)

    async def _lost_in(
        self, conn: asyncpg.Connection, org_id: str, run_id: str
    ) -> RunTakenOver | RunCancelled:
        """Why a write fenced on this process's lease found no run to write to: a
        person cancelled it, or another orchestrator took it over."""
        state = await conn.fetchval(
            "SELECT state FROM runs WHERE org_id = $1 AND run_id = $2", org_id, run_id
        )
        return RunCancelled(run_id) if state == "CANCELLED" else RunTakenOver(run_id)

    # ------------------------------------------------------------ erasure (I9)

    async def conversation_subjects(
        self, *, org_id: str, conversation_id: str
    ) -> tuple[MemorySubject, ...]:
        async with self._connection() as conn:
            rows = await conn.fetch(
                "SELECT DISTINCT h.subject_kind, h.subject_id FROM held_copies h "
                "JOIN runs r ON r.run_id = h.run_id "
                "WHERE r.org_id = $1 AND r.conversation_id = $2 AND h.org_id = $1 "
                "ORDER BY 1, 2 LIMIT 31",
                org_id,
                conversation_id,
            )
        return tuple(
            MemorySubject(kind=_subject_kind(r["subject_kind"]), id=r["subject_id"]) for r in rows
        )

    async def erase_copies(
        self, *, org_id: str, subject_kind: str, subject_id: str
    ) -> ErasedCopies:
        """Replace every copy the org's runs hold of what they copied about a subject
        with the tombstone (erasure.py says where and how), abandon the pending
        writes about it, and forget the copies themselves: one transaction."""
        async with self._connection() as conn, conn.transaction():
            texts = [
                row["copied_text"]
                for row in await conn.fetch(
                    "SELECT DISTINCT copied_text FROM held_copies "
                    "WHERE org_id = $1 AND subject_kind = $2 AND subject_id = $3",
                    org_id,
                    subject_kind,
                    subject_id,
                )
            ]
            if not texts:
                return ErasedCopies(runs=0, confirmations_abandoned=0)
            org_wide = search_forms(t for t in texts if len(t) >= ORG_WIDE_MIN_CHARS)
            run_ids = [
                row["run_id"]
                for row in await conn.fetch(
                    """
                    SELECT run_id FROM held_copies
                    WHERE org_id = $1 AND subject_kind = $2 AND subject_id = $3
                    UNION
                    SELECT r.run_id FROM runs r, unnest($4::text[]) AS n(form)
                    WHERE r.org_id = $1 AND strpos(
                        concat_ws(' ', r.input, r.answer, r.reason, r.earlier_turns::text,
                                  r.loop_state::text, r.citations::text), n.form) > 0
                    UNION
                    SELECT s.run_id FROM steps s, unnest($4::text[]) AS n(form)
                    WHERE s.org_id = $1
                      AND strpos(concat_ws(' ', s.detail::text, s.error_message), n.form) > 0
                    UNION
                    SELECT c.run_id FROM confirmations c, unnest($4::text[]) AS n(form)
                    WHERE c.org_id = $1 AND strpos(
                        concat_ws(' ', c.arguments_json, c.card::text, c.result::text, c.note),
                        n.form) > 0
                    ORDER BY 1
                    """,
                    org_id,
                    subject_kind,
                    subject_id,
                    org_wide,
                )
            ]
            eraser = Eraser(texts)
            erased_runs = 0
            abandoned = 0
            for run_id in run_ids:
                changed, dropped = await self._erase_in_run(conn, org_id, run_id, eraser)
                erased_runs += changed
                abandoned += dropped
            # The same text kept under another subject (a block is about its archiver
            # too) was erased from the runs just now; its row would be the last copy.
            await conn.execute(
                "DELETE FROM held_copies WHERE org_id = $1 AND ((subject_kind = $2 "
                "AND subject_id = $3) OR copied_text = ANY($4::text[]))",
                org_id,
                subject_kind,
                subject_id,
                texts,
            )
        return ErasedCopies(runs=erased_runs, confirmations_abandoned=abandoned)

    async def _erase_in_run(
        self, conn: asyncpg.Connection, org_id: str, run_id: str, eraser: Eraser
    ) -> tuple[int, int]:
        run = await conn.fetchrow(
            "SELECT input, answer, reason, earlier_turns, loop_state, citations, state, "
            "current_confirmation FROM runs WHERE org_id = $1 AND run_id = $2 FOR UPDATE",
            org_id,
            run_id,
        )
        if run is None:
            return 0, 0
        changed = False
        texts = {k: eraser.text(run[k]) for k in ("input", "answer", "reason")}
        documents = {
            k: _erased_json(run[k], eraser) for k in ("earlier_turns", "loop_state", "citations")
        }
        if any(texts[k] != run[k] for k in texts) or any(documents[k] != run[k] for k in documents):
            changed = True
            await conn.execute(
                "UPDATE runs SET input = $3, answer = $4, reason = $5, earlier_turns = $6::jsonb, "
                "loop_state = $7::jsonb, citations = $8::jsonb WHERE org_id = $1 AND run_id = $2",
                org_id,
                run_id,
                texts["input"],
                texts["answer"],
                texts["reason"],
                documents["earlier_turns"],
                documents["loop_state"],
                documents["citations"],
            )
        for step in await conn.fetch(
            "SELECT seq, detail, error_message FROM steps WHERE org_id = $1 AND run_id = $2",
            org_id,
            run_id,
        ):
            detail = _erased_json(step["detail"], eraser)
            message = eraser.text(step["error_message"]) if step["error_message"] else None
            if detail != step["detail"] or message != step["error_message"]:
                changed = True
                await conn.execute(
                    "UPDATE steps SET detail = $3::jsonb, error_message = $4 "
                    "WHERE run_id = $1 AND seq = $2",
                    run_id,
                    step["seq"],
                    detail,
                    message,
                )
        abandoned = 0
        for confirmation in await conn.fetch(
            "SELECT confirmation_token, state, arguments_json, card, result, note "
            "FROM confirmations WHERE org_id = $1 AND run_id = $2",
            org_id,
            run_id,
        ):
            arguments = eraser.text(confirmation["arguments_json"])
            card = _erased_json(confirmation["card"], eraser)
            result = _erased_json(confirmation["result"], eraser)
            note = eraser.text(confirmation["note"])
            if (arguments, card, result, note) == (
                confirmation["arguments_json"],
                confirmation["card"],
                confirmation["result"],
                confirmation["note"],
            ):
                continue
            changed = True
            # A write about the erased subject that nobody approved yet is never made:
            # approving it now would keep the tombstone, or worse, bring the text back.
            pending = confirmation["state"] == "PENDING"
            abandoned += pending
            await conn.execute(
                "UPDATE confirmations SET arguments_json = $3, card = $4::jsonb, "
                "result = $5::jsonb, note = $6, "
                "state = CASE WHEN state = 'PENDING' THEN 'ABANDONED' ELSE state END "
                "WHERE org_id = $1 AND confirmation_token = $2",
                org_id,
                confirmation["confirmation_token"],
                arguments,
                card,
                result,
                note,
            )
            if (
                pending
                and run["state"] == "CONFIRMATION_PENDING"
                and run["current_confirmation"] == confirmation["confirmation_token"]
            ):
                await conn.execute(
                    "UPDATE runs SET state = 'CANCELLED', current_confirmation = NULL, "
                    "reason = $3, updated_at = clock_timestamp() "
                    "WHERE org_id = $1 AND run_id = $2",
                    org_id,
                    run_id,
                    "the write this run waited on was about a subject whose records were "
                    "erased, so it was abandoned unapproved and nothing was written",
                )
        return int(changed), abandoned

    async def pending_confirmations(
        self, *, org_id: str, user_id: str | None
    ) -> list[Confirmation]:
        """Open confirmations of the org's runs (or one person's), oldest first."""
        async with self._connection() as conn:
            rows = await conn.fetch(
                """
                SELECT c.* FROM runs r
                JOIN confirmations c ON c.confirmation_token = r.current_confirmation
                                    AND c.org_id = r.org_id
                WHERE r.org_id = $1 AND r.state = 'CONFIRMATION_PENDING'
                  AND ($2::text IS NULL OR r.user_id = $2)
                  AND c.expires_at > clock_timestamp()
                ORDER BY c.created_at, c.confirmation_token
                """,
                org_id,
                user_id,
            )
        return [_confirmation(row) for row in rows]

    # ------------------------------------------------------------ leases and sweeps

    async def renew_leases(self, run_ids: Sequence[str]) -> None:
        if not run_ids:
            return
        async with self._connection() as conn:
            await conn.execute(
                """
                UPDATE runs SET lease_until = clock_timestamp() + make_interval(secs => $3)
                WHERE run_id = ANY($1::text[]) AND lease_owner = $2 AND state = 'RUNNING'
                """,
                list(run_ids),
                self.owner,
                self.lease_seconds,
            )

    async def release_leases(self) -> None:
        """On shutdown: let the recovery sweep act on this process's runs at once."""
        async with self._connection() as conn:
            await conn.execute(
                "UPDATE runs SET lease_until = clock_timestamp() "
                "WHERE lease_owner = $1 AND state = 'RUNNING'",
                self.owner,
            )

    async def recover_stopped_runs(
        self, *, ttl_seconds: float, limit: int = 100
    ) -> list[Recovered]:
        """Runs left RUNNING under a lease that ran out: back to their person when an
        approval was in flight, otherwise FAILED with the reason."""
        recovered: list[Recovered] = []
        async with self._connection() as conn, conn.transaction():
            rows = await conn.fetch(
                """
                SELECT run_id, org_id, step_count, current_confirmation, clock_timestamp() AS now
                FROM runs
                WHERE state = 'RUNNING' AND (lease_until IS NULL OR lease_until < clock_timestamp())
                ORDER BY lease_until NULLS FIRST
                LIMIT $1
                FOR UPDATE SKIP LOCKED
                """,
                limit,
            )
            for row in rows:
                org_id, run_id = row["org_id"], row["run_id"]
                latest = None
                if row["current_confirmation"] is not None:
                    conf_row = await conn.fetchrow(
                        "SELECT * FROM confirmations WHERE org_id = $1 AND confirmation_token = $2 "
                        "FOR UPDATE",
                        org_id,
                        row["current_confirmation"],
                    )
                    latest = _confirmation(conf_row) if conf_row is not None else None
                decision = after_interruption(
                    latest, last_seq=row["step_count"], now=row["now"], ttl_seconds=ttl_seconds
                )
                if isinstance(decision, BackToPerson):
                    assert latest is not None
                    await conn.execute(
                        "UPDATE confirmations SET interrupted_at = $3, expires_at = $4 "
                        "WHERE org_id = $1 AND confirmation_token = $2",
                        org_id,
                        latest.token,
                        row["now"],
                        decision.expires_at,
                    )
                    await conn.execute(
                        """
                        UPDATE runs SET state = 'CONFIRMATION_PENDING', lease_owner = NULL,
                               lease_until = NULL, updated_at = clock_timestamp()
                        WHERE org_id = $1 AND run_id = $2
                        """,
                        org_id,
                        run_id,
                    )
                    recovered.append(
                        Recovered(run_id, org_id, "back_to_person", "an approval was in flight")
                    )
                else:
                    assert isinstance(decision, EndRun)
                    await conn.execute(
                        """
                        UPDATE runs SET state = 'FAILED', reason = $3, lease_owner = NULL,
                               lease_until = NULL, updated_at = clock_timestamp()
                        WHERE org_id = $1 AND run_id = $2
                        """,
                        org_id,
                        run_id,
                        decision.reason,
                    )
                    recovered.append(Recovered(run_id, org_id, "failed", decision.reason))
        return recovered

    async def confirmations_due(self) -> bool:
        async with self._connection() as conn:
            due: bool = await conn.fetchval(
                """
                SELECT EXISTS (
                    SELECT 1 FROM runs r
                    JOIN confirmations c ON c.confirmation_token = r.current_confirmation
                                        AND c.org_id = r.org_id
                    WHERE r.state = 'CONFIRMATION_PENDING' AND c.expires_at <= clock_timestamp()
                )
                """
            )
        return due

    async def expire_confirmations(self, *, span_id: str, limit: int = 100) -> list[str]:
        """Open confirmations past their expiry end their runs FAILED with the reason;
        returns the run ids."""
        ended: list[str] = []
        async with self._connection() as conn, conn.transaction():
            rows = await conn.fetch(
                """
                SELECT c.*, clock_timestamp() AS now FROM runs r
                JOIN confirmations c ON c.confirmation_token = r.current_confirmation
                                    AND c.org_id = r.org_id
                WHERE r.state = 'CONFIRMATION_PENDING' AND c.expires_at <= clock_timestamp()
                LIMIT $1
                FOR UPDATE OF r, c SKIP LOCKED
                """,
                limit,
            )
            for row in rows:
                confirmation = _confirmation(row)
                new_state, reason = expiry_on_sweep(confirmation)
                await self._expire(conn, confirmation, new_state, reason, span_id, row["now"])
                ended.append(confirmation.run_id)
        return ended

    # ------------------------------------------------------------ inside a transaction

    async def _fence(self, conn: asyncpg.Connection, org_id: str, run_id: str) -> None:
        held = await conn.fetchval(
            "SELECT run_id FROM runs WHERE org_id = $1 AND run_id = $2 AND state = 'RUNNING' "
            "AND lease_owner = $3 FOR UPDATE",
            org_id,
            run_id,
            self.owner,
        )
        if held is None:
            raise await self._lost_in(conn, org_id, run_id)

    async def _append_step(
        self, conn: asyncpg.Connection, org_id: str, run_id: str, step: StepRecord
    ) -> None:
        await conn.execute(
            "WITH run AS (UPDATE runs SET step_count = step_count + 1 "
            "WHERE org_id = $1 AND run_id = $2 RETURNING step_count)" + _INSERT_STEP,
            org_id,
            run_id,
            *_step_args(step),
        )
        if step.copies:
            await conn.executemany(
                "INSERT INTO held_copies (org_id, subject_kind, subject_id, run_id, copied_text) "
                "VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                [(org_id, c.subject_kind, c.subject_id, run_id, c.text) for c in step.copies],
            )

    async def _run_in(self, conn: asyncpg.Connection, org_id: str, run_id: str) -> Run:
        row = await conn.fetchrow(
            _RUN_WITH_PENDING + " WHERE r.org_id = $1 AND r.run_id = $2", org_id, run_id
        )
        return _run(row)
