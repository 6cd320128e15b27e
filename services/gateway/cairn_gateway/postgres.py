"""Run reservations, provider ceilings and provider cooldowns in PostgreSQL,
shared by all replicas.

Each check-and-take is one call of a function (migration 0003) that holds an
advisory lock on the run or the provider to the end of its statement, so two
gateways cannot both read "room for one more" and both send, and a call pays one
round trip for it, not a transaction of several. Time is PostgreSQL's clock, not the replica's, so replicas with skewed
clocks still count into the same buckets. The decisions themselves
(`check_run_budget`, `check_ceiling`) are the pure functions in domain.py.
"""

from __future__ import annotations

import asyncpg

from cairn_gateway.config import ProviderConfig
from cairn_gateway.domain import (
    CEILING_BUCKET_SECONDS,
    CEILING_SEND_ALLOWANCE_SECONDS,
    CEILING_WINDOW_SECONDS,
    ChatRequest,
    CooldownCause,
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
        needed = check_run_budget(request)
        try:
            async with self._db.pool.acquire() as conn:
                row = await conn.fetchrow(
                    "SELECT reservation_id, in_flight FROM reserve_run_tokens($1, $2, $3, $4, $5, $6)",
                    *_reservation_args(org_id, request, needed),
                )
        except _DB_ERRORS as exc:
            raise _reservation_unavailable(request, exc) from exc
        return _reservation(row, request)

    async def begin_call(
        self, *, org_id: str, request: ChatRequest, provider: ProviderConfig | None, tokens: int
    ) -> tuple[str | None, CeilingGrant | None]:
        if (
            provider is None
            or not provider.has_ceiling
            or request.remaining_budget_tokens is None
            or not request.run_id
        ):
            reservation = await self.reserve_run(org_id=org_id, request=request)
            grant = None if provider is None else await self.take_ceiling(provider, tokens)
            return reservation, grant
        needed = check_run_budget(request)
        try:
            async with self._db.pool.acquire() as conn:
                row = await conn.fetchrow(
                    "SELECT reservation_id, in_flight, epoch_seconds, used_tokens, "
                    "used_requests, bucket_start, granted FROM begin_call("
                    "$1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
                    *_reservation_args(org_id, request, needed),
                    *_ceiling_args(provider, tokens),
                )
        except _DB_ERRORS as exc:
            raise _reservation_unavailable(request, exc) from exc
        return _reservation(row, request), _grant(row, provider, tokens)

    async def release_run(self, reservation_id: str) -> None:
        try:
            async with self._db.pool.acquire() as conn:
                await conn.execute("SELECT release_run_tokens($1::uuid)", reservation_id)
        except _DB_ERRORS:
            # The row expires on its own; the call itself has already completed.
            return

    async def take_ceiling(self, provider: ProviderConfig, tokens: int) -> CeilingGrant | None:
        if not provider.has_ceiling:
            return None
        try:
            async with self._db.pool.acquire() as conn:
                row = await conn.fetchrow(
                    "SELECT epoch_seconds, used_tokens, used_requests, bucket_start, granted "
                    "FROM take_ceiling($1, $2, $3, $4, $5, $6, $7, $8)",
                    *_ceiling_args(provider, tokens),
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
        return _grant(row, provider, tokens)

    async def settle_ceiling(self, grant: CeilingGrant, used_tokens: int) -> None:
        if not grant.granted or used_tokens == grant.tokens:
            return
        try:
            async with self._db.pool.acquire() as conn:
                await conn.execute(
                    "SELECT settle_ceiling($1, $2, $3)",
                    grant.provider,
                    grant.bucket_start,
                    used_tokens - grant.tokens,
                )
        except _DB_ERRORS:
            # The bucket keeps the estimate; it leaves the window within 70 seconds.
            return

    async def finish_call(
        self, reservation_id: str | None, grant: CeilingGrant | None, used_tokens: int
    ) -> None:
        settle = grant is not None and grant.granted and used_tokens != grant.tokens
        if not settle:
            if reservation_id is not None:
                await self.release_run(reservation_id)
            return
        assert grant is not None
        if reservation_id is None:
            await self.settle_ceiling(grant, used_tokens)
            return
        try:
            async with self._db.pool.acquire() as conn:
                await conn.execute(
                    "SELECT release_run_tokens($1::uuid), settle_ceiling($2, $3, $4)",
                    reservation_id,
                    grant.provider,
                    grant.bucket_start,
                    used_tokens - grant.tokens,
                )
        except _DB_ERRORS:
            # Both expire on their own: the reservation at its TTL, the estimate when
            # its bucket leaves the window. The call itself has already completed.
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


def _reservation_args(org_id: str, request: ChatRequest, needed: int) -> tuple[object, ...]:
    return (
        f"gateway-run:{org_id}:{request.run_id}",
        org_id,
        request.run_id,
        needed,
        request.remaining_budget_tokens,
        float(RESERVATION_TTL_SECONDS),
    )


def _reservation_unavailable(request: ChatRequest, exc: BaseException) -> LedgerUnavailable:
    return LedgerUnavailable(
        f"cannot reserve run {request.run_id!r}'s budget: the gateway database "
        f"is unreachable ({type(exc).__name__})"
    )


def _reservation(row: asyncpg.Record, request: ChatRequest) -> str:
    reservation: str | None = row["reservation_id"]
    if reservation is None:
        # Refused under the lock: the pure check words it with what was in flight.
        check_run_budget(request, reserved_in_flight=int(row["in_flight"]))
        raise AssertionError("the ledger refused a reservation check_run_budget allows")
    return reservation


def _ceiling_args(provider: ProviderConfig, tokens: int) -> tuple[object, ...]:
    return (
        f"gateway-ceiling:{provider.name}",
        provider.name,
        tokens,
        provider.tokens_per_minute,
        provider.requests_per_minute,
        CEILING_BUCKET_SECONDS,
        CEILING_WINDOW_SECONDS + CEILING_SEND_ALLOWANCE_SECONDS,
        CEILING_RETENTION_SECONDS,
    )


def _grant(row: asyncpg.Record, provider: ProviderConfig, tokens: int) -> CeilingGrant:
    granted = bool(row["granted"])
    if granted:
        return CeilingGrant(
            provider=provider.name,
            bucket_start=int(row["bucket_start"]),
            tokens=tokens,
            granted=True,
            detail="",
            retry_after_seconds=None,
        )
    # Refused under the lock; the words are the pure check's.
    check = check_ceiling(
        provider=provider,
        tokens=tokens,
        used_tokens=int(row["used_tokens"]),
        used_requests=int(row["used_requests"]),
        epoch_seconds=float(row["epoch_seconds"]),
    )
    return CeilingGrant(
        provider=provider.name,
        bucket_start=int(row["bucket_start"]),
        tokens=0,
        granted=False,
        detail=check.detail,
        retry_after_seconds=check.retry_after_seconds,
    )
