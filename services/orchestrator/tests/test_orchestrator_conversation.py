"""Conversation compaction: which earlier turns travel, which large ones are archived
first and named by reference, and how a run records it; without a network.
(The window's bound, clipping and eviction basics are in the phases tests.)"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from cairn_libs.clock import FakeClock
from cairn_libs.fence import NONCE_PATTERN
from cairn_libs.fence import block_body as tool_data
from cairn_libs.token_estimate import estimate_tokens
from cairn_orchestrator.conversation import CompactedConversation, ConversationArchiver
from cairn_orchestrator.conversation_window import (
    ARCHIVE_AT_CHARS,
    CONVERSATION_TOKEN_BOUND,
    CONVERSATION_TURN_CHARS,
    cited_block_ids,
    plan_conversation,
    window_lines,
)
from cairn_orchestrator.domain import (
    CallCredentials,
    ConversationTurn,
    ModelReply,
    ModelRequest,
    Run,
    RunState,
    StepKind,
)
from cairn_orchestrator.errors import DependencyFailed
from cairn_orchestrator.knowledge_tool import search_knowledge_tool
from cairn_orchestrator.loop import RunLoop
from cairn_orchestrator.memory_tools import RECALL, memory_tools
from cairn_orchestrator.run_scope import Caller
from cairn_orchestrator.testing import (
    ALICE,
    FakeMemory,
    FakeRetrieval,
    MemoryRunStore,
    Reply,
    ScriptedGateway,
    answer,
    handbook_spec,
    tool_calls,
)
from cairn_orchestrator.tools import ToolRegistry

CREDENTIALS = CallCredentials(caller_token="alice-own-token", actor_token="actor")


def large(tag: str, chars: int = 1500) -> str:
    """A message of `chars` characters whose whitespace must survive verbatim."""
    body = f"[{tag}] " + "  ".join(f"word{i}\n" for i in range(chars))
    return body[:chars]


def turns(*contents: str) -> list[ConversationTurn]:
    return [
        ConversationTurn("user" if i % 2 == 0 else "assistant", c) for i, c in enumerate(contents)
    ]


# ---------------------------------------------------------------- the pure plan


def test_a_turn_of_eight_hundred_characters_is_archived_and_one_shorter_is_not() -> None:
    plan = plan_conversation(turns("a" * (ARCHIVE_AT_CHARS - 1), "b" * ARCHIVE_AT_CHARS))
    assert [block.turn for block in plan.to_archive] == [1]
    (block,) = plan.to_archive
    assert block.content == "b" * ARCHIVE_AT_CHARS and block.role == "assistant"
    assert block.label.startswith("assistant message, 800 characters: bbb")
    assert [entry.archived for entry in plan.entries] == [False, True]


def test_a_kept_large_turn_travels_clipped_and_names_its_archived_block() -> None:
    plan = plan_conversation(turns(large("budget")))
    (line,) = window_lines(plan, {0: "r42"})
    head, _, text = line.partition("): ")
    assert head == "user (1500 characters, clipped; the whole message is recall:r42"
    assert len(text) == CONVERSATION_TURN_CHARS and text.endswith("…")
    assert text.startswith("[budget] word0 word1")  # one line, whitespace collapsed
    assert cited_block_ids(plan, {0: "r42"}) == ("r42",)


def test_an_evicted_large_turn_is_archived_but_its_reference_no_longer_travels() -> None:
    old = large("oldest")
    recent = [f"recent turn {i} " + "x" * 380 for i in range(8)]
    plan = plan_conversation(turns(old, *recent))
    assert plan.evicted >= 1 and plan.entries[0].turn > 0
    assert [block.turn for block in plan.to_archive] == [0]
    ids = {0: "r5"}
    assert cited_block_ids(plan, ids) == ()
    assert not any("recall:r5" in line for line in window_lines(plan, ids))


def test_references_age_out_oldest_first_like_any_other_line() -> None:
    contents = [large(f"big{i}", 900) for i in range(6)]
    plan = plan_conversation(turns(*contents))
    ids = {i: f"r{100 + i}" for i in range(6)}
    cited = cited_block_ids(plan, ids)
    assert cited == tuple(ids[e.turn] for e in plan.entries)
    assert cited[-1] == "r105" and "r100" not in cited  # the newest kept, the oldest gone
    assert [e.turn for e in plan.entries] == sorted(e.turn for e in plan.entries)


def test_a_large_turn_that_could_not_be_archived_says_so_in_its_line() -> None:
    (line,) = window_lines(plan_conversation(turns(large("x"))), {})
    assert line.startswith("user (1500 characters, clipped; not archived): [x]")


@given(
    st.lists(st.integers(min_value=0, max_value=3000), max_size=25),
    st.integers(min_value=1, max_value=10**18 - 1),
)
def test_the_window_stays_within_its_bound_whatever_ids_the_archive_hands_out(
    lengths: list[int], widest_number: int
) -> None:
    plan = plan_conversation(turns(*("z" * n for n in lengths)))
    ids = {block.turn: f"r{widest_number}" for block in plan.to_archive}
    lines = window_lines(plan, ids)
    assert sum(estimate_tokens(line) for line in lines) <= CONVERSATION_TOKEN_BOUND
    assert len(plan.to_archive) == sum(1 for n in lengths if n >= ARCHIVE_AT_CHARS)


# ---------------------------------------------------------------- the archiver


async def compact(
    archiver: ConversationArchiver, earlier: list[ConversationTurn], *, conversation: str = "conv-1"
) -> CompactedConversation:
    return await archiver.compact(
        plan_conversation(earlier),
        org_id="org-a",
        user_id="alice",
        conversation_id=conversation,
        credentials=CREDENTIALS,
        deadline_seconds=5,
    )


async def test_compaction_archives_every_large_turn_verbatim_with_the_callers_credentials() -> None:
    fake = FakeMemory()
    earlier = turns(large("first"), "short reply", large("second", 2000))
    result = await ConversationArchiver(fake).compact(
        plan_conversation(earlier),
        org_id="org-a",
        user_id="alice",
        conversation_id="conv-1",
        credentials=CREDENTIALS,
        deadline_seconds=5,
    )
    kept = {block.content: block for block in fake.blocks.values()}
    assert set(kept) == {earlier[0].content, earlier[2].content}
    assert {b.conversation_id for b in kept.values()} == {"conv-1"}
    assert {b.role for b in kept.values()} == {"user"}
    assert all(creds == CREDENTIALS for _, _, creds in fake.writes)
    archived = result.detail.archived
    assert [(a.turn, a.chars) for a in archived] == [(0, 1500), (2, 2000)]
    cited = result.detail.cited_block_ids
    assert cited and all(any(f"recall:{c}" in line for line in result.lines) for c in cited)
    assert result.error is None


async def test_the_same_long_message_sent_with_the_next_turn_is_not_archived_again() -> None:
    fake = FakeMemory()
    archiver = ConversationArchiver(fake)
    earlier = turns(large("kept once"))
    first = await compact(archiver, earlier)
    again = await compact(archiver, [*earlier, ConversationTurn("assistant", "ok")])
    assert len(fake.blocks) == 1
    assert again.detail.archived[0].already_archived is True
    assert again.detail.cited_block_ids == first.detail.cited_block_ids
    other = await compact(archiver, earlier, conversation="conv-2")
    assert len(fake.blocks) == 2 and other.detail.archived[0].already_archived is False


async def test_a_failed_archive_leaves_the_turn_clipped_unreferenced_and_says_why() -> None:
    fake = FakeMemory(archive_failure=DependencyFailed("memory", "UNAVAILABLE", "connect failed"))
    result = await compact(ConversationArchiver(fake), turns(large("lost?")))
    assert result.error is not None and result.error.code == "memory.unavailable"
    assert "1 of 1 large turns could not be archived" in result.error.message
    assert "not archived" in result.lines[0]
    assert result.detail.to_json()["failed_turns"] == [0]


async def test_without_a_memory_service_large_turns_are_clipped_and_the_record_says_why() -> None:
    result = await compact(ConversationArchiver(None), turns(large("nowhere")))
    assert result.error is None
    assert "keeps no memories" in result.detail.to_json()["note"]
    assert result.detail.to_json()["cited_block_ids"] == []


# ---------------------------------------------------------------- in a run


class RunHarness:
    def __init__(self, replies: list[Reply], *, memory: FakeMemory | None) -> None:
        self.clock = FakeClock()
        self.store = MemoryRunStore(self.clock)
        self.gateway = ScriptedGateway(replies=list(replies))
        self.memory = memory
        registry = ToolRegistry()
        registry.register(search_knowledge_tool(FakeRetrieval()))
        for tool in memory_tools(memory, clock=self.clock):
            registry.register(tool)
        self.loop = RunLoop(
            store=self.store,
            gateway=self.gateway,
            retrieval=FakeRetrieval(),
            memory=memory,
            registry=registry,
            mint_actor_token=lambda run_id, agent: f"actor-token-for-{run_id}",
            clock=self.clock,
            conversation=ConversationArchiver(memory),
        )

    async def start(
        self, earlier: list[ConversationTurn], *, conversation_id: str = "conv-1"
    ) -> Run:
        return await self.loop.start(
            spec=handbook_spec(tools=("search_knowledge", RECALL), sources=(), reads_memory=False),
            caller=Caller(principal=ALICE, token="alice-own-token"),
            question="What did I say about the budget?",
            conversation_id=conversation_id,
            earlier=earlier,
        )


def conversation_block(request: ModelRequest) -> str:
    user = request.messages[1].content
    lines = user.split("\n")
    start = next(
        i
        for i, line in enumerate(lines)
        if (m := NONCE_PATTERN.match(line)) and m["kind"] == "conversation"
    )
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("<<<END-CAIRN-DATA"))
    return "\n".join(lines[start:end])


async def test_a_run_archives_large_turns_cites_them_in_the_fenced_window_and_records_it() -> None:
    fake = FakeMemory()
    earlier = turns(large("budget talk"), "Noted.")
    run = RunHarness([answer("You said the budget was agreed.")], memory=fake)
    finished = await run.start(earlier)
    assert finished.state is RunState.COMPLETED
    (block_id,) = fake.blocks
    assert fake.blocks[block_id].content == earlier[0].content
    window = conversation_block(run.gateway.requests[0])
    assert f"recall:{block_id}" in window and "assistant: Noted." in window
    assert f"recall:{block_id}" not in run.gateway.requests[0].messages[0].content
    (step,) = [s for s in run.store.runs[finished.run_id].steps if s.name == "conversation"]
    assert step.kind is StepKind.CONVERSATION_ARCHIVE and step.error is None
    assert step.detail["cited_block_ids"] == [block_id]
    assert step.detail["archived"][0]["block_id"] == block_id


async def test_the_model_brings_an_archived_turn_back_verbatim_with_recall() -> None:
    fake = FakeMemory()
    earlier = turns(large("the exact words"))

    def recall_what_the_window_names(request: ModelRequest) -> ModelReply:
        reference = next(
            word.rstrip("):")
            for word in conversation_block(request).split()
            if word.startswith("recall:")
        )
        return tool_calls((RECALL, json.dumps({"id": reference})))

    run = RunHarness([recall_what_the_window_names, answer("Here it is.")], memory=fake)
    finished = await run.start(earlier)
    assert finished.state is RunState.COMPLETED
    tool_message = run.gateway.requests[1].messages[-1]
    assert tool_message.role == "tool" and tool_message.name == RECALL
    assert json.loads(tool_data(tool_message.content))["content"] == earlier[0].content


async def test_a_run_with_only_short_turns_records_no_conversation_step() -> None:
    run = RunHarness([answer("Fine.")], memory=FakeMemory())
    finished = await run.start(turns("hello", "hi"))
    assert [s.name for s in run.store.runs[finished.run_id].steps] == ["scripted-model"]
    assert run.memory is not None and run.memory.blocks == {}


async def test_a_run_without_a_conversation_id_archives_into_one_of_its_own() -> None:
    fake = FakeMemory()
    run = RunHarness([answer("Fine.")], memory=fake)
    finished = await run.start(turns(large("solo")), conversation_id="")
    (block,) = fake.blocks.values()
    assert block.conversation_id == finished.run_id
