"""GetDocument over real gRPC: a citation's document, whole, for a caller who may
read it, and the one denial (PERMISSION_DENIED), reading exactly like a missing id, for anyone else; and
document ids as real corpora spell them (`_exit.2`, `guide#install`)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import json_format

from cairn.retrieval.v1 import retrieval_pb2
from cairn_libs.db import Database, load_migrations
from cairn_libs.demo_corpus import handbook_documents, load_handbook
from cairn_libs.errors import DENIAL_MESSAGE
from cairn_retrieval.app import MIGRATIONS
from cairn_retrieval.domain import chunk_id_for, document_id_of_chunk, point_id
from cairn_retrieval.postgres.document_reads import PostgresDocumentReads

if TYPE_CHECKING:
    from conftest import Org, RunningRetrieval

BONUS_POOL = "handbook-bonus-pool-2026"


def _ingest_handbook(retrieval: RunningRetrieval, org: Org) -> dict[str, retrieval_pb2.Document]:
    documents = handbook_documents(load_handbook())
    documents[0].metadata.update({"owner": "people team", "pages": 2})
    retrieval.client.ingest(org.ingester(), documents)
    return {d.document_id: d for d in documents}


def _refusal(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    return caught.value.code(), caught.value.details() or ""


def test_a_reader_gets_the_whole_document_with_title_source_and_metadata_but_not_its_acl(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    handbook = _ingest_handbook(keyword_retrieval, org)
    maria = org.reader("maria", roles=["manager"])

    bonus = keyword_retrieval.client.get_document(maria, BONUS_POOL)
    leave = keyword_retrieval.client.get_document(maria, "handbook-leave")

    assert (bonus.document_id, bonus.source, bonus.title) == (
        BONUS_POOL,
        "handbook",
        "Bonus pool 2026 (managers only)",
    )
    assert bonus.text == handbook[BONUS_POOL].text
    assert not bonus.HasField("acl")
    assert json_format.MessageToDict(leave.metadata) == {"owner": "people team", "pages": 2}


def test_the_managers_only_document_reads_to_tom_exactly_like_a_document_that_does_not_exist(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    _ingest_handbook(keyword_retrieval, org)
    tom = org.reader("tom", roles=["employee"])
    client = keyword_retrieval.client

    refusals = {
        _refusal(lambda document_id=document_id: client.get_document(tom, document_id))
        for document_id in (BONUS_POOL, "handbook-does-not-exist")
    }

    assert refusals == {(grpc.StatusCode.PERMISSION_DENIED, DENIAL_MESSAGE)}
    assert client.get_document(tom, "handbook-leave").title == "Leave and holidays"


def test_another_orgs_caller_with_the_same_names_and_roles_gets_the_one_denial(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    _ingest_handbook(keyword_retrieval, org)
    stranger = org.issuer.caller_token(
        org_id=f"{org.org_id}-other", user_id="maria", roles=["manager", "hr", "ingester"]
    )
    assert _refusal(lambda: keyword_retrieval.client.get_document(stranger, BONUS_POOL)) == (
        grpc.StatusCode.PERMISSION_DENIED,
        DENIAL_MESSAGE,
    )


def test_only_an_ingester_of_the_org_who_may_read_the_document_sees_its_acl(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    _ingest_handbook(keyword_retrieval, org)
    hr_ingester = org.reader("docs-bot", roles=["ingester", "hr"])
    ingester_only = org.ingester()

    shown = keyword_retrieval.client.get_document(hr_ingester, BONUS_POOL)

    assert list(shown.acl.roles) == ["hr", "manager"]
    assert (list(shown.acl.users), list(shown.acl.groups)) == ([], [])
    # Managing the corpus does not widen what one may read: the search rule decides.
    assert _refusal(lambda: keyword_retrieval.client.get_document(ingester_only, BONUS_POOL))[
        0
    ] == (grpc.StatusCode.PERMISSION_DENIED)


@pytest.mark.parametrize("document_id", ["", "a" * 513, "line\nbreak", "\u202eevil", " padded"])
def test_reading_an_id_no_document_can_have_is_invalid_naming_it(
    keyword_retrieval: RunningRetrieval, org: Org, document_id: str
) -> None:
    code, message = _refusal(
        lambda: keyword_retrieval.client.get_document(org.reader(), document_id)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert (repr(document_id[:20])[:-1] if document_id else "document_id is empty") in message


def test_a_nul_in_the_id_is_refused_at_the_door(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    code, message = _refusal(lambda: keyword_retrieval.client.get_document(org.reader(), "a\x00b"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "document_id contains U+0000" in message


# ---------------------------------------------------------------- document ids

ODD_IDS = ("_exit.2", "guide.md#install", "100%#x", "%23 is not #", "a b/c?d=e&f")


def test_chunk_ids_escape_the_document_id_so_the_first_hash_always_ends_it() -> None:
    for document_id in ODD_IDS:
        chunk_id = chunk_id_for(document_id, "0123456789abcdef", 3)
        assert document_id_of_chunk(chunk_id) == document_id
        assert chunk_id.endswith("#0123456789ab-00003")
    assert chunk_id_for("plain-id", "0123456789abcdef", 0) == "plain-id#0123456789ab-00000"
    assert chunk_id_for("a#b", "0" * 16, 0) != chunk_id_for("a%23b", "0" * 16, 0)


async def test_ids_with_underscores_hashes_and_percents_are_ingested_replaced_and_deleted(
    private_retrieval: RunningRetrieval, org: Org
) -> None:
    client = private_retrieval.client
    reader = org.reader(groups=["staff"])

    def doc(document_id: str, text: str) -> retrieval_pb2.Document:
        return retrieval_pb2.Document(
            document_id=document_id,
            source="man",
            title=document_id,
            text=text,
            acl=retrieval_pb2.Acl(groups=["staff"]),
        )

    first = client.ingest(
        org.ingester(),
        [doc(i, f"Version one of page {n} about zanzibar.") for n, i in enumerate(ODD_IDS)],
    )
    assert [r.result.outcome for r in first] == [retrieval_pb2.DOCUMENT_OUTCOME_INGESTED] * len(
        ODD_IDS
    )
    again = client.ingest(
        org.ingester(),
        [doc(i, f"Version two of page {n} about zanzibar.") for n, i in enumerate(ODD_IDS)],
    )
    assert [r.result.outcome for r in again] == [retrieval_pb2.DOCUMENT_OUTCOME_REPLACED] * len(
        ODD_IDS
    )

    found = client.search(reader, "zanzibar version", ["man"], k=20)
    assert sorted(r.document_id for r in found.results) == sorted(ODD_IDS)
    assert all("Version two" in r.text for r in found.results)
    assert {document_id_of_chunk(r.chunk_id) for r in found.results} == set(ODD_IDS)
    assert client.get_document(reader, "guide.md#install").text.startswith("Version two of page 1")

    assert client.delete(org.ingester(), "guide.md#install").chunks_removed == 1
    assert client.delete(org.ingester(), "100%#x").chunks_removed == 1
    left = client.search(reader, "zanzibar version", ["man"], k=20)
    assert sorted(r.document_id for r in left.results) == sorted(
        {"_exit.2", "%23 is not #", "a b/c?d=e&f"}
    )

    private_retrieval.process.stop()
    points = await private_retrieval.stored_points(org.org_id)
    assert sorted(payload["document_id"] for _, payload in points) == sorted(  # type: ignore[type-var]
        ["_exit.2", "%23 is not #", "a b/c?d=e&f"]
    )
    assert {pid for pid, _ in points} == {point_id(org.org_id, r.chunk_id) for r in left.results}


@pytest.mark.parametrize("document_id", ["tab\there", "\u200bzero-width", "bell\x07", "x\n"])
def test_ids_with_control_or_format_characters_fail_their_document_naming_it(
    keyword_retrieval: RunningRetrieval, org: Org, document_id: str
) -> None:
    (response,) = keyword_retrieval.client.ingest(
        org.ingester(),
        [retrieval_pb2.Document(document_id=document_id, source="s", text="Some text.")],
    )
    assert response.result.outcome == retrieval_pb2.DOCUMENT_OUTCOME_FAILED
    assert repr(document_id) in response.result.error
    assert "printable" in response.result.error


async def test_documents_stored_before_their_text_was_kept_get_it_back_at_the_same_offsets(
    pg_url: str,
) -> None:
    schema = f"retrieval_text_{uuid.uuid4().hex[:8]}"
    migrations = load_migrations(MIGRATIONS)
    before = Database(
        url=pg_url, schema=schema, migrations=[m for m in migrations if m.version < 4]
    )
    text = "Alpha beta gamma.\n\nDelta epsilon zeta eta.  Theta iota."
    # Two overlapping chunks and a third after a gap of blanks.
    spans = [(0, 23), (19, 42), (44, len(text))]
    assert await before.ready()
    async with before.pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO documents (org_id, document_id, source, content_hash, acl, chunk_count) "
            "VALUES ('o', 'd', 's', 'h', '{group:g}', 3)"
        )
        audience = await conn.fetchval(
            "INSERT INTO audiences (org_id, source, acl) VALUES ('o', 's', '{group:g}') "
            "RETURNING audience_id"
        )
        for ordinal, (start, end) in enumerate(spans):
            await conn.execute(
                "INSERT INTO chunks (org_id, chunk_id, document_id, source, acl, audience_id, "
                "text, ordinal, char_start, char_end, length, state) "
                "VALUES ('o', $1, 'd', 's', '{group:g}', $2, $3, $4, $5, $6, 1, 'ready')",
                f"d#{ordinal}",
                audience,
                text[start:end],
                ordinal,
                start,
                end,
            )
    await before.close()

    after = Database(url=pg_url, schema=schema, migrations=migrations)
    assert await after.ready()
    try:
        stored = await PostgresDocumentReads(after).document("o", "d")
    finally:
        await after.close()

    assert stored is not None
    assert stored.text == text[:42] + "  " + text[44:]
    for start, end in spans:
        assert stored.text[start:end] == text[start:end]
