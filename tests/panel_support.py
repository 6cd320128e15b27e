"""The web panel as a person meets it, for the end-to-end tests and the bench:
the built panel (web/dist) served by the real REST proxy in front of the
session's real services, and Debian's headless chromium driven by Playwright
through its executable path (Playwright's own browser download never runs).

The dev stack's demo people are offered exactly as `make run` offers them: the
tokens are minted here and written to the file CAIRN_PANEL_DEV_IDENTITIES_FILE
names; the proxy only hands them out.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import (
    REPO_ROOT,
    build_restproxy,
    free_port,
    start_restproxy,
    wait_for_http,
)

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")

from playwright.sync_api import Browser, Page, Playwright, sync_playwright

PANEL_DIST = REPO_ROOT / "web" / "dist"
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = REPO_ROOT / "build" / "panel-screenshots"
AXE_SOURCE = REPO_ROOT / "web" / "node_modules" / "axe-core" / "axe.min.js"
TRACE_TEMPLATE = "https://traces.example.com/trace/{trace_id}"
DEMO_PEOPLE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("maria", "Maria (manager)", ("manager",)),
    ("tom", "Tom (employee)", ("employee",)),
)


def built_panel() -> Path:
    """web/dist as `make web` builds it; built here when missing so a targeted
    pytest run works too (npm ci must have run: `make web-install`)."""
    if not (PANEL_DIST / "index.html").exists():
        if not (REPO_ROOT / "web" / "node_modules").exists():
            raise RuntimeError("web/node_modules is missing: run `make web` first")
        subprocess.run(
            ["npx", "vite", "build", "--logLevel", "warn"], cwd=REPO_ROOT / "web", check=True
        )
    return PANEL_DIST


def write_dev_identities(path: Path, issuer: TokenIssuer, *, org: str) -> Path:
    people = [
        {
            "id": user,
            "title": title,
            "roles": list(roles),
            "token": issuer.caller_token(org_id=org, user_id=user, roles=roles, ttl_seconds=86400),
        }
        for user, title, roles in DEMO_PEOPLE
    ]
    path.write_text(json.dumps(people))
    path.chmod(0o600)
    return path


@contextmanager
def running_panel(
    *,
    addresses: dict[str, str],
    issuer: TokenIssuer,
    org: str,
    log_dir: Path,
    extra_env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Yield the proxy's base URL, serving the built panel with dev identities on."""
    build_restproxy()
    log_dir.mkdir(parents=True, exist_ok=True)
    identities = write_dev_identities(log_dir / "dev-identities.json", issuer, org=org)
    port = free_port()
    proxy = start_restproxy(
        port=port,
        addresses=addresses,
        env={
            "CAIRN_PANEL_DIR": str(built_panel()),
            "CAIRN_PANEL_DEV_IDENTITIES_FILE": str(identities),
            "CAIRN_PANEL_TRACE_URL_TEMPLATE": TRACE_TEMPLATE,
            # the browser keeps connections open; do not wait out the default drain
            "CAIRN_SHUTDOWN_GRACE_SECONDS": "1",
            **(extra_env or {}),
        },
        log_dir=log_dir,
    )
    try:
        wait_for_http(proxy)
        yield f"http://127.0.0.1:{port}"
    finally:
        proxy.stop()


@contextmanager
def chromium() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        raise RuntimeError(f"{CHROMIUM} is missing: `make chromium` installs Debian's chromium")
    with sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            yield browser
        finally:
            browser.close()


def launch(playwright: Playwright) -> Browser:
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM), args=["--no-sandbox"], headless=True
    )


@dataclass
class PanelPage:
    """One browser tab on the panel, collecting what the page itself reported:
    uncaught errors and console errors (a CSP refusal is one)."""

    page: Page
    base_url: str
    page_errors: list[str]
    console_errors: list[str]

    def goto(self, path: str = "/") -> None:
        self.page.goto(self.base_url + path)
        self.page.wait_for_selector("header.top")

    def sign_in_as(self, title: str) -> None:
        self.goto("/")
        self.page.get_by_role("button", name=f"Sign in as {title}").click()
        self.page.get_by_test_id("signed-in-as").wait_for()

    def ask(self, question: str, *, agent: str = "handbook") -> None:
        self.page.locator(f"#agent option[value='{agent}']").wait_for(state="attached")
        self.page.locator("#agent").select_option(agent)
        self.page.locator("#question").fill(question)
        self.page.locator("form.ask button[type=submit]").click()

    def wait_for_state(self, *states: str, timeout_ms: float = 60_000) -> str:
        run = self.page.get_by_test_id("run")
        wanted = " or ".join(f'@data-state="{s}"' for s in states)
        self.page.wait_for_selector(
            f"xpath=//section[@data-testid='run' and ({wanted})]", timeout=timeout_ms
        )
        return str(run.get_attribute("data-state"))

    def visible_text(self) -> str:
        return str(self.page.evaluate("() => document.body.innerText"))

    def axe_violations(self) -> list[dict[str, Any]]:
        """axe-core's serious and critical violations on the page as it is now.
        Evaluated through the DevTools protocol, so the panel's CSP (which would
        refuse an injected script tag) stays as strict as in production."""
        if not self.page.evaluate("() => typeof window.axe === 'object'"):
            self.page.evaluate(AXE_SOURCE.read_text() + "\n;undefined")
        result: dict[str, Any] = self.page.evaluate(
            "async () => await window.axe.run(document, {resultTypes: ['violations']})"
        )
        return [
            {"id": v["id"], "impact": v["impact"], "nodes": [n["target"] for n in v["nodes"]]}
            for v in result["violations"]
            if v["impact"] in ("serious", "critical")
        ]

    def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


@contextmanager
def panel_page(browser: Browser, base_url: str, **context_options: Any) -> Iterator[PanelPage]:
    context = browser.new_context(**context_options)
    page = context.new_page()
    page.set_default_timeout(30_000)
    opened = PanelPage(page=page, base_url=base_url, page_errors=[], console_errors=[])
    page.on("pageerror", lambda exc: opened.page_errors.append(str(exc)))
    page.on(
        "console",
        lambda msg: opened.console_errors.append(msg.text) if msg.type == "error" else None,
    )
    try:
        yield opened
    finally:
        context.close()
