"""What a caller can send retrieval that no store can hold, and what a restarting
database looks like to a caller: a document's own failure, INVALID_ARGUMENT naming
the field, or UNAVAILABLE; never INTERNAL, never a whole batch lost."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import asyncpg
import grpc
import pytest

from cairn.retrieval.v1 import retrieval_pb2
from cairn_libs.errors import DependencyUnavailable
from cairn_libs.stack import REPO_ROOT
from cairn_retrieval.postgres.corpus_counts import PostgresCorpusCounts

if TYPE_CHECKING:
    from conftest import Org, RunningRetrieval


def _document(document_id: str, text: str, **metadata: Any) -> retrieval_pb2.Document:
    document = retrieval_pb2.Document(
        document_id=document_id,
        source="handbook",
        title=document_id,
        text=text,
        acl=retrieval_pb2.Acl(groups=["staff"]),
    )
    if metadata:
        document.metadata.update(metadata)
    return document


def _outcomes(responses: Sequence[retrieval_pb2.IngestDocumentsResponse]) -> list[str]:
    return [
        retrieval_pb2.DocumentOutcome.Name(r.result.outcome).removeprefix("DOCUMENT_OUTCOME_")
        for r in responses
    ]


def test_a_nan_in_one_documents_metadata_fails_that_document_and_the_rest_are_ingested(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    responses = keyword_retrieval.client.ingest(
        org.ingester(),
        [
            _document("before", "Alpha text about onboarding.", pages=3),
            _document("poisoned", "Beta text about travel.", score=math.nan),
            _document("after", "Gamma text about offboarding.", tags=["a", "b"]),
        ],
    )

    assert _outcomes(responses) == ["INGESTED", "FAILED", "INGESTED"]
    assert responses[1].result.document_id == "poisoned"
    assert responses[1].result.error == (
        'documents[1].metadata["score"] is nan; send a finite number (no NaN or Infinity)'
    )
    assert keyword_retrieval.client.stats(org.ingester()).documents == 2


@pytest.mark.parametrize(
    ("poisoned", "error"),
    [
        (
            _document("d", "Text.", **{"key\x00": "v"}),
            "a key of documents[1].metadata contains U+0000, which cannot be stored; remove it",
        ),
        (
            _document("d", "Text.", note=["fine", "not\x00fine"]),
            'documents[1].metadata["note"][1] contains U+0000, which cannot be stored; remove it',
        ),
        (
            _document("d", "Text with a \x00 inside."),
            "documents[1].text contains U+0000, which cannot be stored; remove it",
        ),
        (
            _document("d", "Text.", depth={"inner": math.inf}),
            'documents[1].metadata["depth"]["inner"] is inf; send a finite number (no NaN or Infinity)',
        ),
    ],
    ids=["nul-in-a-metadata-key", "nul-in-a-metadata-list", "nul-in-the-text", "inf-nested"],
)
def test_text_or_numbers_no_store_can_hold_fail_only_their_own_document(
    keyword_retrieval: RunningRetrieval,
    org: Org,
    poisoned: retrieval_pb2.Document,
    error: str,
) -> None:
    responses = keyword_retrieval.client.ingest(
        org.ingester(), [_document("first", "Alpha text."), poisoned, _document("third", "Gamma.")]
    )

    assert _outcomes(responses) == ["INGESTED", "FAILED", "INGESTED"]
    assert responses[1].result.error == error


def test_the_rest_of_an_ingest_request_is_still_checked_at_the_door(
    keyword_retrieval: RunningRetrieval, org: Org
) -> None:
    # Only `documents` is left to the service; a search's fields are the door's.
    with pytest.raises(grpc.RpcError) as caught:
        keyword_retrieval.client.search(org.reader(groups=["staff"]), "travel", ["hand\x00book"])

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        "sources[0] contains U+0000, which cannot be stored; remove it"
    )


@pytest.mark.parametrize("document_id", ["a" * 5000, "tab\tid", " leading", "\u202eevil"])
def test_deleting_an_id_no_document_can_have_is_invalid_naming_it(
    keyword_retrieval: RunningRetrieval, org: Org, document_id: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        keyword_retrieval.client.delete(org.ingester(), document_id)

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not an id a document can have" in (caught.value.details() or "")


class _BrokenPool:
    """A pool whose every query fails the way a restarting PostgreSQL does."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    async def fetch(self, *_args: object) -> list[object]:
        raise self._error


class _Database:
    def __init__(self, error: BaseException) -> None:
        self.pool = _BrokenPool(error)


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.InternalClientError("got result for unknown protocol state 3"),
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.TooManyConnectionsError("sorry, too many clients already"),
        ConnectionResetError("reset by peer"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_every_way_a_database_restart_shows_itself_is_unavailable(
    error: BaseException,
) -> None:
    store = PostgresCorpusCounts(_Database(error))  # type: ignore[arg-type]

    with pytest.raises(DependencyUnavailable, match="retry shortly"):
        await store.counts_by_source("org", model_id="")


def test_a_misconfigured_retrieval_says_so_in_one_json_line_and_exits(
    service_env: dict[str, str], tmp_path: Any
) -> None:
    finished = subprocess.run(
        [sys.executable, "-m", "cairn_retrieval"],
        env={
            "PATH": "/usr/bin:/bin",
            **service_env,
            "CAIRN_QDRANT_PATH": str(tmp_path / "qdrant"),
            "CAIRN_EMBEDDER": "none",
            "CAIRN_QDRANT_ENGINE": "edgy",
        },
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )

    lines = (finished.stdout + finished.stderr).strip().splitlines()
    assert finished.returncode == 2
    assert "Traceback" not in finished.stderr
    assert len(lines) == 1, lines
    event = json.loads(lines[0])
    assert event["event"] == "service.config_invalid"
    assert "CAIRN_QDRANT_ENGINE='edgy'" in event["error"]
