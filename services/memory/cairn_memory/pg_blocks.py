"""Archived conversation blocks in PostgreSQL: kept once per conversation and
content, found by full text, readable only by the conversation's owner."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from cairn_memory.domain import Block, BlockDraft, BlockSearch
from cairn_memory.pg_rows import BLOCK_COLUMNS, Rows


class PostgresBlocks:
    def __init__(self, rows: Rows) -> None:
        self._rows = rows

    async def archive(
        self,
        draft: BlockDraft,
        *,
        org_id: str,
        user_id: str,
        now: datetime,
        expires_at: datetime,
    ) -> int | None:
        """Keep a block and return its number; the conversation is the first
        archiver's, and only theirs: None (nothing kept) when it is someone else's."""
        stored = self._rows.vault.seal(draft.content, org_id=org_id)
        async with self._rows.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO conversations (org_id, conversation_id, owner_user_id, created_at) "
                "VALUES ($1, $2, $3, $4) ON CONFLICT (org_id, conversation_id) DO NOTHING",
                org_id,
                draft.conversation_id,
                user_id,
                now,
            )
            owner = await conn.fetchval(
                "SELECT owner_user_id FROM conversations WHERE org_id = $1 AND conversation_id = $2",
                org_id,
                draft.conversation_id,
            )
            if owner != user_id:
                return None
            digest = self._rows.vault.digest("\x00".join((draft.role, draft.label, draft.content)))
            # Serialise archives of one conversation so two copies of a block cannot race in.
            await conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended($1 || '/' || $2, 0))",
                org_id,
                draft.conversation_id,
            )
            held = await conn.fetchval(
                "SELECT block_number FROM blocks WHERE org_id = $1 AND conversation_id = $2 "
                "AND content_digest = $3 AND expires_at > $4 ORDER BY block_number LIMIT 1",
                org_id,
                draft.conversation_id,
                digest,
                now,
            )
            if held is None:
                held = await conn.fetchval(
                    """
                INSERT INTO blocks (
                    org_id, conversation_id, archived_by, label, role, content, content_sealed,
                    search, created_at, expires_at, content_digest
                ) VALUES (
                    $1, $2, $3, $4, $5, $6, $7,
                    setweight(to_tsvector('english', $4), 'A')
                        || setweight(to_tsvector('english', $8), 'B'),
                    $9, $10, $11
                )
                RETURNING block_number
                """,
                    org_id,
                    draft.conversation_id,
                    user_id,
                    draft.label,
                    draft.role,
                    stored.plain,
                    stored.sealed,
                    draft.content,
                    now,
                    expires_at,
                    digest,
                )
            # The block already kept is about whomever this archive names too.
            await conn.executemany(
                "INSERT INTO block_subjects (block_number, org_id, subject_kind, subject_id) "
                "VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                [(held, org_id, about.kind.value, about.id) for about in draft.subjects],
            )
        return int(held)

    async def recall_block(
        self, *, org_id: str, user_id: str, number: int, now: datetime
    ) -> Block | None:
        async with self._rows.connection() as conn:
            row = await conn.fetchrow(
                f"""
                SELECT {BLOCK_COLUMNS} FROM blocks b
                JOIN conversations c
                  ON c.org_id = b.org_id AND c.conversation_id = b.conversation_id
                WHERE b.org_id = $1 AND b.block_number = $2 AND c.owner_user_id = $3
                  AND b.expires_at > $4
                """,
                org_id,
                number,
                user_id,
                now,
            )
        return self._rows.block(row) if row is not None else None

    async def owns_conversation(self, *, org_id: str, user_id: str, conversation_id: str) -> bool:
        async with self._rows.connection() as conn:
            owner = await conn.fetchval(
                "SELECT owner_user_id FROM conversations WHERE org_id = $1 AND conversation_id = $2",
                org_id,
                conversation_id,
            )
        return bool(owner == user_id)

    async def search_blocks(
        self, search: BlockSearch, *, org_id: str, user_id: str, now: datetime
    ) -> list[Block]:
        """Full-text over the caller's unexpired blocks: label (weight A) outranks content
        (weight B); equal ranks come newest first."""
        conversation_clause = "AND b.conversation_id = $6" if search.conversation_id else ""
        extra: list[Any] = [search.conversation_id] if search.conversation_id else []
        async with self._rows.connection() as conn:
            rows = await conn.fetch(
                f"""
                WITH q AS (SELECT websearch_to_tsquery('english', $2) AS query)
                SELECT {BLOCK_COLUMNS}, ts_rank(b.search, q.query) AS rank
                FROM q, blocks b
                JOIN conversations c
                  ON c.org_id = b.org_id AND c.conversation_id = b.conversation_id
                WHERE b.org_id = $1 AND c.owner_user_id = $3 AND b.search @@ q.query
                  AND b.expires_at > $5 AND b.erased_at IS NULL {conversation_clause}
                ORDER BY rank DESC, b.block_number DESC
                LIMIT $4
                """,
                org_id,
                search.query,
                user_id,
                search.limit,
                now,
                *extra,
            )
        return [self._rows.block(r) for r in rows]
