"""Deployment settings read by the process: the times to live and encryption at rest
(CAIRN_MEMORY_TTL_DAYS, CAIRN_MEMORY_BLOCK_TTL_DAYS, CAIRN_MEMORY_ENCRYPTION_KEY), seen over real gRPC and in
the database, including a deployment without the key reading sealed text."""

from __future__ import annotations

from datetime import UTC, timedelta
from typing import TYPE_CHECKING

import asyncpg

from cairn.memory.v1 import memory_pb2

if TYPE_CHECKING:
    from conftest import ClientFactory

WORKSPACE = memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_WORKSPACE)


def test_the_time_to_live_is_a_deployment_setting(variant_client: ClientFactory) -> None:
    memory = variant_client().remember("The release train leaves on Thursdays.").memory
    created = memory.provenance.created_at.ToDatetime(tzinfo=UTC)
    expires = memory.provenance.expires_at.ToDatetime(tzinfo=UTC)
    assert expires - created == timedelta(days=7)


async def test_the_blocks_time_to_live_is_a_deployment_setting_of_its_own(
    variant_client: ClientFactory, pg_url: str
) -> None:
    alice = variant_client()
    alice.archive("standup", "Standup notes, verbatim.", "conv-ttl")
    conn = await asyncpg.connect(pg_url)
    try:
        lifetime = await conn.fetchval(
            "SELECT expires_at - created_at FROM memory.blocks WHERE org_id = $1", alice.org_id
        )
    finally:
        await conn.close()
    assert lifetime == timedelta(days=3)


async def test_with_a_key_text_rests_sealed_and_reads_back_whole(
    variant_client: ClientFactory, pg_url: str
) -> None:
    alice = variant_client()
    alice.remember("The vendor contract renews in October.")
    block_id = alice.archive("contract", "Full contract discussion, verbatim.", "conv-sealed")

    assert [m.text for m in alice.recall("").memories] == ["The vendor contract renews in October."]
    assert alice.recall_block(block_id).content == "Full contract discussion, verbatim."
    conn = await asyncpg.connect(pg_url)
    try:
        memory_row = await conn.fetchrow(
            "SELECT body, body_sealed FROM memory.memories WHERE org_id = $1", alice.org_id
        )
        block_row = await conn.fetchrow(
            "SELECT content, content_sealed FROM memory.blocks WHERE org_id = $1", alice.org_id
        )
    finally:
        await conn.close()
    assert memory_row["body"] is None and b"contract" not in memory_row["body_sealed"]
    assert block_row["content"] is None and b"verbatim" not in block_row["content_sealed"]


def test_a_deployment_without_the_key_says_the_text_is_unreadable(
    variant_client: ClientFactory, client: ClientFactory
) -> None:
    variant_client().remember("The board meets in Geneva.")
    block_id = variant_client().archive("board", "Board minutes.", "conv-locked")

    recalled = client().recall("")
    (memory,) = recalled.memories
    assert memory.text == ""
    assert "1 of these memories are encrypted and this deployment holds no key" in (
        recalled.mode_reason
    )
    block = client().recall_block(block_id)
    assert (block.content, block.readable) == ("", False)
