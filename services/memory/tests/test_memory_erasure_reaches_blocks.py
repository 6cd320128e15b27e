"""Forget reaches archived blocks (I9): a block names whom it is about, and Forget of
any of them leaves only its tombstone, in every table and in every RPC that shows it.
A holder of copies that cannot be reached makes Forget say so, never claim success."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cairn.memory.v1 import memory_pb2
from cairn_libs.identity import TokenIssuer
from cairn_libs.pytest_plugin import stored_text_locations
from cairn_libs.stack import ServiceProcess, free_port

from .conftest import ClientFactory, _start, client_factory

SECRET_STORY = "Dana Whitfield asked to move her interview because of a hospital visit"


def candidate(subject_id: str) -> memory_pb2.Subject:
    return memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_CANDIDATE, id=subject_id)


def archive_about(client: object, content: str, *subjects: memory_pb2.Subject) -> str:
    request = memory_pb2.ArchiveRequest(
        label=content[:40],
        role="user",
        content=content,
        conversation_id=f"conv-{uuid.uuid4().hex[:8]}",
        subjects=list(subjects),
    )
    return str(
        client.stub.Archive(request, metadata=client.metadata, timeout=20).block_id  # type: ignore[attr-defined]
    )


def test_forget_leaves_only_the_tombstone_of_a_block_about_the_subject(
    client: ClientFactory, pg_url: str
) -> None:
    maria = client("maria")
    subject = candidate(f"cand-{uuid.uuid4().hex[:8]}")
    story = f"{SECRET_STORY} ({uuid.uuid4().hex[:6]})."
    about_dana = archive_about(maria, story, subject)
    unrelated = archive_about(maria, f"The quarterly planning notes {uuid.uuid4().hex[:6]}.")

    erasure = maria.forget(subject).erasure

    assert erasure.blocks_erased == 1
    assert erasure.copies_erased, "no orchestrator is configured: memory held the only copies"
    tombstone = maria.recall_block(about_dana)
    assert tombstone.erased and tombstone.content == "" and tombstone.label == ""
    assert tombstone.block_id == about_dana
    assert maria.search_blocks("hospital interview") == []
    assert maria.recall_block(unrelated).content.startswith("The quarterly planning notes")
    assert stored_text_locations(pg_url, story, schemas=["memory"]) == []
    assert stored_text_locations(pg_url, "hospital visit", schemas=["memory"]) == []


def test_a_block_is_about_its_archiver_so_forgetting_oneself_erases_it(
    client: ClientFactory,
) -> None:
    tom = client("tom", roles=())
    block_id = tom.archive("My own notes", "Tom's own words about his week.", "conv-tom")

    assert tom.recall_block(block_id).subjects == [
        memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_USER, id="tom")
    ]
    erasure = tom.forget(memory_pb2.Subject(kind=memory_pb2.SUBJECT_KIND_USER, id="tom")).erasure
    assert erasure.blocks_erased == 1
    assert tom.recall_block(block_id).erased


def test_held_shows_how_many_blocks_an_erasure_blanked(client: ClientFactory) -> None:
    maria = client("maria")
    subject = candidate(f"cand-{uuid.uuid4().hex[:8]}")
    archive_about(maria, f"First note about the candidate {uuid.uuid4().hex[:6]}.", subject)
    archive_about(maria, f"Second note about the candidate {uuid.uuid4().hex[:6]}.", subject)
    maria.forget(subject)

    (record,) = maria.held(subject).erasures
    assert (record.blocks_erased, record.copies_erased) == (2, True)


@pytest.fixture(scope="module")
def unreachable_holder_process(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    # Nothing listens on this port: the orchestrator that holds copies is down.
    proc = _start(
        service_env,
        Path(tmp_path_factory.mktemp("memory-unreachable-logs")),
        suffix="-unreachable",
        CAIRN_EMBEDDER="none",
        CAIRN_ORCHESTRATOR_ADDR=f"127.0.0.1:{free_port()}",
    )
    yield proc
    proc.stop()


def test_forget_says_unavailable_when_a_holder_of_copies_is_down_and_keeps_its_own_erasure(
    unreachable_holder_process: ServiceProcess, issuer: TokenIssuer, new_org: str
) -> None:
    with grpc.insecure_channel(unreachable_holder_process.address) as channel:
        maria = client_factory(channel, issuer, new_org)("maria")
        subject = candidate("cand-down")
        maria.remember("The candidate prefers morning interviews.", subject)

        with pytest.raises(grpc.RpcError) as refused:
            maria.forget(subject)

        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "call Forget again" in (refused.value.details() or "")
        held = maria.held(subject)
        assert [m.state for m in held.memories] == [memory_pb2.MEMORY_STATE_ERASED]
        (record,) = held.erasures
        assert (record.memories_erased, record.copies_erased) == (1, False)
