"""What the gateway's tests share: the fake vendors' control surface, the provider
file that puts three of them in failover order, and request builders.

Providers, in failover order:
  alpha  needs a key (the fake refuses calls without it), reasoning effort on
  beta   no key, no reasoning effort
  gamma  no key; also serves embeddings
Timeouts are short so a hanging vendor costs about a second. By default the file
turns retries and cooldowns off, so a test of failover sees failover alone and no
test inherits a cooldown from the one before; the tests of retries and cooldowns
pass their own settings.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from cairn.gateway.v1 import gateway_pb2
from cairn_libs.clients import call_metadata
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import (
    ServiceProcess,
)

ALPHA_KEY = "sk-cairn-test-ALPHA-7f3a9c-never-log-me"
PROVIDER_TIMEOUT_SECONDS = 1.0


@dataclass
class FakeVendor:
    name: str
    process: ServiceProcess
    # One keep-alive client for the control surface: a test makes several calls.
    _control: httpx.Client | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.process.address}"

    @property
    def control(self) -> httpx.Client:
        if self._control is None:
            self._control = httpx.Client(base_url=self.url, timeout=10)
        return self._control

    def script(self, *steps: dict[str, Any]) -> None:
        self.control.post("/_control/script", json={"steps": list(steps)}).raise_for_status()

    def reset(self) -> None:
        self.control.post("/_control/reset").raise_for_status()

    def requests(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        response = self.control.get("/_control/requests")
        response.raise_for_status()
        return [r for r in response.json()["requests"] if r["path"] == path]

    def stop(self) -> None:
        if self._control is not None:
            self._control.close()
        self.process.stop()


@dataclass
class Vendors:
    alpha: FakeVendor
    beta: FakeVendor
    gamma: FakeVendor

    def all(self) -> tuple[FakeVendor, ...]:
        return (self.alpha, self.beta, self.gamma)


NO_RETRIES_NO_COOLDOWNS = {"max_retries": 0, "cooldown_max_seconds": 0}


def provider_yaml(
    vendors: Vendors,
    *,
    timeout: float = PROVIDER_TIMEOUT_SECONDS,
    resilience: dict[str, float] | None = None,
) -> str:
    settings = NO_RETRIES_NO_COOLDOWNS if resilience is None else resilience
    extra = "".join(f"\n    {key}: {value}" for key, value in settings.items())
    return f"""
providers:
  - name: alpha
    base_url: {vendors.alpha.url}/v1
    api_key_env: CAIRN_TEST_ALPHA_KEY
    supports_reasoning_effort: true
    timeout_seconds: {timeout}{extra}
    models: {{fast: alpha-fast, balanced: alpha-balanced, deep: alpha-deep}}
  - name: beta
    base_url: {vendors.beta.url}/v1
    timeout_seconds: {timeout}{extra}
    models: {{fast: beta-fast, balanced: beta-balanced, deep: beta-deep}}
  - name: gamma
    base_url: {vendors.gamma.url}/v1
    timeout_seconds: {timeout}{extra}
    embedding_model: gamma-embed
    models: {{balanced: gamma-balanced, deep: shared-deep}}
"""


def user(text: str) -> gateway_pb2.Message:
    return gateway_pb2.Message(role=gateway_pb2.MESSAGE_ROLE_USER, content=text)


def chat_request(
    text: str = "What is the capital of France?", **fields: Any
) -> gateway_pb2.ChatRequest:
    fields.setdefault("tier", gateway_pb2.TIER_BALANCED)
    return gateway_pb2.ChatRequest(messages=[user(text)], **fields)


def new_run_id() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


def acting_metadata(
    issuer: TokenIssuer, *, org_id: str, user_id: str, run_id: str
) -> tuple[tuple[str, str], ...]:
    """A person's token with the orchestrator's acting credential for one run, as the
    orchestrator sends every call it makes inside that run."""
    return call_metadata(
        issuer.caller_token(org_id=org_id, user_id=user_id, roles=["member"]),
        actor_token=issuer.actor_token(service="orchestrator", run_id=run_id, agent="tester"),
    )


@dataclass(frozen=True)
class CollectedSpan:
    name: str
    attributes: dict[str, object]
    status_code: int
    # Everything the exporter sent for this span, as text, for "is it anywhere" checks.
    raw: str


class SpanCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: what a collector would get from the gateway."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[CollectedSpan] = []
        self._server: grpc.Server | None = None
        self.endpoint = ""

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        collected = []
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {a.key: _any_value(a.value) for a in span.attributes}
                    collected.append(
                        CollectedSpan(span.name, attributes, span.status.code, str(span))
                    )
        with self._lock:
            self._spans.extend(collected)
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> None:
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        self.endpoint = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, name: str, *, run_id: str, timeout: float = 10.0) -> list[CollectedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [
                s
                for s in self.spans()
                if s.name == name and s.attributes.get("cairn.run_id") == run_id
            ]
            if found:
                return found
            time.sleep(0.05)
        raise TimeoutError(f"no span named {name!r}; got {[s.name for s in self.spans()]}")


def _any_value(value: common_pb2.AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
