"""Signing in to the web panel as a deployment does: OpenID Connect authorization
code with PKCE against the configured issuer. The issuer here is a small real HTTP
server on loopback that checks the PKCE verifier against the challenge (S256) and
hands out a token the services accept; the panel is the built one, served by the
real proxy, in Debian's headless chromium. The token must end up in memory only:
never in a URL, storage or the proxy's log."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse

import pytest

from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import build_restproxy, free_port, start_restproxy, wait_for_http
from tests.conftest import Stack
from tests.panel_support import built_panel, chromium, panel_page

pytestmark = pytest.mark.timeout(120)

CLIENT_ID = "cairn-panel"


@dataclass
class Issuer:
    """What the fake issuer was asked, and the one token it hands out."""

    token: str
    base_url: str = ""
    authorize_queries: list[dict[str, str]] = field(default_factory=list)
    token_forms: list[dict[str, str]] = field(default_factory=list)
    codes: dict[str, dict[str, str]] = field(default_factory=dict)


def _handler(issuer: Issuer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def _json(self, code: int, body: dict[str, Any]) -> None:
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Access-Control-Allow-Origin", "*")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/.well-known/openid-configuration":
                self._json(
                    200,
                    {
                        "issuer": issuer.base_url,
                        "authorization_endpoint": f"{issuer.base_url}/authorize",
                        "token_endpoint": f"{issuer.base_url}/token",
                    },
                )
            elif url.path == "/authorize":
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                issuer.authorize_queries.append(query)
                code = f"code-{len(issuer.codes)}"
                issuer.codes[code] = query
                self.send_response(302)
                self.send_header(
                    "Location",
                    f"{query['redirect_uri']}?{urlencode({'code': code, 'state': query['state']})}",
                )
                self.end_headers()
            else:
                self._json(404, {"error": "not_found"})

        def do_OPTIONS(self) -> None:
            self.send_response(204)
            self.send_header("Access-Control-Allow-Origin", "*")
            self.send_header("Access-Control-Allow-Headers", "Content-Type")
            self.send_header("Access-Control-Allow-Methods", "GET, POST")
            self.end_headers()

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
            issuer.token_forms.append(form)
            asked = issuer.codes.pop(form.get("code", ""), None)
            verifier = form.get("code_verifier", "").encode()
            challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier).digest()).rstrip(b"=")
            if (
                asked is None
                or asked.get("code_challenge") != challenge.decode()
                or form.get("client_id") != CLIENT_ID
                or form.get("redirect_uri") != asked.get("redirect_uri")
            ):
                self._json(400, {"error": "invalid_grant"})
                return
            self._json(200, {"access_token": issuer.token, "token_type": "Bearer"})

    return Handler


@pytest.fixture(scope="module")
def oidc_issuer(stack: Stack) -> Iterator[Issuer]:
    found = Issuer(token=stack.token("tom", ["employee"]))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(found))
    found.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield found
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def proxy(
    stack: Stack, oidc_issuer: Issuer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    build_restproxy()
    port = free_port()
    log_dir = tmp_path_factory.mktemp("panel-oidc")
    process = start_restproxy(
        port=port,
        addresses=stack.addresses,
        env={
            "CAIRN_PANEL_DIR": str(built_panel()),
            "CAIRN_PANEL_OIDC_ISSUER": oidc_issuer.base_url,
            "CAIRN_PANEL_OIDC_CLIENT_ID": CLIENT_ID,
            "CAIRN_SHUTDOWN_GRACE_SECONDS": "1",
        },
        log_dir=log_dir,
    )
    try:
        wait_for_http(process)
        yield f"http://127.0.0.1:{port}", process.log_path
    finally:
        process.stop()


def test_a_deployment_signs_in_with_pkce_and_keeps_the_token_only_in_memory(
    proxy: tuple[str, Path], oidc_issuer: Issuer
) -> None:
    url, proxy_log = proxy
    with chromium() as browser, panel_page(browser, url) as panel:
        requested: list[str] = []
        panel.page.on("request", lambda request: requested.append(request.url))
        panel.goto("/")
        # no demo people in a deployment
        assert panel.page.get_by_text("development only").count() == 0
        panel.page.get_by_role("button", name="Sign in with your organisation").click()
        panel.page.get_by_test_id("signed-in-as").wait_for()
        assert "tom" in panel.page.get_by_test_id("signed-in-as").inner_text()
        # the panel works with the token it was given: a real call to the services
        panel.page.get_by_role("link", name="What cairn holds about me").click()
        held = panel.page.get_by_test_id("held-empty").or_(
            panel.page.get_by_test_id("held-memories")
        )
        held.first.wait_for()
        assert panel.page.get_by_test_id("service-error").count() == 0

        [asked] = oidc_issuer.authorize_queries
        assert asked["response_type"] == "code" and asked["client_id"] == CLIENT_ID
        assert asked["code_challenge_method"] == "S256" and asked["scope"] == "openid"
        assert asked["redirect_uri"] == f"{url}/"
        [exchanged] = oidc_issuer.token_forms
        assert exchanged["grant_type"] == "authorization_code" and exchanged["code_verifier"]
        assert "code=" not in panel.page.url and "state=" not in panel.page.url
        stored = panel.page.evaluate("() => JSON.stringify({...localStorage, ...sessionStorage})")
        assert oidc_issuer.token not in stored and exchanged["code_verifier"] not in stored
        assert not [u for u in requested if oidc_issuer.token in u]
        assert oidc_issuer.token not in proxy_log.read_text()

        # a reload forgets the token: it lived in this page's memory only
        panel.page.reload()
        panel.page.get_by_role("button", name="Sign in with your organisation").wait_for()
        assert panel.page.get_by_test_id("signed-in-as").count() == 0
        assert panel.page_errors == []


def test_a_token_the_services_refuse_returns_to_the_sign_in_with_their_message(
    stack: Stack, tmp_path: Path
) -> None:
    forger = TokenIssuer.from_file(generate_dev_keypair(tmp_path / "other-key")[0])
    forged = forger.caller_token(org_id=stack.org, user_id="mallory", roles=["manager"])
    identities = tmp_path / "dev-identities.json"
    identities.write_text(
        json.dumps([{"id": "mallory", "title": "Mallory (forged)", "roles": [], "token": forged}])
    )
    build_restproxy()
    port = free_port()
    process = start_restproxy(
        port=port,
        addresses=stack.addresses,
        env={
            "CAIRN_PANEL_DIR": str(built_panel()),
            "CAIRN_PANEL_DEV_IDENTITIES_FILE": str(identities),
            "CAIRN_SHUTDOWN_GRACE_SECONDS": "1",
        },
        log_dir=tmp_path / "logs",
    )
    try:
        wait_for_http(process)
        with chromium() as browser, panel_page(browser, f"http://127.0.0.1:{port}") as panel:
            panel.goto("/")
            panel.page.get_by_role("button", name="Sign in as Mallory (forged)").click()
            # ListAgents is refused UNAUTHENTICATED: back to the sign-in, saying why
            notice = panel.page.get_by_role("status").filter(has_text="You were signed out")
            notice.wait_for()
            assert notice.locator(".service-message").inner_text().strip()
            assert panel.page.get_by_test_id("signed-in-as").count() == 0
            assert (
                "Traceback" not in panel.visible_text() and "TypeError" not in panel.visible_text()
            )
            assert panel.page_errors == []
    finally:
        process.stop()
