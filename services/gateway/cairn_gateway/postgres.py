"""Run reservations, provider ceilings and provider cooldowns in PostgreSQL,
shared by all replicas.

Each check-and-take runs in one short transaction under an advisory lock on the
run or the provider, so two gateways cannot both read "room for one more" and
both send. Time is PostgreSQL's clock, not the replica's, so replicas with skewed
clocks still count into the same buckets. The decisions themselves
(`check_run_budget`, `check_ceiling`) are the pure functions in domain.py.
"""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg

from cairn_gateway.config import ProviderConfig
from cairn_gateway.domain import (
    ChatRequest,
    CooldownCause,
    ceiling_bucket,
    ceiling_window_floor,
    check_ceiling,
    check_run_budget,
)
from cairn_gateway.errors import CooldownsUnavailable, LedgerUnavailable
from cairn_gateway.ledger import CeilingGrant
from cairn_gateway.resilience import Cooling, SharedCooling
from cairn_libs.db import CONNECTION_ERRORS, Database
from cairn_libs.errors import DependencyUnavailable

# Longer than any call can take; a crashed gateway's reservations stop counting then.
RESERVATION_TTL_SECONDS = 900
# Buckets older than this are never counted again.
CEILING_RETENTION_SECONDS = 3600

# Every way the ledger's database can fail, translated here into LedgerUnavailable
# (UNAVAILABLE to callers, never INTERNAL). CONNECTION_ERRORS covers a server restart
# mid-protocol (asyncpg's InternalClientError, which is neither a PostgresError nor an
# InterfaceError); the door keeps text PostgreSQL cannot store (U+0000) out of here.
_DB_ERRORS: tuple[type[BaseException], ...] = (
    *CONNECTION_ERRORS,
    asyncpg.PostgresError,
    DependencyUnavailable,
)


class PostgresLedger:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def reserve_run(self, *, org_id: str, request: ChatRequest) -> str | None:
        if request.remaining_budget_tokens is None:
            return None
        if not request.run_id:
            # No run to share the budget with: the call alone must fit.
            check_run_budget(request)
            return None
        # Fail fast without touching the database when the call alone cannot fit.
        check_run_budget(request)
        try:
            async with self._db.pool.acquire() as conn, conn.transaction():
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                    f"gateway-run:{org_id}:{request.run_id}",
                )
                in_flight = await conn.fetchval(
                    "SELECT COALESCE(SUM(tokens), 0) FROM run_reservations "
                    "WHERE org_id = $1 AND run_id = $2 AND expires_at > now()",
                    org_id,
                    request.run_id,
                )
                needed = check_run_budget(request, reserved_in_flight=int(in_flight))
                reservation: str = await conn.fetchval(
                    "INSERT INTO run_reservations (org_id, run_id, tokens, expires_at) "
                    "VALUES ($1, $2, $3, now() + make_interval(secs => $4)) "
                    "RETURNING reservation_id::text",
                    org_id,
                    request.run_id,
                    needed,
                    float(RESERVATION_TTL_SECONDS),
                )
                return reservation
        except _DB_ERRORS as exc:
            raise LedgerUnavailable(
                f"cannot reserve run {request.run_id!r}'s budget: the gateway database "
                f"is unreachable ({type(exc).__name__})"
            ) from exc

    async def release_run(self, reservation_id: str) -> None:
        try:
            async with self._db.pool.acquire() as conn:
                await conn.execute(
                    "DELETE FROM run_reservations WHERE reservation_id = $1::uuid "
                    "OR expires_at < now()",
                    reservation_id,
                )
        except _DB_ERRORS:
            # The row expires on its own; the call itself has already completed.
            return

    async def take_ceiling(self, provider: ProviderConfig, tokens: int) -> CeilingGrant | None:
        if not provider.has_ceiling:
            return None
        try:
            async with self._db.pool.acquire() as conn, conn.transaction():
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                    f"gateway-ceiling:{provider.name}",
                )
                # clock_timestamp(), not now(): now() is when the transaction began,
                # before the wait for the lock, and would date the grant too early.
                now: datetime = await conn.fetchval("SELECT clock_timestamp()")
                epoch = now.timestamp()
                row = await conn.fetchrow(
                    "SELECT COALESCE(SUM(tokens), 0) AS tokens, COALESCE(SUM(requests), 0) AS requests "
                    "FROM ceiling_usage WHERE provider = $1 AND window_start >= $2",
                    provider.name,
                    _at(ceiling_window_floor(epoch)),
                )
                check = check_ceiling(
                    provider=provider,
                    tokens=tokens,
                    used_tokens=int(row["tokens"]),
                    used_requests=int(row["requests"]),
                    epoch_seconds=epoch,
                )
                bucket = ceiling_bucket(epoch)
                if check.granted:
                    await conn.execute(
                        "INSERT INTO ceiling_usage (provider, window_start, tokens, requests) "
                        "VALUES ($1, $2, $3, 1) ON CONFLICT (provider, window_start) DO UPDATE "
                        "SET tokens = ceiling_usage.tokens + EXCLUDED.tokens, "
                        "requests = ceiling_usage.requests + 1",
                        provider.name,
                        _at(bucket),
                        tokens,
                    )
                    await conn.execute(
                        "DELETE FROM ceiling_usage WHERE provider = $1 AND window_start < $2",
                        provider.name,
                        _at(epoch - CEILING_RETENTION_SECONDS),
                    )
        except _DB_ERRORS as exc:
            # Fail closed: a ceiling that cannot be checked is not a ceiling.
            return CeilingGrant(
                provider=provider.name,
                bucket_start=0,
                tokens=0,
                granted=False,
                detail=f"ceiling state unreachable ({type(exc).__name__}); not sent",
            )
        return CeilingGrant(
            provider=provider.name,
            bucket_start=bucket,
            tokens=tokens if check.granted else 0,
            granted=check.granted,
            detail=check.detail,
            retry_after_seconds=check.retry_after_seconds,
        )

    async def settle_ceiling(self, grant: CeilingGrant, used_tokens: int) -> None:
        if not grant.granted or used_tokens == grant.tokens:
            return
        try:
            async with self._db.pool.acquire() as conn:
                await conn.execute(
                    "UPDATE ceiling_usage SET tokens = GREATEST(tokens + $3, 0) "
                    "WHERE provider = $1 AND window_start = $2",
                    grant.provider,
                    _at(grant.bucket_start),
                    used_tokens - grant.tokens,
                )
        except _DB_ERRORS:
            # The bucket keeps the estimate; it leaves the window within 70 seconds.
            return


