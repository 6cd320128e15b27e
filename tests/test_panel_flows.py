"""The web panel end to end: Debian's headless chromium on the built panel,
served by the real REST proxy in front of the real services, signing in as the
dev stack's demo people. Each test is one thing a person does with the panel;
every view it passes through is checked by axe-core and saved as a screenshot
under build/panel-screenshots/."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from playwright.sync_api import Browser, Request, expect

from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.errors import DENIAL_MESSAGE
from cairn_libs.stack import REPO_ROOT
from tests.conftest import Stack
from tests.panel_support import PanelPage, chromium, panel_page, running_panel

pytestmark = pytest.mark.timeout(180)

BONUS = "How is the annual bonus calculated?"
# What only the managers-only chapter holds (demo/handbook.yaml).
MANAGERS_ONLY = (
    "Bonus pool 2026",
    "company factor of 0.9",
    "handbook-bonus-pool-2026",
    "9 percent",
)


@pytest.fixture(scope="module")
def panel_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_panel(
        addresses=stack.addresses,
        issuer=stack.issuer,
        org=stack.org,
        log_dir=tmp_path_factory.mktemp("panel"),
    ) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture
def panel(browser: Browser, panel_url: str, stack: Stack) -> Iterator[PanelPage]:
    _model_control(stack, "reset", {})
    with panel_page(browser, panel_url) as page:
        yield page
        assert page.page_errors == [], page.page_errors
        refused = [e for e in page.console_errors if "Content Security Policy" in e]
        assert refused == [], refused
    _model_control(stack, "reset", {})


def _model_control(stack: Stack, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        f"{stack.model_url}/_control/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _script(stack: Stack, *steps: dict[str, Any]) -> None:
    _model_control(stack, "script", {"steps": list(steps)})


def _accessible(panel: PanelPage, view: str) -> None:
    """axe-core finds no serious or critical violation, and the view is kept."""
    panel.screenshot(view)
    violations = panel.axe_violations()
    assert violations == [], (view, violations)


def _grpc_run(stack: Stack, token: str, run_id: str) -> orchestrator_pb2.Run:
    with grpc.insecure_channel(stack.addresses["orchestrator"]) as ch:
        return (
            orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
            .GetRun(
                orchestrator_pb2.GetRunRequest(run_id=run_id),
                metadata=call_metadata(token),
                timeout=10,
            )
            .run
        )


def _catalog(language: str) -> dict[str, str]:
    name = {"en": "en.ts", "zh-Hans": "zh-Hans.ts"}[language]
    text = (REPO_ROOT / "web" / "src" / "messages" / name).read_text()
    return dict(re.findall(r'^\s*"([\w.]+)": "((?:[^"\\]|\\.)*)",?$', text, flags=re.M))


def test_maria_sees_the_managers_only_bonus_citation_and_opens_its_text(panel: PanelPage) -> None:
    panel.sign_in_as("Maria (manager)")
    panel.ask(BONUS)
    assert panel.wait_for_state("RUN_STATE_COMPLETED") == "RUN_STATE_COMPLETED"
    # the managers-only chapter is among the passages retrieved under her rights
    retrieval = panel.page.get_by_test_id("timeline").locator("[data-step='STEP_KIND_RETRIEVAL']")
    assert "Bonus pool 2026 (managers only)" in retrieval.inner_text()
    assert panel.page.get_by_test_id("citations").get_by_role("button").count() >= 1
    # the offline demo model is said out loud
    assert "offline demo model" in panel.page.get_by_test_id("degraded").inner_text()
    _accessible(panel, "ask-answer-maria")
    retrieval.get_by_role("button", name=re.compile(r"Bonus pool 2026")).click()
    chunk = panel.page.get_by_test_id("cited-chunk")
    chunk.wait_for()
    assert "company factor of 0.9" in chunk.inner_text()
    _accessible(panel, "citation-document")


def test_a_follow_up_goes_in_the_same_conversation_with_the_earlier_turns(
    panel: PanelPage, stack: Stack
) -> None:
    started: list[dict[str, Any]] = []

    def record(request: Request) -> None:
        if request.method == "POST" and request.url.endswith("/v1/runs"):
            started.append(request.post_data_json or {})

    panel.page.on("request", record)
    panel.sign_in_as("Maria (manager)")
    panel.ask("How many days of leave do I get?")
    panel.wait_for_state("RUN_STATE_COMPLETED")
    first_run = str(panel.page.get_by_test_id("run").get_attribute("data-run-id"))
    first_answer = panel.page.get_by_test_id("answer").locator("p").inner_text()
    panel.ask("And how many carry over?")
    panel.page.wait_for_function(
        f"() => document.querySelector('[data-testid=run]')?.dataset.runId !== {first_run!r}"
    )
    panel.wait_for_state("RUN_STATE_COMPLETED")
    second_run = str(panel.page.get_by_test_id("run").get_attribute("data-run-id"))
    assert [r["language"] for r in started] == ["en", "en"]
    assert started[0]["conversationId"] == started[1]["conversationId"]
    assert started[0]["messages"] == []
    assert started[1]["messages"] == [
        {"role": "TURN_ROLE_USER", "content": "How many days of leave do I get?"},
        {"role": "TURN_ROLE_ASSISTANT", "content": first_answer},
    ]
    token = stack.token("maria", ["manager"])
    runs = [_grpc_run(stack, token, r) for r in (first_run, second_run)]
    assert runs[0].conversation_id == runs[1].conversation_id == started[0]["conversationId"]
    assert panel.page.get_by_role("heading", name="This conversation").count() == 1


def test_tom_asks_the_same_and_nothing_of_the_managers_chapter_appears_anywhere(
    panel: PanelPage,
) -> None:
    panel.sign_in_as("Tom (employee)")
    panel.ask(BONUS)
    assert panel.wait_for_state("RUN_STATE_COMPLETED") == "RUN_STATE_COMPLETED"
    # open every detail of every step, so hidden text would be on the screen too
    for summary in panel.page.locator("details > summary").all():
        summary.click()
    screen = panel.page.evaluate("() => document.documentElement.outerHTML")
    for secret in MANAGERS_ONLY:
        assert secret not in screen, secret
    assert "How bonuses work" in panel.page.get_by_test_id("citations").inner_text()
    _accessible(panel, "ask-answer-tom-steps-open")


def test_tom_approves_a_memory_then_sees_it_held_with_provenance_and_erases_it(
    panel: PanelPage, stack: Stack
) -> None:
    preference = f"Tom prefers the window seat on trains ({uuid.uuid4().hex[:6]})."
    _script(
        stack,
        {
            "action": "tool_call",
            "name": "remember",
            "arguments": {
                "text": preference,
                "subject": {"kind": "USER"},
                "claim_type": "USER_STATEMENT",
            },
        },
        {"action": "answer", "content": "Noted: I will remember your seat preference."},
    )
    panel.sign_in_as("Tom (employee)")
    panel.ask("Please remember that I prefer the window seat on trains.", agent="assistant")
    assert (
        panel.wait_for_state("RUN_STATE_CONFIRMATION_PENDING") == "RUN_STATE_CONFIRMATION_PENDING"
    )
    inline = panel.page.get_by_test_id("run").get_by_test_id("confirmation-card")
    assert preference in inline.inner_text()
    run_id = str(panel.page.get_by_test_id("run").get_attribute("data-run-id"))
    _accessible(panel, "confirmation-inline")

    panel.page.get_by_role("link", name="Waiting for you").click()
    waiting = panel.page.get_by_test_id("waiting").get_by_test_id("confirmation-card")
    waiting.first.wait_for()
    assert preference in waiting.inner_text()
    _accessible(panel, "waiting-for-you")
    waiting.get_by_role("button", name="Approve").click()

    # the approval goes on live in the run's view
    assert panel.wait_for_state("RUN_STATE_COMPLETED") == "RUN_STATE_COMPLETED"
    assert panel.page.url.endswith(f"/runs/{run_id}")
    assert "Noted: I will remember" in panel.page.get_by_test_id("answer").inner_text()
    # the approved run is a turn of the conversation, so a follow-up carries it
    panel.page.get_by_role("link", name="Ask").click()
    conversation = panel.page.locator("section.conversation")
    assert "Noted: I will remember your seat preference." in conversation.inner_text()
    timeline = panel.page.get_by_test_id("timeline")
    assert timeline.locator("[data-step='STEP_KIND_CONFIRMATION_RESOLVED']").count() == 1
    assert timeline.locator("[data-step='STEP_KIND_TOOL_CALL']").count() >= 1

    panel.page.get_by_role("link", name="What cairn holds about me").click()
    memories = panel.page.get_by_test_id("held-memories")
    memories.wait_for()
    held = memories.locator("li", has_text=preference)
    assert held.count() == 1
    provenance = held.locator(".provenance").inner_text()
    assert f"Written by an agent in run {run_id} for tom" in provenance
    assert "kept until" in provenance
    assert "USER_STATEMENT" in held.inner_text()
    _accessible(panel, "held-about-me")

    panel.page.get_by_role("button", name="Forget everything about me").click()
    _accessible(panel, "forget-confirm-step")
    panel.page.get_by_role("button", name="Yes, forget it").click()
    panel.page.get_by_test_id("erased").wait_for()
    assert preference not in panel.visible_text()
    record = panel.page.get_by_test_id("erasures").inner_text()
    assert "by tom" in record and "1 memories" in record
    _accessible(panel, "held-after-erasure")

    panel.page.get_by_role("link", name="Past runs").click()
    panel.page.locator("#state-filter").select_option("RUN_STATE_COMPLETED")
    panel.page.get_by_test_id("past-runs").get_by_role("button").first.wait_for()
    _accessible(panel, "past-runs")


def test_a_card_resolved_elsewhere_shows_the_services_message_and_approving_twice_is_harmless(
    panel: PanelPage, stack: Stack
) -> None:
    _script(
        stack,
        {
            "action": "tool_call",
            "name": "remember",
            "arguments": {"text": "Tom likes green tea.", "subject": {"kind": "USER"}},
        },
        {"action": "answer", "content": "Noted."},
    )
    panel.sign_in_as("Tom (employee)")
    panel.ask("Remember that I like green tea.", agent="assistant")
    panel.wait_for_state("RUN_STATE_CONFIRMATION_PENDING")
    # another tab of Tom's lists the same card, and keeps it on screen
    with panel_page(panel.page.context.browser, panel.base_url) as other:  # type: ignore[arg-type]
        other.goto("/waiting")
        other.page.get_by_role("button", name="Sign in as Tom (employee)").click()
        stale = other.page.get_by_test_id("waiting").get_by_test_id("confirmation-card")
        stale.filter(has_text="green tea").first.wait_for()
        panel.page.get_by_test_id("run").get_by_role("button", name="Approve").click()
        assert panel.wait_for_state("RUN_STATE_COMPLETED") == "RUN_STATE_COMPLETED"

        card = stale.filter(has_text="green tea").first
        # denying what was approved: the orchestrator's own message, on the card
        card.get_by_role("button", name="Deny").click()
        message = card.get_by_test_id("service-error")
        message.wait_for()
        assert "already approved by 'tom'" in message.locator(".service-message").inner_text()
        assert "Traceback" not in other.visible_text() and "TypeError" not in other.visible_text()
        _accessible(other, "deny-after-approval-message")
        # approving twice takes effect once and shows the finished run
        card.get_by_role("button", name="Approve").click()
        assert other.wait_for_state("RUN_STATE_COMPLETED") == "RUN_STATE_COMPLETED"
        assert other.page.get_by_test_id("service-error").count() == 0
        assert other.page_errors == []


def test_steps_appear_one_by_one_while_the_run_is_still_running(
    panel: PanelPage, stack: Stack
) -> None:
    # The first model call is held by the fake vendor: the steps before it must
    # be on the screen while the run is RUNNING and has no answer.
    _script(stack, {"action": "hang", "seconds": 4})
    panel.sign_in_as("Maria (manager)")
    panel.ask("How many days of leave do I get?")
    timeline = panel.page.get_by_test_id("timeline")
    timeline.locator("[data-step='STEP_KIND_RETRIEVAL']").wait_for()
    run_id = str(panel.page.get_by_test_id("run").get_attribute("data-run-id"))
    assert run_id
    during = _grpc_run(stack, stack.token("maria", ["manager"]), run_id)
    drawn_during = timeline.locator("li").count()
    assert during.state == orchestrator_pb2.RUN_STATE_RUNNING and not during.answer
    assert panel.page.get_by_test_id("answer").count() == 0
    assert panel.page.get_by_test_id("run").get_attribute("data-state") == "RUN_STATE_RUNNING"
    assert drawn_during >= 2  # the memory read and the retrieval, before any model answer
    _accessible(panel, "run-live")

    assert panel.wait_for_state("RUN_STATE_COMPLETED") == "RUN_STATE_COMPLETED"
    assert timeline.locator("li").count() > drawn_during
    assert timeline.locator("li.running").count() == 0
    link = panel.page.get_by_test_id("trace-link")
    after = _grpc_run(stack, stack.token("maria", ["manager"]), run_id)
    assert link.get_attribute("href") == f"https://traces.example.com/trace/{after.trace_id}"


def test_cancel_stops_a_held_run_and_past_runs_list_it_under_cancelled(
    panel: PanelPage, stack: Stack
) -> None:
    _script(stack, {"action": "hang", "seconds": 30})
    panel.sign_in_as("Maria (manager)")
    question = f"What is the travel policy? ({uuid.uuid4().hex[:6]})"
    panel.ask(question)
    panel.page.get_by_test_id("timeline").locator("[data-step='STEP_KIND_RETRIEVAL']").wait_for()
    panel.page.get_by_role("button", name="Cancel the run").click()
    assert panel.wait_for_state("RUN_STATE_CANCELLED", timeout_ms=20_000) == "RUN_STATE_CANCELLED"
    assert "Cancelled by maria" in panel.visible_text()
    run_id = str(panel.page.get_by_test_id("run").get_attribute("data-run-id"))
    cancelled = _grpc_run(stack, stack.token("maria", ["manager"]), run_id)
    assert (
        cancelled.state == orchestrator_pb2.RUN_STATE_CANCELLED
        and cancelled.cancelled_by == "maria"
    )

    panel.page.get_by_role("link", name="Past runs").click()
    panel.page.locator("#state-filter").select_option("RUN_STATE_CANCELLED")
    listed = panel.page.get_by_test_id("past-runs").get_by_role("button", name=question)
    listed.wait_for()
    # the filtered page replaces the unfiltered one; a slower unfiltered answer never wins
    expect(panel.page.get_by_test_id("past-runs").locator("tbody")).not_to_contain_text("Completed")
    listed.click()
    assert panel.wait_for_state("RUN_STATE_CANCELLED") == "RUN_STATE_CANCELLED"
    assert panel.page.url.endswith(f"/runs/{run_id}")


def test_switching_to_simplified_chinese_changes_every_label_and_the_card(
    panel: PanelPage, stack: Stack
) -> None:
    _script(
        stack,
        {
            "action": "tool_call",
            "name": "remember",
            "arguments": {"text": "Tom works from the Berlin office.", "subject": {"kind": "USER"}},
        },
    )
    panel.sign_in_as("Tom (employee)")
    panel.page.locator("#language").select_option("zh-Hans")
    panel.ask("请记住我在柏林办公室工作。", agent="assistant")
    card = panel.page.get_by_test_id("run").get_by_test_id("confirmation-card")
    card.wait_for(timeout=60_000)
    english = _catalog("en")
    chinese = _catalog("zh-Hans")
    assert set(english) == set(chinese)
    screen = panel.visible_text()
    untranslated = [
        text
        for key, text in english.items()
        if "{" not in text and len(text) > 3 and text != chinese[key] and text in screen
    ]
    assert untranslated == [], untranslated
    assert "提问" in screen and "退出登录" in screen
    assert card.get_attribute("lang") == "zh-Hans"
    summary = card.locator("h3").inner_text()
    assert re.search(r"[\u4e00-\u9fff]", summary.replace("需要您批准", "")), summary
    assert card.get_by_test_id("card-fallback").count() == 0
    assert panel.page.evaluate("() => document.documentElement.lang") == "zh-Hans"
    _accessible(panel, "zh-hans-card")
    # the choice is remembered, the token is not
    panel.page.reload()
    panel.page.wait_for_selector("header.top")
    assert panel.page.locator("#language").input_value() == "zh-Hans"
    assert panel.page.get_by_role("button", name="以 Tom (employee) 身份登录").count() == 1
    stored = panel.page.evaluate("() => JSON.stringify({...localStorage, ...sessionStorage})")
    assert "eyJ" not in stored, stored
    panel.page.locator("#language").select_option("en")


def test_without_a_token_the_panel_shows_the_sign_in_and_a_403_reads_as_the_one_denial(
    panel: PanelPage, stack: Stack
) -> None:
    panel.goto("/waiting")
    assert panel.page.get_by_role("heading", name="Sign in to cairn").count() == 1
    assert panel.page.get_by_text("development only").first.is_visible()
    assert panel.page.get_by_test_id("waiting").count() == 0
    _accessible(panel, "sign-in")

    with grpc.insecure_channel(stack.addresses["orchestrator"]) as ch:
        marias = (
            orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
            .StartRun(
                orchestrator_pb2.StartRunRequest(
                    agent="handbook", input="How do I report a lost laptop?"
                ),
                metadata=call_metadata(stack.token("maria", ["manager"])),
                timeout=60,
            )
            .run
        )
    denials = []
    for run_id in (marias.run_id, "run-that-does-not-exist"):
        panel.goto(f"/runs/{run_id}")
        panel.page.get_by_role("button", name="Sign in as Tom (employee)").click()
        denial = panel.page.get_by_test_id("denial")
        denial.wait_for()
        denials.append(denial.inner_text())
        assert DENIAL_MESSAGE in denials[-1]
        assert "Traceback" not in panel.visible_text() and "at " not in denial.inner_text()
        assert "How do I report" not in panel.visible_text()
        panel.page.get_by_role("button", name="Sign out").click()
    assert denials[0] == denials[1]
    # a URL or log never carries the token
    assert "eyJ" not in panel.page.url


def test_the_whole_flow_works_from_the_keyboard_alone(panel: PanelPage, stack: Stack) -> None:
    _script(
        stack,
        {
            "action": "tool_call",
            "name": "remember",
            "arguments": {"text": "Tom takes Fridays off in August.", "subject": {"kind": "USER"}},
        },
        {"action": "answer", "content": "Noted your August Fridays."},
    )
    panel.goto("/")
    page = panel.page

    def tab_to(pattern: str) -> None:
        for _ in range(80):
            page.keyboard.press("Tab")
            focused = page.evaluate(
                "() => { const e = document.activeElement; return (e.getAttribute('aria-label') || e.id || e.innerText || '').trim() }"
            )
            if re.search(pattern, str(focused)):
                return
        raise AssertionError(f"Tab never reached {pattern!r}")

    tab_to(r"^Sign in as Tom")
    page.keyboard.press("Enter")
    page.get_by_test_id("signed-in-as").wait_for()
    page.locator("#agent option[value='assistant']").wait_for(state="attached")
    tab_to(r"^agent$")
    for _ in range(5):
        if page.locator("#agent").input_value() == "assistant":
            break
        page.keyboard.press("ArrowDown")
    assert page.locator("#agent").input_value() == "assistant"
    tab_to(r"^question$")
    page.keyboard.type("Remember that I take Fridays off in August.")
    tab_to(r"^Ask$")
    page.keyboard.press("Enter")
    panel.wait_for_state("RUN_STATE_CONFIRMATION_PENDING")
    tab_to(r"^Approve$")
    page.keyboard.press("Enter")
    assert panel.wait_for_state("RUN_STATE_COMPLETED") == "RUN_STATE_COMPLETED"
    tab_to(r"^What cairn holds about me$")
    page.keyboard.press("Enter")
    page.get_by_test_id("held-memories").wait_for()
    assert "Fridays off in August" in page.get_by_test_id("held-memories").inner_text()


def test_dark_scheme_and_reduced_motion_are_honoured_and_stay_accessible(
    browser: Browser, panel_url: str
) -> None:
    with panel_page(browser, panel_url, color_scheme="dark", reduced_motion="reduce") as panel:
        panel.sign_in_as("Maria (manager)")
        panel.ask("How many days of leave do I get?")
        panel.wait_for_state("RUN_STATE_COMPLETED")
        background = panel.page.evaluate("() => getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(15, 20, 25)", background
        bar = panel.page.locator(".bar span").first
        assert bar.evaluate("e => getComputedStyle(e).transitionDuration") in ("0s", "0s, 0s")
        _accessible(panel, "dark-reduced-motion")
        assert panel.page_errors == []
