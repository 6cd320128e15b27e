"""The typed step details are stored as the JSON the trajectory has always held
(and the panel reads): the same keys, in the same order, optional keys only when
they apply."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cairn_orchestrator.domain import (
    ArchivedTurnDetail,
    ConfirmationRequestedDetail,
    ConversationArchiveDetail,
    ErrorValue,
    LabelledChunk,
    MemoryReadDetail,
    ModelAttempt,
    ModelCallDetail,
    RetrievalDetail,
    ToolCallRequest,
)
from cairn_orchestrator.testing import chunk, tool_calls
from cairn_orchestrator.tools import ToolCallOutcome


def items(detail: dict[str, Any]) -> list[tuple[str, Any]]:
    return list(detail.items())


def test_a_memory_read_that_answered_names_its_mode_and_the_memories_it_read() -> None:
    detail = MemoryReadDetail(k=5, mode="SEMANTIC", mode_reason="", memory_ids=("m1", "m2"))
    assert items(detail.to_json()) == [
        ("k", 5),
        ("mode", "SEMANTIC"),
        ("mode_reason", ""),
        ("count", 2),
        ("memory_ids", ["m1", "m2"]),
    ]


def test_a_memory_read_that_failed_has_no_mode() -> None:
    assert items(MemoryReadDetail(k=3).to_json()) == [("k", 3), ("count", 0), ("memory_ids", [])]


def test_a_retrieval_lists_each_result_with_its_label_and_scores() -> None:
    labelled = LabelledChunk(label="S1", chunk=chunk(1))
    detail = RetrievalDetail(
        k=4,
        sources=("handbook",),
        mode="KEYWORD_ONLY",
        mode_reason="no embedder",
        results=(labelled,),
    )
    assert detail.to_json() == {
        "k": 4,
        "sources": ["handbook"],
        "mode": "KEYWORD_ONLY",
        "mode_reason": "no embedder",
        "count": 1,
        "results": [
            {
                "label": "S1",
                "document_id": "doc-1",
                "chunk_id": "doc-1#0",
                "source": "handbook",
                "title": "Policy 1",
                "char_start": 0,
                "char_end": 100,
                "bm25_score": 0.0,
                "dense_score": 0.0,
                "fused_score": 0.0,
            }
        ],
    }
    assert list(detail.to_json())[:4] == ["k", "sources", "mode", "mode_reason"]
    failed = RetrievalDetail(k=4, sources=("handbook",)).to_json()
    assert items(failed) == [("k", 4), ("sources", ["handbook"]), ("count", 0), ("results", [])]


def test_a_model_call_says_what_was_asked_then_who_answered_and_why_a_turn_was_rerun() -> None:
    asked = ModelCallDetail(
        tier="balanced",
        max_tokens=800,
        remaining_budget_tokens=900,
        messages=3,
        tools_offered=("a",),
    )
    assert items(asked.to_json()) == [
        ("tier", "balanced"),
        ("max_tokens", 800),
        ("remaining_budget_tokens", 900),
        ("messages", 3),
        ("tools_offered", ["a"]),
    ]
    reply = replace(
        tool_calls(("note", "{}"), tokens=50),
        attempts=(ModelAttempt("scripted", "scripted-model", "ok", 200, 1.5, ""),),
    )
    answered = ModelCallDetail(
        tier="fast",
        max_tokens=1,
        remaining_budget_tokens=2,
        messages=1,
        tools_offered=(),
        reply=reply,
    ).to_json()
    assert list(answered)[5:] == [
        "provider",
        "model",
        "usage",
        "attempts",
        "finish_reason",
        "tool_calls",
        "answer_chars",
    ]
    assert answered["usage"] == {"prompt_tokens": 40, "completion_tokens": 10, "total_tokens": 50}
    assert answered["attempts"] == [
        {
            "provider": "scripted",
            "model": "scripted-model",
            "outcome": "ok",
            "http_status": 200,
            "latency_ms": 1.5,
            "detail": "",
        }
    ]
    assert answered["tool_calls"] == [{"id": "call-0", "name": "note"}]
    rerun = ModelCallDetail(
        tier="fast",
        max_tokens=1,
        remaining_budget_tokens=2,
        messages=1,
        tools_offered=(),
        rerun="why",
    ).to_json()
    assert list(rerun)[-1] == "rerun" and rerun["rerun"] == "why"


def test_a_tool_call_keeps_its_result_unless_it_failed_and_marks_a_confirmed_write() -> None:
    call = ToolCallRequest(id="c1", name="note", arguments_json='{"text":"hi"}')
    outcome = ToolCallOutcome(
        call=call, content="{}", arguments={"text": "hi"}, result={"ok": True}, result_bytes=11
    )
    assert items(outcome.detail()) == [
        ("tool_call_id", "c1"),
        ("arguments", {"text": "hi"}),
        ("truncated", False),
        ("result_bytes", 11),
        ("result", {"ok": True}),
    ]
    confirmed = replace(outcome.step_detail(), attempt=2).to_json()
    assert list(confirmed)[-2:] == ["confirmed", "attempt"] and confirmed["attempt"] == 2
    reused = replace(outcome.step_detail(), reused_prefetch=True).to_json()
    assert list(reused)[-1] == "reused_prefetch"
    imported = ToolCallOutcome(
        call=call,
        content="",
        error=None,
        source="directory",
        transport="mcp",
        knowledge=(LabelledChunk("S1", chunk(1)),),
    ).detail()
    assert list(imported)[-3:] == ["labels", "source", "transport"]
    unparsed = ToolCallOutcome(
        call=ToolCallRequest(id="c2", name="note", arguments_json="{oops"),
        content="",
        error=ErrorValue("tool.bad_arguments", "the arguments are not JSON"),
    ).detail()
    assert "result" not in unparsed and unparsed["arguments"] == "{oops"


def test_a_conversation_archive_says_note_and_failed_turns_only_when_there_are_some() -> None:
    detail = ConversationArchiveDetail(
        conversation_id="conv",
        turns=3,
        window_turns=2,
        evicted_turns=1,
        clipped_turns=1,
        window_tokens=40,
        archived=(
            ArchivedTurnDetail(
                turn=0, role="user", chars=900, block_id="r1", already_archived=False
            ),
        ),
        cited_block_ids=("r1",),
    )
    assert items(detail.to_json()) == [
        ("conversation_id", "conv"),
        ("turns", 3),
        ("window_turns", 2),
        ("evicted_turns", 1),
        ("clipped_turns", 1),
        ("window_tokens", 40),
        (
            "archived",
            [
                {
                    "turn": 0,
                    "role": "user",
                    "chars": 900,
                    "block_id": "r1",
                    "already_archived": False,
                }
            ],
        ),
        ("cited_block_ids", ["r1"]),
    ]
    noted = replace(detail, note="n", failed_turns=(0,))
    assert list(noted.to_json())[-2:] == ["note", "failed_turns"]
    assert noted.to_json()["failed_turns"] == [0]


def test_a_confirmation_request_adds_nothing_before_the_store_writes_its_card() -> None:
    assert ConfirmationRequestedDetail().to_json() == {}
