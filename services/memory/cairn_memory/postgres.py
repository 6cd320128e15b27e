"""Memories, profile facts, erasures and archived blocks in PostgreSQL (schema `memory`).

Every statement narrows by org_id (I5); every time it compares against is a
parameter from the service's clock. Decisions that need the current state (is a
superseded id active, is the previous profile value current, does this user own
the conversation) are taken inside the same transaction as the write, with the
rows locked, so two concurrent calls cannot both win. asyncpg's connection
errors become StorageUnavailable here and nowhere else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import asyncpg
from opentelemetry import trace

from cairn_libs.db import CONNECTION_ERRORS, Database, Migration, load_migrations, vector_literal
from cairn_libs.errors import Denied
from cairn_memory.domain import (
    Author,
    AuthorKind,
    Block,
    BlockDraft,
    BlockSearch,
    ClaimType,
    Erasure,
    FactVersion,
    HeldAbout,
    HeldCursor,
    HeldQuery,
    Memory,
    MemoryState,
    NewMemory,
    ProfileFact,
    ProfileUpdate,
    PurgeCounts,
    Subject,
    SubjectKind,
    effective_state,
    normalised_text,
    shown,
)
from cairn_memory.errors import (
    ProfileValueChanged,
    RefusedInput,
    StorageUnavailable,
    SupersedesNotActive,
)
from cairn_memory.vault import StoredText, TextVault

SCHEMA: Final = "memory"
PURGE_BATCH: Final = 5000
# pgvector >= 0.8: keep scanning the HNSW graph until k rows pass the org filter,
# in exact distance order, instead of returning fewer than k.
SEMANTIC_SETTINGS: Final = (
    "SET LOCAL hnsw.iterative_scan = strict_order",
    # Candidates per graph pass. Measured at 1M memories (100k in the org): 40 gave
    # recall@5 0.94 in 3.0 ms, 64 gave 0.984 in 4.3 ms, 100 gave 0.992 in 6.6 ms.
    "SET LOCAL hnsw.ef_search = 64",
    # Plan for this org's size every time: a generic plan cached by the prepared
    # statement cannot see the org id, and picks one strategy for every org (a full
    # distance sort of a 100k-memory org took 10x longer than the HNSW scan).
    "SET LOCAL plan_cache_mode = force_custom_plan",
    # A short LIMIT query never repays JIT compilation, which the planner may pick
    # for a mid-sized org's exact scan and which costs tens of milliseconds.
    "SET LOCAL jit = off",
)

_MEMORY_COLUMNS: Final = """
    memory_id::text AS memory_id, org_id, subject_kind, subject_id, body, body_sealed, tags,
    importance, claim_type, event_at, valid_from, valid_until, author_kind, author_id, run_id,
    on_behalf_of, source_ref, created_at, expires_at, state,
    coalesce(superseded_by::text, '') AS superseded_by
"""
_RECALLABLE: Final = """
    org_id = $1 AND state = 'ACTIVE' AND expires_at > $2
    AND (valid_from IS NULL OR valid_from <= $2)
    AND (valid_until IS NULL OR valid_until > $2)
"""
_FACT_COLUMNS: Final = """
    version_id, org_id, subject_kind, subject_id, fact_key, value, value_sealed, is_current,
    author_kind, author_id, run_id, on_behalf_of, created_at, expires_at
"""
_BLOCK_COLUMNS: Final = """
    b.block_number, b.org_id, b.conversation_id, b.label, b.role, b.content, b.content_sealed,
    b.created_at, b.erased_at,
    ARRAY(SELECT s.subject_kind || ':' || s.subject_id FROM block_subjects s
          WHERE s.block_number = b.block_number ORDER BY s.subject_kind, s.subject_id)
        AS subjects
