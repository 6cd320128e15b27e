"""Runs and steps in PostgreSQL (schema `orchestrator`).

Every statement narrows by org_id (I5). A step gets its seq inside the same
transaction that locks its run row, so steps of one run are numbered densely and
in the order they were recorded, and the loop state written with a step is
always the state after that step. asyncpg errors become StoreUnavailable here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg

from cairn_libs.db import Database, Migration, load_migrations
from cairn_orchestrator.domain import (
    Citation,
    ConversationTurn,
    ErrorValue,
    LoopState,
    PageCursor,
    Run,
    RunState,
    RunUsage,
    Step,
    StepKind,
    StepRecord,
)
from cairn_orchestrator.errors import StoreUnavailable

SCHEMA = "orchestrator"
MIGRATIONS_DIR = Path(__file__).parent / "migrations"

_RUN_COLUMNS = (
    "run_id, org_id, user_id, agent, state, input, conversation_id, answer, citations, reason, "
    "trace_id, prompt_tokens, completion_tokens, total_tokens, model_calls, created_at, updated_at"
)


def migrations() -> list[Migration]:
    return load_migrations(MIGRATIONS_DIR)


def _run(row: asyncpg.Record) -> Run:
    return Run(
        run_id=row["run_id"],
        org_id=row["org_id"],
        user_id=row["user_id"],
        agent=row["agent"],
        state=RunState(row["state"]),
        input=row["input"],
        conversation_id=row["conversation_id"],
        trace_id=row["trace_id"],
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
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class PostgresRunStore:
    def __init__(self, database: Database) -> None:
        self._db = database

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        try:
            async with self._db.pool.acquire(timeout=5) as conn:
                yield conn
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            raise StoreUnavailable(f"the run store is unavailable ({type(exc).__name__})") from exc

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
    ) -> Run:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                f"""
                INSERT INTO runs (run_id, org_id, user_id, agent, state, input, conversation_id,
                                  earlier_turns, trace_id)
                VALUES ($1, $2, $3, $4, 'RUNNING', $5, $6, $7::jsonb, $8)
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
            )
        return _run(row)

    async def record_step(
        self, *, org_id: str, run_id: str, step: StepRecord, loop_state: LoopState | None
    ) -> Step:
        async with self._connection() as conn, conn.transaction():
            locked = await conn.fetchval(
                "SELECT run_id FROM runs WHERE org_id = $1 AND run_id = $2 FOR UPDATE",
                org_id,
                run_id,
            )
            if locked is None:
                raise StoreUnavailable(f"run {run_id!r} vanished while a step was being recorded")
            row = await conn.fetchrow(
                """
                INSERT INTO steps (run_id, seq, org_id, kind, name, span_id, started_at, finished_at,
                                   detail, error_code, error_message)
                SELECT $1, coalesce(max(seq), 0) + 1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9, $10
                FROM steps WHERE run_id = $1
                RETURNING *
                """,
                run_id,
                org_id,
                step.kind.value,
                step.name,
                step.span_id,
                step.started_at,
                step.finished_at,
                _json(dict(step.detail)),
                step.error.code if step.error else None,
                step.error.message if step.error else None,
            )
            if loop_state is not None:
                await conn.execute(
                    "UPDATE runs SET loop_state = $3::jsonb, updated_at = clock_timestamp() "
                    "WHERE org_id = $1 AND run_id = $2",
                    org_id,
                    run_id,
                    _json(loop_state.to_json()),
                )
        return _step(row)

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
    ) -> Run:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                f"""
                UPDATE runs SET state = $3, answer = $4, citations = $5::jsonb, reason = $6,
                       prompt_tokens = $7, completion_tokens = $8, total_tokens = $9, model_calls = $10,
                       loop_state = coalesce($11::jsonb, loop_state), updated_at = clock_timestamp()
                WHERE org_id = $1 AND run_id = $2
                RETURNING {_RUN_COLUMNS}
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
                _json(loop_state.to_json()) if loop_state is not None else None,
            )
        if row is None:
            raise StoreUnavailable(f"run {run_id!r} vanished before it could be finished")
        return _run(row)

    async def get_run(self, *, org_id: str, run_id: str, user_id: str | None) -> Run | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                f"""
                SELECT {_RUN_COLUMNS} FROM runs
                WHERE org_id = $1 AND run_id = $2 AND ($3::text IS NULL OR user_id = $3)
                """,
                org_id,
                run_id,
                user_id,
            )
        return _run(row) if row is not None else None

    async def list_runs(
        self, *, org_id: str, user_id: str | None, limit: int, after: PageCursor | None
    ) -> list[Run]:
        async with self._connection() as conn:
            rows = await conn.fetch(
                f"""
                SELECT {_RUN_COLUMNS} FROM runs
                WHERE org_id = $1 AND ($2::text IS NULL OR user_id = $2)
                  AND ($3::timestamptz IS NULL OR (created_at, run_id) < ($3, $4::text))
                ORDER BY created_at DESC, run_id DESC
                LIMIT $5
                """,
                org_id,
                user_id,
                after.created_at if after else None,
                after.run_id if after else "",
                limit,
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
