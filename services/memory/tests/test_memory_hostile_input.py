"""Hostile input against the memory service: every value a request can carry but no
memory can hold is INVALID_ARGUMENT naming its field, and a database that fails in
any of the ways asyncpg reports is UNAVAILABLE, never INTERNAL.

The domain is tested on its own as well as over gRPC: the service's door refuses
some of these values too, and memory must not rely on it."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, cast

import asyncpg
import grpc
import pytest
from google.protobuf import timestamp_pb2

from cairn.memory.v1 import memory_pb2
from cairn_libs.db import CONNECTION_ERRORS, Database
from cairn_libs.errors import status_for
from cairn_memory.convert import remember_draft_from_proto
from cairn_memory.domain import (
    Author,
    AuthorKind,
    RememberDraft,
    Subject,
    SubjectKind,
    block_draft,
    block_number,
    block_search,
    held_query,
    held_scope,
    new_memory,
    profile_update,
    recall_query,
    refuse_secrets_in_block,
)
from cairn_memory.errors import RefusedInput, StorageUnavailable
from cairn_memory.postgres import PostgresStore
from cairn_memory.vault import PlainVault

if TYPE_CHECKING:
    from conftest import ClientFactory

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOW = datetime(2030, 6, 1, 12, tzinfo=UTC)
AUTHOR = Author(kind=AuthorKind.PERSON, id="alice")
CANDIDATE = Subject(kind=SubjectKind.CANDIDATE, id="c-1")


def candidate(subject_id: str) -> memory_pb2.Subject:
    return memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_CANDIDATE, id=subject_id)


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


BASE_DRAFT = RememberDraft(
    text="Prefers mornings.", subject_kind=SubjectKind.CANDIDATE, subject_id="c-1"
)


def remember(**fields: Any) -> object:
    return new_memory(
        dataclasses.replace(BASE_DRAFT, **fields),
        author=AUTHOR,
        now=NOW,
        ttl=timedelta(days=90),
        memory_id=str(uuid.uuid4()),
    )


# --- U+0000 ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: remember(text="Prefers\x00 mornings."), "text"),
        (lambda: remember(tags=["ok", "b\x00d"]), "tags[1]"),
        (lambda: remember(source_ref="doc\x00"), "source_ref"),
        (lambda: remember(subject_id="c\x001"), "subject.id"),
        (
            lambda: profile_update(
                subject=CANDIDATE,
                fact_key="coffee",
                value="latte\x00",
                previous_value=None,
                author=AUTHOR,
                now=NOW,
                ttl=timedelta(days=1),
            ),
            "value",
        ),
        (
            lambda: profile_update(
                subject=CANDIDATE,
                fact_key="coffee",
                value="latte",
                previous_value="mocha\x00",
                author=AUTHOR,
                now=NOW,
                ttl=timedelta(days=1),
            ),
            "previous_value",
        ),
        (
            lambda: recall_query(query="mor\x00nings", subject=None, k=0, include_profile=False),
            "query",
        ),
        (lambda: block_search(query="a\x00b", limit=0, conversation_id=""), "query"),
        (lambda: block_search(query="ab", limit=0, conversation_id="c\x00"), "conversation_id"),
        (
            lambda: refuse_secrets_in_block(
                label="l", role="user", content="a\x00b", conversation_id="c"
            ),
            "content",
        ),
    ],
    ids=[
        "text",
        "tag",
        "source-ref",
        "subject-id",
        "fact-value",
        "previous-value",
        "recall-query",
        "block-query",
        "block-conversation",
        "archive-content",
    ],
)
def test_nul_anywhere_is_refused_by_the_domain_naming_the_field(
    call: Callable[[], object], field: str
) -> None:
    with pytest.raises(RefusedInput, match=rf"^{re.escape(field)} contains the character U\+0000"):
        call()


def test_nul_in_a_remembered_text_is_invalid_argument_over_grpc(client: ClientFactory) -> None:
    error = refusal(lambda: client().remember("Prefers\x00 mornings."))
    assert error.code() == INVALID
    assert "U+0000" in (error.details() or "")


# --- times ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["event_at", "valid_from", "valid_until"])
@pytest.mark.parametrize(
    "stamp",
    [
        timestamp_pb2.Timestamp(seconds=253_402_300_800),
        timestamp_pb2.Timestamp(seconds=-62_135_596_801),
        timestamp_pb2.Timestamp(seconds=2**62),
        timestamp_pb2.Timestamp(seconds=0, nanos=-1),
        timestamp_pb2.Timestamp(seconds=0, nanos=1_000_000_000),
    ],
    ids=["after-9999", "before-0001", "huge", "negative-nanos", "nanos-overflow"],
)
def test_a_timestamp_outside_its_range_is_refused_at_conversion_naming_the_field(
    field: str, stamp: timestamp_pb2.Timestamp
) -> None:
    request = memory_pb2.RememberRequest(text="Ok.", subject=candidate("c-1"))
    getattr(request, field).CopyFrom(stamp)
    with pytest.raises(RefusedInput, match=rf"^{field} .*out of range"):
        remember_draft_from_proto(request)


@pytest.mark.parametrize("field", ["event_at", "valid_from", "valid_until"])
def test_a_moment_that_leaves_the_calendar_in_utc_is_refused_naming_the_field(field: str) -> None:
    # 0001-01-01T00:00+05:00 is a valid Python datetime, but in UTC it is year 0.
    edge = datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5)))
    with pytest.raises(RefusedInput, match=rf"^{field} .*out of range"):
        remember(**{field: edge})


def test_a_validity_window_that_ends_before_it_starts_is_refused() -> None:
    with pytest.raises(RefusedInput, match="valid_until .* is not after valid_from"):
        remember(valid_from=NOW, valid_until=NOW - timedelta(seconds=1))


def test_the_earliest_and_latest_timestamps_are_kept_and_read_back(client: ClientFactory) -> None:
    earliest = timestamp_pb2.Timestamp(seconds=-62_135_596_800)
    latest = timestamp_pb2.Timestamp(seconds=253_402_300_799, nanos=999_999_000)
    memory = (
        client()
        .remember(
            "Has been around forever.",
            candidate("c-edge"),
            event_at=earliest,
            valid_from=earliest,
            valid_until=latest,
        )
        .memory
    )
    assert (memory.event_at, memory.valid_from, memory.valid_until) == (earliest, earliest, latest)


@pytest.mark.parametrize("field", ["event_at", "valid_from", "valid_until"])
def test_an_out_of_range_timestamp_is_invalid_argument_over_grpc(
    client: ClientFactory, field: str
) -> None:
    stamp = timestamp_pb2.Timestamp(seconds=253_402_300_800)
    error = refusal(lambda: client().remember("Ok.", candidate("c-2"), **{field: stamp}))
    assert error.code() == INVALID
    assert field in (error.details() or "")


# --- enums ---------------------------------------------------------------------------------


@pytest.mark.parametrize("number", [6, 99, -1, 2**31 - 1])
def test_an_unknown_subject_kind_is_invalid_argument_in_every_rpc(
    client: ClientFactory, number: int
) -> None:
    subject = memory_pb2.Subject(kind=cast(Any, number), id="c-1")
    alice = client()
    calls: list[Callable[[], object]] = [
        lambda: alice.remember("Ok.", subject),
        lambda: alice.update_profile(subject, "coffee", "latte"),
        lambda: alice.recall("", subject=subject),
        lambda: alice.held(subject),
    ]
    for call in calls:
        error = refusal(call)
        assert error.code() == INVALID
        assert "subject.kind" in (error.details() or "")


@pytest.mark.parametrize("number", [4, 99, -7])
def test_an_unknown_claim_type_is_invalid_argument(client: ClientFactory, number: int) -> None:
    error = refusal(lambda: client().remember("Ok.", candidate("c-3"), claim_type=number))
    assert error.code() == INVALID
    assert "claim_type" in (error.details() or "")


# --- numbers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.remember("Ok.", importance=2**31 - 1), "importance"),
        (lambda c: c.remember("Ok.", importance=-(2**31)), "importance"),
        (lambda c: c.recall("x", k=2**31 - 1), "k"),
        (lambda c: c.recall("x", k=-(2**31)), "k"),
        (lambda c: c.held(candidate("c-4"), page_size=2**31 - 1), "page_size"),
        (lambda c: c.held(candidate("c-4"), page_size=-1), "page_size"),
        (lambda c: c.search_blocks("x", limit=2**31 - 1), "limit"),
    ],
    ids=["importance-max", "importance-min", "k-max", "k-min", "page-max", "page-neg", "limit"],
)
def test_giant_numbers_are_invalid_argument_naming_the_field(
    client: ClientFactory, call: Callable[[Any], object], field: str
) -> None:
    error = refusal(lambda: call(client()))
    assert error.code() == INVALID
    assert (error.details() or "").startswith(f"{field} ")


# --- page tokens ---------------------------------------------------------------------------


def _b64(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _token(*fields: tuple[str, str]) -> str:
    """A token in Held's own form (urlsafe base64 over compact JSON) with these fields."""
    return _b64(json.dumps(dict(fields), separators=(",", ":")))


