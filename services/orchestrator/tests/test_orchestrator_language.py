"""The person's language: a StartRun's BCP 47 tag becomes the language the run's
cards are written in ("en" or "zh-Hans"), kept with the run (so a card proposed
after a confirmation, on another orchestrator, is in it too), shown as
Run.language, handed to tools as ToolContext.language, and said on every card
(language, language_fallback). A tag cairn has no text in falls back to English,
visibly; what is not a language tag at all is refused, naming the value."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from cairn_libs.clock import FakeClock
from cairn_libs.db import Database
from cairn_libs.errors import InvalidInput
from cairn_libs.identity import Principal
from cairn_orchestrator.confirmations import shown_card
from cairn_orchestrator.domain import (
    CallCredentials,
    Confirmation,
    ConfirmationCard,
    ConfirmationState,
    LabelBook,
    PendingConfirmation,
    Run,
    RunLanguage,
    RunState,
    ToolCallRequest,
    card_language,
)
from cairn_orchestrator.memory_tools import (
    CARD_TEXT,
    memory_tools,
    remember_card,
    update_profile_card,
)
from cairn_orchestrator.servicer import run_to_proto
from cairn_orchestrator.testing import FakeMemory, ScriptedGateway, answer, tool_calls
from cairn_orchestrator.tools import ToolContext
from services.orchestrator.tests.test_orchestrator_confirmations import Harness

NOW = datetime(2025, 1, 1, tzinfo=UTC)
REMEMBER_TEA = ("remember", '{"text":"Prefers green tea.","subject":{"kind":"USER"}}')
REMEMBER_CAKE = ("remember", '{"text":"Likes cake.","subject":{"kind":"USER"}}')
HAN = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(scope="module")
async def database(pg_url: str) -> Any:
    from cairn_orchestrator.postgres import SCHEMA, migrations

    db = Database(url=pg_url, schema=SCHEMA, migrations=migrations())
    assert await db.ready()
    yield db
    await db.close()


# ---------------------------------------------------------------- normalising the tag


@pytest.mark.parametrize(
    ("tag", "expected"),
    [
        ("", RunLanguage("en")),
        ("en", RunLanguage("en")),
        ("en-GB", RunLanguage("en")),
        ("EN-us", RunLanguage("en")),
        ("zh", RunLanguage("zh-Hans")),
        ("zh-CN", RunLanguage("zh-Hans")),
        ("zh-sg", RunLanguage("zh-Hans")),
        ("zh-Hans", RunLanguage("zh-Hans")),
        ("zh-Hans-CN", RunLanguage("zh-Hans")),
        ("zh-Hant", RunLanguage("en", fallback=True)),
        ("zh-TW", RunLanguage("en", fallback=True)),
        ("zh-Hant-HK", RunLanguage("en", fallback=True)),
        ("fr", RunLanguage("en", fallback=True)),
        ("de-CH-1996", RunLanguage("en", fallback=True)),
    ],
)
def test_a_language_tag_becomes_english_or_simplified_chinese(
    tag: str, expected: RunLanguage
) -> None:
    assert card_language(tag) == expected


@pytest.mark.parametrize(
    "tag",
    ["zh_CN", "en US", "e", "123", "en-", "-en", "zh--CN", "en-" + "a" * 9, "x" * 36, "en\x00"],
)
def test_what_is_not_a_language_tag_is_refused_naming_the_value(tag: str) -> None:
    with pytest.raises(ValueError, match="is not a BCP 47 language tag") as raised:
        card_language(tag)
    assert repr(tag[:20])[:-1] in str(raised.value)


# ---------------------------------------------------------------- the built-in cards


def context(language: str) -> ToolContext:
    return ToolContext(
        principal=Principal(org_id="org-a", user_id="alice"),
        run_id="run_1",
        agent="assistant",
        remaining_tokens=1000,
        sources=(),
        credentials=CallCredentials(caller_token="t", actor_token="a"),
        labels=LabelBook(),
        language=language,
    )


def test_both_languages_have_every_card_text() -> None:
    assert set(CARD_TEXT["zh-Hans"]) == set(CARD_TEXT["en"])
    without_words = {"tags_joiner", "importance_value"}
    untranslated = [
        key
        for key, text in CARD_TEXT["zh-Hans"].items()
        if key not in without_words and not HAN.search(text)
    ]
    assert untranslated == []


def _every_text(card: ConfirmationCard) -> list[str]:
    return [card.summary, *card.warnings, *(d.label for d in card.details)]


def test_the_remember_card_is_written_in_simplified_chinese_for_a_chinese_run() -> None:
    arguments = {
        "text": "Prefers green tea.",
        "subject": {"kind": "CANDIDATE", "id": "cand-17"},
        "claim_type": "INFERENCE",
        "tags": ["drinks", "office"],
        "importance": 3,
    }
    card = remember_card(arguments, context("zh-Hans"), now=NOW, ttl=timedelta(days=90))
    assert card.language == "zh-Hans" and not card.language_fallback
    assert all(HAN.search(text) for text in _every_text(card))
    details = {d.label: d.value for d in card.details}
    assert details["将保存的内容"] == "Prefers green tea."
    assert details["关于"] == "候选人 cand-17"
    assert details["信息性质"] == "推断"
    assert details["保存至"].startswith("2025-04-01（从现在起 90 天）")
    assert details["标签"] == "drinks、office" and details["重要程度"] == "3/5"
    assert card.summary == "保存一条关于候选人 cand-17的记忆：“Prefers green tea.”"
    assert card.warnings[0].startswith("个人数据") and "2025-04-01" in card.warnings[0]
    assert "推断" in card.warnings[1]
    english = remember_card(arguments, context("en"), now=NOW, ttl=timedelta(days=90))
    assert english.language == "en" and not HAN.search(" ".join(_every_text(english)))
    assert [d.value for d in english.details][0] == "Prefers green tea."


def test_the_update_profile_card_is_written_in_simplified_chinese_for_a_chinese_run() -> None:
    arguments = {
        "subject": {"kind": "USER"},
        "key": "preferred_language",
        "value": "German",
        "previous_value": "English",
    }
    card = update_profile_card(arguments, context("zh-Hans"), now=NOW, ttl=timedelta(hours=12))
    assert card.language == "zh-Hans"
    assert all(HAN.search(text) for text in _every_text(card))
    details = {d.label: d.value for d in card.details}
    assert details["关于"] == "用户 alice（提问者本人）"
    assert details["原值"].startswith("“English”") and details["新值"] == "German"
    assert "12 小时" in details["保存至"]
    assert card.summary == "将用户 alice（提问者本人）的 preferred_language 设为“German”"


def test_a_card_shown_again_after_an_interruption_speaks_the_cards_language() -> None:
    card = remember_card(
        {"text": "Likes tea.", "subject": {"kind": "USER"}},
        context("zh-Hans"),
        now=NOW,
        ttl=timedelta(days=90),
    )
    confirmation = Confirmation(
        token="cnf_x",
        org_id="org-a",
        run_id="run_1",
        user_id="alice",
        call=ToolCallRequest(id="c", name="remember", arguments_json="{}"),
        card=card,
        state=ConfirmationState.EXECUTING,
        created_at=NOW,
        expires_at=NOW + timedelta(hours=1),
        resolved_at=NOW,
    )
    shown = shown_card(confirmation)
    assert (
        shown.warnings[0].startswith("你已于 2025-01-01")
        and "最多只会生效一次" in shown.warnings[0]
    )
    assert shown.details[-1].label == "状态" and shown.language == "zh-Hans"


def test_the_proto_run_carries_the_language_and_the_cards_language() -> None:
    card = ConfirmationCard(summary="Keep it", language="en", language_fallback=True)
    run = Run(
        run_id="run_1",
        org_id="org-a",
        user_id="alice",
        agent="a",
        state=RunState.CONFIRMATION_PENDING,
        input="q",
        conversation_id="",
        trace_id="",
        created_at=NOW,
        updated_at=NOW,
        language="en",
        language_fallback=True,
        pending_confirmation=PendingConfirmation(
            confirmation_token="cnf_x",
            run_id="run_1",
            tool_name="remember",
            card=card,
            created_at=NOW,
            expires_at=NOW,
        ),
    )
    message = run_to_proto(run)
    assert message.language == "en"
    assert message.pending_confirmation.card.language == "en"
    assert message.pending_confirmation.card.language_fallback is True
    chinese = run_to_proto(replace(run, language="zh-Hans", pending_confirmation=None))
    assert chinese.language == "zh-Hans"


# ---------------------------------------------------------------- through runs


def _with_memory_tools(database: Database, gateway: ScriptedGateway, org: str) -> Harness:
    """A harness whose agent may also remember (the memory tools registered)."""
    clock = FakeClock()
    return Harness(
        database,
        gateway,
        org,
        clock=clock,
        extra_tools=tuple(memory_tools(FakeMemory(), clock=clock)),
        offered=("search_knowledge", "note", "remember"),
    )


async def _ask(harness: Harness, language: str) -> Run:
    return await harness.orchestrator.start_run(
        harness.alice,
        agent=harness.spec.name,
        question="Remember that I prefer green tea.",
        conversation_id="",
        earlier=[],
        language=language,
    )


async def test_a_run_asked_in_chinese_proposes_chinese_cards_even_after_resuming_elsewhere(
    database: Database, new_org: str
) -> None:
    first = _with_memory_tools(
        database, ScriptedGateway([tool_calls(REMEMBER_TEA, REMEMBER_CAKE)]), new_org
    )
    run = await _ask(first, "zh-CN")
    assert run.state is RunState.CONFIRMATION_PENDING and run.language == "zh-Hans"
    assert run.pending_confirmation is not None
    card = run.pending_confirmation.card
    assert card.language == "zh-Hans" and not card.language_fallback
    assert card.summary == "保存一条关于用户 alice（提问者本人）的记忆：“Prefers green tea.”"
    # Another orchestrator (its own store and lease owner) continues the run: the
    # language comes from the stored run, not from the process that started it.
    second = _with_memory_tools(database, ScriptedGateway([answer("好的。")]), new_org)
    again = await second.resolve(run)
    assert again.state is RunState.CONFIRMATION_PENDING and again.language == "zh-Hans"
    assert again.pending_confirmation is not None
    assert again.pending_confirmation.card.summary.startswith("保存一条关于")
    assert again.pending_confirmation.card.language == "zh-Hans"
    listed = await second.orchestrator.get_run(second.alice.principal, run.run_id)
    assert listed.language == "zh-Hans" and not listed.language_fallback
    done = await second.resolve(again)
    assert done.state is RunState.COMPLETED and done.language == "zh-Hans"


async def test_a_run_asked_in_a_language_without_card_text_shows_english_marked_as_fallback(
    database: Database, new_org: str
) -> None:
    harness = _with_memory_tools(database, ScriptedGateway([tool_calls(REMEMBER_TEA)]), new_org)
    run = await _ask(harness, "fr-FR")
    assert run.language == "en" and run.language_fallback
    assert run.pending_confirmation is not None
    card = run.pending_confirmation.card
    assert card.language == "en" and card.language_fallback
    assert card.summary.startswith("Keep a memory about")
    (listed,) = await harness.orchestrator.pending_confirmations(harness.alice.principal)
    assert listed.card.language_fallback


async def test_a_tool_whose_card_has_no_chinese_text_is_marked_as_a_fallback_in_a_chinese_run(
    database: Database, new_org: str
) -> None:
    # The harness's `note` tool writes its card in English only.
    harness = Harness(database, ScriptedGateway([tool_calls(("note", '{"text":"tea"}'))]), new_org)
    run = await _ask(harness, "zh-Hans")
    assert run.language == "zh-Hans" and run.pending_confirmation is not None
    card = run.pending_confirmation.card
    assert card.language == "en" and card.language_fallback


async def test_an_english_run_has_english_cards_that_are_not_a_fallback(
    database: Database, new_org: str
) -> None:
    harness = _with_memory_tools(database, ScriptedGateway([tool_calls(REMEMBER_TEA)]), new_org)
    run = await _ask(harness, "")
    assert run.language == "en" and not run.language_fallback
    assert run.pending_confirmation is not None
    card = run.pending_confirmation.card
    assert card.language == "en" and not card.language_fallback


async def test_start_run_refuses_a_malformed_language_before_any_work(
    database: Database, new_org: str
) -> None:
    harness = Harness(database, ScriptedGateway([]), new_org)
    with pytest.raises(InvalidInput, match=r"language 'zh_CN' is not a BCP 47 language tag"):
        await _ask(harness, "zh_CN")
    assert harness.gateway.requests == []
    runs = await harness.orchestrator.list_runs(
        harness.alice.principal, requested_size=5, page_token=""
    )
    assert runs.runs == ()
