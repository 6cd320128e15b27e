"""The archive over real gRPC: monotonic r<N> ids, verbatim recall with tolerant ids,
full-text ranking (label above content, ties newest first), and who may see what."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import grpc
import pytest

if TYPE_CHECKING:
    from conftest import ClientFactory

DENIED = grpc.StatusCode.PERMISSION_DENIED


def conversation() -> str:
    return f"conv-{uuid.uuid4().hex[:8]}"


def number(block_id: str) -> int:
    assert block_id.startswith("r")
    return int(block_id[1:])


def test_archive_ids_come_from_one_monotonic_sequence(client: ClientFactory) -> None:
    alice = client("alice")
    other_org = client("zoe", org_id=f"org-{uuid.uuid4().hex[:12]}")
    ids = []
    for n in range(4):
        ids.append(alice.archive(f"part {n}", f"content {n}", conversation()))
        ids.append(other_org.archive(f"part {n}", f"content {n}", conversation()))
    numbers = [number(i) for i in ids]
    assert numbers == sorted(numbers)
    assert len(set(numbers)) == len(numbers)


def test_archiving_the_same_block_again_returns_the_block_already_kept(
    client: ClientFactory,
) -> None:
    alice = client("alice")
    conv = conversation()
    first = alice.archive("turn 3", "The same long turn.", conv)
    assert alice.archive("turn 3", "The same long turn.", conv) == first
    # A different content, label or conversation is a different block.
    assert alice.archive("turn 3", "Another long turn.", conv) != first
    assert alice.archive("turn 4", "The same long turn.", conv) != first
    assert alice.archive("turn 3", "The same long turn.", conversation()) != first


def test_a_block_comes_back_verbatim_under_every_tolerant_spelling_of_its_id(
    client: ClientFactory,
) -> None:
    alice = client()
    content = "  Line one.\n\tLine two with trailing spaces   \n\nLast line, unicode: café ✓\n"
    conv = conversation()
    block_id = alice.archive("tool output", content, conv, role="tool")
    digits = block_id[1:]
    for spelling in (block_id, block_id.upper() + " ", digits, f"  {digits}\t"):
        block = alice.recall_block(spelling)
        assert block.block_id == block_id
        assert block.content == content
        assert (block.label, block.role, block.conversation_id) == ("tool output", "tool", conv)
        assert block.readable


@pytest.mark.parametrize("bad_id", ["", "r", "rx7", "r-7", "r0", "block 7", "r7r"])
def test_a_malformed_block_id_is_refused_with_the_accepted_form(
    client: ClientFactory, bad_id: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client().recall_block(bad_id)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        f"block_id {bad_id!r} is not a block id; use the form r<N>, e.g. 'r7'"
    )


def test_a_match_in_the_label_outranks_one_in_the_content(client: ClientFactory) -> None:
    alice = client()
    conv = conversation()
    in_label = alice.archive("kubernetes rollout", "We discussed the plan for next week.", conv)
    in_content = alice.archive("weekly sync", "The kubernetes cluster needs an upgrade.", conv)
    alice.archive("lunch", "Nothing relevant here at all.", conv)
    found = [b.block_id for b in alice.search_blocks("kubernetes")]
    assert found == [in_label, in_content]


def test_equal_matches_come_newest_first(client: ClientFactory) -> None:
    alice = client()
    # Two conversations, so the second copy is a block of its own, not the first returned.
    older = alice.archive("note", "The invoice was sent to the customer.", conversation())
    newer = alice.archive("note", "The invoice was sent to the customer.", conversation())
    assert [b.block_id for b in alice.search_blocks("invoice")] == [newer, older]


def test_search_limit_defaults_to_five_and_is_bounded(client: ClientFactory) -> None:
    alice = client()
    conv = conversation()
    for n in range(7):
        alice.archive(f"deploy {n}", "A deploy happened.", conv)
    assert len(alice.search_blocks("deploy")) == 5
    assert len(alice.search_blocks("deploy", limit=7)) == 7
    with pytest.raises(grpc.RpcError) as info:
        alice.search_blocks("deploy", limit=21)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit 21 is out of range; use 1-20" in (info.value.details() or "")


def test_search_can_narrow_to_one_conversation(client: ClientFactory) -> None:
    alice = client()
    first, second = conversation(), conversation()
    in_first = alice.archive("budget", "Budget talk.", first)
    alice.archive("budget", "Budget talk.", second)
    assert [b.block_id for b in alice.search_blocks("budget", conversation_id=first)] == [in_first]


def test_another_user_can_neither_recall_nor_find_nor_write_into_my_conversation(
    client: ClientFactory,
) -> None:
    alice, bob = client("alice"), client("bob")
    conv = conversation()
    block_id = alice.archive("salary discussion", "Alice's salary expectations.", conv)

    with pytest.raises(grpc.RpcError) as theirs:
        bob.recall_block(block_id)
    with pytest.raises(grpc.RpcError) as missing:
        bob.recall_block("r999999999999")
    assert theirs.value.code() == missing.value.code() == DENIED
    assert theirs.value.details() == missing.value.details() == "not found or not permitted"

    assert bob.search_blocks("salary") == []
    for call in (
        lambda: bob.search_blocks("salary", conversation_id=conv),
        lambda: bob.archive("injected", "Bob writes into Alice's conversation.", conv),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == DENIED
    assert [b.block_id for b in alice.search_blocks("salary")] == [block_id]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"label": "x", "content": "y", "conversation_id": ""}, "conversation_id is required"),
        ({"label": "", "content": "y", "conversation_id": "c"}, "label is required"),
        ({"label": "x", "content": "  ", "conversation_id": "c"}, "content is empty"),
    ],
    ids=["no-conversation", "no-label", "no-content"],
)
def test_archive_refuses_incomplete_blocks(
    client: ClientFactory, fields: dict[str, str], message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client().archive(**fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (info.value.details() or "")