SOME_ID = str(uuid.uuid4())
CRAFTED_TOKENS = [
    "garbage!!",
    _b64("garbage"),
    _b64("\xff\xfe"),
    "9" * 400,
    "A" * 100_000,
    _token(("c", "9999-12-31T23:59:59.999999-23:59"), ("m", SOME_ID), ("s", "x")),
    _token(("c", "0001-01-01T00:00:00+23:59"), ("m", SOME_ID), ("s", "x")),
    _token(("c", "2030-01-01T00:00:00"), ("m", SOME_ID), ("s", "x")),
    _token(("c", "99999999999999999999"), ("m", SOME_ID), ("s", "x")),
    _token(("c", "2030-01-01T00:00:00+00:00"), ("m", "9" * 40), ("s", "x")),
    _token(("c", "2030-01-01T00:00:00+00:00"), ("m", SOME_ID)),
    _token(("c", "2030-01-01T00:00:00+00:00"), ("m", SOME_ID), ("s", "x"), ("y", "")),
]
TOKEN_IDS = [
    "garbage",
    "b64-garbage",
    "b64-bytes",
    "huge-number",
    "huge-token",
    "overflow-high",
    "overflow-low",
    "naive-time",
    "huge-time",
    "bad-id",
    "old-shape",
    "extra-part",
]


