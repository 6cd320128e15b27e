"""The directory's answers, in SQL that narrows by the caller's org and role.

Who may see what is decided in the WHERE clause, not after the rows came back:
a manager sees the teams they manage and their people, HR sees the whole org,
everybody sees their own balance. A question whose answer the caller may not see
reads exactly like one about something that does not exist: the one denial (I6).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from typing import Any

import asyncpg

from cairn_libs.db import CONNECTION_ERRORS, Database, load_migrations
from cairn_libs.errors import DependencyUnavailable
from cairn_libs.identity import Principal

SCHEMA = "people_directory"
MIGRATIONS = load_migrations(__file__.rsplit("/", 1)[0] + "/migrations")
DENIAL_CODE = "permission_denied"
DENIAL_MESSAGE = "not found or not yours to see"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A tool's own failure, as data for the caller: a code and a message."""

    code: str
    message: str


DENIED = Refusal(DENIAL_CODE, DENIAL_MESSAGE)


def _days(value: Decimal) -> float | int:
    return int(value) if value == value.to_integral_value() else float(value)


class Directory:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        try:
            rows: list[asyncpg.Record] = await self._db.pool.fetch(sql, *args)
        except CONNECTION_ERRORS as exc:
            raise DependencyUnavailable("the people directory's database is not reachable") from exc
        return rows

    async def count_open_positions(
        self, principal: Principal, *, team: str | None
    ) -> dict[str, Any] | Refusal:
        rows = await self._fetch(
            """
            SELECT t.team_id, t.name, count(p.position_id) AS open
            FROM teams t LEFT JOIN open_positions p
              ON p.org_id = t.org_id AND p.team_id = t.team_id
            WHERE t.org_id = $1
              AND ('hr' = ANY($2::text[]) OR ('manager' = ANY($2::text[]) AND t.manager_user_id = $3))
              AND ($4::text IS NULL OR t.team_id = $4)
            GROUP BY t.team_id, t.name
            ORDER BY t.team_id
            """,
            principal.org_id,
            list(principal.roles),
            principal.user_id,
            team,
        )
        if not rows:
            return DENIED
        return {
            "teams": [
                {"team": r["team_id"], "name": r["name"], "open_positions": r["open"]} for r in rows
            ],
            "total": sum(r["open"] for r in rows),
        }

    async def leave_balance(
        self, principal: Principal, *, person: str | None
    ) -> dict[str, Any] | Refusal:
        rows = await self._fetch(
            """
            SELECT p.user_id, p.display_name, b.days_left
            FROM people p JOIN leave_balances b ON b.org_id = p.org_id AND b.user_id = p.user_id
            WHERE p.org_id = $1 AND p.user_id = $2
              AND (p.user_id = $3
                   OR 'hr' = ANY($4::text[])
                   OR ('manager' = ANY($4::text[]) AND EXISTS (
                         SELECT 1 FROM teams t
                         WHERE t.org_id = p.org_id AND t.team_id = p.team_id
                           AND t.manager_user_id = $3)))
            """,
            principal.org_id,
            person or principal.user_id,
            principal.user_id,
            list(principal.roles),
        )
        if not rows:
            return DENIED
        row = rows[0]
        return {
            "person": row["user_id"],
            "name": row["display_name"],
            "days_left": _days(row["days_left"]),
        }

    async def request_leave(
        self,
        principal: Principal,
        *,
        start_date: date,
        days: int,
        note: str,
        idempotency_key: str,
        run_id: str,
    ) -> dict[str, Any] | Refusal:
        """Book leave for the caller, once per idempotency key: a repeat returns the
        first outcome and changes nothing (it only counts the delivery)."""
        try:
            async with self._db.pool.acquire() as conn, conn.transaction():
                existing = await conn.fetchrow(
                    "UPDATE leave_requests SET deliveries = deliveries + 1 "
                    "WHERE org_id = $1 AND idempotency_key = $2 "
                    "RETURNING request_id, user_id, start_date, days",
                    principal.org_id,
                    idempotency_key,
                )
                if existing is not None:
                    if existing["user_id"] != principal.user_id:
                        return DENIED
                    balance = await conn.fetchval(
                        "SELECT days_left FROM leave_balances WHERE org_id = $1 AND user_id = $2",
                        principal.org_id,
                        principal.user_id,
                    )
                    return self._booked(existing, balance, repeated=True)
                balance = await conn.fetchval(
                    "UPDATE leave_balances SET days_left = days_left - $3 "
                    "WHERE org_id = $1 AND user_id = $2 AND days_left >= $3 RETURNING days_left",
                    principal.org_id,
                    principal.user_id,
                    days,
                )
                if balance is None:
                    known = await conn.fetchval(
                        "SELECT days_left FROM leave_balances WHERE org_id = $1 AND user_id = $2",
                        principal.org_id,
                        principal.user_id,
                    )
                    if known is None:
                        return DENIED
                    return Refusal(
                        "insufficient_balance",
                        f"{days} days were asked for and {_days(known)} are left; nothing was booked",
                    )
                row = await conn.fetchrow(
                    "INSERT INTO leave_requests "
                    "(org_id, request_id, user_id, start_date, days, note, idempotency_key, run_id) "
                    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) "
                    "RETURNING request_id, user_id, start_date, days",
                    principal.org_id,
                    f"leave_{uuid.uuid4().hex[:12]}",
                    principal.user_id,
                    start_date,
                    days,
                    note,
                    idempotency_key,
                    run_id,
                )
        except CONNECTION_ERRORS as exc:
            raise DependencyUnavailable("the people directory's database is not reachable") from exc
        return self._booked(row, balance, repeated=False)

    @staticmethod
    def _booked(row: asyncpg.Record, balance: Decimal | None, *, repeated: bool) -> dict[str, Any]:
        return {
            "request_id": row["request_id"],
            "start_date": row["start_date"].isoformat(),
            "days": row["days"],
            "days_left": _days(balance) if balance is not None else None,
            "already_booked": repeated,
        }


def database(url: str) -> Database:
    return Database(url=url, schema=SCHEMA, migrations=MIGRATIONS, max_size=4)
