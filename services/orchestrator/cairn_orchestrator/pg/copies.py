"""The copies runs keep of texts about subjects (ports.CopyStore, and the
conversation's subjects ports.RunStore asks for): whom a conversation's runs
copied texts about, and erasure (I9): every copy the org's runs hold of what they
copied about a subject replaced with the tombstone (erasure.py says where and
how), the pending writes about it abandoned, the copies themselves forgotten."""

from __future__ import annotations

import json

import asyncpg

from cairn_orchestrator.domain import (
    SUBJECT_KINDS,
    ConfirmationState,
    MemorySubject,
    SubjectKindName,
)
from cairn_orchestrator.erasure import ORG_WIDE_MIN_CHARS, ErasedCopies, Eraser, search_forms
from cairn_orchestrator.pg.base import PgStore
from cairn_orchestrator.pg.rows import json_text
from cairn_orchestrator.store_decisions import write_after_erasure


def _subject_kind(name: str) -> SubjectKindName:
    return next((k for k in SUBJECT_KINDS if k == name), "WORKSPACE")


def _erased_json(raw: str | None, eraser: Eraser) -> str | None:
    """A stored JSON document (as text) with every copy erased; the same text when
    it held none (PostgreSQL prints jsonb its own way, so compare values, not text)."""
    if raw is None:
        return None
    value = json.loads(raw)
    erased = eraser.value(value)
    return raw if erased == value else json_text(erased)


class PgCopies(PgStore):
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
            erasure = write_after_erasure(
                ConfirmationState(confirmation["state"]),
                waited_on=run["state"] == "CONFIRMATION_PENDING"
                and run["current_confirmation"] == confirmation["confirmation_token"],
            )
            abandoned += erasure.abandoned
            await conn.execute(
                "UPDATE confirmations SET arguments_json = $3, card = $4::jsonb, "
                "result = $5::jsonb, note = $6, state = $7 "
                "WHERE org_id = $1 AND confirmation_token = $2",
                org_id,
                confirmation["confirmation_token"],
                arguments,
                card,
                result,
                note,
                erasure.state.value,
            )
            if erasure.run_reason is not None:
                await conn.execute(
                    "UPDATE runs SET state = 'CANCELLED', current_confirmation = NULL, "
                    "reason = $3, updated_at = clock_timestamp() "
                    "WHERE org_id = $1 AND run_id = $2",
                    org_id,
                    run_id,
                    erasure.run_reason,
                )
        return int(changed), abandoned