@pytest.mark.parametrize("token", CRAFTED_TOKENS, ids=TOKEN_IDS)
def test_a_crafted_page_token_is_refused_by_the_domain_naming_page_token(token: str) -> None:
    with pytest.raises(RefusedInput, match=r"^page_token ") as info:
        held_query(CANDIDATE, page_size=0, page_token=token, org_id="o")
    assert len(info.value.message) < 400


def test_a_page_token_of_another_subject_or_org_is_refused() -> None:
    scope = held_scope(org_id="o", subject=CANDIDATE)
    token = _token(("c", "2030-01-01T00:00:00+00:00"), ("m", SOME_ID), ("s", scope))
    assert held_query(CANDIDATE, page_size=0, page_token=token, org_id="o").after is not None
    for org_id, subject in (
        ("o", Subject(kind=SubjectKind.CANDIDATE, id="c-2")),
        ("other-org", CANDIDATE),
    ):
        with pytest.raises(RefusedInput, match=r"^page_token was given out for another"):
            held_query(subject, page_size=0, page_token=token, org_id=org_id)


@pytest.mark.parametrize("token", CRAFTED_TOKENS, ids=TOKEN_IDS)
def test_a_crafted_page_token_is_invalid_argument_over_grpc(
    client: ClientFactory, token: str
) -> None:
    error = refusal(lambda: client().held(candidate("c-5"), page_token=token))
    assert error.code() == INVALID
    assert (error.details() or "").startswith("page_token ")


