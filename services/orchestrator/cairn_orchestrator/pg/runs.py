"""Runs and their steps (ports.RunStore, without conversation_subjects: copies.py).

A step takes its seq from the run row (`step_count`) in the same statement that
appends it, so the steps of a run are numbered densely, in the order recorded,
with one round trip and no scan; the loop state written with a step is always the
state after that step. Every write a driver makes is fenced on this process's
lease: a process whose run was taken over gets RunTakenOver and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from cairn_orchestrator.domain import (
    ENGLISH,
    Citation,
    ConversationTurn,
    LoopState,
    PageCursor,
    Run,
    RunLanguage,
    RunState,
    RunUsage,
    Step,
    StepRecord,
)
from cairn_orchestrator.pg.base import PgStore
from cairn_orchestrator.pg.rows import (
    RUN_COLUMNS,
    RUN_WITH_PENDING,
    copies_arrays,
    insert_steps_from_run,
    json_text,
    keep_copies,
    run_from_row,
    state_json,
    step_from_row,
    steps_arrays,
)


class PgRuns(PgStore):
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
                RETURNING {RUN_COLUMNS}
                """,
                run_id,
                org_id,
                user_id,
                agent,
                input,
                conversation_id,
                json_text([{"role": t.role, "content": t.content} for t in earlier_turns]),
                trace_id,
                root_span_id,
                self.owner,
                self.lease_seconds,
                language.language,
                language.fallback,
            )
        return run_from_row(row)

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
                + keep_copies(first=15)
                + insert_steps_from_run(count=3, arrays=7)
                + " RETURNING *",
                org_id,
                run_id,
                len(steps),
                state_json(loop_state),
                self.owner,
                self.lease_seconds,
                *steps_arrays(steps),
                *copies_arrays(steps),
            )
        if not rows:
            raise await self._lost(org_id, run_id)
        return sorted((step_from_row(row) for row in rows), key=lambda step: step.seq)

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
                    RETURNING {RUN_COLUMNS}, step_count
                ), added AS ({insert_steps_from_run(count=13, arrays=14)})
                {keep_copies(first=22)}
                SELECT * FROM run
                """,
                org_id,
                run_id,
                state.value,
                answer,
                json_text([c.to_json() for c in citations]),
                reason,
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens,
                usage.model_calls,
                state_json(loop_state),
                self.owner,
                len(steps),
                *steps_arrays(steps),
                *copies_arrays(steps),
            )
        if row is None:
            raise await self._lost(org_id, run_id)
        return run_from_row(row)

    async def get_run(self, *, org_id: str, run_id: str, user_id: str | None) -> Run | None:
        async with self._connection() as conn:
            row = await conn.fetchrow(
                RUN_WITH_PENDING
                + " WHERE r.org_id = $1 AND r.run_id = $2 AND ($3::text IS NULL OR r.user_id = $3)",
                org_id,
                run_id,
                user_id,
            )
        return run_from_row(row) if row is not None else None

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
                RUN_WITH_PENDING
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
        return [run_from_row(row) for row in rows]

    async def list_steps(self, *, org_id: str, run_id: str, after_seq: int = 0) -> list[Step]:
        async with self._connection() as conn:
            rows = await conn.fetch(
                "SELECT * FROM steps WHERE org_id = $1 AND run_id = $2 AND seq > $3 ORDER BY seq",
                org_id,
                run_id,
                after_seq,
            )
        return [step_from_row(row) for row in rows]
