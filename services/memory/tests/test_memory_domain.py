"""The memory service's pure rules, without a database: sentences, secrets,
authorship, defaults, recall modes, and the tolerant block id parser."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cairn_libs.errors import status_for
from cairn_libs.identity import Actor, CallIdentity, Principal
from cairn_memory.domain import (
    AuthorKind,
    ClaimType,
    HeldCursor,
    MemoryState,
    RecallMode,
    RememberDraft,
    SubjectKind,
    author_of,
    effective_state,
    format_block_id,
    format_page_token,
    new_memory,
    normalised_text,
    parse_block_id,
    parse_page_token,
    recall_mode,
)
from cairn_memory.errors import (
    NotOneSentence,
    ProfileValueChanged,
    RefusedInput,
    SecretInText,
    StorageUnavailable,
    SupersedesNotActive,
)
from cairn_memory.screening import secret_kind, sentence_count

NOW = datetime(2030, 6, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize(
    "text",
    [
        "Prefers morning interviews.",
        "Dr. Smith met her on Jan. 5 at 3 p.m. in the U.S. office.",
        "J. R. R. Tolkien is her favourite author.",
        "The fee is 3.5 percent, e.g. on every invoice.",
        'She asked "why?" and then left.',
        "Works at Acme Inc. since 2019",
        "Wow!",
    ],
)
def test_one_sentence_is_counted_as_one(text: str) -> None:
    assert sentence_count(text) == 1


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("She joined in May. She leads the platform team.", 2),
        ("Is it done? Yes. It shipped!", 3),
        ('He said "fine." Then he left.', 2),
        ("Meeting at 5. 6 people came.", 2),
    ],
)
def test_several_sentences_are_counted(text: str, count: int) -> None:
    assert sentence_count(text) == count


@pytest.mark.parametrize(
    "text",
    [
        "The code review is on 12 March 2030.",
        "Her employee number is 48213.",
        "The password policy changed last year.",
        "The token bucket limit is 100 requests per second.",
        "Ask about the sk-learning course she took.",
        "Room 101 is booked from 091500 for the interview panel.",
    ],
)
def test_ordinary_sentences_are_not_taken_for_secrets(text: str) -> None:
    assert secret_kind(text) is None


def test_a_person_calling_directly_is_the_author() -> None:
    identity = CallIdentity(principal=Principal(org_id="o", user_id="alice"))
    author = author_of(identity)
    assert (author.kind, author.id, author.run_id, author.on_behalf_of) == (
        AuthorKind.PERSON,
        "alice",
        "",
        "",
    )


def test_an_acting_service_makes_the_model_the_author_for_its_run() -> None:
    identity = CallIdentity(
        principal=Principal(org_id="o", user_id="alice"),
        actor=Actor(service="orchestrator", run_id="run-1", agent="screener"),
    )
    author = author_of(identity)
    assert (author.kind, author.id, author.run_id, author.on_behalf_of) == (
        AuthorKind.MODEL,
        "screener",
        "run-1",
        "alice",
    )
    without_agent = CallIdentity(
        principal=Principal(org_id="o", user_id="alice"),
        actor=Actor(service="orchestrator", run_id="run-2"),
    )
    assert author_of(without_agent).id == "orchestrator"


def _draft(**fields: object) -> RememberDraft:
    values: dict[str, object] = {
        "text": "Prefers tea.",
        "subject_kind": SubjectKind.WORKSPACE,
        "subject_id": "",
    }
    values.update(fields)
    return RememberDraft(**values)  # type: ignore[arg-type]


def test_a_new_memory_gets_the_defaults_and_expires_after_the_ttl() -> None:
    author = author_of(CallIdentity(principal=Principal(org_id="o", user_id="alice")))
    memory = new_memory(
        _draft(tags=[" a ", "a", "b"], supersedes=["0B0A8C38-6B1F-4F62-9C3F-7D2B8B1E2A10"]),
        author=author,
        now=NOW,
        ttl=timedelta(days=90),
        memory_id="m",
    )
    assert memory.importance == 2
    assert memory.claim_type is ClaimType.UNKNOWN
    assert memory.expires_at == NOW + timedelta(days=90)
    assert memory.tags == ("a", "b")
    assert memory.supersedes == ("0b0a8c38-6b1f-4f62-9c3f-7d2b8b1e2a10",)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"subject_kind": None}, RefusedInput, "subject.kind is required"),
        (
            {"subject_kind": SubjectKind.EMPLOYEE, "subject_id": " "},
            RefusedInput,
            "subject.id is required for a EMPLOYEE subject",
        ),
        (
            {"subject_id": "team-a"},
            RefusedInput,
            "subject.id must be empty for a WORKSPACE subject",
        ),
        ({"text": "One. Two."}, NotOneSentence, "text holds 2 sentences"),
        ({"importance": -1}, RefusedInput, "importance -1 is out of range"),
        ({"text": "The key is AKIAIOSFODNN7EXAMPLE."}, SecretInText, "an AWS access key"),
        (
            {"valid_from": NOW, "valid_until": NOW},
            RefusedInput,
            "is not after valid_from",
        ),
        ({"event_at": datetime(2030, 1, 1)}, RefusedInput, "has no time zone"),
    ],
)
def test_new_memory_refuses_with_a_reason(
    fields: dict[str, object], error: type[Exception], message: str
) -> None:
    author = author_of(CallIdentity(principal=Principal(org_id="o", user_id="alice")))
    with pytest.raises(error) as info:
        new_memory(_draft(**fields), author=author, now=NOW, ttl=timedelta(days=1), memory_id="m")
    assert message in str(info.value)


def test_the_same_text_is_compared_case_and_space_insensitively() -> None:
    assert normalised_text("  Prefers   TEA. ") == normalised_text("prefers tea.")
    assert normalised_text("Prefers tea.") != normalised_text("Prefers coffee.")


def test_an_active_memory_past_its_expiry_reads_as_expired() -> None:
    assert effective_state(MemoryState.ACTIVE, expires_at=NOW, now=NOW) is MemoryState.EXPIRED
    assert (
        effective_state(MemoryState.ACTIVE, expires_at=NOW + timedelta(seconds=1), now=NOW)
        is MemoryState.ACTIVE
    )
    assert effective_state(MemoryState.ERASED, expires_at=NOW, now=NOW) is MemoryState.ERASED


def test_recall_is_semantic_only_with_an_embedder_and_a_query() -> None:
    assert recall_mode(has_embedder=True, query="tea")[0] is RecallMode.SEMANTIC
    assert recall_mode(has_embedder=True, query="  ") == (
        RecallMode.NEWEST_FIRST,
        "no query was given; memories are listed newest first",
    )
    assert recall_mode(has_embedder=False, query="tea") == (
        RecallMode.NEWEST_FIRST,
        "no embedder is configured; memories are listed newest first",
    )


whitespace = st.text(alphabet=" \t\n\r", max_size=3)


@given(
    n=st.integers(min_value=1, max_value=10**18 - 1),
    prefix=st.sampled_from(["", "r", "R"]),
    before=whitespace,
    after=whitespace,
)
def test_every_tolerant_spelling_of_a_block_id_parses_to_its_number(
    n: int, prefix: str, before: str, after: str
) -> None:
    assert parse_block_id(f"{before}{prefix}{n}{after}") == n
    assert parse_block_id(format_block_id(n)) == n


@given(st.text(max_size=30))
def test_the_block_id_parser_accepts_only_what_names_a_block(raw: str) -> None:
    number = parse_block_id(raw)
    if number is None:
        return
    assert number >= 1
    assert raw.strip().lstrip("rR").lstrip("0") == str(number)
    assert raw.strip()[:1] in "rR0123456789"


@given(st.integers(max_value=0))
def test_zero_and_negative_numbers_name_no_block(n: int) -> None:
    assert parse_block_id(str(n)) is None
    assert parse_block_id(f"r{n}") is None


@given(
    # A day inside Timestamp's range, so every offset still converts to UTC.
    moment=st.datetimes(
        min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.timezones()
    ),
    memory_id=st.uuids(),
)
def test_a_held_page_token_names_exactly_the_cursor_it_was_made_from(
    moment: datetime, memory_id: uuid.UUID
) -> None:
    cursor = HeldCursor(created_at=moment, memory_id=str(memory_id))
    parsed = parse_page_token(format_page_token(cursor))
    assert parsed.memory_id == cursor.memory_id
    # The same instant (compared in UTC: a local time in a fold never equals one in
    # another zone) with the same offset.
    assert parsed.created_at.astimezone(UTC) == moment.astimezone(UTC)
    assert parsed.created_at.utcoffset() == moment.utcoffset()


@pytest.mark.parametrize("token", ["", "===", "bm90LWEtdG9rZW4", "MjAzMS0wMS0wMVQwMDowMDowMHx4"])
def test_a_page_token_held_did_not_give_out_is_refused(token: str) -> None:
    with pytest.raises(RefusedInput, match="is not a token Held gave out"):
        parse_page_token(token)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RefusedInput("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotOneSentence("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (SecretInText("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (SupersedesNotActive("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (ProfileValueChanged("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (StorageUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_every_memory_error_maps_to_its_status_code(
    error: Exception, code: grpc.StatusCode
) -> None:
    assert status_for(error) == (code, "x")