class PostgresCooldowns:
    """Every replica's running cooldowns in one table, ends only ever moved later.
    Time is PostgreSQL's: a cooldown is written as "so many seconds from now" and
    read back as "so many seconds left", so replicas' clocks need not agree."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def share(self, provider: ProviderConfig, cooling: Cooling) -> None:
        cause = (cooling.cause or CooldownCause.FAILURES).value
        try:
            async with self._db.pool.acquire() as conn:
                await conn.execute(
                    """
                    INSERT INTO provider_cooldowns (provider, base_url, cooling_until, cause)
                    VALUES ($1, $2, clock_timestamp() + make_interval(secs => $3), $4)
                    ON CONFLICT (provider, base_url) DO UPDATE SET
                        cause = CASE WHEN EXCLUDED.cooling_until > provider_cooldowns.cooling_until
                                     THEN EXCLUDED.cause ELSE provider_cooldowns.cause END,
                        cooling_until = GREATEST(provider_cooldowns.cooling_until,
                                                 EXCLUDED.cooling_until),
                        updated_at = clock_timestamp()
                    """,
                    provider.name,
                    provider.base_url,
                    float(cooling.seconds_left),
                    cause,
                )
        except _DB_ERRORS as exc:
            raise CooldownsUnavailable(
                f"the shared cooldowns are unreachable ({type(exc).__name__})"
            ) from exc

    async def running(self) -> list[SharedCooling]:
        try:
            async with self._db.pool.acquire() as conn:
                rows = await conn.fetch(
                    "SELECT provider, base_url, cause, "
                    "extract(epoch FROM cooling_until - clock_timestamp())::float8 AS left_s "
                    "FROM provider_cooldowns WHERE cooling_until > clock_timestamp()"
                )
        except _DB_ERRORS as exc:
            raise CooldownsUnavailable(
                f"the shared cooldowns are unreachable ({type(exc).__name__})"
            ) from exc
        return [
            SharedCooling(
                provider=row["provider"],
                base_url=row["base_url"],
                seconds_left=float(row["left_s"]),
                cause=CooldownCause(row["cause"]),
            )
            for row in rows
        ]


def _at(epoch_seconds: float) -> datetime:
    return datetime.fromtimestamp(epoch_seconds, UTC)
