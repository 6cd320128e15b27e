"""A person cancels a run (ports.ConfirmationStore's cancel part): the cancel
itself, under the run's and its confirmation's row locks in the order
confirmations.py takes them; the last steps the process working on the run adds;
and which of this process's runs were cancelled (its watcher's question)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from cairn_orchestrator.confirmations import cancel_effect, cancel_reason
from cairn_orchestrator.domain import Run, RunState, StepRecord
from cairn_orchestrator.pg.base import PgStore
from cairn_orchestrator.pg.rows import (
    confirmation_from_row,
    copies_arrays,
    insert_steps_from_run,
    keep_copies,
    steps_arrays,
)
from cairn_orchestrator.pg.tx import append_steps, run_in
from cairn_orchestrator.store_decisions import cancel_step


class PgCancels(PgStore):
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
                confirmation = confirmation_from_row(conf_row) if conf_row is not None else None
            effect = cancel_effect(
                confirmation, run_state=run_state, run_lease_live=run_row["lease_live"]
            )
            now: datetime = run_row["now"]
            steps: list[StepRecord] = []
            if confirmation is not None and effect.write != "none":
                if effect.new_state is not None:
                    await conn.execute(
                        "UPDATE confirmations SET state = $3 "
                        "WHERE org_id = $1 AND confirmation_token = $2",
                        org_id,
                        confirmation.token,
                        effect.new_state.value,
                    )
                steps.append(
                    cancel_step(
                        confirmation,
                        effect,
                        cancelled_by=user_id,
                        words=words,
                        span_id=span_id,
                        now=now,
                    )
                )
            await append_steps(
                conn,
                org_id,
                run_id,
                steps,
                also_set="state = 'CANCELLED', reason = $4, cancelled_by = $5, "
                "lease_until = NULL, updated_at = clock_timestamp()",
                args=(cancel_reason(user_id, words, effect), user_id),
            )
            return await run_in(conn, org_id, run_id)

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
                + keep_copies(first=13)
                + insert_steps_from_run(count=3, arrays=5),
                org_id,
                run_id,
                len(steps),
                self.owner,
                *steps_arrays(steps),
                *copies_arrays(steps),
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
