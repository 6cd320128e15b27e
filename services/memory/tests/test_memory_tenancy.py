"""Tenancy on every RPC (I5): another org, even with the same user id, subject ids,
conversation ids and block ids, sees and changes nothing of this org's."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import grpc
import pytest

from cairn.memory.v1 import memory_pb2

if TYPE_CHECKING:
    from conftest import ClientFactory, MemoryClient


def candidate(subject_id: str) -> memory_pb2.Subject:
    return memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_CANDIDATE, id=subject_id)


@pytest.fixture
def two_orgs(client: ClientFactory) -> tuple[MemoryClient, MemoryClient]:
    """The same user name in two orgs."""
    return client("alice"), client("alice", org_id=f"org-{uuid.uuid4().hex[:12]}")


def test_another_org_recalls_and_holds_nothing_of_ours(
    two_orgs: tuple[MemoryClient, MemoryClient],
) -> None:
    ours, theirs = two_orgs
    subject = candidate("c-30")
    ours.remember("Negotiated a signing bonus.", subject)
    ours.update_profile(subject, "preferred_name", "Jo")

    assert theirs.recall("signing bonus").memories == []
    assert theirs.recall("").memories == []
    assert theirs.recall("x", subject=subject, include_profile=True).profile == []
    held = theirs.held(subject)
    assert (list(held.memories), list(held.profile), list(held.erasures)) == ([], [], [])


def test_another_orgs_forget_and_profile_updates_touch_nothing_of_ours(
    two_orgs: tuple[MemoryClient, MemoryClient],
) -> None:
    ours, theirs = two_orgs
    subject = candidate("c-31")
    ours.remember("Prefers written feedback.", subject)
    ours.update_profile(subject, "team", "platform")

    erasure = theirs.forget(subject).erasure
    assert (erasure.memories_erased, erasure.facts_erased) == (0, 0)
    with pytest.raises(grpc.RpcError) as info:
        theirs.update_profile(subject, "team", "sales", previous_value="platform")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    same_text = theirs.remember("Prefers written feedback.", subject)
    assert not same_text.already_held

    held = ours.held(subject)
    assert [m.text for m in held.memories] == ["Prefers written feedback."]
    assert [(f.fact_key, f.value) for f in held.profile] == [("team", "platform")]
    assert list(held.erasures) == []


def test_another_org_can_neither_recall_nor_find_our_blocks(
    two_orgs: tuple[MemoryClient, MemoryClient],
) -> None:
    ours, theirs = two_orgs
    conv = f"conv-{uuid.uuid4().hex[:8]}"
    block_id = ours.archive("offer letter draft", "Offer: 90k with equity.", conv)

    with pytest.raises(grpc.RpcError) as info:
        theirs.recall_block(block_id)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert theirs.search_blocks("offer letter") == []
    # The same conversation id in another org is another conversation.
    their_block = theirs.archive("offer letter draft", "Their own offer.", conv)
    assert [b.block_id for b in theirs.search_blocks("offer", conversation_id=conv)] == [
        their_block
    ]
    assert [b.block_id for b in ours.search_blocks("offer", conversation_id=conv)] == [block_id]
