"""schemathesis against the REST proxy: every operation of the OpenAPI document the
proxy itself serves at /openapi.json, requests drawn by schemathesis from that
document alone (parameters, bodies and formats as the document declares them, so
the contract a REST caller reads is what is fuzzed), sent over real HTTP with a
valid demo token to the proxy in front of the whole stack. Each operation is drawn
three ways: to fit the document as served; to fit it with every object closed to
unknown fields (the proxy refuses those with 400, which the document does not say, so
drawn as served most bodies stop at the proxy); and, where a body or query parameter
can be wrong at all, to break it (schemathesis's negative mode).

What must hold for every answer:

- no 5xx, neither as the HTTP status nor as a streamed final error line;
- every 4xx is a JSON body with a non-empty message;
- afterwards the proxy reports every backend ready (/readyz 200).

tests/test_restproxy_fuzz_openapi.py draws from the proto messages instead; the two
meet in the middle. Bounded per operation in examples (CAIRN_SCHEMATHESIS_EXAMPLES)
and in wall-clock time (CAIRN_SCHEMATHESIS_SECONDS_PER_OPERATION) so it fits in
`make test`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.core.result import Err
from schemathesis.core.transport import Response
from schemathesis.schemas import BaseSchema

from tests.conftest import OtlpReceiver, Stack, repo_path
from tests.restproxy_support import running_restproxy

EXAMPLES = int(os.environ.get("CAIRN_SCHEMATHESIS_EXAMPLES", "15"))
BUDGET_SECONDS = float(os.environ.get("CAIRN_SCHEMATHESIS_SECONDS_PER_OPERATION", "2"))
REQUEST_TIMEOUT_SECONDS = 30
# gRPC codes a stream must never end on when the stack is healthy:
# UNKNOWN, INTERNAL, UNAVAILABLE, DATA_LOSS
SERVER_CODES = {2, 13, 14, 15}
MAX_LINES = 50

pytestmark = pytest.mark.timeout(300)


def _committed() -> dict[str, Any]:
    """Label ("GET /v1/agents") -> operation, of the operations served by default, from
    the committed document; the model gateway's routes are off
    (CAIRN_RESTPROXY_EXPOSE_GATEWAY)."""
    document = json.loads(
        repo_path("services", "restproxy", "internal", "openapi", "cairn.swagger.json").read_text()
    )
    return {
        f"{method.upper()} {path}": operation
        for path, operations in document["paths"].items()
        if not path.startswith("/v1/gateway/")
        for method, operation in operations.items()
    }


def _committed_operations() -> list[str]:
    return sorted(_committed())


def _draws() -> list[tuple[str, str, str]]:
    """(document, mode, label): every operation drawn to fit the document as served and
    to fit it closed to unknown fields; and, where a body or query parameter can be
    wrong at all (a path segment is any string), drawn to break it (schemathesis's
    negative mode: wrong types, missing required values), which must still be 4xx."""
    draws = []
    for label, operation in sorted(_committed().items()):
        draws += [("served", "positive", label), ("served_closed", "positive", label)]
        if any(p.get("in") in {"body", "query"} for p in operation.get("parameters", [])):
            draws.append(("served", "negative", label))
    return draws


@pytest.fixture(scope="module")
def rest(
    stack: Stack, otlp: tuple[OtlpReceiver, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with running_restproxy(
        stack, otlp_endpoint=otlp[1], log_dir=tmp_path_factory.mktemp("restproxy-schemathesis")
    ) as url:
        yield url


@pytest.fixture(scope="module")
def served(rest: str) -> BaseSchema:
    """The OpenAPI document as the proxy serves it, loaded by schemathesis."""
    return schemathesis.openapi.from_url(f"{rest}/openapi.json", timeout=10)


def _closed(node: Any) -> Any:
    """`node` with every object schema closed to properties it does not name, as the
    proxy treats a body (an unknown JSON field is 400); the served document does not say
    so, and drawn as it is most bodies carry an extra key and stop at the proxy."""
    if isinstance(node, list):
        return [_closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    closed = {key: _closed(value) for key, value in node.items()}
    if isinstance(closed.get("properties"), dict) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


@pytest.fixture(scope="module")
def served_closed(rest: str) -> BaseSchema:
    """The served document with its object schemas closed (see `_closed`), so the
    drawn bodies get past the proxy's unknown-field check to the services."""
    document = httpx.get(f"{rest}/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(_closed(document))


def _served_labels(schema: BaseSchema) -> list[str]:
    """Every operation's label; an operation schemathesis cannot read fails here."""
    labels = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        labels.append(result.ok().label)
    return sorted(labels)


def _findings(response: Response) -> list[str]:
    """What is wrong with one answer: a 5xx, a 4xx that is not JSON with a message,
    or a stream that ended on a server-side error."""
    if response.status_code >= 500:
        return [f"HTTP {response.status_code}: {response.text[:300]}"]
    found: list[str] = []
    # NDJSON lines end at \n only; splitlines() would also cut at U+2028 inside a string
    lines = [line for line in response.text.split("\n") if line.strip()][:MAX_LINES]
    if response.status_code >= 400 and not lines:
        found.append(f"HTTP {response.status_code} with an empty body")
    for line in lines:
        try:
            body: Any = json.loads(line)
        except ValueError:
            if response.status_code >= 400:
                found.append(f"HTTP {response.status_code}, not JSON: {line[:200]!r}")
            continue
        if not isinstance(body, dict):
            if response.status_code >= 400:
                found.append(f"HTTP {response.status_code}, not a JSON object: {line[:200]!r}")
            continue
        error = body.get("error")
        if response.status_code >= 400:
            # a streaming route refused before its first event answers with its one
            # {"error": {...}} line (README, REST proxy: Errors); a unary route with the status
            message = (error if isinstance(error, dict) else body).get("message")
            if not (isinstance(message, str) and message.strip()):
                found.append(f"HTTP {response.status_code} without a message: {line[:300]}")
        if isinstance(error, dict) and error.get("code") in SERVER_CODES:
            found.append(f"a stream ended on code {error.get('code')}: {line[:300]}")
    return found


def test_the_served_openapi_lists_every_operation_the_proxy_serves_by_default(
    served: BaseSchema,
) -> None:
    assert _served_labels(served) == _committed_operations()


@pytest.mark.parametrize(("document", "mode", "label"), _draws())
def test_every_rest_operation_drawn_by_schemathesis_answers_without_a_5xx_and_every_4xx_says_why(
    stack: Stack,
    rest: str,
    request: pytest.FixtureRequest,
    document: str,
    mode: str,
    label: str,
) -> None:
    schema: BaseSchema = request.getfixturevalue(document)
    method, path = label.split(" ", 1)
    cases: st.SearchStrategy[Case[Any]] = schema[path][method].as_strategy(
        generation_mode=GenerationMode(mode)
    )
    token = stack.token("fuzzer", ["employee", "ingester"], org=f"org-{uuid.uuid4().hex[:10]}")
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + BUDGET_SECONDS
    findings: list[str] = []
    sent = 0
    session = requests.Session()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def probe(case: Case[Any]) -> None:
        nonlocal sent
        if time.monotonic() > deadline:
            return
        response = case.call(
            base_url=rest, session=session, headers=headers, timeout=REQUEST_TIMEOUT_SECONDS
        )
        sent += 1
        findings.extend(
            f"{case.method} {case.formatted_path} query={case.query!r} "
            f"body={case.body!r:.300} -> {finding}"
            for finding in _findings(response)
        )

    with session:
        probe()
    assert sent > 0
    assert findings == []
    ready = httpx.get(f"{rest}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
