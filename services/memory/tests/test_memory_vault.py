"""Encryption at rest: a round trip with the key, what rests in the database, and the
locked case (no key or the wrong key) reported as unreadable, never guessed."""

from __future__ import annotations

import base64
import os
from datetime import UTC, datetime

import pytest

from cairn_libs.clock import FakeClock
from cairn_libs.db import Database
from cairn_libs.errors import ConfigurationError
from cairn_libs.identity import CallIdentity, Principal
from cairn_memory.convert import fact_to_proto, memory_to_proto
from cairn_memory.domain import BlockDraft, RecallQuery, RememberDraft, Subject, SubjectKind
from cairn_memory.keeper import MemoryKeeper
from cairn_memory.postgres import PostgresStore
from cairn_memory.vault import AesGcmVault, PlainVault, StoredText, TextVault, vault_from_key

KEY = os.urandom(32)
SUBJECT = Subject(kind=SubjectKind.USER, id="u-1")


def keeper_with(database: Database, vault: TextVault) -> MemoryKeeper:
    return MemoryKeeper(
        store=PostgresStore(database, vault=vault),
        embedder=None,
        clock=FakeClock(datetime(2032, 1, 1, tzinfo=UTC)),
    )


def draft(text: str) -> RememberDraft:
    return RememberDraft(text=text, subject_kind=SubjectKind.USER, subject_id="u-1")


@pytest.fixture
def alice(new_org: str) -> CallIdentity:
    return CallIdentity(
        principal=Principal(org_id=new_org, user_id="alice", roles=("privacy_officer",))
    )


def test_sealed_text_opens_with_the_key_for_its_own_org_only() -> None:
    vault = AesGcmVault(KEY)
    sealed = vault.seal("Prefers tea.", org_id="org-a")
    assert sealed.plain is None and sealed.sealed is not None
    assert b"tea" not in sealed.sealed
    assert vault.open(sealed, org_id="org-a") == "Prefers tea."
    assert vault.open(sealed, org_id="org-b") is None
    assert AesGcmVault(os.urandom(32)).open(sealed, org_id="org-a") is None
    assert PlainVault().open(sealed, org_id="org-a") is None
    assert vault.open(StoredText(plain="written before the key", sealed=None), org_id="org-a") == (
        "written before the key"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not base64!", "is not valid base64"),
        (base64.b64encode(b"short").decode(), "decodes to 5 bytes"),
    ],
)
def test_a_bad_key_is_refused_at_start_up(value: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        vault_from_key(value)
    assert isinstance(vault_from_key(None), PlainVault)
    assert isinstance(vault_from_key(base64.b64encode(KEY).decode()), AesGcmVault)


async def test_memories_blocks_and_facts_round_trip_sealed(
    isolated_database: Database, alice: CallIdentity
) -> None:
    keeper = keeper_with(isolated_database, AesGcmVault(KEY))
    memory, _ = await keeper.remember(draft("Allergic to peanuts."), alice)
    _, already_held = await keeper.remember(draft("allergic to  peanuts."), alice)
    fact = await keeper.update_profile(
        subject=SUBJECT, fact_key="team", value="payments", previous_value=None, identity=alice
    )
    block_id = await keeper.archive(
        BlockDraft(
            label="notes", role="user", content="Verbatim secretive notes.", conversation_id="c"
        ),
        alice.principal,
    )
    fact = await keeper.update_profile(
        subject=SUBJECT, fact_key="team", value="growth", previous_value="payments", identity=alice
    )

    assert memory.text == "Allergic to peanuts." and already_held
    assert fact.current is not None and fact.current.value == "growth"
    assert [v.value for v in fact.history] == ["payments"]
    block = await keeper.recall_block(block_id, alice.principal)
    assert (block.content, block.readable) == ("Verbatim secretive notes.", True)

    async with isolated_database.pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT body, body_sealed FROM memories WHERE org_id = $1", alice.principal.org_id
        )
        block_row = await conn.fetchrow(
            "SELECT content, content_sealed FROM blocks WHERE org_id = $1", alice.principal.org_id
        )
        values = await conn.fetch(
            "SELECT value FROM profile_fact_versions WHERE org_id = $1", alice.principal.org_id
        )
    assert row["body"] is None and b"peanuts" not in row["body_sealed"]
    assert block_row["content"] is None and b"secretive" not in block_row["content_sealed"]
    assert [v["value"] for v in values] == [None, None]


async def test_without_the_key_sealed_text_is_unreadable_and_said_so(
    isolated_database: Database, alice: CallIdentity
) -> None:
    sealing = keeper_with(isolated_database, AesGcmVault(KEY))
    await sealing.remember(draft("Takes medication at noon."), alice)
    block_id = await sealing.archive(
        BlockDraft(label="notes", role="user", content="Sealed block.", conversation_id="c"),
        alice.principal,
    )
    await sealing.update_profile(
        subject=SUBJECT, fact_key="desk", value="B12", previous_value=None, identity=alice
    )

    for locked in (
        keeper_with(isolated_database, PlainVault()),
        keeper_with(isolated_database, AesGcmVault(os.urandom(32))),
    ):
        recalled = await locked.recall(
            RecallQuery(query="", subject=SUBJECT, k=5, include_profile=True), alice.principal
        )
        (memory,) = recalled.memories
        assert (memory.text, memory.readable) == ("", False)
        assert "1 of these memories are encrypted and this deployment holds no key" in (
            recalled.mode_reason
        )
        (fact,) = recalled.profile
        assert fact.current is not None and not fact.current.readable
        # The caller is told on the wire too, not just handed an empty string.
        assert memory_to_proto(memory).readable is False
        assert fact_to_proto(fact).readable is False
        block = await locked.recall_block(block_id, alice.principal)
        assert (block.content, block.readable) == ("", False)
