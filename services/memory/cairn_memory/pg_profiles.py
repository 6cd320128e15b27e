"""Profile facts in PostgreSQL: one current version per key, every earlier one kept
until erased; an update that names the value it replaces is checked under a row lock."""

from __future__ import annotations

from datetime import datetime

import asyncpg

from cairn_memory.domain import ProfileFact, ProfileUpdate, Subject, check_previous_value
from cairn_memory.errors import ProfileValueChanged
from cairn_memory.pg_rows import FACT_COLUMNS, Rows
from cairn_memory.vault import StoredText


class PostgresProfiles:
    def __init__(self, rows: Rows) -> None:
        self._rows = rows

    async def current_profile(
        self, *, org_id: str, subject: Subject, now: datetime
    ) -> list[ProfileFact]:
        async with self._rows.connection() as conn:
            rows = await conn.fetch(
                f"SELECT {FACT_COLUMNS} FROM profile_fact_versions WHERE org_id = $1 "
                "AND subject_kind = $2 AND subject_id = $3 AND is_current AND expires_at > $4 "
                "ORDER BY fact_key",
                org_id,
                subject.kind.value,
                subject.id,
                now,
            )
        return self._rows.facts(rows, now=now, with_history=False)

    async def update_profile(self, update: ProfileUpdate, *, org_id: str) -> ProfileFact:
        subject = update.subject
        key_args = (org_id, subject.kind.value, subject.id, update.fact_key)
        now = update.created_at
        async with self._rows.connection() as conn, conn.transaction():
            current = await conn.fetchrow(
                f"SELECT {FACT_COLUMNS} FROM profile_fact_versions WHERE org_id = $1 "
                "AND subject_kind = $2 AND subject_id = $3 AND fact_key = $4 AND is_current "
                "FOR UPDATE",
                *key_args,
            )
            live = current is not None and current["expires_at"] > now
            current_value = (
                self._rows.vault.open(
                    StoredText(current["value"], current["value_sealed"]), org_id=org_id
                )
                if current is not None and live
                else None
            )
            if update.previous_value is not None:
                check_previous_value(update, live=live, current_value=current_value)
            if live and current_value == update.value:
                rows = await self._fact_rows(conn, *key_args)
                return self._rows.facts(rows, now=now, with_history=True)[0]
            if current is not None:
                await conn.execute(
                    "UPDATE profile_fact_versions SET is_current = false WHERE version_id = $1",
                    current["version_id"],
                )
            stored = self._rows.vault.seal(update.value, org_id=org_id)
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
        return self._rows.facts(rows, now=now, with_history=True)[0]

    async def _fact_rows(self, conn: asyncpg.Connection, *key_args: str) -> list[asyncpg.Record]:
        rows: list[asyncpg.Record] = await conn.fetch(
            f"SELECT {FACT_COLUMNS} FROM profile_fact_versions WHERE org_id = $1 "
            "AND subject_kind = $2 AND subject_id = $3 AND fact_key = $4 AND erased_at IS NULL "
            "ORDER BY version_id DESC",
            *key_args,
        )
        return rows
