"""Run ownership and the maintenance sweeps (ports.RunLeases): this process's
leases renewed and released, runs whose lease ran out recovered (back to their
person when an approval was in flight, else FAILED with the reason), and open
confirmations past their expiry ended. The sweeps scan across orgs by design and
then act on each row by its own org and id; what each row becomes is decided in
confirmations.py."""

from __future__ import annotations

from collections.abc import Sequence

from cairn_orchestrator.confirmations import (
    BackToPerson,
    EndRun,
    Recovered,
    after_interruption,
    expiry_on_sweep,
)
from cairn_orchestrator.pg.base import PgStore
from cairn_orchestrator.pg.rows import confirmation_from_row
from cairn_orchestrator.pg.tx import expire_in


class PgLeases(PgStore):
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
                    latest = confirmation_from_row(conf_row) if conf_row is not None else None
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
                confirmation = confirmation_from_row(row)
                new_state, reason = expiry_on_sweep(confirmation)
                await expire_in(conn, confirmation, new_state, reason, span_id, row["now"])
                ended.append(confirmation.run_id)
        return ended
