"""Statements that run inside a transaction another store method holds: appending
a step under the run's row lock, reading the run back, finding out why a fenced
write found no run, and ending a run whose confirmation expired."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from cairn_orchestrator.domain import Confirmation, ConfirmationState, Run, StepRecord
from cairn_orchestrator.errors import RunCancelled, RunTakenOver
from cairn_orchestrator.pg.rows import (
    RUN_WITH_PENDING,
    copies_arrays,
    insert_steps_from_run,
    keep_copies,
    run_from_row,
    steps_arrays,
)
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


async def append_steps(
    conn: asyncpg.Connection,
    org_id: str,
    run_id: str,
    steps: Sequence[StepRecord],
    *,
    also_set: str = "",
    args: Sequence[Any] = (),
) -> None:
    """Append `steps` after the run's step_count, with the copies they made, and
    change the run (`also_set`: SQL assignments whose parameters are $4 onwards,
    `args`), all in one statement: a round trip, however many steps and copies."""
    arrays = 4 + len(args)
    await conn.execute(
        "WITH run AS (UPDATE runs SET step_count = step_count + $3"
        + (f", {also_set}" if also_set else "")
        + " WHERE org_id = $1 AND run_id = $2 RETURNING run_id, org_id, step_count)"
        + keep_copies(first=arrays + 8)
        + insert_steps_from_run(count=3, arrays=arrays),
        org_id,
        run_id,
        len(steps),
        *args,
        *steps_arrays(steps),
        *copies_arrays(steps),
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
    await append_steps(
        conn,
        confirmation.org_id,
        confirmation.run_id,
        [expiry_step(confirmation, reason=reason, span_id=span_id, now=now)],
        also_set="state = 'FAILED', reason = $4, lease_owner = NULL, lease_until = NULL, "
        "updated_at = clock_timestamp()",
        args=(reason,),
    )
