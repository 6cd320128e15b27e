"""What is held about a subject, and its erasure: Held's pages and Forget's one
statement over memories, profile facts and archived blocks."""

from __future__ import annotations

from datetime import datetime

from cairn_memory.domain import Erasure, HeldAbout, HeldCursor, HeldQuery, Subject
from cairn_memory.pg_rows import FACT_COLUMNS, MEMORY_COLUMNS, Rows


class PostgresSubjects:
    def __init__(self, rows: Rows) -> None:
        self._rows = rows

    async def held(self, query: HeldQuery, *, org_id: str, now: datetime) -> HeldAbout:
        """One page of memories about a subject, newest first (keyset on created_at,
        memory_id, so pages neither skip nor repeat while memories are added), and on
        the first page its profile facts and erasures."""
        subject = query.subject
        args = (org_id, subject.kind.value, subject.id)
        after = query.after
        page_clause = "AND (created_at, memory_id) < ($5, $6::uuid)" if after else ""
        page_args = [after.created_at, after.memory_id] if after else []
        async with self._rows.connection() as conn:
            memory_rows = await conn.fetch(
                f"SELECT {MEMORY_COLUMNS} FROM memories WHERE org_id = $1 AND subject_kind = $2 "
                f"AND subject_id = $3 {page_clause} "
                "ORDER BY memories.created_at DESC, memories.memory_id DESC LIMIT $4",
                *args,
                query.page_size + 1,
                *page_args,
            )
            next_page = None
            if len(memory_rows) > query.page_size:
                memory_rows = memory_rows[: query.page_size]
                last = memory_rows[-1]
                next_page = HeldCursor(
                    created_at=last["created_at"],
                    memory_id=str(last["memory_id"]),
                    scope=query.scope,
                )
            if after is not None:
                return HeldAbout(
                    memories=tuple(self._rows.memory(r, now=now) for r in memory_rows),
                    profile=(),
                    erasures=(),
                    next_page=next_page,
                )
            fact_rows = await conn.fetch(
                f"SELECT {FACT_COLUMNS} FROM profile_fact_versions WHERE org_id = $1 "
                "AND subject_kind = $2 AND subject_id = $3 AND erased_at IS NULL "
                "ORDER BY fact_key, version_id DESC",
                *args,
            )
            erasure_rows = await conn.fetch(
                "SELECT erased_by, erased_at, memories_erased, facts_erased, blocks_erased, "
                "copies_erased FROM erasures "
                "WHERE org_id = $1 AND subject_kind = $2 AND subject_id = $3 "
                "ORDER BY erased_at DESC, erasure_id DESC",
                *args,
            )
        return HeldAbout(
            memories=tuple(self._rows.memory(r, now=now) for r in memory_rows),
            profile=tuple(self._rows.facts(fact_rows, now=now, with_history=True)),
            erasures=tuple(
                Erasure(
                    subject=subject,
                    erased_by=r["erased_by"],
                    erased_at=r["erased_at"],
                    memories_erased=r["memories_erased"],
                    facts_erased=r["facts_erased"],
                    blocks_erased=r["blocks_erased"],
                    copies_erased=r["copies_erased"],
                )
                for r in erasure_rows
            ),
            next_page=next_page,
        )

    async def forget(
        self, *, org_id: str, subject: Subject, erased_by: str, now: datetime
    ) -> tuple[Erasure, int]:
        """Erase a subject's memories, facts and archived blocks and record the erasure,
        in one statement; returns the erasure and its record's id (to mark the copies
        elsewhere erased once they are).

        A block keeps its number, conversation and dates so `r<N>` still resolves, to
        its tombstone; its content, label, search terms and digest go, since each of
        them repeats the erased text (a digest could confirm a guess).
        """
        async with self._rows.connection() as conn:
            row = await conn.fetchrow(
                """
                WITH erased_memories AS (
                    UPDATE memories
                    SET body = NULL, body_sealed = NULL, text_digest = NULL, embedding = NULL,
                        tags = '{}', source_ref = '', state = 'ERASED', erased_at = $4
                    WHERE org_id = $1 AND subject_kind = $2 AND subject_id = $3
                      AND state <> 'ERASED'
                    RETURNING 1
                ), erased_facts AS (
                    UPDATE profile_fact_versions
                    SET value = NULL, value_sealed = NULL, is_current = false, erased_at = $4
                    WHERE org_id = $1 AND subject_kind = $2 AND subject_id = $3
                      AND erased_at IS NULL
                    RETURNING fact_key
                ), erased_blocks AS (
                    UPDATE blocks
                    SET content = NULL, content_sealed = NULL, label = '', search = ''::tsvector,
                        content_digest = NULL, erased_at = $4
                    WHERE erased_at IS NULL AND block_number IN (
                        SELECT block_number FROM block_subjects
                        WHERE org_id = $1 AND subject_kind = $2 AND subject_id = $3
                    )
                    RETURNING 1
                )
                INSERT INTO erasures (
                    org_id, subject_kind, subject_id, erased_by, erased_at, memories_erased,
                    facts_erased, blocks_erased
                )
                SELECT $1, $2, $3, $5, $4,
                       (SELECT count(*) FROM erased_memories),
                       (SELECT count(DISTINCT fact_key) FROM erased_facts),
                       (SELECT count(*) FROM erased_blocks)
                RETURNING erasure_id, erased_by, erased_at, memories_erased, facts_erased,
                          blocks_erased
                """,
                org_id,
                subject.kind.value,
                subject.id,
                now,
                erased_by,
            )
        assert row is not None
        erasure = Erasure(
            subject=subject,
            erased_by=row["erased_by"],
            erased_at=row["erased_at"],
            memories_erased=row["memories_erased"],
            facts_erased=row["facts_erased"],
            blocks_erased=row["blocks_erased"],
        )
        return erasure, int(row["erasure_id"])

    async def mark_copies_erased(self, *, org_id: str, erasure_id: int) -> None:
        async with self._rows.connection() as conn:
            await conn.execute(
                "UPDATE erasures SET copies_erased = true WHERE org_id = $1 AND erasure_id = $2",
                org_id,
                erasure_id,
            )
