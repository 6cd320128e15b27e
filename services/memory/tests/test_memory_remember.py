"""Remember over real gRPC: every refusal with its code and message, provenance from
the call's tokens, duplicates, and supersede chains."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import timestamp_pb2

from cairn.memory.v1 import memory_pb2

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import ClientFactory

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def workspace() -> memory_pb2.Subject:
    return memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_WORKSPACE)


def candidate(subject_id: str) -> memory_pb2.Subject:
    return memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_CANDIDATE, id=subject_id)


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def stamp(moment: datetime) -> timestamp_pb2.Timestamp:
    value = timestamp_pb2.Timestamp()
    value.FromDatetime(moment)
    return value


@pytest.mark.parametrize(
    ("text", "fields", "code", "message"),
    [
        (
            "She joined in May. She leads the platform team.",
            {},
            INVALID,
            "text holds 2 sentences; a memory is one sentence",
        ),
        ("x" * 301, {}, INVALID, "text is 301 characters; a memory is one sentence of at most 300"),
        ("   ", {}, INVALID, "text is empty"),
        ("First line\nsecond line", {}, INVALID, "text spans several lines"),
        ("Ok.", {"importance": 6}, INVALID, "importance 6 is out of range; use 1-5"),
        ("Ok.", {"source_ref": "s" * 1025}, INVALID, "source_ref is 1025 characters; at most 1024"),
        # The shared door or memory's own conversion may refuse it first; both name the field.
        ("Ok.", {"claim_type": 9}, INVALID, "claim_type"),
        (
            "Ok.",
            {"supersedes": [str(uuid.uuid4()) for _ in range(21)]},
            INVALID,
            "supersedes names 21 memories; at most 20 per call",
        ),
        (
            "Ok.",
            {"supersedes": ["not-an-id"]},
            INVALID,
            "supersedes[0] = 'not-an-id' is not a memory id",
        ),
        (
            "Ok.",
            {"supersedes": [str(uuid.uuid4())]},
            PRECONDITION,
            "is not an active memory of this subject",
        ),
    ],
    ids=[
        "two-sentences",
        "too-long",
        "empty",
        "two-lines",
        "importance",
        "source-ref",
        "claim-type",
        "too-many-supersedes",
        "malformed-supersedes",
        "unknown-supersedes",
    ],
)
def test_remember_refuses_bad_input_with_a_reason(
    client: ClientFactory, text: str, fields: dict[str, object], code: grpc.StatusCode, message: str
) -> None:
    error = refusal(lambda: client().remember(text, **fields))
    assert error.code() == code
    assert message in (error.details() or "")


def test_a_personal_memory_without_a_subject_id_is_refused_at_the_door(
    client: ClientFactory,
) -> None:
    error = refusal(lambda: client().remember("Prefers mornings.", candidate("")))
    assert error.code() == INVALID
    assert error.details() == (
        "subject.id is required for a CANDIDATE subject: a personal memory must name whom it is about"
    )


def test_a_memory_without_a_subject_kind_is_refused(client: ClientFactory) -> None:
    error = refusal(lambda: client().remember("Prefers mornings.", memory_pb2.Subject()))
    assert error.code() == INVALID
    assert "subject.kind is required" in (error.details() or "")


def test_valid_until_must_come_after_valid_from(client: ClientFactory) -> None:
    start = datetime(2030, 1, 1, tzinfo=UTC)
    error = refusal(
        lambda: client().remember(
            "The office is closed.",
            valid_from=stamp(start),
            valid_until=stamp(start - timedelta(days=1)),
        )
    )
    assert error.code() == INVALID
    assert "is not after valid_from" in (error.details() or "")


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("The staging key is sk-proj-Abcdefghijklmnopqrstuvwx1234.", "an API key"),
        ("Deploys use AKIAIOSFODNN7EXAMPLE for the bucket.", "an AWS access key"),
        ("The bot token is ghp_abcdefghijklmnopqrstuvwxyz0123456789.", "a GitHub token"),
        (
            "Her session is eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U today.",
            "a JSON Web Token",
        ),
        ("The wiki login is password: hunter2 for everyone.", "a password"),
        ("Her login code is 482913 until noon.", "a one-time code"),
        ("Use 48291377 as the otp.", "a one-time code"),
    ],
    ids=["openai", "aws", "github", "jwt", "password", "code", "otp-after"],
)
def test_text_that_looks_like_a_secret_is_refused_without_echoing_it(
    client: ClientFactory, text: str, kind: str
) -> None:
    error = refusal(lambda: client().remember(text))
    details = error.details() or ""
    assert error.code() == INVALID
    assert f"text looks like it contains {kind}; secrets are never kept in memory" in details
    secret_words = [
        w for w in text.split() if any(ch.isdigit() for ch in w) or w.startswith("hunter")
    ]
    assert secret_words
    for word in secret_words:
        assert word.rstrip(".") not in details


def test_a_secret_in_a_tag_is_refused_too(client: ClientFactory) -> None:
    error = refusal(
        lambda: client().remember("Owns the deploy bot.", tags=["AKIAIOSFODNN7EXAMPLE"])
    )
    assert error.code() == INVALID
    assert "tags[0] looks like it contains an AWS access key" in (error.details() or "")


def test_a_person_calling_directly_is_recorded_as_the_person(client: ClientFactory) -> None:
    memory = client("alice").remember("The team meets on Tuesdays.").memory
    provenance = memory.provenance
    assert provenance.author_kind == memory_pb2.AUTHOR_KIND_PERSON
    assert provenance.author_id == "alice"
    assert provenance.run_id == ""
    assert provenance.on_behalf_of == ""


def test_an_agent_acting_in_a_run_is_recorded_as_the_model_with_its_run(
    client: ClientFactory,
) -> None:
    acting = client("alice", run_id="run-77", agent="recruiter")
    memory = acting.remember("The candidate prefers remote interviews.", candidate("c-1")).memory
    provenance = memory.provenance
    assert provenance.author_kind == memory_pb2.AUTHOR_KIND_MODEL
    assert provenance.author_id == "recruiter"
    assert provenance.run_id == "run-77"
    assert provenance.on_behalf_of == "alice"


def test_defaults_and_expiry_are_set_by_the_server(client: ClientFactory) -> None:
    before = datetime.now(UTC)
    memory = client().remember("The budget review is quarterly.").memory
    created = memory.provenance.created_at.ToDatetime(tzinfo=UTC)
    expires = memory.provenance.expires_at.ToDatetime(tzinfo=UTC)
    assert memory.importance == 2
    assert memory.claim_type == memory_pb2.CLAIM_TYPE_UNKNOWN
    assert memory.state == memory_pb2.MEMORY_STATE_ACTIVE
    assert created >= before - timedelta(seconds=5)
    assert expires - created == timedelta(days=90)


def test_the_source_ref_is_stored_as_declared(client: ClientFactory) -> None:
    ref = "https://wiki.example/page?id=42 (as the caller says)"
    memory = client().remember("The wiki describes the rota.", source_ref=ref).memory
    assert memory.provenance.declared_source_ref == ref


def test_the_same_text_about_the_same_subject_returns_the_memory_already_held(
    client: ClientFactory,
) -> None:
    alice = client("alice")
    first = alice.remember("Prefers tea over coffee.", candidate("c-2"))
    second = alice.remember("  prefers TEA over   coffee. ", candidate("c-2"))
    other_subject = alice.remember("Prefers tea over coffee.", candidate("c-3"))
    assert not first.already_held
    assert second.already_held
    assert second.memory.memory_id == first.memory.memory_id
    assert second.memory.text == "Prefers tea over coffee."
    assert not other_subject.already_held
    held = alice.held(candidate("c-2"))
    assert [m.memory_id for m in held.memories] == [first.memory.memory_id]


def test_supersede_chains_keep_every_link_and_recall_only_the_latest(client: ClientFactory) -> None:
    alice = client("alice")
    subject = candidate("c-4")
    first = alice.remember("Interview is on Monday.", subject).memory
    second = alice.remember(
        "Interview moved to Tuesday.", subject, supersedes=[first.memory_id]
    ).memory
    third = alice.remember(
        "Interview moved to Wednesday.", subject, supersedes=[second.memory_id]
    ).memory

    held = {m.memory_id: m for m in alice.held(subject).memories}
    assert held[first.memory_id].state == memory_pb2.MEMORY_STATE_SUPERSEDED
    assert held[first.memory_id].provenance.superseded_by == second.memory_id
    assert held[second.memory_id].state == memory_pb2.MEMORY_STATE_SUPERSEDED
    assert held[second.memory_id].provenance.superseded_by == third.memory_id
    assert held[third.memory_id].state == memory_pb2.MEMORY_STATE_ACTIVE
    assert held[first.memory_id].text == "Interview is on Monday."  # nothing is deleted by an add

    recalled = alice.recall("when is the interview", subject=subject, k=10).memories
    assert [m.memory_id for m in recalled] == [third.memory_id]


def test_superseding_a_memory_that_is_no_longer_active_refuses_the_whole_call(
    client: ClientFactory,
) -> None:
    alice = client("alice")
    subject = candidate("c-5")
    old = alice.remember("Lives in Lyon.", subject).memory
    alive = alice.remember("Speaks French.", subject).memory
    alice.remember("Lives in Paris.", subject, supersedes=[old.memory_id])

    error = refusal(
        lambda: alice.remember(
            "Lives in Nice.", subject, supersedes=[alive.memory_id, old.memory_id]
        )
    )
    assert error.code() == PRECONDITION
    assert f"supersedes[1] = {old.memory_id!r} is not an active memory" in (error.details() or "")
    held = {m.text: m for m in alice.held(subject).memories}
    assert "Lives in Nice." not in held
    assert held["Speaks French."].state == memory_pb2.MEMORY_STATE_ACTIVE


def test_superseding_a_memory_of_another_subject_is_refused(client: ClientFactory) -> None:
    alice = client("alice")
    theirs = alice.remember("Likes cycling.", candidate("c-6")).memory
    error = refusal(
        lambda: alice.remember("Likes running.", candidate("c-7"), supersedes=[theirs.memory_id])
    )
    assert error.code() == PRECONDITION
    assert alice.held(candidate("c-6")).memories[0].state == memory_pb2.MEMORY_STATE_ACTIVE


def test_superseding_another_orgs_memory_reads_like_a_missing_one(client: ClientFactory) -> None:
    other_org = client("mallory", org_id=f"org-{uuid.uuid4().hex[:12]}")
    theirs = other_org.remember("Holds the launch plan.").memory
    missing = str(uuid.uuid4())
    error_theirs = refusal(
        lambda: client("alice").remember("New plan.", supersedes=[theirs.memory_id])
    )
    error_missing = refusal(lambda: client("alice").remember("New plan.", supersedes=[missing]))
    assert error_theirs.code() == error_missing.code() == PRECONDITION
    assert (error_theirs.details() or "").replace(theirs.memory_id, "ID") == (
        error_missing.details() or ""
    ).replace(missing, "ID")
    assert other_org.held(workspace()).memories[0].state == memory_pb2.MEMORY_STATE_ACTIVE


def test_a_call_without_a_token_is_unauthenticated(memory_channel: grpc.Channel) -> None:
    from cairn.memory.v1 import memory_pb2_grpc

    stub = memory_pb2_grpc.MemoryServiceStub(memory_channel)
    error = refusal(lambda: stub.Remember(memory_pb2.RememberRequest(text="Hi."), timeout=10))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_concurrent_identical_adds_agree_on_one_memory(client: ClientFactory) -> None:
    alice = client()
    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(
            pool.map(
                lambda _: alice.remember("Starts on the first of June.", candidate("c-8")), range(8)
            )
        )
    assert len({r.memory.memory_id for r in responses}) == 1
    assert sum(1 for r in responses if not r.already_held) == 1


def test_concurrent_supersedes_of_one_memory_let_exactly_one_win(client: ClientFactory) -> None:
    alice = client()
    subject = candidate("c-9")
    old = alice.remember("Salary band is B.", subject).memory

    def replace(n: int) -> grpc.StatusCode:
        try:
            alice.remember(f"Salary band is C{n}.", subject, supersedes=[old.memory_id])
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(max_workers=6) as pool:
        codes = list(pool.map(replace, range(6)))
    assert codes.count(grpc.StatusCode.OK) == 1
    assert codes.count(PRECONDITION) == 5
    active = [m for m in alice.held(subject).memories if m.state == memory_pb2.MEMORY_STATE_ACTIVE]
    assert len(active) == 1
