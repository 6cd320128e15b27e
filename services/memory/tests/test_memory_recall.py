"""Recall over real gRPC: SEMANTIC with the local embedder, NEWEST_FIRST without one
(a second process with CAIRN_EMBEDDER=none), each saying so; validity windows,
subjects, profile and bounds."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import timestamp_pb2

from cairn.memory.v1 import memory_pb2

if TYPE_CHECKING:
    from conftest import ClientFactory

SEMANTIC = memory_pb2.RECALL_MODE_SEMANTIC
NEWEST_FIRST = memory_pb2.RECALL_MODE_NEWEST_FIRST


def candidate(subject_id: str) -> memory_pb2.Subject:
    return memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_CANDIDATE, id=subject_id)


def stamp(year: int) -> timestamp_pb2.Timestamp:
    value = timestamp_pb2.Timestamp()
    value.FromDatetime(datetime(year, 1, 1, tzinfo=UTC))
    return value


def test_semantic_recall_finds_the_related_memory_and_says_it_is_semantic(
    client: ClientFactory,
) -> None:
    alice = client()
    subject = candidate("c-10")
    alice.remember("The candidate prefers interviews early in the morning.", subject)
    alice.remember("Our office coffee machine is broken again.", subject)
    alice.remember("The quarterly budget was approved by finance.", subject)

    response = alice.recall("What time of day suits her for meetings?", subject=subject, k=3)

    assert response.mode == SEMANTIC
    assert response.mode_reason == "memories are ranked by similarity of meaning to the query"
    assert response.memories[0].text == "The candidate prefers interviews early in the morning."
    scores = [m.score for m in response.memories]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] > 0.3


def test_without_an_embedder_recall_is_newest_first_and_says_why(
    variant_client: ClientFactory,
) -> None:
    alice = variant_client()
    for text in ("First note.", "Second note.", "Third note."):
        alice.remember(text)

    response = alice.recall("anything at all", k=2)

    assert response.mode == NEWEST_FIRST
    assert response.mode_reason == "no embedder is configured; memories are listed newest first"
    assert [m.text for m in response.memories] == ["Third note.", "Second note."]
    assert all(m.score == 0 for m in response.memories)


def test_an_empty_query_is_newest_first_even_with_an_embedder(client: ClientFactory) -> None:
    alice = client()
    alice.remember("Older note.")
    alice.remember("Newer note.")
    response = alice.recall("")
    assert response.mode == NEWEST_FIRST
    assert response.mode_reason == "no query was given; memories are listed newest first"
    assert [m.text for m in response.memories] == ["Newer note.", "Older note."]


def test_k_defaults_to_five_and_is_bounded(client: ClientFactory) -> None:
    alice = client()
    for n in range(7):
        alice.remember(f"Note number {n} about the rota.")
    assert len(alice.recall("rota").memories) == 5
    assert len(alice.recall("rota", k=7).memories) == 7
    with pytest.raises(grpc.RpcError) as info:
        alice.recall("rota", k=51)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "k 51 is out of range; use 1-50" in (info.value.details() or "")


def test_memories_outside_their_validity_window_are_never_recalled(client: ClientFactory) -> None:
    alice = client()
    alice.remember("The old office was in Leeds.", valid_from=stamp(2020), valid_until=stamp(2021))
    alice.remember("The new office opens in Bristol.", valid_from=stamp(2999))
    alice.remember("The office is in York.", valid_from=stamp(2020), valid_until=stamp(2999))

    for recall in (alice.recall("where is the office"), alice.recall("")):
        assert [m.text for m in recall.memories] == ["The office is in York."]
    held = alice.held(memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_WORKSPACE))
    assert len(held.memories) == 3


def test_a_subject_narrows_recall_and_no_subject_spans_the_org(client: ClientFactory) -> None:
    alice = client()
    alice.remember("Enjoys climbing.", candidate("c-11"))
    alice.remember("Enjoys sailing.", candidate("c-12"))
    only_one = alice.recall("hobbies", subject=candidate("c-11"))
    everyone = alice.recall("hobbies")
    assert [m.text for m in only_one.memories] == ["Enjoys climbing."]
    assert sorted(m.text for m in everyone.memories) == ["Enjoys climbing.", "Enjoys sailing."]


def test_recall_can_include_the_subjects_current_profile(client: ClientFactory) -> None:
    alice = client()
    subject = candidate("c-13")
    alice.update_profile(subject, "coffee_preference", "espresso")
    alice.update_profile(subject, "coffee_preference", "flat white")
    alice.update_profile(candidate("c-14"), "coffee_preference", "tea")

    response = alice.recall("coffee", subject=subject, include_profile=True)

    assert [(f.fact_key, f.value) for f in response.profile] == [
        ("coffee_preference", "flat white")
    ]
    assert alice.recall("coffee", subject=subject).profile == []
    with pytest.raises(grpc.RpcError) as info:
        alice.recall("coffee", include_profile=True)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "include_profile needs a subject" in (info.value.details() or "")


def test_a_recall_subject_of_a_person_kind_needs_an_id(client: ClientFactory) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client().recall("x", subject=candidate(""))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "subject.id is required for a CANDIDATE subject" in (info.value.details() or "")
