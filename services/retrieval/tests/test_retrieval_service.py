"""RetrievalService over real gRPC, as a separate process, on real PostgreSQL and
an embedded Qdrant (each hybrid test runs on local mode and on Qdrant Edge)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import asyncpg
import grpc
import pytest

from cairn.retrieval.v1 import retrieval_pb2
from cairn_libs.identity import TokenIssuer
from cairn_retrieval.domain import point_id

if TYPE_CHECKING:
    from conftest import Org, RunningRetrieval


def document(
    document_id: str,
    text: str,
    *,
    source: str = "handbook",
    title: str = "",
    users: Sequence[str] = (),
    roles: Sequence[str] = (),
    groups: Sequence[str] = (),
) -> retrieval_pb2.Document:
    return retrieval_pb2.Document(
        document_id=document_id,
        source=source,
        title=title or document_id,
        text=text,
        acl=retrieval_pb2.Acl(users=list(users), roles=list(roles), groups=list(groups)),
    )


def outcomes(responses: Sequence[retrieval_pb2.IngestDocumentsResponse]) -> list[str]:
    return [retrieval_pb2.DocumentOutcome.Name(r.result.outcome) for r in responses]


HANDBOOK = (
    "Expense policy\n\n"
    "Travel must be booked through the company portal. Economy class is the default "
    "for flights shorter than six hours.\n\n"
    "Meals on business trips are reimbursed up to forty euros a day when the "
    "receipts are attached to the expense report within thirty days."
)


def test_ingested_document_is_found_with_a_citation_whose_offsets_are_exact(
    retrieval: RunningRetrieval, org: Org
) -> None:
    responses = retrieval.client.ingest(
        org.ingester(), [document("expenses", HANDBOOK, title="Expenses", groups=["staff"])]
    )
    assert outcomes(responses) == ["DOCUMENT_OUTCOME_INGESTED"]
    assert responses[-1].documents_done == responses[-1].documents_total == 1
    assert responses[-1].result.chunks >= 1
    assert responses[-1].result.embedded_chunks == responses[-1].result.chunks

    answer = retrieval.client.search(
        org.reader(groups=["staff"]), "how much are meals reimbursed", ["handbook"]
    )

    assert answer.mode == retrieval_pb2.SEARCH_MODE_HYBRID
    assert answer.mode_reason == ""
    top = answer.results[0]
    assert (top.document_id, top.source, top.title) == ("expenses", "handbook", "Expenses")
    assert HANDBOOK[top.char_start : top.char_end] == top.text
    assert "forty euros" in top.text
    assert top.keyword_rank == 1 and top.dense_rank == 1
    assert top.bm25_score > 0 and top.dense_score > 0
    assert top.fused_score == pytest.approx(2 / 61)


def test_a_query_of_only_common_words_is_answered_dense_only_and_says_why(
    retrieval: RunningRetrieval, org: Org
) -> None:
    retrieval.client.ingest(
        org.ingester(), [document("faq", "What is the office address?", groups=["staff"])]
    )
    answer = retrieval.client.search(org.reader(groups=["staff"]), "what is the", ["handbook"])
    assert answer.mode == retrieval_pb2.SEARCH_MODE_DENSE_ONLY
    assert "dense-only" in answer.mode_reason
    assert [(r.document_id, r.keyword_rank, r.dense_rank) for r in answer.results] == [
        ("faq", 0, 1)
    ]


def test_search_with_no_sources_is_refused_as_invalid(
    retrieval: RunningRetrieval, org: Org
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        retrieval.client.search(org.reader(), "anything", [])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_bad_document_fails_alone_and_the_stream_reports_each_document(
    retrieval: RunningRetrieval, org: Org
) -> None:
    responses = retrieval.client.ingest(
        org.ingester(),
        [
            document("first", "Alpha text about onboarding.", groups=["staff"]),
            document("", "No id."),
            document("third", "Bad source.", source="not a source"),
            document("fourth", "Delta text about offboarding.", groups=["staff"]),
        ],
    )
    assert outcomes(responses) == [
        "DOCUMENT_OUTCOME_INGESTED",
        "DOCUMENT_OUTCOME_FAILED",
        "DOCUMENT_OUTCOME_FAILED",
        "DOCUMENT_OUTCOME_INGESTED",
    ]
    assert [r.documents_done for r in responses] == [1, 2, 3, 4]
    assert {r.documents_total for r in responses} == {4}
    assert [r.chunks_written for r in responses] == [1, 1, 1, 2]
    assert "document_id is empty" in responses[1].result.error
    assert "'not a source'" in responses[2].result.error
    assert responses[0].result.error == responses[3].result.error == ""


def test_a_caller_without_the_ingester_role_cannot_ingest_delete_or_read_stats(
    retrieval: RunningRetrieval, org: Org
) -> None:
    reader = org.reader(roles=["staff"], groups=["ingester"])
    calls = [
        lambda: retrieval.client.ingest(reader, [document("x", "Some text.", groups=["staff"])]),
        lambda: retrieval.client.delete(reader, "x"),
        lambda: retrieval.client.stats(reader),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert caught.value.details() == "not found or not permitted"
    assert retrieval.client.stats(org.ingester()).documents == 0


def test_deleting_without_a_document_id_is_refused_as_invalid(
    retrieval: RunningRetrieval, org: Org
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        retrieval.client.delete(org.ingester(), "")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_deleting_a_document_that_does_not_exist_reads_like_any_other_denial(
    retrieval: RunningRetrieval, org: Org
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        retrieval.client.delete(org.ingester(), "never-ingested")
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert caught.value.details() == "not found or not permitted"


@pytest.mark.parametrize(("query", "k"), [("", 4), ("   ", 4), ("fine", 51), ("fine", -1)])
def test_an_empty_query_or_a_k_out_of_range_is_refused_as_invalid(
    retrieval: RunningRetrieval, org: Org, query: str, k: int
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        retrieval.client.search(org.reader(), query, ["handbook"], k=k)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_when_the_best_matches_are_all_forbidden_the_caller_still_gets_k_allowed_results(
    retrieval: RunningRetrieval, org: Org
) -> None:
    forbidden = [
        document(
            f"secret-{i:02d}", f"Zebra zebra zebra migration plan number {i}.", groups=["board"]
        )
        for i in range(30)
    ]
    allowed = [
        document(
            "open-1", "The zebra crossing outside the office is being repainted.", groups=["staff"]
        ),
        document(
            "open-2", "Our migration to the new payroll system ends in May.", groups=["staff"]
        ),
        document("open-3", "Zebra is the code name of the mobile app.", groups=["staff"]),
        document("open-4", "Parking permits are renewed every January.", groups=["staff"]),
        document("open-5", "The cafeteria serves lunch from noon.", groups=["staff"]),
    ]
    retrieval.client.ingest(org.ingester(), forbidden + allowed)

    board = retrieval.client.search(org.reader(groups=["board"]), "zebra migration", ["handbook"])
    assert {r.document_id for r in board.results} <= {d.document_id for d in forbidden}

    answer = retrieval.client.search(
        org.reader(groups=["staff"]), "zebra migration", ["handbook"], k=4
    )
    assert len(answer.results) == 4
    assert {r.document_id for r in answer.results} <= {d.document_id for d in allowed}
    keyword_hits = {r.document_id for r in answer.results if r.keyword_rank}
    assert keyword_hits == {"open-1", "open-2", "open-3"}
    assert all(r.dense_rank for r in answer.results)


def test_another_org_never_sees_a_chunk_whatever_its_acl_says(
    retrieval: RunningRetrieval, org: Org, issuer: TokenIssuer
) -> None:
    retrieval.client.ingest(
        org.ingester(),
        [
            document(
                "salaries",
                "Salary bands for engineers are reviewed every spring.",
                users=["reader"],
                roles=["admin", "ingester"],
                groups=["staff"],
            )
        ],
    )
    other = f"{org.org_id}-other"
    same_names = issuer.caller_token(
        org_id=other, user_id="reader", roles=["admin", "ingester"], groups=["staff"]
    )
    answer = retrieval.client.search(same_names, "salary bands engineers", ["handbook"], k=50)
    assert list(answer.results) == []
    assert answer.mode == retrieval_pb2.SEARCH_MODE_HYBRID
    assert retrieval.client.stats(same_names).documents == 0
    with pytest.raises(grpc.RpcError) as caught:
        retrieval.client.delete(same_names, "salaries")
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    mine = retrieval.client.search(org.reader(groups=["staff"]), "salary bands", ["handbook"])
    assert [r.document_id for r in mine.results] == ["salaries"]


async def _chunk_rows(
    pg: asyncpg.Connection, org_id: str, document_id: str
) -> list[asyncpg.Record]:
    return await pg.fetch(
        "SELECT chunk_id, chunk_no, state, embedded, xmin::text AS version FROM retrieval.chunks "
        "WHERE org_id = $1 AND document_id = $2 ORDER BY chunk_id",
        org_id,
        document_id,
    )


async def _posting_count(pg: asyncpg.Connection, org_id: str, chunk_nos: Sequence[int]) -> int:
    count: int = await pg.fetchval(
        "SELECT count(*) FROM retrieval.postings WHERE org_id = $1 AND chunk_no = ANY($2::bigint[])",
        org_id,
        list(chunk_nos),
    )
    return count


LONG_POLICY = "\n\n".join(
    f"Section {i}. " + " ".join(f"clause{i}x{j} applies to remote work" for j in range(40))
    for i in range(6)
)


async def test_re_ingesting_an_unchanged_document_writes_nothing(
    retrieval: RunningRetrieval, org: Org, pg: asyncpg.Connection
) -> None:
    doc = document("remote", LONG_POLICY, groups=["staff"])
    first = retrieval.client.ingest(org.ingester(), [doc])
    assert outcomes(first) == ["DOCUMENT_OUTCOME_INGESTED"]
    assert first[0].result.chunks > 2
    before = await _chunk_rows(pg, org.org_id, "remote")

    again = retrieval.client.ingest(org.ingester(), [doc])

    assert outcomes(again) == ["DOCUMENT_OUTCOME_UNCHANGED"]
    assert again[0].result.chunks == first[0].result.chunks
    assert again[0].chunks_written == 0
    assert await _chunk_rows(pg, org.org_id, "remote") == before
    assert all(r["state"] == "ready" and r["embedded"] for r in before)


async def test_a_changed_document_replaces_its_chunks_in_both_stores(
    retrieval: RunningRetrieval, org: Org, pg: asyncpg.Connection
) -> None:
    reader = org.reader(groups=["staff"])
    retrieval.client.ingest(
        org.ingester(), [document("lunch", "Lunch is served in the atrium.", groups=["staff"])]
    )
    old_rows = await _chunk_rows(pg, org.org_id, "lunch")
    old_ids = [r["chunk_id"] for r in old_rows]
    assert await _posting_count(pg, org.org_id, [r["chunk_no"] for r in old_rows]) > 0

    replaced = retrieval.client.ingest(
        org.ingester(), [document("lunch", "Dinner is served on the terrace.", groups=["staff"])]
    )

    assert outcomes(replaced) == ["DOCUMENT_OUTCOME_REPLACED"]
    new_rows = await _chunk_rows(pg, org.org_id, "lunch")
    assert new_rows and not {r["chunk_id"] for r in new_rows} & set(old_ids)
    assert await _posting_count(pg, org.org_id, [r["chunk_no"] for r in old_rows]) == 0
    assert await _posting_count(pg, org.org_id, [r["chunk_no"] for r in new_rows]) > 0
    assert retrieval.client.search(reader, "atrium", ["handbook"]).results[0].text == (
        "Dinner is served on the terrace."
    )
    answer = retrieval.client.search(reader, "terrace", ["handbook"])
    assert [(r.chunk_id, r.keyword_rank) for r in answer.results] == [(new_rows[0]["chunk_id"], 1)]
    # The old chunk's vector is gone too: the dense list holds only the new chunk.
    assert [
        r.dense_rank for r in retrieval.client.search(reader, "atrium", ["handbook"], k=50).results
    ] == [1]


def test_stats_count_documents_chunks_and_embedded_chunks_per_source(
    retrieval: RunningRetrieval, org: Org
) -> None:
    retrieval.client.ingest(
        org.ingester(),
        [
            document("a", "One.", source="wiki", groups=["staff"]),
            document("b", LONG_POLICY, source="wiki", groups=["staff"]),
            document("c", "Three.", source="handbook", groups=["staff"]),
        ],
    )
    stats = retrieval.client.stats(org.ingester())
    per_source = {s.source: (s.documents, s.chunks, s.embedded_chunks) for s in stats.sources}
    wiki_chunks = per_source["wiki"][1]
    assert per_source == {"handbook": (1, 1, 1), "wiki": (2, wiki_chunks, wiki_chunks)}
    assert wiki_chunks > 2
    assert (stats.documents, stats.chunks, stats.embedded_chunks) == (
        3,
        wiki_chunks + 1,
        wiki_chunks + 1,
    )
    assert stats.embedder == "all-MiniLM-L6-v2-onnx-int8"


async def test_delete_removes_a_document_from_postgres_and_qdrant(
    private_retrieval: RunningRetrieval, org: Org, pg: asyncpg.Connection
) -> None:
    client = private_retrieval.client
    client.ingest(
        org.ingester(),
        [
            document("keep", "Version one of the kept document.", groups=["staff"]),
            document("drop", LONG_POLICY, groups=["staff"]),
        ],
    )
    client.ingest(
        org.ingester(), [document("keep", "Version two of the kept document.", groups=["staff"])]
    )
    drop_rows = await _chunk_rows(pg, org.org_id, "drop")
    drop_ids = [r["chunk_id"] for r in drop_rows]
    assert await _posting_count(pg, org.org_id, [r["chunk_no"] for r in drop_rows]) > 0
    keep_ids = [r["chunk_id"] for r in await _chunk_rows(pg, org.org_id, "keep")]

    removed = client.delete(org.ingester(), "drop")

    assert removed.chunks_removed == len(drop_ids) > 2
    assert await _chunk_rows(pg, org.org_id, "drop") == []
    assert await _posting_count(pg, org.org_id, [r["chunk_no"] for r in drop_rows]) == 0
    assert (
        await pg.fetchval("SELECT count(*) FROM retrieval.documents WHERE org_id = $1", org.org_id)
        == 1
    )
    with pytest.raises(grpc.RpcError) as caught:
        client.delete(org.ingester(), "drop")
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED

    private_retrieval.process.stop()  # the embedded store: one process per folder
    points = await private_retrieval.stored_points(org.org_id)
    assert sorted(pid for pid, _ in points) == sorted(point_id(org.org_id, c) for c in keep_ids)
    assert {payload["document_id"] for _, payload in points} == {"keep"}


def test_without_an_embedder_search_is_keyword_only_and_says_why(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    ingested = keyword_retrieval.client.ingest(
        org.ingester(),
        [document("vpn", "Connect to the VPN before opening the wiki.", groups=["staff"])],
    )
    assert (ingested[0].result.chunks, ingested[0].result.embedded_chunks) == (1, 0)

    answer = keyword_retrieval.client.search(org.reader(groups=["staff"]), "vpn wiki", ["handbook"])

    assert answer.mode == retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY
    assert answer.mode_reason == "no embedder is configured; these results are keyword-only"
    assert [(r.document_id, r.keyword_rank, r.dense_rank) for r in answer.results] == [
        ("vpn", 1, 0)
    ]
    stats = keyword_retrieval.client.stats(org.ingester())
    assert (stats.chunks, stats.embedded_chunks, stats.embedder) == (1, 0, "")


def test_with_qdrant_unreachable_search_is_keyword_only_and_ingest_changes_nothing(
    retrieval: RunningRetrieval,
    unreachable_qdrant_retrieval: RunningRetrieval,
    org: Org,
) -> None:
    degraded = unreachable_qdrant_retrieval.client
    retrieval.client.ingest(
        org.ingester(),
        [document("badge", "Badges are printed at the front desk.", groups=["staff"])],
    )

    failed = degraded.ingest(
        org.ingester(),
        [document("printer", "The printer is on the second floor.", groups=["staff"])],
    )
    assert outcomes(failed) == ["DOCUMENT_OUTCOME_FAILED"]
    assert "vector store is unreachable" in failed[0].result.error

    answer = degraded.search(org.reader(groups=["staff"]), "badges printed printer", ["handbook"])
    assert answer.mode == retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY
    assert answer.mode_reason == "the vector store is unreachable; these results are keyword-only"
    assert [r.document_id for r in answer.results] == ["badge"]
    assert retrieval.client.stats(org.ingester()).documents == 1


# ---------------------------------------------------------------- the mode asked for

MODES = retrieval_pb2.SearchMode


def test_a_keyword_only_search_runs_only_bm25_and_says_it_was_asked_for(
    retrieval: RunningRetrieval, org: Org
) -> None:
    retrieval.client.ingest(
        org.ingester(),
        [
            document("expenses", HANDBOOK, groups=["staff"]),
            document("canteen", "Lunch in the canteen costs four euros.", groups=["staff"]),
        ],
    )
    reader = org.reader(groups=["staff"])

    answer = retrieval.client.search(
        reader, "meals reimbursed", ["handbook"], mode=MODES.SEARCH_MODE_KEYWORD_ONLY
    )

    assert answer.mode == MODES.SEARCH_MODE_KEYWORD_ONLY
    assert answer.mode_reason == "keyword-only was asked for; dense search did not run"
    assert [(r.document_id, r.keyword_rank, r.dense_rank) for r in answer.results] == [
        ("expenses", 1, 0)
    ]
    assert answer.results[0].dense_score == 0


def test_a_dense_only_search_runs_only_the_vectors_and_says_it_was_asked_for(
    retrieval: RunningRetrieval, org: Org
) -> None:
    retrieval.client.ingest(
        org.ingester(),
        [
            document("expenses", HANDBOOK, groups=["staff"]),
            document("canteen", "Lunch in the canteen costs four euros.", groups=["staff"]),
        ],
    )

    answer = retrieval.client.search(
        org.reader(groups=["staff"]), "zzzqx meals", ["handbook"], mode=MODES.SEARCH_MODE_DENSE_ONLY
    )

    assert answer.mode == MODES.SEARCH_MODE_DENSE_ONLY
    assert answer.mode_reason == "dense-only was asked for; keyword search did not run"
    assert {r.document_id for r in answer.results} == {"expenses", "canteen"}
    assert all(r.keyword_rank == 0 and r.dense_rank > 0 for r in answer.results)
    assert all(r.bm25_score == 0 and r.dense_score > 0 for r in answer.results)


def test_hybrid_asked_for_or_left_unspecified_is_the_same_answer(
    retrieval: RunningRetrieval, org: Org
) -> None:
    retrieval.client.ingest(org.ingester(), [document("expenses", HANDBOOK, groups=["staff"])])
    reader = org.reader(groups=["staff"])
    unspecified = retrieval.client.search(reader, "meals reimbursed", ["handbook"])
    hybrid = retrieval.client.search(
        reader, "meals reimbursed", ["handbook"], mode=MODES.SEARCH_MODE_HYBRID
    )
    assert unspecified == hybrid
    assert hybrid.mode == MODES.SEARCH_MODE_HYBRID and hybrid.mode_reason == ""


def test_dense_only_without_an_embedder_is_a_failed_precondition_saying_why(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    keyword_retrieval.client.ingest(
        org.ingester(), [document("vpn", "Connect to the VPN first.", groups=["staff"])]
    )
    with pytest.raises(grpc.RpcError) as caught:
        keyword_retrieval.client.search(
            org.reader(groups=["staff"]), "vpn", ["handbook"], mode=MODES.SEARCH_MODE_DENSE_ONLY
        )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "needs an embedder and none is configured" in (caught.value.details() or "")
    keyword = keyword_retrieval.client.search(
        org.reader(groups=["staff"]), "vpn", ["handbook"], mode=MODES.SEARCH_MODE_KEYWORD_ONLY
    )
    assert keyword.mode_reason == "keyword-only was asked for; dense search did not run"


def test_dense_only_with_the_vector_store_down_is_unavailable_not_keyword_results(
    unreachable_qdrant_retrieval: RunningRetrieval, org: Org
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        unreachable_qdrant_retrieval.client.search(
            org.reader(), "vpn", ["handbook"], mode=MODES.SEARCH_MODE_DENSE_ONLY
        )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "vector store is unreachable" in (caught.value.details() or "")


def test_a_mode_the_contract_does_not_define_is_refused_at_the_door(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        keyword_retrieval.client.search(org.reader(), "vpn", ["handbook"], mode=7)  # type: ignore[arg-type]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mode is 7" in (caught.value.details() or "")


def test_a_word_only_in_the_title_is_found_by_both_halves(
    retrieval: RunningRetrieval, org: Org
) -> None:
    text = "Twenty weeks are paid in full; tell your manager three months ahead."
    retrieval.client.ingest(
        org.ingester(),
        [
            document("titled", text, title="Parental leave", groups=["staff"]),
            document("untitled", text, title="Section 7", groups=["staff"]),
        ],
    )
    reader = org.reader(groups=["staff"])

    keyword = retrieval.client.search(
        reader, "parental", ["handbook"], mode=MODES.SEARCH_MODE_KEYWORD_ONLY
    )
    dense = retrieval.client.search(
        reader, "parental leave", ["handbook"], mode=MODES.SEARCH_MODE_DENSE_ONLY
    )

    assert [r.document_id for r in keyword.results] == ["titled"]
    assert [r.document_id for r in dense.results] == ["titled", "untitled"]
    assert dense.results[0].dense_score > dense.results[1].dense_score
