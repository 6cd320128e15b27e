"""I6: every refusal reads the same. Whether the thing does not exist or belongs to
someone else, each service answers with one code and one message, so a caller
cannot tell the two apart."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from cairn.memory.v1 import memory_pb2, memory_pb2_grpc
from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.errors import DENIAL_CODE, DENIAL_MESSAGE
from tests.conftest import Stack


def _refusal(
    method: Callable[..., Any], request: Any, metadata: Any
) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        method(request, metadata=metadata, timeout=10)
    return caught.value.code(), caught.value.details() or ""


def test_someone_elses_run_reads_like_a_run_that_does_not_exist(stack: Stack) -> None:
    owner = call_metadata(stack.token("maria", ["manager"]))
    stranger = call_metadata(stack.token("tom", ["employee"]))
    with grpc.insecure_channel(stack.addresses["orchestrator"]) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        run = stub.StartRun(
            orchestrator_pb2.StartRunRequest(
                agent="handbook", input="How many days of leave do I get?"
            ),
            metadata=owner,
            timeout=60,
        ).run
        refusals = {
            _refusal(stub.GetRun, orchestrator_pb2.GetRunRequest(run_id=rid), stranger)
            for rid in (run.run_id, f"run_{uuid.uuid4().hex}")
        } | {
            _refusal(
                stub.GetTrajectory, orchestrator_pb2.GetTrajectoryRequest(run_id=rid), stranger
            )
            for rid in (run.run_id, f"run_{uuid.uuid4().hex}")
        }
    assert refusals == {(DENIAL_CODE, DENIAL_MESSAGE)}


def test_another_orgs_document_reads_like_a_document_that_does_not_exist(stack: Stack) -> None:
    other_org = stack.token("loader", ["ingester"], org=f"org-{uuid.uuid4().hex[:10]}")
    with grpc.insecure_channel(stack.addresses["retrieval"]) as ch:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(ch)
        refusals = {
            _refusal(
                stub.DeleteDocument,
                retrieval_pb2.DeleteDocumentRequest(document_id=document_id),
                call_metadata(other_org),
            )
            for document_id in ("handbook-bonus-pool-2026", f"doc-{uuid.uuid4().hex}")
        }
        # The document is still there for its own org.
        stats = stub.Stats(
            retrieval_pb2.StatsRequest(),
            metadata=call_metadata(stack.token("loader", ["ingester"])),
            timeout=10,
        )
    assert refusals == {(DENIAL_CODE, DENIAL_MESSAGE)}
    assert stats.documents == len(stack.corpus["documents"])


def test_someone_elses_archived_block_reads_like_a_block_that_does_not_exist(stack: Stack) -> None:
    conversation = f"conv-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(stack.addresses["memory"]) as ch:
        stub = memory_pb2_grpc.MemoryServiceStub(ch)
        block_id = stub.Archive(
            memory_pb2.ArchiveRequest(
                label="notes", role="user", content="Private notes.", conversation_id=conversation
            ),
            metadata=call_metadata(stack.token("maria", ["manager"])),
            timeout=10,
        ).block_id
        stranger = call_metadata(stack.token("tom", ["employee"]))
        refusals = {
            _refusal(stub.RecallBlock, memory_pb2.RecallBlockRequest(block_id=bid), stranger)
            for bid in (block_id, "r999999999")
        }
    assert refusals == {(DENIAL_CODE, DENIAL_MESSAGE)}
