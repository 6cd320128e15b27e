"""What every memory-schema adapter shares: a connection whose failures are
translated once (StorageUnavailable, RefusedInput), the column lists, and rows made
back into domain records (opening sealed text through the vault)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Final

import asyncpg

from cairn_libs.db import CONNECTION_ERRORS, Database
from cairn_memory.domain import (
    Author,
    AuthorKind,
    Block,
    ClaimType,
    FactVersion,
    Memory,
    MemoryState,
    ProfileFact,
    Subject,
    SubjectKind,
    effective_state,
)
from cairn_memory.errors import RefusedInput, StorageUnavailable
from cairn_memory.vault import StoredText, TextVault

MEMORY_COLUMNS: Final = """
    memory_id::text AS memory_id, org_id, subject_kind, subject_id, body, body_sealed, tags,
    importance, claim_type, event_at, valid_from, valid_until, author_kind, author_id, run_id,
    on_behalf_of, source_ref, created_at, expires_at, state,
    coalesce(superseded_by::text, '') AS superseded_by
"""
RECALLABLE: Final = """
    org_id = $1 AND state = 'ACTIVE' AND expires_at > $2
    AND (valid_from IS NULL OR valid_from <= $2)
    AND (valid_until IS NULL OR valid_until > $2)
"""
FACT_COLUMNS: Final = """
    version_id, org_id, subject_kind, subject_id, fact_key, value, value_sealed, is_current,
    author_kind, author_id, run_id, on_behalf_of, created_at, expires_at
"""
BLOCK_COLUMNS: Final = """
    b.block_number, b.org_id, b.conversation_id, b.label, b.role, b.content, b.content_sealed,
    b.created_at, b.erased_at,
    ARRAY(SELECT s.subject_kind || ':' || s.subject_id FROM block_subjects s
          WHERE s.block_number = b.block_number ORDER BY s.subject_kind, s.subject_id)
        AS subjects
"""


class Rows:
    """Connections to the memory schema, and its rows as domain records."""

    def __init__(self, database: Database, *, vault: TextVault) -> None:
        self.database = database
        self.vault = vault

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        pool = self.database.pool
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

    def memory(self, row: asyncpg.Record, *, now: datetime, score: float = 0.0) -> Memory:
        stored_state = MemoryState(row["state"])
        text: str | None = ""
        if stored_state is not MemoryState.ERASED:
            text = self.vault.open(
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
            author=author(row),
            created_at=row["created_at"],
            expires_at=row["expires_at"],
            superseded_by=row["superseded_by"],
            source_ref=row["source_ref"],
            state=effective_state(stored_state, expires_at=row["expires_at"], now=now),
            readable=text is not None,
            score=score,
        )

    def version(self, row: asyncpg.Record) -> FactVersion:
        value = self.vault.open(StoredText(row["value"], row["value_sealed"]), org_id=row["org_id"])
        return FactVersion(
            value=value or "",
            author=author(row),
            created_at=row["created_at"],
            expires_at=row["expires_at"],
            readable=value is not None,
        )

    def facts(
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
                    current = self.version(row)
                elif with_history:
                    history.append(self.version(row))
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

    def block(self, row: asyncpg.Record) -> Block:
        subjects = tuple(subject_of(pair) for pair in row["subjects"])
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
        content = self.vault.open(
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


def subject_of(pair: str) -> Subject:
    kind, _, subject_id = pair.partition(":")
    return Subject(SubjectKind(kind), subject_id)


def author(row: asyncpg.Record) -> Author:
    return Author(
        kind=AuthorKind(row["author_kind"]),
        id=row["author_id"],
        run_id=row["run_id"],
        on_behalf_of=row["on_behalf_of"],
    )


def subject_filter(subject: Subject | None, *, first: int) -> tuple[str, list[str]]:
    if subject is None:
        return "", []
    return (
        f"AND subject_kind = ${first} AND subject_id = ${first + 1}",
        [subject.kind.value, subject.id],
    )
