"""Confirmed writes (ports.ConfirmationStore's confirmation part): proposing,
resolving, starting and recording a write each happen in one transaction that
holds the run's and the confirmation's row locks, taken in that order everywhere
(cancels.py too), so concurrent resolutions, executions and cancels serialise and
never deadlock. The decision taken inside is pure (confirmations.py), and so are
the records it leaves (store_decisions.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime

import asyncpg

from cairn_orchestrator.confirmations import (
    AlreadyDecided,
    Claim,
    Expire,
    Refuse,
    Reject,
    ResolutionRecord,
    Resolver,
    decide_resolution,
    requested_detail,
)
from cairn_orchestrator.domain import (
    Confirmation,
    ConfirmationProposal,
    Decision,
    JSONValue,
    LoopState,
    Run,
    RunState,
    StepRecord,
)
from cairn_orchestrator.errors import RunTakenOver
from cairn_orchestrator.pg.base import PgStore
from cairn_orchestrator.pg.rows import (
    confirmation_from_row,
    json_text,
)
from cairn_orchestrator.pg.tx import append_steps, expire_in, lost_in, run_in
from cairn_orchestrator.store_decisions import (
    claim_records,
    claimed_state,
    write_step_after_cancel,
)


class PgConfirmations(PgStore):
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
            # The run is parked and the write kept in one statement: no confirmation
            # row unless this process still held the run.
            expires_at: datetime | None = await conn.fetchval(
                """
                WITH parked AS (
                    UPDATE runs SET state = 'CONFIRMATION_PENDING', loop_state = $3::jsonb,
                           current_confirmation = $4, lease_owner = NULL, lease_until = NULL,
                           prompt_tokens = $6, completion_tokens = $7, total_tokens = $8,
                           model_calls = $9, updated_at = clock_timestamp()
                    WHERE org_id = $1 AND run_id = $2 AND state = 'RUNNING' AND lease_owner = $5
                    RETURNING run_id
                )
                INSERT INTO confirmations (confirmation_token, org_id, run_id, user_id, tool_name,
                                           tool_call_id, arguments_json, card, state, expires_at)
                SELECT $4, $1, parked.run_id, $10, $11, $12, $13, $14::jsonb, 'PENDING',
                       clock_timestamp() + make_interval(secs => $15)
                FROM parked
                RETURNING expires_at
                """,
                org_id,
                run_id,
                json_text(loop_state.to_json()),
                proposal.token,
                self.owner,
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens,
                usage.model_calls,
                user_id,
                proposal.call.name,
                proposal.call.id,
                proposal.call.arguments_json,
                json_text(proposal.card.to_json()),
                proposal.ttl_seconds,
            )
            if expires_at is None:
                raise await lost_in(conn, org_id, run_id)
            detail = {**step.detail, **requested_detail(proposal, expires_at=expires_at)}
            await append_steps(conn, org_id, run_id, [replace(step, detail=detail)])
            return await run_in(conn, org_id, run_id)

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
            # Locks are always taken run first, then confirmation (as begin_write and
            # record_write do), so concurrent resolutions and executions never deadlock:
            # this statement finds the confirmation's run and locks the run alone.
            run_row = await conn.fetchrow(
                """
                SELECT state, loop_state, coalesce(lease_until > clock_timestamp(), false) AS lease_live,
                       clock_timestamp() AS now
                FROM runs WHERE org_id = $1 AND run_id = (
                    SELECT run_id FROM confirmations WHERE org_id = $1 AND confirmation_token = $2
                )
                FOR UPDATE
                """,
                org_id,
                token,
            )
            if run_row is None:
                return ResolutionRecord(Refuse())
            conf_row = await conn.fetchrow(
                "SELECT * FROM confirmations WHERE org_id = $1 AND confirmation_token = $2 FOR UPDATE",
                org_id,
                token,
            )
            confirmation = confirmation_from_row(conf_row)
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
                await expire_in(conn, confirmation, outcome.state, outcome.reason, span_id, now)
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
                run = await run_in(conn, org_id, confirmation.run_id)
                return ResolutionRecord(outcome, confirmation, run, state)
            else:
                assert isinstance(outcome, Reject | AlreadyDecided)
            run = await run_in(conn, org_id, confirmation.run_id)
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
                claimed_state(claim).value,
                claim.decision,
                resolved_by,
                now,
                note,
            )
            confirmation = confirmation_from_row(row)
        steps, loop_state = claim_records(
            confirmation,
            claim,
            loop_state=loop_state,
            resolved_by=resolved_by,
            note=note,
            now=now,
            span_id=span_id,
            started_at=started_at,
        )
        await append_steps(
            conn,
            org_id,
            run_id,
            steps,
            also_set="state = 'RUNNING', reason = '', loop_state = $4::jsonb, lease_owner = $5, "
            "lease_until = clock_timestamp() + make_interval(secs => $6), "
            "updated_at = clock_timestamp()",
            args=(json_text(loop_state.to_json()), self.owner, self.lease_seconds),
        )
        return confirmation, loop_state

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
        return confirmation_from_row(row)

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
                raise await lost_in(conn, org_id, run_id)
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
                json_text(result),
            )
            if done is None:
                raise RunTakenOver(run_id)
            if cancelled:
                await append_steps(conn, org_id, run_id, [write_step_after_cancel(step)])
            else:
                await append_steps(
                    conn,
                    org_id,
                    run_id,
                    [step],
                    also_set="loop_state = $4::jsonb, updated_at = clock_timestamp()",
                    args=(json_text(loop_state.to_json()),),
                )
        return cancelled

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
        return [confirmation_from_row(row) for row in rows]
