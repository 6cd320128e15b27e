"""Held (subject access), Forget (erasure) and UpdateProfile over real gRPC, and what
an erasure leaves in the database."""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg
import grpc
import pytest

from cairn.memory.v1 import memory_pb2
from cairn_libs.errors import DENIAL_MESSAGE

if TYPE_CHECKING:
    from conftest import ClientFactory


def candidate(subject_id: str) -> memory_pb2.Subject:
    return memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_CANDIDATE, id=subject_id)


def test_held_lists_everything_about_a_subject_with_provenance(client: ClientFactory) -> None:
    subject = candidate("c-20")
    person = client("alice")
    agent = client("alice", run_id="run-9", agent="screener")
    first = person.remember("Applied for the data role.", subject, tags=["hiring"]).memory
    agent.remember("Applied for the platform role instead.", subject, supersedes=[first.memory_id])
    person.update_profile(subject, "preferred_name", "Sam")
    agent.update_profile(subject, "preferred_name", "Sammy", previous_value="Sam")
    person.remember("Unrelated note about someone else.", candidate("c-21"))

    held = person.held(subject)

    assert [m.text for m in held.memories] == [
        "Applied for the platform role instead.",
        "Applied for the data role.",
    ]
    newest, oldest = held.memories
    assert newest.provenance.author_kind == memory_pb2.AUTHOR_KIND_MODEL
    assert newest.provenance.run_id == "run-9"
    assert oldest.provenance.author_kind == memory_pb2.AUTHOR_KIND_PERSON
    assert oldest.provenance.superseded_by == newest.memory_id
    assert oldest.state == memory_pb2.MEMORY_STATE_SUPERSEDED
    assert list(oldest.tags) == ["hiring"]
    (fact,) = held.profile
    assert (fact.fact_key, fact.value) == ("preferred_name", "Sammy")
    assert fact.provenance.author_kind == memory_pb2.AUTHOR_KIND_MODEL
    assert [v.value for v in fact.history] == ["Sam"]
    assert fact.history[0].provenance.author_id == "alice"
    assert list(held.erasures) == []


def test_forget_erases_a_subject_and_records_the_erasure(client: ClientFactory) -> None:
    subject = candidate("c-22")
    alice = client("alice")
    alice.remember("Was referred by a former colleague.", subject, tags=["referral"])
    alice.remember("Asked for a later start date.", subject)
    alice.update_profile(subject, "notice_period", "three months")
    kept = alice.remember("Was referred by a friend.", candidate("c-23")).memory

    erasure = client("dpo").forget(subject).erasure

    assert erasure.erased_by == "dpo"
    assert erasure.memories_erased == 2
    assert erasure.facts_erased == 1
    held = alice.held(subject)
    assert [m.state for m in held.memories] == [memory_pb2.MEMORY_STATE_ERASED] * 2
    assert all(m.text == "" and list(m.tags) == [] for m in held.memories)
    assert list(held.profile) == []
    (record,) = held.erasures
    assert (record.erased_by, record.memories_erased, record.facts_erased) == ("dpo", 2, 1)
    assert alice.recall("referred by a colleague", subject=subject).memories == []
    assert alice.recall("", subject=subject).memories == []
    assert all(m.memory_id == kept.memory_id for m in alice.recall("referred").memories)
    assert alice.recall("notice", subject=subject, include_profile=True).profile == []


def test_after_forget_the_same_text_can_be_remembered_anew(client: ClientFactory) -> None:
    subject = candidate("c-24")
    alice = client()
    first = alice.remember("Likes chess.", subject).memory
    alice.forget(subject)
    again = alice.remember("Likes chess.", subject)
    assert not again.already_held
    assert again.memory.memory_id != first.memory_id


async def test_an_erased_memory_keeps_no_text_no_digest_and_no_embedding_in_the_database(
    client: ClientFactory, pg_url: str
) -> None:
    subject = candidate("c-25")
    alice = client()
    alice.remember("Mentioned a health condition in confidence.", subject)
    alice.forget(subject)
    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch(
            "SELECT body, body_sealed, text_digest, embedding IS NULL AS no_embedding, tags, state "
            "FROM memory.memories WHERE org_id = $1 AND subject_id = 'c-25'",
            alice.org_id,
        )
    finally:
        await conn.close()
    assert len(rows) == 1
    row = rows[0]
    assert row["body"] is None and row["body_sealed"] is None and row["text_digest"] is None
    assert row["no_embedding"] and row["tags"] == [] and row["state"] == "ERASED"


