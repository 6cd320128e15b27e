"""Run reservations and provider ceilings in the real PostgreSQL, under concurrency,
with two ledgers on separate pools standing in for two gateway replicas."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from cairn_gateway.app import SCHEMA, gateway_database
from cairn_gateway.config import ProviderConfig
from cairn_gateway.domain import ChatMessage, ChatRequest
from cairn_gateway.errors import LedgerUnavailable, RunBudgetExceeded
from cairn_gateway.ledger import CeilingGrant
from cairn_gateway.postgres import PostgresLedger
from cairn_libs.db import Database


async def _database(url: str) -> Database:
    db = gateway_database(url)
    assert await db.ready()
    return db


@pytest.fixture(scope="module")
async def replicas(pg_url: str) -> AsyncIterator[tuple[PostgresLedger, PostgresLedger]]:
    first, second = await _database(pg_url), await _database(pg_url)
    yield PostgresLedger(first), PostgresLedger(second)
    await first.close()
    await second.close()


def test_the_gateways_database_sends_nothing_on_release_but_a_rollback() -> None:
    assert gateway_database("postgresql://unused").reset == "transaction"


def call(run_id: str, *, budget: int, max_tokens: int = 100) -> ChatRequest:
    return ChatRequest(
        messages=(ChatMessage("user", "abcd"),),  # 1 prompt token
        run_id=run_id,
        remaining_budget_tokens=budget,
        max_tokens=max_tokens,
    )


async def test_concurrent_calls_of_one_run_reserve_no_more_than_its_budget(
    replicas: tuple[PostgresLedger, PostgresLedger], new_org: str
) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    request = call(run_id, budget=500)  # 101 each: four fit

    async def reserve(i: int) -> str | None:
        try:
            return await replicas[i % 2].reserve_run(org_id=new_org, request=request)
        except RunBudgetExceeded:
            return None

    granted = [r for r in await asyncio.gather(*(reserve(i) for i in range(20))) if r]

    assert len(granted) == 4
    await replicas[0].release_run(granted[0])
    assert await replicas[1].reserve_run(org_id=new_org, request=request) is not None


async def test_another_orgs_run_with_the_same_id_has_its_own_budget(
    replicas: tuple[PostgresLedger, PostgresLedger], new_org: str
) -> None:
    run_id = "run-shared-name"
    await replicas[0].reserve_run(org_id=new_org, request=call(run_id, budget=101))

    other = await replicas[0].reserve_run(org_id=new_org + "-b", request=call(run_id, budget=101))

    assert other is not None
    with pytest.raises(RunBudgetExceeded, match="101 are reserved"):
        await replicas[1].reserve_run(org_id=new_org, request=call(run_id, budget=101))


async def test_a_call_without_a_budget_reserves_nothing(
    replicas: tuple[PostgresLedger, PostgresLedger], new_org: str
) -> None:
    request = ChatRequest(messages=(ChatMessage("user", "x"),), run_id="r")

    assert await replicas[0].reserve_run(org_id=new_org, request=request) is None


def limited(name: str, *, tpm: int | None = None, rpm: int | None = None) -> ProviderConfig:
    return ProviderConfig(
        name=name,
        base_url="https://x/v1",
        api_key_env="",
        models={"fast": "m"},
        tokens_per_minute=tpm,
        requests_per_minute=rpm,
    )


async def test_two_replicas_together_stay_under_one_tokens_per_minute_ceiling(
    replicas: tuple[PostgresLedger, PostgresLedger],
) -> None:
    provider = limited(f"ceiling-{uuid.uuid4().hex[:8]}", tpm=8000)

    grants = await asyncio.gather(*(replicas[i % 2].take_ceiling(provider, 700) for i in range(40)))

    granted = [g for g in grants if g is not None and g.granted]
    assert len(granted) == 11  # 11 * 700 = 7700 <= 8000 < 8400
    refused = [g for g in grants if g is not None and not g.granted]
    assert all(g.retry_after_seconds is not None for g in refused)


async def test_a_call_that_exactly_fills_the_ceiling_is_granted_and_one_token_more_is_not(
    replicas: tuple[PostgresLedger, PostgresLedger],
) -> None:
    provider = limited(f"ceiling-{uuid.uuid4().hex[:8]}", tpm=1000, rpm=3)

    too_big = await replicas[0].take_ceiling(provider, 1001)
    first = await replicas[0].take_ceiling(provider, 400)
    filling = await replicas[1].take_ceiling(provider, 600)
    over = await replicas[0].take_ceiling(provider, 1)

    assert too_big is not None and not too_big.granted and too_big.retry_after_seconds is None
    assert "one call of 1001 tokens exceeds the ceiling of 1000" in too_big.detail
    assert first is not None and first.granted and first.tokens == 400
    assert filling is not None and filling.granted and filling.detail == ""
    assert over is not None and not over.granted and over.retry_after_seconds is not None
    assert over.detail == "1000 of 1000 tokens/minute used; 1 more would pass the ceiling"


async def test_settling_with_the_real_usage_gives_the_difference_back(
    replicas: tuple[PostgresLedger, PostgresLedger],
) -> None:
    provider = limited(f"ceiling-{uuid.uuid4().hex[:8]}", tpm=1000)
    first = await replicas[0].take_ceiling(provider, 900)
    assert first is not None and first.granted
    refused = await replicas[1].take_ceiling(provider, 900)
    assert refused is not None and not refused.granted

    await replicas[0].settle_ceiling(first, 50)

    again = await replicas[1].take_ceiling(provider, 900)
    assert again is not None and again.granted


async def test_finishing_a_call_releases_its_reservation_and_settles_its_grant_together(
    replicas: tuple[PostgresLedger, PostgresLedger], new_org: str
) -> None:
    provider = limited(f"ceiling-{uuid.uuid4().hex[:8]}", tpm=1000)
    request = call(f"run-{uuid.uuid4().hex[:8]}", budget=101)
    reservation = await replicas[0].reserve_run(org_id=new_org, request=request)
    grant = await replicas[0].take_ceiling(provider, 900)
    assert grant is not None and grant.granted
    with pytest.raises(RunBudgetExceeded):
        await replicas[1].reserve_run(org_id=new_org, request=request)

    await replicas[0].finish_call(reservation, grant, 50)

    assert await replicas[1].reserve_run(org_id=new_org, request=request) is not None
    again = await replicas[1].take_ceiling(provider, 900)
    assert again is not None and again.granted


async def test_beginning_a_call_reserves_its_run_and_takes_its_first_ceiling_together(
    replicas: tuple[PostgresLedger, PostgresLedger], new_org: str
) -> None:
    provider = limited(f"ceiling-{uuid.uuid4().hex[:8]}", tpm=1000)
    request = call(f"run-{uuid.uuid4().hex[:8]}", budget=101)

    reservation, grant = await replicas[0].begin_call(
        org_id=new_org, request=request, provider=provider, tokens=900
    )

    assert reservation is not None and grant is not None and grant.granted
    with pytest.raises(RunBudgetExceeded, match="101 are reserved"):
        await replicas[1].reserve_run(org_id=new_org, request=request)
    refused = await replicas[1].take_ceiling(provider, 200)
    assert refused is not None and not refused.granted
    assert refused.detail == "900 of 1000 tokens/minute used; 200 more would pass the ceiling"


async def test_a_call_its_run_cannot_afford_takes_nothing_from_the_ceiling(
    replicas: tuple[PostgresLedger, PostgresLedger], new_org: str
) -> None:
    provider = limited(f"ceiling-{uuid.uuid4().hex[:8]}", tpm=1000, rpm=1)
    request = call(f"run-{uuid.uuid4().hex[:8]}", budget=101)
    await replicas[0].reserve_run(org_id=new_org, request=request)

    with pytest.raises(RunBudgetExceeded):
        await replicas[1].begin_call(org_id=new_org, request=request, provider=provider, tokens=900)

    whole = await replicas[0].take_ceiling(provider, 1000)
    assert whole is not None and whole.granted


async def test_requests_per_minute_holds_across_replicas(
    replicas: tuple[PostgresLedger, PostgresLedger],
) -> None:
    provider = limited(f"ceiling-{uuid.uuid4().hex[:8]}", rpm=5)

    grants = await asyncio.gather(*(replicas[i % 2].take_ceiling(provider, 1) for i in range(12)))

    assert sum(1 for g in grants if g is not None and g.granted) == 5


async def test_a_provider_without_a_ceiling_never_touches_the_database(
    replicas: tuple[PostgresLedger, PostgresLedger],
) -> None:
    assert await replicas[0].take_ceiling(limited("free"), 10**9) is None


async def test_with_the_database_down_a_ceiling_fails_closed_and_a_budget_is_unavailable(
    new_org: str,
) -> None:
    down = PostgresLedger(
        Database(url="postgresql://nobody@127.0.0.1:1/none", schema=SCHEMA, migrations=[])
    )

    grant = await down.take_ceiling(limited("any", tpm=100), 1)

    assert grant is not None and not grant.granted and "unreachable" in grant.detail
    with pytest.raises(LedgerUnavailable, match="cannot reserve run 'r'"):
        await down.reserve_run(org_id=new_org, request=call("r", budget=1000))


class _BrokenMidProtocol:
    """A pool whose connections fail the way asyncpg does when the server restarts
    in the middle of a query ("got result for unknown protocol state"): with an
    InternalClientError, which is neither a PostgresError nor an InterfaceError. Not
    reproducible on demand against a real server, so it stands in for one here."""

    def acquire(self) -> _BrokenMidProtocol:
        return self

    async def __aenter__(self) -> None:
        raise asyncpg.InternalClientError("got result for unknown protocol state 3")

    async def __aexit__(self, *_: object) -> None:
        return None


class _RestartingDatabase(Database):
    @property
    def pool(self) -> Any:
        return _BrokenMidProtocol()


async def test_a_database_restart_mid_protocol_is_unavailable_never_internal(
    new_org: str,
) -> None:
    restarting = PostgresLedger(
        _RestartingDatabase(url="postgresql://unused", schema=SCHEMA, migrations=[])
    )

    with pytest.raises(LedgerUnavailable, match=r"unreachable \(InternalClientError\)"):
        await restarting.reserve_run(org_id=new_org, request=call("r", budget=1000))
    grant = await restarting.take_ceiling(limited("any", tpm=100), 1)
    assert grant is not None and not grant.granted
    assert "ceiling state unreachable (InternalClientError)" in grant.detail
    # Giving back is best effort: the rows expire on their own.
    await restarting.release_run("00000000-0000-0000-0000-000000000000")
    settled = CeilingGrant(provider="any", bucket_start=0, tokens=10, granted=True)
    await restarting.settle_ceiling(settled, 3)
