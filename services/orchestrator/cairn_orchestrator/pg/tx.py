"""Statements that run inside a transaction another store method holds: appending
a step under the run's row lock, reading the run back, finding out why a fenced
write found no run, and ending a run whose confirmation expired."""

from __future__ import annotations

from datetime import datetime

import asyncpg

from cairn_orchestrator.domain import Confirmation, ConfirmationState, Run, StepRecord
from cairn_orchestrator.errors import RunCancelled, RunTakenOver
from cairn_orchestrator.pg.rows import INSERT_STEP, RUN_WITH_PENDING, run_from_row, step_args
from cairn_orchestrator.store_decisions import expiry_step, why_lost


async def lost_in(
    conn: asyncpg.Connection, org_id: str, run_id: str
) -> RunTakenOver | RunCancelled:
    """Why a write fenced on this process's lease found no run to write to: a
    person cancelled it, or another orchestrator took it over."""
    state = await conn.fetchval(
        "SELECT state FROM runs WHERE org_id = $1 AND run_id = $2", org_id, run_id
    )
    return why_lost(run_id, state)


async def append_step(conn: asyncpg.Connection, org_id: str, run_id: str, step: StepRecord) -> None:
    await conn.execute(
        "WITH run AS (UPDATE runs SET step_count = step_count + 1 "
        "WHERE org_id = $1 AND run_id = $2 RETURNING step_count)" + INSERT_STEP,
        org_id,
        run_id,
        *step_args(step),
    )
    if step.copies:
        await conn.executemany(
            "INSERT INTO held_copies (org_id, subject_kind, subject_id, run_id, copied_text) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
            [(org_id, c.subject_kind, c.subject_id, run_id, c.text) for c in step.copies],
        )


async def run_in(conn: asyncpg.Connection, org_id: str, run_id: str) -> Run:
    row = await conn.fetchrow(
        RUN_WITH_PENDING + " WHERE r.org_id = $1 AND r.run_id = $2", org_id, run_id
    )
    return run_from_row(row)


async def expire_in(
    conn: asyncpg.Connection,
    confirmation: Confirmation,
    new_state: ConfirmationState,
    reason: str,
    span_id: str,
    now: datetime,
) -> None:
    """The confirmation takes `new_state` and its run ends FAILED with the reason,
    its CONFIRMATION_RESOLVED step saying so."""
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
    await append_step(
        conn,
        confirmation.org_id,
        confirmation.run_id,
        expiry_step(confirmation, reason=reason, span_id=span_id, now=now),
    )
