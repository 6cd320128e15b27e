"""The service's wiring in process: readiness, the periodic purge started by start()
and cancelled by stop(), and embeddings filled in for memories kept without an
embedder."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from cairn_libs.clock import FakeClock
from cairn_libs.db import Database
from cairn_libs.embedding import Embedder
from cairn_libs.identity import CallIdentity, Principal
from cairn_memory.app import MemoryApp
from cairn_memory.domain import HeldQuery, RecallMode, RecallQuery, RememberDraft, SubjectKind
from cairn_memory.keeper import MemoryKeeper
from cairn_memory.postgres import PostgresStore, migrations
from cairn_memory.vault import PlainVault

START = datetime(2033, 1, 1, tzinfo=UTC)


def app_on(database: Database, clock: FakeClock, *, interval: float = 3600.0) -> MemoryApp:
    return MemoryApp(
        database=database,
        embedder=None,
        vault=PlainVault(),
        clock=clock,
        ttl=timedelta(days=1),
        purge_interval_seconds=interval,
    )


async def test_ready_is_true_only_when_the_database_answers_and_is_migrated(
    pg_url: str, isolated_schema: str
) -> None:
    reachable = app_on(
        Database(url=pg_url, schema=isolated_schema, migrations=migrations()), FakeClock(START)
    )
    unreachable = app_on(
        Database(url="postgresql://nobody@127.0.0.1:1/none", schema="memory", migrations=[]),
        FakeClock(START),
    )
    try:
        assert await reachable.ready()
        assert not await unreachable.ready()
    finally:
        await reachable.stop()
        await unreachable.stop()


async def test_the_purge_runs_inside_the_service_from_start_until_stop(
    pg_url: str, isolated_schema: str, new_org: str
) -> None:
    clock = FakeClock(START)
    app = app_on(
        Database(url=pg_url, schema=isolated_schema, migrations=migrations()), clock, interval=0.05
    )
    assert await app.ready()
    alice = CallIdentity(
        principal=Principal(org_id=new_org, user_id="alice", roles=("privacy_officer",))
    )
    memory, _ = await app.keeper.remember(
        RememberDraft(text="Short-lived note.", subject_kind=SubjectKind.WORKSPACE, subject_id=""),
        alice,
    )
    clock.advance(timedelta(days=2))
    await app.start()
    try:
        assert app.maintaining
        await asyncio.wait_for(app.maintained.wait(), timeout=10)
        assert (
            await app.keeper.held(HeldQuery(memory.subject, page_size=10), alice.principal)
        ).memories == ()
    finally:
        await app.stop()
    assert not app.maintaining


async def test_memories_kept_without_an_embedder_become_semantically_recallable(
    isolated_database: Database, local_embedder: Embedder, new_org: str
) -> None:
    clock = FakeClock(START)
    store = PostgresStore(isolated_database, vault=PlainVault())
    without = MemoryKeeper(store=store, embedder=None, clock=clock)
    with_embedder = MemoryKeeper(store=store, embedder=local_embedder, clock=clock)
    alice = CallIdentity(
        principal=Principal(org_id=new_org, user_id="alice", roles=("privacy_officer",))
    )
    await without.remember(
        RememberDraft(
            text="The team loves hiking in the mountains.",
            subject_kind=SubjectKind.WORKSPACE,
            subject_id="",
        ),
        alice,
    )
    query = RecallQuery(query="outdoor activities", subject=None, k=5, include_profile=False)

    before = await with_embedder.recall(query, alice.principal)
    assert before.mode is RecallMode.SEMANTIC
    assert before.memories == ()

    assert await with_embedder.backfill_embeddings() >= 1
    after = await with_embedder.recall(query, alice.principal)
    assert [m.text for m in after.memories] == ["The team loves hiking in the mountains."]
