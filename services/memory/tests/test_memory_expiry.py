"""Expiry and validity through the keeper and the real PostgreSQL store, with a fake
clock moving the whole service through time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from cairn_libs.clock import FakeClock
from cairn_libs.db import Database
from cairn_libs.errors import Denied
from cairn_libs.identity import CallIdentity, Principal
from cairn_memory.domain import (
    BlockDraft,
    BlockSearch,
    HeldQuery,
    MemoryState,
    RecallQuery,
    RememberDraft,
    Subject,
    SubjectKind,
)
from cairn_memory.errors import SupersedesNotActive
from cairn_memory.keeper import MemoryKeeper
from cairn_memory.postgres import PostgresStore
from cairn_memory.vault import PlainVault

START = datetime(2031, 3, 1, 9, tzinfo=UTC)
TTL = timedelta(days=90)
SUBJECT = Subject(kind=SubjectKind.CANDIDATE, id="c-1")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
def keeper(isolated_database: Database, clock: FakeClock) -> MemoryKeeper:
    store = PostgresStore(isolated_database, vault=PlainVault())
    return MemoryKeeper(store=store, embedder=None, clock=clock, ttl=TTL)


@pytest.fixture
def alice(new_org: str) -> CallIdentity:
    return CallIdentity(
        principal=Principal(org_id=new_org, user_id="alice", roles=("privacy_officer",))
    )


def draft(text: str, **fields: object) -> RememberDraft:
    return RememberDraft(
        text=text,
        subject_kind=SubjectKind.CANDIDATE,
        subject_id="c-1",
        **fields,  # type: ignore[arg-type]
    )


def everything(subject: Subject | None = SUBJECT) -> RecallQuery:
    return RecallQuery(query="", subject=subject, k=50, include_profile=subject is not None)


async def recalled_texts(keeper: MemoryKeeper, alice: CallIdentity) -> list[str]:
    return [m.text for m in (await keeper.recall(everything(), alice.principal)).memories]


async def test_a_memory_is_recalled_until_it_expires_then_reads_expired_then_is_purged(
    keeper: MemoryKeeper, clock: FakeClock, alice: CallIdentity
) -> None:
    memory, _ = await keeper.remember(draft("Prefers video calls."), alice)
    assert memory.expires_at == START + TTL

    clock.advance(TTL - timedelta(seconds=1))
    assert await recalled_texts(keeper, alice) == ["Prefers video calls."]

    clock.advance(timedelta(seconds=1))
    assert await recalled_texts(keeper, alice) == []
    (held,) = (await keeper.held(HeldQuery(SUBJECT, page_size=100), alice.principal)).memories
    assert held.state is MemoryState.EXPIRED

    counts = await keeper.purge_expired()
    assert counts.memories >= 1
    assert (await keeper.held(HeldQuery(SUBJECT, page_size=100), alice.principal)).memories == ()


async def test_the_same_text_after_expiry_is_a_new_memory(
    keeper: MemoryKeeper, clock: FakeClock, alice: CallIdentity
) -> None:
    first, _ = await keeper.remember(draft("Lives near the office."), alice)
    clock.advance(TTL + timedelta(days=1))
    again, already_held = await keeper.remember(draft("Lives near the office."), alice)
    assert not already_held
    assert again.memory_id != first.memory_id
    states = {
        m.memory_id: m.state
        for m in (await keeper.held(HeldQuery(SUBJECT, page_size=100), alice.principal)).memories
    }
    assert states == {first.memory_id: MemoryState.EXPIRED, again.memory_id: MemoryState.ACTIVE}


async def test_an_expired_memory_cannot_be_superseded(
    keeper: MemoryKeeper, clock: FakeClock, alice: CallIdentity
) -> None:
    old, _ = await keeper.remember(draft("Works remotely."), alice)
    clock.advance(TTL)
    with pytest.raises(SupersedesNotActive):
        await keeper.remember(draft("Works from the office.", supersedes=[old.memory_id]), alice)


async def test_validity_windows_follow_the_clock(
    keeper: MemoryKeeper, clock: FakeClock, alice: CallIdentity
) -> None:
    await keeper.remember(
        draft(
            "Is on parental leave.",
            valid_from=START + timedelta(days=10),
            valid_until=START + timedelta(days=20),
        ),
        alice,
    )
    assert await recalled_texts(keeper, alice) == []
    clock.advance(timedelta(days=10))
    assert await recalled_texts(keeper, alice) == ["Is on parental leave."]
    clock.advance(timedelta(days=10))
    assert await recalled_texts(keeper, alice) == []


async def test_profile_facts_expire_and_are_purged_too(
    keeper: MemoryKeeper, clock: FakeClock, alice: CallIdentity
) -> None:
    await keeper.update_profile(
        subject=SUBJECT, fact_key="desk", value="B12", previous_value=None, identity=alice
    )
    recalled = await keeper.recall(everything(), alice.principal)
    assert [f.current.value for f in recalled.profile if f.current] == ["B12"]

    clock.advance(TTL)
    assert (await keeper.recall(everything(), alice.principal)).profile == ()
    (fact,) = (await keeper.held(HeldQuery(SUBJECT, page_size=100), alice.principal)).profile
    assert fact.current is None
    assert [v.value for v in fact.history] == ["B12"]

    fact_after = await keeper.update_profile(
        subject=SUBJECT, fact_key="desk", value="C3", previous_value="", identity=alice
    )
    assert fact_after.current is not None and fact_after.current.value == "C3"

    await keeper.purge_expired()
    (fact,) = (await keeper.held(HeldQuery(SUBJECT, page_size=100), alice.principal)).profile
    assert fact.current is not None and fact.current.value == "C3"
    assert fact.history == ()


BLOCK_TTL = timedelta(days=7)


@pytest.fixture
def archivist(isolated_database: Database, clock: FakeClock) -> MemoryKeeper:
    store = PostgresStore(isolated_database, vault=PlainVault())
    return MemoryKeeper(store=store, embedder=None, clock=clock, ttl=TTL, block_ttl=BLOCK_TTL)


def block(label: str, content: str) -> BlockDraft:
    return BlockDraft(label=label, role="user", content=content, conversation_id="conv-expiry")


async def test_an_archived_block_expires_on_its_own_setting_then_is_purged_and_its_id_never_reused(
    archivist: MemoryKeeper, clock: FakeClock, alice: CallIdentity
) -> None:
    block_id = await archivist.archive(
        block("hotel booking", "We booked the Lisbon hotel."), alice.principal
    )
    await archivist.remember(draft("Prefers aisle seats."), alice)
    search = BlockSearch(query="hotel", limit=5, conversation_id=None)

    clock.advance(BLOCK_TTL - timedelta(seconds=1))
    assert (
        await archivist.recall_block(block_id, alice.principal)
    ).content == "We booked the Lisbon hotel."
    assert [b.block_id for b in await archivist.search_blocks(search, alice.principal)] == [
        block_id
    ]

    clock.advance(timedelta(seconds=1))
    with pytest.raises(Denied):
        await archivist.recall_block(block_id, alice.principal)
    assert await archivist.search_blocks(search, alice.principal) == []
    # The memory follows its own, longer time to live.
    assert await recalled_texts(archivist, alice) == ["Prefers aisle seats."]

    counts = await archivist.purge_expired()
    assert counts.blocks >= 1
    later = await archivist.archive(block("hotel again", "Another hotel."), alice.principal)
    assert int(later[1:]) > int(block_id[1:])
    with pytest.raises(Denied):
        await archivist.recall_block(block_id, alice.principal)


async def test_blocks_follow_the_memory_time_to_live_unless_set_apart(
    keeper: MemoryKeeper, clock: FakeClock, alice: CallIdentity
) -> None:
    block_id = await keeper.archive(
        block("visa", "The visa appointment is confirmed."), alice.principal
    )
    clock.advance(BLOCK_TTL)
    assert (await keeper.recall_block(block_id, alice.principal)).readable
    clock.advance(TTL - BLOCK_TTL)
    with pytest.raises(Denied):
        await keeper.recall_block(block_id, alice.principal)
