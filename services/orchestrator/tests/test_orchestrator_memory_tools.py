"""The built-in memory tools without a network: what their confirmation cards tell a
person, what reaches the memory service and with whose credentials, how memory
service failures come back as data, and what a deployment without memory answers."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cairn_libs.clock import FakeClock
from cairn_libs.errors import DENIAL_MESSAGE
from cairn_libs.identity import Principal
from cairn_libs.memory_block import NEVER_A_REASON
from cairn_orchestrator.domain import (
    ArchivedBlock,
    CallCredentials,
    ConfirmationCard,
    LabelBook,
    MemorySubject,
    ProfileFact,
    ToolCallRequest,
)
from cairn_orchestrator.errors import DependencyFailed
from cairn_orchestrator.memory_tools import (
    MEMORY_TOOL_NAMES,
    NO_MEMORIES,
    RECALL,
    RECALL_MEMORY,
    RECALL_SEARCH,
    REMEMBER,
    UPDATE_PROFILE,
    block_id_of,
    memory_tools,
    remember_card,
    update_profile_card,
)
from cairn_orchestrator.testing import FakeMemory, memory
from cairn_orchestrator.tools import (
    CONFIRMATION_UNAVAILABLE,
    INVALID_INPUT,
    ToolCallOutcome,
    ToolContext,
    ToolRegistry,
    dispatch,
)

NOW = datetime(2025, 1, 1, tzinfo=UTC)
CREDENTIALS = CallCredentials(caller_token="alice-own-token", actor_token="actor-token-for-run_1")


def context(*, confirmed: bool = False, user: str = "alice") -> ToolContext:
    return ToolContext(
        principal=Principal(org_id="org-a", user_id=user),
        run_id="run_1",
        agent="assistant",
        remaining_tokens=1000,
        sources=(),
        credentials=CREDENTIALS,
        labels=LabelBook(),
        confirmation_token="conf-1" if confirmed else None,
    )


def registry(fake: FakeMemory | None, *, ttl: timedelta = timedelta(days=90)) -> ToolRegistry:
    tools = ToolRegistry()
    for tool in memory_tools(fake, clock=FakeClock(), ttl=ttl):
        tools.register(tool)
    return tools


async def call(
    tools: ToolRegistry, name: str, arguments: dict[str, Any], *, confirmed: bool = False
) -> ToolCallOutcome:
    request = ToolCallRequest(id="call-1", name=name, arguments_json=json.dumps(arguments))
    return await dispatch(tools, request, context(confirmed=confirmed))


def card_details(card: ConfirmationCard) -> dict[str, str]:
    return {detail.label: detail.value for detail in card.details}


def remember_args(**changes: Any) -> dict[str, Any]:
    return {
        "text": "Prefers interviews in the morning.",
        "subject": {"kind": "CANDIDATE", "id": "cand-17"},
        "claim_type": "USER_STATEMENT",
    } | changes


# ---------------------------------------------------------------- registration


def test_all_five_memory_tools_register_and_only_the_two_writes_need_a_person() -> None:
    tools = registry(FakeMemory())
    assert set(MEMORY_TOOL_NAMES) <= set(tools.names())
    needing = {name for name in MEMORY_TOOL_NAMES if tools.get(name).confirmation_required}  # type: ignore[union-attr]
    assert needing == {REMEMBER, UPDATE_PROFILE}
    for name in (REMEMBER, UPDATE_PROFILE):
        tool = tools.get(name)
        assert tool is not None and tool.effect == "write" and tool.card is not None


# ---------------------------------------------------------------- the remember card


def test_the_remember_card_says_what_about_whom_by_whom_and_until_when() -> None:
    card = remember_card(remember_args(), context(), now=NOW, ttl=timedelta(days=90))
    details = card_details(card)
    assert details["What will be kept"] == "Prefers interviews in the morning."
    assert details["About"] == "candidate cand-17"
    assert "an agent (assistant, in run run_1), not a person" in details["Written by"]
    assert details["Kept until"].startswith("2025-04-01 (90 days from now)")
    assert details["Claim"] == "a user's statement"
    assert (
        card.summary
        == 'Keep a memory about candidate cand-17: "Prefers interviews in the morning."'
    )


def test_the_remember_card_warns_that_a_memory_about_a_person_is_personal_data() -> None:
    card = remember_card(remember_args(), context(), now=NOW, ttl=timedelta(days=90))
    (warning,) = card.warnings
    assert warning.startswith("Personal data: this is about a person (candidate cand-17).")
    assert "until 2025-04-01" in warning and "erased" in warning


def test_a_workspace_memory_is_not_personal_data_and_carries_no_warning() -> None:
    card = remember_card(
        remember_args(text="The office closes at six.", subject={"kind": "WORKSPACE"}),
        context(),
        now=NOW,
        ttl=timedelta(days=90),
    )
    assert card.warnings == ()
    assert card_details(card)["About"] == "the workspace (not a person)"


def test_a_user_subject_without_an_id_is_the_person_asking() -> None:
    card = remember_card(
        remember_args(subject={"kind": "USER"}), context(user="alice"), now=NOW, ttl=timedelta(1)
    )
    assert card_details(card)["About"] == "user alice (the person asking)"
    assert card.warnings and "user alice" in card.warnings[0]


def test_an_inference_about_a_person_is_flagged_as_the_agents_own() -> None:
    card = remember_card(
        remember_args(claim_type="INFERENCE"), context(), now=NOW, ttl=timedelta(days=90)
    )
    assert card_details(card)["Claim"] == "an inference"
    assert any("inference about a person" in w for w in card.warnings)


def test_the_card_promises_the_deployments_time_to_live() -> None:
    card = remember_card(remember_args(), context(), now=NOW, ttl=timedelta(days=30))
    assert card_details(card)["Kept until"].startswith("2025-01-31 (30 days from now)")
    hours = remember_card(remember_args(), context(), now=NOW, ttl=timedelta(hours=12))
    assert card_details(hours)["Kept until"].startswith("2025-01-01 (12 hours from now)")


def test_the_registered_card_renders_with_the_clock_and_the_configured_ttl() -> None:
    tool = registry(FakeMemory(), ttl=timedelta(days=7)).get(REMEMBER)
    assert tool is not None and tool.card is not None
    card = tool.card(remember_args(), context())
    assert card_details(card)["Kept until"].startswith("2025-01-08 (7 days from now)")


# ---------------------------------------------------------------- the update_profile card


def test_the_update_profile_card_shows_the_key_the_old_value_and_the_new_one() -> None:
    arguments = {
        "subject": {"kind": "USER"},
        "key": "preferred_language",
        "value": "German",
        "previous_value": "English",
    }
    card = update_profile_card(arguments, context(), now=NOW, ttl=timedelta(days=90))
    details = card_details(card)
    assert details["Fact"] == "preferred_language"
    assert details["Old value"].startswith('"English"')
    assert details["New value"] == "German"
    assert details["About"] == "user alice (the person asking)"
    assert "not a person" in details["Written by"] and details["Kept until"].startswith(
        "2025-04-01"
    )
    assert card.summary == 'Set preferred_language for user alice (the person asking) to "German"'
    assert card.warnings and card.warnings[0].startswith("Personal data")


def test_an_old_value_the_agent_does_not_know_is_said_to_be_unknown() -> None:
    arguments = {"subject": {"kind": "WORKSPACE"}, "key": "office_hours", "value": "9-17"}
    card = update_profile_card(arguments, context(), now=NOW, ttl=timedelta(days=90))
    assert card_details(card)["Old value"].startswith("not known to the agent")
    assert card.warnings == ()


# ---------------------------------------------------------------- writes reach memory


async def test_remember_is_refused_without_an_approval_and_never_reaches_memory() -> None:
    fake = FakeMemory()
    outcome = await call(registry(fake), REMEMBER, remember_args())
    assert outcome.error is not None and outcome.error.code == CONFIRMATION_UNAVAILABLE
    assert fake.writes == []


async def test_an_approved_remember_reaches_memory_with_the_callers_and_the_runs_tokens() -> None:
    fake = FakeMemory()
    outcome = await call(
        registry(fake), REMEMBER, remember_args(tags=["interview"], importance=3), confirmed=True
    )
    assert outcome.error is None, outcome.error
    (name, arguments, credentials), *_ = fake.writes
    assert name == "remember" and credentials == CREDENTIALS
    assert arguments == {
        "text": "Prefers interviews in the morning.",
        "subject": MemorySubject("CANDIDATE", "cand-17"),
        "claim_type": "USER_STATEMENT",
        "tags": ["interview"],
        "importance": 3,
    }
    assert outcome.result["kept"] is True
    assert outcome.result["origin"] == "written by an agent in run run_1 on 2025-01-01"
    assert outcome.result["kept_until"] == "2025-04-01"


async def test_what_is_kept_is_exactly_what_the_card_showed() -> None:
    fake = FakeMemory()
    arguments = remember_args(text="  Prefers   interviews\tin the morning. ")
    tools = registry(fake)
    tool = tools.get(REMEMBER)
    assert tool is not None and tool.card is not None
    shown = card_details(tool.card(arguments, context()))["What will be kept"]
    await call(tools, REMEMBER, arguments, confirmed=True)
    assert fake.writes[0][1]["text"] == shown == "Prefers interviews in the morning."


@pytest.mark.parametrize(
    "arguments",
    [
        remember_args(subject={"kind": "CANDIDATE"}),  # a person must be named
        remember_args(subject={"kind": "EMPLOYEE", "id": "  "}),
        remember_args(subject={"kind": "WORKSPACE", "id": "bob"}),  # the workspace is nobody
        remember_args(author_kind="PERSON"),  # a model cannot claim a person wrote it
        remember_args(text="Line one.\nLine two."),
        remember_args(text="x" * 301),
        remember_args(claim_type="FACT"),
    ],
)
async def test_arguments_memory_would_refuse_are_invalid_input_before_anything_runs(
    arguments: dict[str, Any],
) -> None:
    fake = FakeMemory()
    outcome = await call(registry(fake), REMEMBER, arguments, confirmed=True)
    assert outcome.error is not None and outcome.error.code == INVALID_INPUT
    assert fake.writes == []


@pytest.mark.parametrize(
    ("status", "code", "message"),
    [
        ("INVALID_ARGUMENT", "memory.invalid_input", "text holds 2 sentences"),
        ("FAILED_PRECONDITION", "memory.conflict", "text holds 2 sentences"),
        ("PERMISSION_DENIED", "memory.denied", DENIAL_MESSAGE),
        ("UNAUTHENTICATED", "memory.denied", DENIAL_MESSAGE),
        ("UNAVAILABLE", "memory.unavailable", "nothing was written"),
        ("DEADLINE_EXCEEDED", "memory.unavailable", "may or may not have been written"),
        ("INTERNAL", "memory.failed", "text holds 2 sentences"),
    ],
)
async def test_each_memory_service_failure_comes_back_as_a_tool_error_code(
    status: str, code: str, message: str
) -> None:
    fake = FakeMemory(failure=DependencyFailed("memory", status, "text holds 2 sentences"))
    outcome = await call(registry(fake), REMEMBER, remember_args(), confirmed=True)
    assert outcome.error is not None
    assert outcome.error.code == code and message in outcome.error.message


async def test_an_approved_profile_change_reaches_memory_with_its_previous_value() -> None:
    fake = FakeMemory()
    arguments = {
        "subject": {"kind": "USER"},
        "key": "preferred_language",
        "value": "German",
        "previous_value": "English",
    }
    outcome = await call(registry(fake), UPDATE_PROFILE, arguments, confirmed=True)
    assert outcome.error is None, outcome.error
    (name, sent, credentials), *_ = fake.writes
    assert name == "update_profile" and credentials == CREDENTIALS
    assert sent == {
        "subject": MemorySubject("USER", "alice"),
        "key": "preferred_language",
        "value": "German",
        "previous_value": "English",
    }
    assert outcome.result["updated"] is True and outcome.result["value"] == "German"


class _AlreadyChanged(FakeMemory):
    """A memory service in which an earlier attempt already set the new value."""

    async def update_profile(self, **kwargs: Any) -> ProfileFact:
        raise DependencyFailed("memory", "FAILED_PRECONDITION", "previous_value is not current")


async def test_a_profile_change_handed_over_again_after_it_took_effect_is_not_a_conflict() -> None:
    current = ProfileFact(
        subject_kind="USER",
        subject_id="alice",
        key="preferred_language",
        value="German",
        author_kind="MODEL",
        author_id="assistant",
        run_id="run_1",
        created_at=NOW,
        expires_at=NOW + timedelta(days=90),
    )
    arguments = {
        "subject": {"kind": "USER"},
        "key": "preferred_language",
        "value": "German",
        "previous_value": "English",
    }
    done = await call(
        registry(_AlreadyChanged(profile=[current])), UPDATE_PROFILE, arguments, confirmed=True
    )
    assert done.error is None and done.result["value"] == "German"
    elsewhere = replace(current, value="French")
    conflict = await call(
        registry(_AlreadyChanged(profile=[elsewhere])), UPDATE_PROFILE, arguments, confirmed=True
    )
    assert conflict.error is not None and conflict.error.code == "memory.conflict"


# ---------------------------------------------------------------- reads


async def test_recall_memory_returns_what_is_in_force_with_origins_and_the_pinned_sentence() -> (
    None
):
    expired = replace(memory(2), expires_at=datetime(2024, 6, 1, tzinfo=UTC))
    by_agent = replace(memory(3), author_kind="MODEL", author_id="assistant", run_id="run_9")
    fake = FakeMemory(memories=[memory(1), expired, by_agent])
    outcome = await call(registry(fake), RECALL_MEMORY, {"query": "answers", "k": 3})
    assert outcome.error is None
    result = outcome.result
    assert [m["memory_id"] for m in result["memories"]] == ["m1", "m3"]
    assert result["memories"][0]["origin"] == "noted by alice on 2024-01-01"
    assert result["memories"][1]["origin"] == "written by an agent in run run_9 on 2024-01-01"
    assert result["memories"][0]["about"] == "user alice"
    assert result["note"] == NEVER_A_REASON
    assert "profile" not in result
    assert fake.calls[-1][:2] == ("answers", 3) and fake.calls[-1][2] == CREDENTIALS


async def test_recall_memory_about_one_subject_brings_its_profile_facts() -> None:
    fact = ProfileFact(
        subject_kind="USER",
        subject_id="alice",
        key="preferred_language",
        value="German",
        author_kind="PERSON",
        author_id="alice",
        run_id="",
        created_at=NOW,
        expires_at=NOW + timedelta(days=90),
        earlier_values=("English",),
    )
    fake = FakeMemory(memories=[memory(1)], profile=[fact])
    outcome = await call(registry(fake), RECALL_MEMORY, {"subject": {"kind": "USER"}})
    assert fake.recall_subjects[-1] == MemorySubject("USER", "alice")
    (profile,) = outcome.result["profile"]
    assert profile["key"] == "preferred_language" and profile["value"] == "German"
    assert profile["earlier_values"] == ["English"]


async def test_recall_brings_an_archived_block_back_verbatim_by_the_reference_the_prompt_uses() -> (
    None
):
    verbatim = "Line one.\n\n  Indented   line two, with  double spaces.\n"
    fake = FakeMemory(
        blocks={
            "r7": ArchivedBlock(
                block_id="r7",
                label="user message",
                role="user",
                content=verbatim,
                conversation_id="conv-1",
                created_at=NOW,
            )
        }
    )
    tools = registry(fake)
    for reference in ("recall:r7", "r7", "R7", " 7 "):
        outcome = await call(tools, RECALL, {"id": reference})
        assert outcome.error is None, reference
        assert outcome.result["content"] == verbatim
        assert outcome.result["id"] == "recall:r7" and outcome.result["role"] == "user"


async def test_recall_of_a_block_that_is_missing_or_not_yours_is_the_one_denial() -> None:
    outcome = await call(registry(FakeMemory()), RECALL, {"id": "r404"})
    assert outcome.error is not None
    assert (outcome.error.code, outcome.error.message) == ("memory.denied", DENIAL_MESSAGE)


async def test_a_block_sealed_without_a_key_is_said_to_be_unreadable() -> None:
    sealed = ArchivedBlock(
        block_id="r3",
        label="l",
        role="user",
        content="",
        conversation_id="c",
        created_at=NOW,
        readable=False,
    )
    outcome = await call(registry(FakeMemory(blocks={"r3": sealed})), RECALL, {"id": "r3"})
    assert outcome.error is not None and outcome.error.code == "memory.sealed"


async def test_recall_search_lists_references_and_excerpts_not_whole_blocks() -> None:
    long_text = "The relocation budget was agreed at length. " * 40
    fake = FakeMemory(
        blocks={
            "r2": ArchivedBlock(
                block_id="r2",
                label="user message about relocation",
                role="user",
                content=long_text,
                conversation_id="conv-1",
                created_at=NOW,
            )
        }
    )
    outcome = await call(registry(fake), RECALL_SEARCH, {"query": "relocation", "limit": 3})
    (found,) = outcome.result["blocks"]
    assert found["id"] == "recall:r2" and "content" not in found
    assert len(found["excerpt"]) <= 280 and found["excerpt"].endswith("…")


def test_a_reference_is_read_the_way_the_prompt_writes_it() -> None:
    assert [block_id_of(raw) for raw in ("recall:r12", "r12", "R12", "12 ")] == ["r12"] * 4


# ---------------------------------------------------------------- no memory at all


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        (REMEMBER, remember_args()),
        (
            UPDATE_PROFILE,
            {"subject": {"kind": "WORKSPACE"}, "key": "office_hours", "value": "9-17"},
        ),
        (RECALL_MEMORY, {"query": "anything"}),
        (RECALL, {"id": "recall:r1"}),
        (RECALL_SEARCH, {"query": "anything"}),
    ],
)
async def test_a_deployment_that_keeps_no_memories_says_so_plainly_instead_of_failing(
    name: str, arguments: dict[str, Any]
) -> None:
    outcome = await call(registry(None), name, arguments)
    assert outcome.error is None
    assert NO_MEMORIES in outcome.result["note"]


def test_without_memory_the_writes_ask_nobody_because_they_cannot_change_anything() -> None:
    tools = registry(None)
    assert not any(tools.get(name).confirmation_required for name in MEMORY_TOOL_NAMES)  # type: ignore[union-attr]
    assert all(NO_MEMORIES in tools.get(name).description for name in MEMORY_TOOL_NAMES)  # type: ignore[union-attr]
