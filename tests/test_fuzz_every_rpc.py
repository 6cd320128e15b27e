"""A schema-driven fuzz of every RPC of every cairn service, against the whole
stack as separate processes (tests/conftest.py's `stack`).

Requests are drawn by hypothesis from each method's request descriptor
(`cairn_libs.proto_strategies`, hostile values included: U+0000 and odd unicode,
undefined enum numbers, integer extremes, NaN, out-of-range Timestamps, nested and
repeated messages), plus raw bytes through a generic bytes-to-bytes call; each is
sent with a valid token, with none, or with a malformed one. What must hold:

- no INTERNAL and no UNKNOWN, ever (a refusal is a status a caller can act on),
  and no message carrying an internal exception's text;
- no UNAVAILABLE from a healthy stack (it invites a retry that fails the same way);
- without a valid token, UNAUTHENTICATED, whatever the body (identity first);
- every service still SERVING on grpc.health.v1 afterwards;
- every PERMISSION_DENIED met reads the same in every service, details included (I6).

Every finding of a method is collected and reported together, as RPC, input,
status and message, rather than shrunk one at a time: the fuzz is bounded
(CAIRN_FUZZ_EXAMPLES per method, and a time budget) so it runs inside `make test`.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf import text_format
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import cairn
from cairn.memory.v1 import memory_pb2
from cairn.orchestrator.v1 import orchestrator_pb2
from cairn.retrieval.v1 import retrieval_pb2
from cairn_libs.clients import call_metadata
from cairn_libs.errors import DENIAL_CODE, DENIAL_MESSAGE
from cairn_libs.proto_strategies import messages
from cairn_libs.stack import health_status
from tests.conftest import SERVICES, Stack, repo_path

EXAMPLES = int(os.environ.get("CAIRN_FUZZ_EXAMPLES", "100"))
# Per method: once spent, the remaining examples return at once.
BUDGET_SECONDS = float(os.environ.get("CAIRN_FUZZ_SECONDS_PER_METHOD", "12"))
CALL_TIMEOUT_SECONDS = 20.0
MAX_STREAMED = 20
# CAIRN_FUZZ_REPORT=1: print how each method answered (run with -s), to see
# whether the fuzz reaches past the door.
REPORT = os.environ.get("CAIRN_FUZZ_REPORT") == "1"
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}


@dataclass(frozen=True)
class Rpc:
    service: str  # e.g. "retrieval"
    path: str  # "/cairn.retrieval.v1.RetrievalService/Search"
    request: Descriptor
    client_streaming: bool
    server_streaming: bool

    def __str__(self) -> str:
        return self.path.lstrip("/")


# Contracts cairn calls but does not serve: a company's own system implements
# cairn.tools.v1.ToolService (the demo people directory's is tested in its own tests).
SERVED_ELSEWHERE = {"tools"}


def every_rpc() -> Iterator[Rpc]:
    """Every method of every service cairn serves in the generated code, so a new
    RPC is fuzzed the day it is added."""
    for found in sorted(pkgutil.walk_packages(cairn.__path__, "cairn."), key=lambda m: m.name):
        if not found.name.endswith("_pb2"):
            continue
        module = importlib.import_module(found.name)
        for service in module.DESCRIPTOR.services_by_name.values():
            if service.full_name.split(".")[1] in SERVED_ELSEWHERE:
                continue
            for method in service.methods:
                yield Rpc(
                    service=service.full_name.split(".")[1],
                    path=f"/{service.full_name}/{method.name}",
                    request=method.input_type,
                    client_streaming=method.client_streaming,
                    server_streaming=method.server_streaming,
                )


RPCS = list(every_rpc())


def _seeds() -> list[str]:
    """Names the running stack knows, drawn now and then for any string field so
    requests reach past "unknown agent" and "no such source"."""
    agents = [
        str(yaml.safe_load(path.read_text())["name"])
        for path in sorted(repo_path("agents").glob("*.yaml"))
    ]
    return [*agents, "handbook", "fuzzer", "staff", "ingester", "admin", "user"]


def requests(rpc: Rpc) -> st.SearchStrategy[Message]:
    # Half valid at the door, so the services' own parsing and storage are fuzzed
    # too, not only the door.
    seeds = _seeds()
    return st.one_of(
        messages(rpc.request, hostile=True, seeds=seeds),
        messages(rpc.request, hostile=False, seeds=seeds),
    )


@dataclass
class Finding:
    rpc: Rpc
    credential: str
    body: str
    code: grpc.StatusCode
    details: str

    def __str__(self) -> str:
        return (
            f"{self.rpc} [{self.credential}] -> {self.code.name} {self.details!r}\n"
            f"    input: {self.body}"
        )


DenialShape = tuple[str, str, tuple[tuple[str, str], ...]]


def _denial_shape(exc: grpc.RpcError) -> DenialShape:
    """What a caller can read of a denial: code, message and every ErrorInfo."""
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    infos: list[tuple[str, str]] = []
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append((info.reason, info.domain))
    return (exc.code().name, exc.details() or "", tuple(infos))


@dataclass
class Fuzz:
    stack: Stack
    token: str
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    # Every distinct denial met, by service (I6: one shape everywhere).
    denials: dict[str, set[DenialShape]] = field(default_factory=dict)

    def channel(self, service: str) -> grpc.Channel:
        if service not in self.channels:
            self.channels[service] = grpc.insecure_channel(self.stack.addresses[service])
        return self.channels[service]

    def metadata(self, credential: str) -> tuple[tuple[str, str], ...]:
        return {
            "valid token": call_metadata(self.token),
            "no token": (),
            "token without Bearer": (("authorization", self.token),),
            "forged token": call_metadata(self.token[:-6] + "AAAAAA"),
        }[credential]

    def call(self, rpc: Rpc, body: bytes, credential: str) -> tuple[grpc.StatusCode, str]:
        """Send `body` as it is (no serializer either way) and return the status."""
        channel = self.channel(rpc.service)
        metadata = self.metadata(credential)
        try:
            if rpc.client_streaming:
                bodies = iter([body])
                if rpc.server_streaming:
                    _drain(
                        channel.stream_stream(rpc.path)(
                            bodies, metadata=metadata, timeout=CALL_TIMEOUT_SECONDS
                        )
                    )
                else:
                    channel.stream_unary(rpc.path)(
                        bodies, metadata=metadata, timeout=CALL_TIMEOUT_SECONDS
                    )
            elif rpc.server_streaming:
                _drain(
                    channel.unary_stream(rpc.path)(
                        body, metadata=metadata, timeout=CALL_TIMEOUT_SECONDS
                    )
                )
            else:
                channel.unary_unary(rpc.path)(body, metadata=metadata, timeout=CALL_TIMEOUT_SECONDS)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                self.denials.setdefault(rpc.service, set()).add(_denial_shape(exc))
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def _drain(call: Any) -> None:
    for count, _ in enumerate(call, start=1):
        if count >= MAX_STREAMED:
            call.cancel()
            return


# Text that only an internal exception puts in a message.
LEAKED = ("Traceback", 'File "', "asyncpg", "grpc._", "google._upb", "Error parsing message")


def _wrong(code: grpc.StatusCode, credential: str, details: str) -> bool:
    if code in NEVER or any(leak in details for leak in LEAKED):
        return True
    return credential != "valid token" and code != grpc.StatusCode.UNAUTHENTICATED


CREDENTIALS = st.sampled_from(
    ["valid token"] * 6 + ["no token", "token without Bearer", "forged token"]
)


@pytest.fixture(scope="module")
def fuzz(stack: Stack) -> Iterator[Fuzz]:
    # An org of its own, so what the fuzz writes or erases touches no other test;
    # every role that unlocks a code path.
    org = f"org-fuzz-{uuid.uuid4().hex[:8]}"
    running = Fuzz(
        stack=stack,
        token=stack.token("fuzzer", ["ingester", "admin", "staff"], org=org),
    )
    yield running
    running.close()


def _fuzz_settings() -> settings:
    return settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        # Findings are collected and listed, not shrunk: shrinking a call over
        # the network would spend the whole time budget on one finding.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def _report(rpc: Rpc, kind: str, answered: Counter[str]) -> None:
    if REPORT:
        print(f"\n{rpc} ({kind}): {dict(answered.most_common())}")


def _assert_none(findings: list[Finding], stack: Stack) -> None:
    unique = {(f.rpc.path, f.credential, f.code, f.details): f for f in findings}
    serving = {name: health_status(stack.addresses[name]) for name in SERVICES}
    assert not unique, f"{len(unique)} finding(s):\n" + "\n".join(str(f) for f in unique.values())
    assert set(serving.values()) == {"SERVING"}, serving


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_no_request_a_schema_allows_gets_internal_or_unknown(fuzz: Fuzz, rpc: Rpc) -> None:
    findings: list[Finding] = []
    answered: Counter[str] = Counter()
    ends = time.monotonic() + BUDGET_SECONDS

    @_fuzz_settings()
    @given(requests(rpc), CREDENTIALS)
    def one(request: Message, credential: str) -> None:
        if time.monotonic() > ends:
            return
        code, details = fuzz.call(rpc, request.SerializeToString(), credential)
        answered[code.name if not REPORT else f"{code.name} {details[:70]}"] += 1
        if _wrong(code, credential, details):
            shown = text_format.MessageToString(request, as_one_line=True, as_utf8=False)
            findings.append(Finding(rpc, credential, shown[:600], code, details))

    one()
    _report(rpc, "messages", answered)
    _assert_none(findings, fuzz.stack)


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_no_body_of_raw_bytes_gets_internal_or_unknown(fuzz: Fuzz, rpc: Rpc) -> None:
    findings: list[Finding] = []
    answered: Counter[str] = Counter()
    ends = time.monotonic() + BUDGET_SECONDS / 3

    @_fuzz_settings()
    @given(st.binary(max_size=200), CREDENTIALS)
    def one(body: bytes, credential: str) -> None:
        if time.monotonic() > ends:
            return
        code, details = fuzz.call(rpc, body, credential)
        answered[code.name if not REPORT else f"{code.name} {details[:70]}"] += 1
        if _wrong(code, credential, details):
            findings.append(Finding(rpc, credential, repr(body[:200]), code, details))

    one()
    _report(rpc, "raw bytes", answered)
    _assert_none(findings, fuzz.stack)


def test_every_rpc_of_every_service_is_fuzzed() -> None:
    # The walk found the services the stack runs, and each of their methods.
    assert {rpc.service for rpc in RPCS} == set(SERVICES)
    assert len(RPCS) >= 24


def test_every_denial_met_reads_the_same_in_every_service_details_included(fuzz: Fuzz) -> None:
    # One denial of each service that has any, so this holds when run alone too.
    by_path = {rpc.path: rpc for rpc in RPCS}
    known = {
        "/cairn.orchestrator.v1.OrchestratorService/GetRun": orchestrator_pb2.GetRunRequest(
            run_id=f"run_{uuid.uuid4().hex}"
        ),
        "/cairn.retrieval.v1.RetrievalService/DeleteDocument": (
            retrieval_pb2.DeleteDocumentRequest(document_id=f"never-{uuid.uuid4().hex}")
        ),
        "/cairn.memory.v1.MemoryService/RecallBlock": memory_pb2.RecallBlockRequest(
            block_id="r999999999"
        ),
    }
    for path, request in known.items():
        fuzz.call(by_path[path], request.SerializeToString(), "valid token")

    shapes = {shape for met in fuzz.denials.values() for shape in met}

    assert set(fuzz.denials) >= {"orchestrator", "retrieval", "memory"}, fuzz.denials
    assert shapes == {(DENIAL_CODE.name, DENIAL_MESSAGE, (("DENIED", "cairn"),))}, fuzz.denials
