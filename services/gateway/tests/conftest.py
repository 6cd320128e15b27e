"""Real processes for the gateway's tests: three fake vendors on loopback and a
gateway configured to fail over across them (see gateway_support), started once
per session; each test starts with the vendors' scripts and request logs empty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from cairn.gateway.v1 import gateway_pb2_grpc
from cairn_libs.clients import call_metadata
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import (
    ServiceProcess,
    free_port,
    serving,
    start_fake_provider,
    wait_for_http,
)
from services.gateway.tests.gateway_support import (
    ALPHA_KEY,
    FakeVendor,
    SpanCollector,
    Vendors,
    acting_metadata,
    provider_yaml,
)


@pytest.fixture(scope="session")
def session_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-logs")


@pytest.fixture(scope="session")
def vendors(session_logs: Path) -> Iterator[Vendors]:
    started = []
    for name in ("alpha", "beta", "gamma"):
        extra = ["--require-key", ALPHA_KEY] if name == "alpha" else []
        proc = start_fake_provider(port=free_port(), log_dir=session_logs, name=name, extra=extra)
        started.append(FakeVendor(name, proc))
    try:
        for vendor in started:
            wait_for_http(vendor.process)
        yield Vendors(*started)
    finally:
        for vendor in started:
            vendor.stop()


@pytest.fixture(scope="session")
def span_collector() -> Iterator[SpanCollector]:
    collector = SpanCollector()
    collector.start()
    yield collector
    collector.stop()


@pytest.fixture(scope="session")
def gateway(
    vendors: Vendors,
    service_env: dict[str, str],
    session_logs: Path,
    span_collector: SpanCollector,
) -> Iterator[ServiceProcess]:
    config = session_logs / "providers.yaml"
    config.write_text(provider_yaml(vendors))
    env = {
        **service_env,
        "CAIRN_GATEWAY_CONFIG": str(config),
        "CAIRN_TEST_ALPHA_KEY": ALPHA_KEY,
        "CAIRN_EMBEDDER": "local",
        "OTEL_EXPORTER_OTLP_ENDPOINT": span_collector.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    with serving("gateway", env=env, log_dir=session_logs) as proc:
        yield proc


@pytest.fixture(autouse=True)
def _fresh_vendors(request: pytest.FixtureRequest) -> None:
    # Only tests that use the vendors pay for the reset.
    if "vendors" in request.fixturenames:
        for vendor in request.getfixturevalue("vendors").all():
            vendor.reset()


@pytest.fixture(scope="session")
def channel(gateway: ServiceProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.address) as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel: grpc.Channel) -> gateway_pb2_grpc.GatewayServiceStub:
    return gateway_pb2_grpc.GatewayServiceStub(channel)


@pytest.fixture
def metadata(issuer: TokenIssuer, new_org: str) -> tuple[tuple[str, str], ...]:
    return call_metadata(issuer.caller_token(org_id=new_org, user_id="ada", roles=["member"]))


@pytest.fixture
def acting(issuer: TokenIssuer, new_org: str) -> Callable[[str], tuple[tuple[str, str], ...]]:
    """Metadata of a call made inside a run: the caller's token (Ada, the same org as
    `metadata`) and the orchestrator's acting credential for that run."""

    def for_run(run_id: str) -> tuple[tuple[str, str], ...]:
        return acting_metadata(issuer, org_id=new_org, user_id="ada", run_id=run_id)

    return for_run