"""


def migrations() -> list[Migration]:
    return load_migrations(Path(__file__).parent / "migrations")


def memory_database(url: str) -> Database:
    return Database(url=url, schema=SCHEMA, migrations=migrations())


# The recall statements are module functions so the benchmark can EXPLAIN exactly
# what the service runs.


def semantic_recall_sql(subject: Subject | None, *, exact: bool = False) -> str:
    """The nearest recallable memories. `exact` orders by an expression the HNSW
    index cannot serve (distance + 0), so PostgreSQL computes every candidate's
    distance: complete and exact, and slow for a large org."""
    subject_clause, _ = _subject_filter(subject, first=5)
    # The index is over half-precision copies (migration 0003); ranking and score use
    # the same expression so the order and the scores agree.
    distance = "embedding::halfvec(384) <=> $3::halfvec(384)"
    return f"""
        SELECT {_MEMORY_COLUMNS}, 1 - ({distance}) AS score
        FROM memories
        WHERE {_RECALLABLE} AND embedding IS NOT NULL {subject_clause}
        ORDER BY {f"({distance}) + 0" if exact else distance}
        LIMIT $4
    """


def semantic_recall_args(
    *, org_id: str, subject: Subject | None, vector: Sequence[float], k: int, now: datetime
) -> list[Any]:
    _, subject_args = _subject_filter(subject, first=5)
    return [org_id, now, vector_literal(vector), k, *subject_args]


def newest_recall_sql(subject: Subject | None) -> str:
    subject_clause, _ = _subject_filter(subject, first=4)
    return f"""
        SELECT {_MEMORY_COLUMNS} FROM memories
        WHERE {_RECALLABLE} {subject_clause}
        ORDER BY memories.created_at DESC, memories.memory_id DESC
        LIMIT $3
    """


def newest_recall_args(*, org_id: str, subject: Subject | None, k: int, now: datetime) -> list[Any]:
    _, subject_args = _subject_filter(subject, first=4)
    return [org_id, now, k, *subject_args]


class PostgresStore:
    def __init__(self, database: Database, *, vault: TextVault) -> None:
        self._db = database
        self._vault = vault

    async def ready(self) -> bool:
        return await self._db.ready()

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        pool = self._db.pool
        try:
            async with pool.acquire(timeout=5) as conn:
                yield conn
        except CONNECTION_ERRORS as exc:
            raise StorageUnavailable("the memory database is not reachable; retry shortly") from exc
        except asyncpg.DataError as exc:
            # The domain refuses what PostgreSQL cannot hold before it gets here; should a
            # value still slip through, it is the request's fault, not an outage, and
            # the database's message (which may quote the value) is not passed on.
            raise RefusedInput(
                "a value in the request cannot be stored (out of range or not valid text); "
                "check the request's times and text and send it again"
            ) from exc

    # --- memories -----------------------------------------------------------------

    async def remember(
        self, memory: NewMemory, *, org_id: str, embedding: Sequence[float] | None
    ) -> tuple[Memory, bool]:
        """Store `memory`, or return the active one with the same text (already_held=True)."""
        digest = self._vault.digest(normalised_text(memory.text))
        stored = self._vault.seal(memory.text, org_id=org_id)
        subject = memory.subject
        now = memory.created_at
        async with self._connection() as conn, conn.transaction():
            if memory.supersedes:
                await self._lock_supersedable(conn, memory, org_id=org_id)
            # An ACTIVE twin past its expiry is expired in fact; record that, so the
            # one-active-text index does not hold a memory nobody can recall.
            await conn.execute(
                "UPDATE memories SET state = 'EXPIRED' WHERE org_id = $1 AND subject_kind = $2 "
                "AND subject_id = $3 AND text_digest = $4 AND state = 'ACTIVE' AND expires_at <= $5",
                org_id,
                subject.kind.value,
                subject.id,
                digest,
                now,
            )
            row = await conn.fetchrow(
                f"""
                INSERT INTO memories (
                    memory_id, org_id, subject_kind, subject_id, body, body_sealed, text_digest,
                    embedding, tags, importance, claim_type, event_at, valid_from, valid_until,
                    author_kind, author_id, run_id, on_behalf_of, source_ref, created_at,
                    expires_at, state
                ) VALUES (
                    $1::uuid, $2, $3, $4, $5, $6, $7, $8::vector, $9, $10, $11, $12, $13, $14,
                    $15, $16, $17, $18, $19, $20, $21, 'ACTIVE'
                )
                ON CONFLICT (org_id, subject_kind, subject_id, text_digest) WHERE state = 'ACTIVE'
                DO NOTHING
                RETURNING {_MEMORY_COLUMNS}
                """,
                memory.memory_id,
                org_id,
                subject.kind.value,
                subject.id,
                stored.plain,
                stored.sealed,
                digest,
                vector_literal(embedding) if embedding is not None else None,
                list(memory.tags),
                memory.importance,
                memory.claim_type.value,
                memory.event_at,
                memory.valid_from,
                memory.valid_until,
                memory.author.kind.value,
                memory.author.id,
                memory.author.run_id,
                memory.author.on_behalf_of,
                memory.source_ref,
                memory.created_at,
                memory.expires_at,
            )
            already_held = row is None
            if row is None:
                row = await conn.fetchrow(
                    f"SELECT {_MEMORY_COLUMNS} FROM memories WHERE org_id = $1 AND subject_kind = $2 "
                    "AND subject_id = $3 AND text_digest = $4 AND state = 'ACTIVE'",
                    org_id,
                    subject.kind.value,
                    subject.id,
                    digest,
                )
                if row is None:
                    raise SupersedesNotActive(
                        "the same text about this subject changed while it was being remembered; retry"
                    )
            held_id = str(row["memory_id"])
            replaced = [m for m in memory.supersedes if m != held_id]
            if replaced:
                await conn.execute(
                    "UPDATE memories SET state = 'SUPERSEDED', superseded_by = $2::uuid "
                    "WHERE org_id = $1 AND memory_id = ANY($3::uuid[])",
                    org_id,
                    held_id,
                    replaced,
                )
        return self._memory(row, now=now), already_held

    async def _lock_supersedable(
        self, conn: asyncpg.Connection, memory: NewMemory, *, org_id: str
    ) -> None:
        rows = await conn.fetch(
            "SELECT memory_id::text AS memory_id FROM memories WHERE org_id = $1 "
            "AND memory_id = ANY($2::uuid[]) AND subject_kind = $3 AND subject_id = $4 "
            "AND state = 'ACTIVE' AND expires_at > $5 FOR UPDATE",
            org_id,
            list(memory.supersedes),
            memory.subject.kind.value,
            memory.subject.id,
            memory.created_at,
        )
        found = {str(r["memory_id"]) for r in rows}
        for index, memory_id in enumerate(memory.supersedes):
            if memory_id not in found:
                raise SupersedesNotActive(
                    f"supersedes[{index}] = {memory_id!r} is not an active memory of this subject "
                    "in your organisation; nothing was remembered or superseded"
                )

    async def recall_semantic(
        self,
        *,
        org_id: str,
        subject: Subject | None,
        vector: Sequence[float],
        k: int,
        now: datetime,
    ) -> list[Memory]:
        args = semantic_recall_args(org_id=org_id, subject=subject, vector=vector, k=k, now=now)
        async with self._connection() as conn, conn.transaction():
            # One round trip: a simple-protocol string may hold several statements.
            await conn.execute("; ".join(SEMANTIC_SETTINGS))
            rows = await conn.fetch(semantic_recall_sql(subject), *args)
            if len(rows) < k:
                # An HNSW graph is not guaranteed to be connected: with many near-
                # duplicate memories a query can land in an island that holds fewer
                # than k of this org's rows although more exist. Fewer than k is
                # rare (or the org holds fewer), so answering it exactly costs little.
                trace.get_current_span().add_event(
                    "memory.recall.exact_fallback", {"cairn.memory.approximate_rows": len(rows)}
                )
                rows = await conn.fetch(semantic_recall_sql(subject, exact=True), *args)
        return [self._memory(r, now=now, score=float(r["score"])) for r in rows]

    async def recall_newest(
        self, *, org_id: str, subject: Subject | None, k: int, now: datetime
    ) -> list[Memory]:
        async with self._connection() as conn:
            rows = await conn.fetch(
                newest_recall_sql(subject),
                *newest_recall_args(org_id=org_id, subject=subject, k=k, now=now),
            )
        return [self._memory(r, now=now) for r in rows]

    async def memories_without_embedding(
        self, *, limit: int, now: datetime
    ) -> list[tuple[str, str, str]]:
        """(org_id, memory_id, text) of active memories stored while no embedder was set."""
        async with self._connection() as conn:
            rows = await conn.fetch(
                "SELECT org_id, memory_id::text AS memory_id, body, body_sealed FROM memories "
                "WHERE state = 'ACTIVE' AND embedding IS NULL AND expires_at > $1 "
                "ORDER BY created_at LIMIT $2",
                now,
                limit,
            )
        found = []
        for r in rows:
            text = self._vault.open(StoredText(r["body"], r["body_sealed"]), org_id=r["org_id"])
            if text is not None:
                found.append((str(r["org_id"]), str(r["memory_id"]), text))
        return found

    async def set_embeddings(self, embeddings: Sequence[tuple[str, str, Sequence[float]]]) -> None:
        """Attach embeddings to (org_id, memory_id) rows that are still active and unembedded."""
        async with self._connection() as conn:
            await conn.executemany(
                "UPDATE memories SET embedding = $3::vector WHERE org_id = $1 "
                "AND memory_id = $2::uuid AND state = 'ACTIVE' AND embedding IS NULL",
                [(org, mid, vector_literal(vec)) for org, mid, vec in embeddings],
            )

    # --- subject access and erasure -------------------------------------------------

    async def held(self, query: HeldQuery, *, org_id: str, now: datetime) -> HeldAbout:
        """One page of memories about a subject, newest first (keyset on created_at,
        memory_id, so pages neither skip nor repeat while memories are added), and on
        the first page its profile facts and erasures."""
        subject = query.subject
        args = (org_id, subject.kind.value, subject.id)
        after = query.after
        page_clause = "AND (created_at, memory_id) < ($5, $6::uuid)" if after else ""
        page_args = [after.created_at, after.memory_id] if after else []
        async with self._connection() as conn:
            memory_rows = await conn.fetch(
                f"SELECT {_MEMORY_COLUMNS} FROM memories WHERE org_id = $1 AND subject_kind = $2 "
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
                    memories=tuple(self._memory(r, now=now) for r in memory_rows),
                    profile=(),
                    erasures=(),
                    next_page=next_page,
                )
            fact_rows = await conn.fetch(
                f"SELECT {_FACT_COLUMNS} FROM profile_fact_versions WHERE org_id = $1 "
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
            memories=tuple(self._memory(r, now=now) for r in memory_rows),
            profile=tuple(self._facts(fact_rows, now=now, with_history=True)),
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
        async with self._connection() as conn:
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
        async with self._connection() as conn:
            await conn.execute(
                "UPDATE erasures SET copies_erased = true WHERE org_id = $1 AND erasure_id = $2",
                org_id,
                erasure_id,
            )

    # --- profile facts --------------------------------------------------------------

    async def current_profile(
        self, *, org_id: str, subject: Subject, now: datetime
    ) -> list[ProfileFact]:
        async with self._connection() as conn:
            rows = await conn.fetch(
                f"SELECT {_FACT_COLUMNS} FROM profile_fact_versions WHERE org_id = $1 "
                "AND subject_kind = $2 AND subject_id = $3 AND is_current AND expires_at > $4 "
                "ORDER BY fact_key",
                org_id,
                subject.kind.value,
                subject.id,
                now,
            )
        return self._facts(rows, now=now, with_history=False)

    async def update_profile(self, update: ProfileUpdate, *, org_id: str) -> ProfileFact:
        subject = update.subject
        key_args = (org_id, subject.kind.value, subject.id, update.fact_key)
        now = update.created_at
        async with self._connection() as conn, conn.transaction():
            current = await conn.fetchrow(
                f"SELECT {_FACT_COLUMNS} FROM profile_fact_versions WHERE org_id = $1 "
                "AND subject_kind = $2 AND subject_id = $3 AND fact_key = $4 AND is_current "
                "FOR UPDATE",
                *key_args,
            )
            live = current is not None and current["expires_at"] > now
            current_value = (
                self._vault.open(
                    StoredText(current["value"], current["value_sealed"]), org_id=org_id
                )
                if current is not None and live
                else None
            )
            if update.previous_value is not None:
                _check_previous(update, live=live, current_value=current_value)
            if live and current_value == update.value:
                rows = await self._fact_rows(conn, *key_args)
                return self._facts(rows, now=now, with_history=True)[0]
            if current is not None:
                await conn.execute(
                    "UPDATE profile_fact_versions SET is_current = false WHERE version_id = $1",
                    current["version_id"],
                )
            stored = self._vault.seal(update.value, org_id=org_id)
            try:
                await conn.execute(
                    """
                    INSERT INTO profile_fact_versions (
                        org_id, subject_kind, subject_id, fact_key, value, value_sealed,
                        is_current, author_kind, author_id, run_id, on_behalf_of, created_at,
                        expires_at
                    ) VALUES ($1, $2, $3, $4, $5, $6, true, $7, $8, $9, $10, $11, $12)
                    """,
                    *key_args,
                    stored.plain,
                    stored.sealed,
                    update.author.kind.value,
                    update.author.id,
                    update.author.run_id,
                    update.author.on_behalf_of,
                    update.created_at,
                    update.expires_at,
                )
            except asyncpg.UniqueViolationError as exc:
                raise ProfileValueChanged(
                    f"fact {update.fact_key!r} was set by another call at the same moment; "
                    "read it again and retry"
                ) from exc
            rows = await self._fact_rows(conn, *key_args)
        return self._facts(rows, now=now, with_history=True)[0]

    async def _fact_rows(self, conn: asyncpg.Connection, *key_args: str) -> list[asyncpg.Record]:
        rows: list[asyncpg.Record] = await conn.fetch(
            f"SELECT {_FACT_COLUMNS} FROM profile_fact_versions WHERE org_id = $1 "
            "AND subject_kind = $2 AND subject_id = $3 AND fact_key = $4 AND erased_at IS NULL "
            "ORDER BY version_id DESC",
            *key_args,
        )
        return rows

    # --- the archive ----------------------------------------------------------------

    async def archive(
        self,
        draft: BlockDraft,
        *,
        org_id: str,
        user_id: str,
        now: datetime,
        expires_at: datetime,
    ) -> int:
        """Keep a block; the conversation is the first archiver's, and only theirs."""
        stored = self._vault.seal(draft.content, org_id=org_id)
        async with self._connection() as conn, conn.transaction():
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
                raise Denied()
            digest = self._vault.digest("\x00".join((draft.role, draft.label, draft.content)))
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
        async with self._connection() as conn:
            row = await conn.fetchrow(
                f"""
                SELECT {_BLOCK_COLUMNS} FROM blocks b
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
        return self._block(row) if row is not None else None

    async def owns_conversation(self, *, org_id: str, user_id: str, conversation_id: str) -> bool:
        async with self._connection() as conn:
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
        async with self._connection() as conn:
            rows = await conn.fetch(
                f"""
                WITH q AS (SELECT websearch_to_tsquery('english', $2) AS query)
                SELECT {_BLOCK_COLUMNS}, ts_rank(b.search, q.query) AS rank
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
        return [self._block(r) for r in rows]

    # --- expiry ---------------------------------------------------------------------

    async def purge_expired(self, *, now: datetime) -> PurgeCounts:
        """Delete every memory, fact version and block past its expiry, in bounded batches."""
        memories = await self._purge_table("memories", "memory_id", now)
        fact_versions = await self._purge_table("profile_fact_versions", "version_id", now)
        blocks = await self._purge_table("blocks", "block_number", now)
        return PurgeCounts(memories=memories, fact_versions=fact_versions, blocks=blocks)

    async def _purge_table(self, table: str, key: str, now: datetime) -> int:
        total = 0
        while True:
            async with self._connection() as conn:
                status = await conn.execute(
                    f"DELETE FROM {table} WHERE {key} IN "
                    f"(SELECT {key} FROM {table} WHERE expires_at <= $1 LIMIT {PURGE_BATCH})",
                    now,
                )
            deleted = int(status.split()[-1])
            total += deleted
            if deleted < PURGE_BATCH:
                return total

    # --- rows to domain -------------------------------------------------------------

    def _memory(self, row: asyncpg.Record, *, now: datetime, score: float = 0.0) -> Memory:
        stored_state = MemoryState(row["state"])
        text: str | None = ""
        if stored_state is not MemoryState.ERASED:
            text = self._vault.open(
                StoredText(row["body"], row["body_sealed"]), org_id=row["org_id"]
            )
        return Memory(
            memory_id=str(row["memory_id"]),
            subject=Subject(kind=SubjectKind(row["subject_kind"]), id=row["subject_id"]),
            text=text or "",
            tags=tuple(row["tags"]),
            importance=row["importance"],
            claim_type=ClaimType(row["claim_type"]),
            event_at=row["event_at"],
            valid_from=row["valid_from"],
            valid_until=row["valid_until"],
            author=_author(row),
            created_at=row["created_at"],
            expires_at=row["expires_at"],
            superseded_by=row["superseded_by"],
            source_ref=row["source_ref"],
            state=effective_state(stored_state, expires_at=row["expires_at"], now=now),
            readable=text is not None,
            score=score,
        )

    def _version(self, row: asyncpg.Record) -> FactVersion:
        value = self._vault.open(
            StoredText(row["value"], row["value_sealed"]), org_id=row["org_id"]
        )
        return FactVersion(
            value=value or "",
            author=_author(row),
            created_at=row["created_at"],
            expires_at=row["expires_at"],
            readable=value is not None,
        )

    def _facts(
        self, rows: Sequence[asyncpg.Record], *, now: datetime, with_history: bool
    ) -> list[ProfileFact]:
        """Rows ordered by fact_key then newest first become one ProfileFact per key."""
        facts: list[ProfileFact] = []
        by_key: dict[str, list[asyncpg.Record]] = {}
        for row in rows:
            by_key.setdefault(row["fact_key"], []).append(row)
        for key, versions in by_key.items():
            first = versions[0]
            current = None
            history = []
            for row in versions:
                if row["is_current"] and row["expires_at"] > now and current is None:
                    current = self._version(row)
                elif with_history:
                    history.append(self._version(row))
            facts.append(
                ProfileFact(
                    subject=Subject(
                        kind=SubjectKind(first["subject_kind"]), id=first["subject_id"]
                    ),
                    fact_key=key,
                    current=current,
                    history=tuple(history),
                )
            )
        return facts

    def _block(self, row: asyncpg.Record) -> Block:
        subjects = tuple(_subject_of(pair) for pair in row["subjects"])
        if row["erased_at"] is not None:
            return Block(
                number=int(row["block_number"]),
                label="",
                role=row["role"],
                content="",
                conversation_id=row["conversation_id"],
                created_at=row["created_at"],
                subjects=subjects,
                erased=True,
            )
        content = self._vault.open(
            StoredText(row["content"], row["content_sealed"]), org_id=row["org_id"]
        )
        return Block(
            number=int(row["block_number"]),
            label=row["label"],
            role=row["role"],
            content=content or "",
            conversation_id=row["conversation_id"],
            created_at=row["created_at"],
            readable=content is not None,
            subjects=subjects,
        )


def _subject_of(pair: str) -> Subject:
    kind, _, subject_id = pair.partition(":")
    return Subject(SubjectKind(kind), subject_id)


def _author(row: asyncpg.Record) -> Author:
    return Author(
        kind=AuthorKind(row["author_kind"]),
        id=row["author_id"],
        run_id=row["run_id"],
        on_behalf_of=row["on_behalf_of"],
    )


def _subject_filter(subject: Subject | None, *, first: int) -> tuple[str, list[str]]:
    if subject is None:
        return "", []
    return (
        f"AND subject_kind = ${first} AND subject_id = ${first + 1}",
        [subject.kind.value, subject.id],
    )


def _check_previous(update: ProfileUpdate, *, live: bool, current_value: str | None) -> None:
    expected = update.previous_value
    key = update.fact_key
    if not live:
        if expected:
            raise ProfileValueChanged(
                f"previous_value {shown(expected)} does not match: {key!r} has no current value; "
                "send previous_value '' (or leave it unset) to set it"
            )
        return
    if current_value is None:
        raise ProfileValueChanged(
            f"the current value of {key!r} is encrypted and this deployment holds no key, "
            "so previous_value cannot be compared; leave previous_value unset to replace it"
        )
    if current_value != expected:
        raise ProfileValueChanged(
            f"previous_value {shown(expected or '')} is not the current value of {key!r}; "
            "read the profile again (Held or Recall with include_profile) and retry"
        )