def test_a_real_page_token_works_only_for_its_own_subject_and_org(
    client: ClientFactory, new_org: str
) -> None:
    alice = client()
    for n in range(3):
        alice.remember(f"Note number {n} about the candidate.", candidate("c-6"))
    token = alice.held(candidate("c-6"), page_size=1).next_page_token
    assert token
    assert len(alice.held(candidate("c-6"), page_size=1, page_token=token).memories) == 1
    other_subject = refusal(lambda: alice.held(candidate("c-7"), page_token=token))
    other_org = refusal(
        lambda: client(org_id=f"{new_org}-b").held(candidate("c-6"), page_token=token)
    )
    for error in (other_subject, other_org):
        assert error.code() == INVALID
        assert (error.details() or "").startswith("page_token ")


# --- the database failing ------------------------------------------------------------------


class FailingConnection:
    def __init__(self, error: BaseException) -> None:
        self._error = error

    async def fetch(self, *args: object) -> list[object]:
        raise self._error


class FailingPool:
    """A pool whose acquire fails (`on_acquire`) or whose connection fails mid-query."""

    def __init__(self, error: BaseException, *, on_acquire: bool) -> None:
        self._error = error
        self._on_acquire = on_acquire

    @asynccontextmanager
    async def acquire(self, **options: float) -> AsyncIterator[FailingConnection]:
        if self._on_acquire:
            raise self._error
        yield FailingConnection(self._error)


class FailingDatabase:
    def __init__(self, pool: FailingPool) -> None:
        self.pool = pool


@pytest.mark.parametrize("on_acquire", [True, False], ids=["on-acquire", "mid-query"])
@pytest.mark.parametrize(
    "error_type", CONNECTION_ERRORS, ids=[e.__name__ for e in CONNECTION_ERRORS]
)
async def test_every_way_the_database_fails_is_unavailable_never_internal(
    error_type: type[BaseException], on_acquire: bool
) -> None:
    pool = FailingPool(error_type("the server went away"), on_acquire=on_acquire)
    store = PostgresStore(cast(Database, FailingDatabase(pool)), vault=PlainVault())
    with pytest.raises(StorageUnavailable) as info:
        await store.memories.recall_newest(org_id="o", subject=None, k=5, now=NOW)
    assert status_for(info.value)[0] == grpc.StatusCode.UNAVAILABLE


async def test_a_value_the_database_cannot_hold_is_invalid_argument_not_an_outage() -> None:
    pool = FailingPool(asyncpg.DataError("invalid input for query argument $2"), on_acquire=False)
    store = PostgresStore(cast(Database, FailingDatabase(pool)), vault=PlainVault())
    with pytest.raises(RefusedInput) as info:
        await store.memories.recall_newest(org_id="o", subject=None, k=5, now=NOW)
    assert status_for(info.value)[0] == INVALID
    assert "$2" not in info.value.message


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda v: block_number(v), "block_id"),
        (
            lambda v: block_draft(
                label="l", role=v, content="c", conversation_id="c", archived_by="alice"
            ),
            "role",
        ),
        (lambda v: remember(supersedes=[v]), "supersedes[0]"),
        (lambda v: held_query(CANDIDATE, page_size=0, page_token=v, org_id="o"), "page_token"),
    ],
    ids=["block-id", "role", "supersedes", "page-token"],
)
def test_a_refusal_never_repeats_a_secret_or_a_wall_of_text(
    call: Callable[[str], object], field: str
) -> None:
    secret = "sk_live_4eC39HqLyjWDarjtT1zdp7dc" * 2
    for value in (secret, "x" * 100_000):
        with pytest.raises(RefusedInput) as info:
            call(value)
        assert info.value.message.startswith(field)
        assert "4eC39HqLyjWDarjtT1zdp7dc" not in info.value.message
        assert len(info.value.message) < 400
