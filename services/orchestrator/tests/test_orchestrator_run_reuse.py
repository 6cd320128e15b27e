"""No repeated work in a run, and independent I/O at once: a search_knowledge call
with the prefetch's query is answered from the prefetch (retrieval, reached over
real gRPC, sees one Search), and memory recall and the prefetch are in flight
together, with their steps still recorded memory first."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clock import FakeClock
from cairn_libs.fence import block_body as tool_data
from cairn_orchestrator.domain import (
    CallCredentials,
    ConversationTurn,
    MemorySubject,
    RecallOutcome,
    Run,
    RunState,
    SearchOutcome,
)
from cairn_orchestrator.knowledge_tool import search_knowledge_tool
from cairn_orchestrator.loop import RunLoop
from cairn_orchestrator.ports import KnowledgeSearch, MemoryRecall
from cairn_orchestrator.remote import RetrievalClient
from cairn_orchestrator.run_scope import Caller
from cairn_orchestrator.testing import (
    ALICE,
    FakeMemory,
    MemoryRunStore,
    ScriptedGateway,
    answer,
    chunk,
    handbook_spec,
    memory,
    tool_calls,
)
from cairn_orchestrator.tools import ToolRegistry

QUESTION = "How much parental leave?"
CALLER = Caller(principal=ALICE, token="alice-own-token")
WAIT_SECONDS = 10.0


class StandInRetrieval(retrieval_pb2_grpc.RetrievalServiceServicer):
    """Retrieval over real gRPC: keeps every Search and who asked."""

    def __init__(self) -> None:
        self.searches: list[tuple[str, tuple[str, ...], int, str]] = []

    async def Search(
        self, request: retrieval_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> retrieval_pb2.SearchResponse:
        authorization = dict(context.invocation_metadata()).get("authorization", "")
        self.searches.append((request.query, tuple(request.sources), request.k, str(authorization)))
        n = len(self.searches)
        return retrieval_pb2.SearchResponse(
            results=[
                retrieval_pb2.SearchResult(
                    document_id=f"doc-{n}-{i}",
                    chunk_id=f"doc-{n}-{i}#0",
                    source="handbook",
                    title=f"Policy {n}.{i}",
                    char_start=0,
                    char_end=20,
                    text=f"Passage {n}.{i}.",
                    fused_score=1.0 / i,
                )
                for i in (1, 2)
            ],
            mode=retrieval_pb2.SEARCH_MODE_KEYWORD_ONLY,
            mode_reason="no embedder is configured",
        )


@dataclass
class Served:
    servicer: StandInRetrieval
    client: RetrievalClient


@pytest.fixture
async def retrieval_stand_in() -> AsyncIterator[Served]:
    server = grpc.aio.server()
    servicer = StandInRetrieval()
    retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = RetrievalClient(f"127.0.0.1:{port}")
    try:
        yield Served(servicer, client)
    finally:
        await client.close()
        await server.stop(grace=None)


def loop_with(
    gateway: ScriptedGateway, retrieval: KnowledgeSearch, memory_port: MemoryRecall
) -> tuple[RunLoop, MemoryRunStore]:
    clock = FakeClock()
    store = MemoryRunStore(clock)
    registry = ToolRegistry()
    registry.register(search_knowledge_tool(retrieval))
    loop = RunLoop(
        store=store,
        gateway=gateway,
        retrieval=retrieval,
        memory=memory_port,
        registry=registry,
        mint_actor_token=lambda run_id, agent: f"actor-token-for-{run_id}",
        clock=clock,
    )
    return loop, store


async def start(loop: RunLoop) -> Run:
    return await loop.start(
        spec=handbook_spec(),
        caller=CALLER,
        question=QUESTION,
        conversation_id="conv-1",
        earlier=[ConversationTurn("user", "hello")],
    )


def search(query: str) -> tuple[str, str]:
    return ("search_knowledge", json.dumps({"query": query}))


async def test_a_search_for_the_question_reuses_the_prefetch_and_its_step_says_so(
    retrieval_stand_in: Served,
) -> None:
    gateway = ScriptedGateway([tool_calls(search(QUESTION)), answer("Sixteen weeks [S2].")])
    loop, store = loop_with(gateway, retrieval_stand_in.client, FakeMemory(memories=[memory(1)]))

    run = await start(loop)

    assert run.state is RunState.COMPLETED, run.reason
    # One Search reached retrieval, the prefetch's, with the caller's own token (I1)
    # and the spec's sources (I7).
    assert retrieval_stand_in.servicer.searches == [
        (QUESTION, ("handbook",), 4, f"Bearer {CALLER.token}")
    ]
    steps = store.runs[run.run_id].steps
    assert [s.kind.value for s in steps] == [
        "MEMORY_READ",
        "RETRIEVAL",
        "MODEL_CALL",
        "TOOL_CALL",
        "MODEL_CALL",
    ]
    tool_step = steps[3]
    assert tool_step.detail["reused_prefetch"] is True and tool_step.error is None
    # The model read the same passages under the labels the prefetch gave them.
    assert tool_step.detail["labels"] == ["S1", "S2"]
    result = json.loads(tool_data(gateway.requests[1].messages[-1].content))
    assert [(r["label"], r["document_id"]) for r in result["results"]] == [
        ("S1", "doc-1-1"),
        ("S2", "doc-1-2"),
    ]
    assert result["mode"] == "KEYWORD_ONLY"
    assert [(c.label, c.document_id) for c in run.citations] == [("S2", "doc-1-2")]


async def test_a_search_for_anything_else_reaches_retrieval_and_claims_no_reuse(
    retrieval_stand_in: Served,
) -> None:
    gateway = ScriptedGateway([tool_calls(search("leave policy")), answer("See [S3].")])
    loop, store = loop_with(gateway, retrieval_stand_in.client, FakeMemory(memories=[memory(1)]))

    run = await start(loop)

    assert run.state is RunState.COMPLETED, run.reason
    assert [query for query, *_ in retrieval_stand_in.servicer.searches] == [
        QUESTION,
        "leave policy",
    ]
    tool_step = store.runs[run.run_id].steps[3]
    assert "reused_prefetch" not in tool_step.detail
    assert tool_step.detail["labels"] == ["S3", "S4"]


async def test_a_second_run_with_the_same_question_searches_again(
    retrieval_stand_in: Served,
) -> None:
    gateway = ScriptedGateway([answer("First."), answer("Second.")])
    loop, _ = loop_with(gateway, retrieval_stand_in.client, FakeMemory(memories=[memory(1)]))

    first, second = await start(loop), await start(loop)

    assert (first.state, second.state) == (RunState.COMPLETED, RunState.COMPLETED)
    # The prefetch is reused within its own run only.
    assert [query for query, *_ in retrieval_stand_in.servicer.searches] == [QUESTION, QUESTION]


@dataclass
class Overlap:
    recall_started: asyncio.Event = field(default_factory=asyncio.Event)
    search_started: asyncio.Event = field(default_factory=asyncio.Event)
    recall_saw_search: bool = False
    search_saw_recall: bool = False


@dataclass
class HeldMemory(FakeMemory):
    """Recall that stays in flight until the prefetch has started too."""

    overlap: Overlap = field(default_factory=Overlap)

    async def recall(
        self,
        *,
        query: str,
        k: int,
        credentials: CallCredentials,
        deadline_seconds: float,
        subject: MemorySubject | None = None,
        include_profile: bool = False,
    ) -> RecallOutcome:
        self.overlap.recall_started.set()
        try:
            await asyncio.wait_for(self.overlap.search_started.wait(), WAIT_SECONDS)
            self.overlap.recall_saw_search = True
        except TimeoutError:
            pass
        return await super().recall(
            query=query,
            k=k,
            credentials=credentials,
            deadline_seconds=deadline_seconds,
            subject=subject,
            include_profile=include_profile,
        )


@dataclass
class HeldRetrieval:
    """A search that stays in flight until recall has started too."""

    overlap: Overlap
    calls: list[str] = field(default_factory=list)

    async def search(
        self,
        *,
        query: str,
        sources: Sequence[str],
        k: int,
        credentials: CallCredentials,
        deadline_seconds: float,
    ) -> SearchOutcome:
        self.calls.append(query)
        self.overlap.search_started.set()
        try:
            await asyncio.wait_for(self.overlap.recall_started.wait(), WAIT_SECONDS)
            self.overlap.search_saw_recall = True
        except TimeoutError:
            pass
        return SearchOutcome(results=(chunk(1),), mode="HYBRID", mode_reason="")


async def test_recall_and_the_prefetch_are_in_flight_together_and_recorded_memory_first() -> None:
    overlap = Overlap()
    memory_port = HeldMemory(memories=[memory(1)], overlap=overlap)
    loop, store = loop_with(
        ScriptedGateway([answer("Sixteen weeks [S1].")]), HeldRetrieval(overlap), memory_port
    )

    run = await start(loop)

    assert run.state is RunState.COMPLETED, run.reason
    # Each saw the other already started: neither waited for the other to finish.
    assert (overlap.recall_saw_search, overlap.search_saw_recall) == (True, True)
    kinds = [s.kind.value for s in store.runs[run.run_id].steps]
    assert kinds[:2] == ["MEMORY_READ", "RETRIEVAL"]
