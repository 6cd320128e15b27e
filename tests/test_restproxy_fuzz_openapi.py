"""A schema-driven fuzz of every operation in the REST proxy's own /openapi.json,
over real HTTP to the proxy in front of the whole stack.

Each operation's request is drawn by hypothesis from the protobuf message its
operationId names (`cairn_libs.proto_strategies`, values the door accepts, sent as
proto3 JSON with path parameters filled in and, for a GET, the scalar fields as
query parameters), and also as arbitrary JSON that need not match the message at
all. What must hold:

- no 5xx, ever, neither as the HTTP status nor as a stream's final error line
  (a healthy stack answers every request with something a caller can act on);
- every 4xx carries a message;
- the proxy still reports every backend SERVING on /readyz afterwards.

schemathesis would do the drawing from the OpenAPI itself; it is not among the
project's development dependencies, and the proto messages the document is
generated from describe the same requests more exactly (field types, enums).
Bounded per operation (CAIRN_REST_FUZZ_EXAMPLES, and a time budget) so it runs
inside `make test`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cairn.memory.v1 import memory_pb2
from cairn.orchestrator.v1 import orchestrator_pb2
from cairn.retrieval.v1 import retrieval_pb2
from cairn_libs.proto_strategies import messages
from tests.conftest import OtlpReceiver, Stack, repo_path
from tests.restproxy_support import running_restproxy

EXAMPLES = int(os.environ.get("CAIRN_REST_FUZZ_EXAMPLES", "15"))
BUDGET_SECONDS = float(os.environ.get("CAIRN_REST_FUZZ_SECONDS_PER_OPERATION", "4"))
FILES = {"OrchestratorService": orchestrator_pb2, "MemoryService": memory_pb2}
FILES["RetrievalService"] = retrieval_pb2
MAX_LINES = 50

pytestmark = pytest.mark.timeout(600)


def _operations() -> list[tuple[str, str, str]]:
    """(method, path template, operationId) of every operation the proxy serves by
    default; the model gateway's routes are off (CAIRN_RESTPROXY_EXPOSE_GATEWAY)."""
    document = json.loads(
        repo_path("services", "restproxy", "internal", "openapi", "cairn.swagger.json").read_text()
    )
    return sorted(
        (method.upper(), path, operation["operationId"])
        for path, operations in document["paths"].items()
        if not path.startswith("/v1/gateway/")
        for method, operation in operations.items()
    )


def _request_descriptor(operation_id: str) -> Descriptor:
    service, method = operation_id.split("_", 1)
    descriptor: Descriptor = (
        FILES[service].DESCRIPTOR.services_by_name[service].methods_by_name[method].input_type
    )
    return descriptor


@pytest.fixture(scope="module")
def rest(
    stack: Stack, otlp: tuple[OtlpReceiver, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with running_restproxy(
        stack, otlp_endpoint=otlp[1], log_dir=tmp_path_factory.mktemp("restproxy-fuzz")
    ) as url:
        yield url


def _url(rest: str, template: str, fields: dict[str, Any], fallback: str) -> str:
    path = template
    while "{" in path:
        start, end = path.index("{"), path.index("}")
        value = fields.pop(path[start + 1 : end], None)
        text = value if isinstance(value, str) and value else fallback
        path = path[:start] + quote(text, safe="") + path[end + 1 :]
    return rest + path


def _query(fields: dict[str, Any]) -> list[tuple[str, str]]:
    params: list[tuple[str, str]] = []
    for name, value in fields.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, bool):
                params.append((name, "true" if item else "false"))
            elif isinstance(item, (str, int, float)):
                params.append((name, str(item)))
    return params


def _findings(response: httpx.Response) -> list[str]:
    """What is wrong with one answer: a 5xx, a 4xx without a message, or a stream
    that ended on a server error."""
    found: list[str] = []
    if response.status_code >= 500:
        found.append(f"HTTP {response.status_code}: {response.text[:300]}")
        return found
    # NDJSON lines end at \n only; splitlines() would also cut at U+2028 inside a string
    lines = [line for line in response.text.split("\n") if line.strip()][:MAX_LINES]
    for line in lines:
        try:
            body = json.loads(line)
        except ValueError:
            found.append(f"not JSON: {line[:200]!r}")
            continue
        error = body.get("error", body) if isinstance(body, dict) else None
        if response.status_code >= 400 and not (isinstance(error, dict) and error.get("message")):
            found.append(f"HTTP {response.status_code} without a message: {line[:300]}")
        if isinstance(error, dict) and "error" in body and error.get("code") in {2, 13, 14, 15}:
            found.append(f"a stream ended on code {error.get('code')}: {line[:300]}")
    return found


@pytest.mark.parametrize(("method", "template", "operation_id"), _operations())
def test_every_rest_operation_answers_without_a_5xx_and_every_4xx_says_why(
    stack: Stack, rest: str, method: str, template: str, operation_id: str
) -> None:
    descriptor = _request_descriptor(operation_id)
    token = stack.token("fuzzer", ["employee", "ingester"], org=f"org-{uuid.uuid4().hex[:10]}")
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + BUDGET_SECONDS
    findings: list[str] = []
    shaped = messages(descriptor, hostile=False, seeds=["handbook", "SUBJECT_KIND_USER"]).map(
        lambda m: json_format.MessageToDict(m)
    )
    anything = st.dictionaries(
        st.text(max_size=12),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
            max_leaves=6,
        ),
        max_size=4,
    )

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(body=shaped | anything, segment=st.text(min_size=1, max_size=20))
    def probe(body: dict[str, Any], segment: str) -> None:
        if time.monotonic() > deadline:
            return
        fields = dict(body)
        url = _url(rest, template, fields, segment)
        with httpx.Client(timeout=60) as client:
            if method in {"GET", "DELETE"}:
                response = client.request(method, url, params=_query(fields), headers=headers)
            else:
                response = client.request(method, url, json=fields, headers=headers)
        findings.extend(
            f"{method} {url} {json.dumps(body)[:300]} -> {f}" for f in _findings(response)
        )

    probe()
    assert findings == []
    ready = httpx.get(f"{rest}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