def test_update_profile_keeps_history_and_checks_the_previous_value(client: ClientFactory) -> None:
    subject = candidate("c-26")
    alice = client()
    alice.update_profile(subject, "coffee_preference", "latte")
    fact = alice.update_profile(subject, "coffee_preference", "mocha", previous_value="latte").fact
    assert fact.value == "mocha"
    assert [v.value for v in fact.history] == ["latte"]

    with pytest.raises(grpc.RpcError) as info:
        alice.update_profile(subject, "coffee_preference", "tea", previous_value="latte")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == (
        "previous_value 'latte' is not the current value of 'coffee_preference'; "
        "read the profile again (Held or Recall with include_profile) and retry"
    )
    with pytest.raises(grpc.RpcError) as info:
        alice.update_profile(subject, "shoe_size", "9", previous_value="8")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'shoe_size' has no current value" in (info.value.details() or "")
    (held_fact,) = alice.held(subject).profile
    assert held_fact.value == "mocha"


def test_setting_a_fact_to_its_current_value_adds_no_history(client: ClientFactory) -> None:
    subject = candidate("c-28")
    alice = client()
    alice.update_profile(subject, "desk", "B12")
    fact = alice.update_profile(subject, "desk", "B12", previous_value="B12").fact
    assert (fact.value, list(fact.history)) == ("B12", [])


@pytest.mark.parametrize(
    ("fact_key", "value", "message"),
    [
        ("Coffee Preference", "latte", "fact_key 'Coffee Preference' is not a fact key"),
        ("coffee", "", "value is empty"),
        ("login", "password: swordfish", "value looks like it contains a password"),
    ],
    ids=["bad-key", "empty-value", "secret-value"],
)
def test_update_profile_refuses_bad_input(
    client: ClientFactory, fact_key: str, value: str, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client().update_profile(candidate("c-27"), fact_key, value)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (info.value.details() or "")
    assert "swordfish" not in (info.value.details() or "")


def test_held_and_forget_need_a_named_subject(client: ClientFactory) -> None:
    for call in (client().held, client().forget):
        with pytest.raises(grpc.RpcError) as info:
            call(candidate(""))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_colleague_without_a_privacy_role_cannot_list_or_erase_a_subject(
    client: ClientFactory,
) -> None:
    subject = memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_CANDIDATE, id="cand-77")
    client("recruiter").remember("The candidate prefers morning interviews.", subject)
    colleague = client("bob", roles=())
    for call in (colleague.held, colleague.forget):
        with pytest.raises(grpc.RpcError) as caught:
            call(subject)
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert caught.value.details() == DENIAL_MESSAGE
    assert len(client("dpo").held(subject).memories) == 1


def test_a_person_may_list_what_is_held_about_themselves(client: ClientFactory) -> None:
    own = memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_USER, id="carol")
    client("dpo").remember("Carol leads the Berlin office move.", own)
    assert [m.text for m in client("carol", roles=()).held(own).memories] == [
        "Carol leads the Berlin office move."
    ]
    with pytest.raises(grpc.RpcError) as caught:
        client("dave", roles=()).held(own)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_held_pages_through_every_memory_newest_first_without_repeats(
    client: ClientFactory,
) -> None:
    subject = candidate("c-paged")
    alice = client("alice")
    written = [
        alice.remember(f"Paged note number {i} about the move.", subject).memory for i in range(7)
    ]
    alice.update_profile(subject, "office", "Berlin")
    alice.forget(candidate("c-paged-other"))

    pages = [alice.held(subject, page_size=3)]
    while pages[-1].next_page_token:
        pages.append(alice.held(subject, page_size=3, page_token=pages[-1].next_page_token))

    assert [len(p.memories) for p in pages] == [3, 3, 1]
    listed = [m.memory_id for p in pages for m in p.memories]
    assert listed == [m.memory_id for m in reversed(written)]
    assert [f.fact_key for f in pages[0].profile] == ["office"]
    assert all(not p.profile and not p.erasures for p in pages[1:])
    # A page that ends exactly at the last memory says there is no next one.
    assert alice.held(subject, page_size=7).next_page_token == ""


def test_a_page_started_before_new_memories_arrive_neither_skips_nor_repeats(
    client: ClientFactory,
) -> None:
    subject = candidate("c-paged-live")
    alice = client("alice")
    older = [alice.remember(f"Older note {i} on the offer.", subject).memory for i in range(4)]
    first = alice.held(subject, page_size=2)
    alice.remember("A newer note that arrived meanwhile.", subject)
    second = alice.held(subject, page_size=2, page_token=first.next_page_token)
    listed = [m.memory_id for m in (*first.memories, *second.memories)]
    assert listed == [m.memory_id for m in reversed(older)]
    assert second.next_page_token == ""


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"page_size": -1},
            "page_size -1 is out of range; use 1-1000 (0 means the default of 100)",
        ),
        ({"page_size": 1001}, "page_size 1001 is out of range"),
        ({"page_token": "not-a-token"}, "page_token 'not-a-token' is not a token Held gave out"),
    ],
)
def test_held_refuses_a_bad_page_request_with_a_reason(
    client: ClientFactory, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client().held(candidate("c-paged-bad"), **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (info.value.details() or "")
