"""Gateways started with other configurations: the embedded offline default, and two
replicas sharing one provider ceiling through PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cairn.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from cairn_libs.stack import (
    ServiceProcess,
    free_port,
    start_fake_provider,
    start_service,
    wait_for_health,
    wait_for_http,
)
from services.gateway.tests.gateway_support import FakeVendor, chat_request

Metadata = tuple[tuple[str, str], ...]


@pytest.fixture(scope="module")
def module_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-setups")


@pytest.fixture(scope="module")
def offline_vendor(module_logs: Path) -> Iterator[FakeVendor]:
    proc = start_fake_provider(port=free_port(), log_dir=module_logs, name="offline")
    try:
        wait_for_http(proc)
        yield FakeVendor("offline", proc)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def offline_gateway(
    offline_vendor: FakeVendor, service_env: dict[str, str], module_logs: Path
) -> Iterator[ServiceProcess]:
    proc = start_service(
        "gateway",
        port=free_port(),
        env={
            **service_env,
            "CAIRN_GATEWAY_CONFIG": "",
            "CAIRN_OFFLINE_MODEL_URL": f"{offline_vendor.url}/v1",
            "CAIRN_EMBEDDER": "none",
        },
        log_dir=module_logs,
        suffix="-offline",
    )
    try:
        wait_for_health(proc)
        yield proc
    finally:
        proc.stop()


def test_with_no_provider_file_the_offline_demo_model_answers_and_says_so(
    offline_gateway: ServiceProcess, metadata: Metadata
) -> None:
    with grpc.insecure_channel(offline_gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        response = stub.Chat(
            chat_request(tier=gateway_pb2.TIER_DEEP), metadata=metadata, timeout=10
        )
        models = stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata, timeout=10)

    assert response.message.content.startswith("[offline demo model] ")
    assert (response.provider, response.model) == ("offline", "cairn-offline-demo")
    (listed,) = models.models
    assert listed.offline_demo and listed.model == "cairn-offline-demo"
    assert list(listed.tiers) == [
        gateway_pb2.TIER_FAST,
        gateway_pb2.TIER_BALANCED,
        gateway_pb2.TIER_DEEP,
    ]


def test_with_the_embedder_turned_off_embed_says_what_is_missing(
    offline_gateway: ServiceProcess, metadata: Metadata
) -> None:
    with grpc.insecure_channel(offline_gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(gateway_pb2.EmbedRequest(texts=["x"]), metadata=metadata, timeout=10)

    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "CAIRN_EMBEDDER=none" in refused.value.details()


def test_a_provider_that_is_down_is_reported_in_the_attempts_and_the_gateway_stays_ready(
    service_env: dict[str, str], module_logs: Path, metadata: Metadata
) -> None:
    dead_port = free_port()
    config = module_logs / "dead.yaml"
    config.write_text(
        "providers:\n  - name: dead\n"
        f"    base_url: http://127.0.0.1:{dead_port}/v1\n"
        "    timeout_seconds: 1\n    models: {balanced: m}\n"
    )
    proc = start_service(
        "gateway",
        port=free_port(),
        env={**service_env, "CAIRN_GATEWAY_CONFIG": str(config)},
        log_dir=module_logs,
        suffix="-dead",
    )
    try:
        wait_for_health(proc)
        with grpc.insecure_channel(proc.address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            with pytest.raises(grpc.RpcError) as failed:
                stub.Chat(chat_request(), metadata=metadata, timeout=10)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "dead [m]: CONNECTION_ERROR" in failed.value.details()
        wait_for_health(proc, want="SERVING", timeout=2)
    finally:
        proc.stop()


# --- two replicas, one ceiling ---------------------------------------------------

CEILING_TOKENS = 3000


@pytest.fixture(scope="module")
def ceiling_pair(
    offline_vendor: FakeVendor, service_env: dict[str, str], module_logs: Path
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    config = module_logs / "ceiling.yaml"
    # A fresh provider name per module run, so earlier runs' usage never counts.
    name = f"metered-{free_port()}"
    config.write_text(
        f"providers:\n  - name: {name}\n    base_url: {offline_vendor.url}/v1\n"
        f"    timeout_seconds: 5\n    tokens_per_minute: {CEILING_TOKENS}\n"
        "    models: {balanced: metered-model}\n"
    )
    procs = [
        start_service(
            "gateway",
            port=free_port(),
            env={**service_env, "CAIRN_GATEWAY_CONFIG": str(config)},
            log_dir=module_logs,
            suffix=f"-replica-{i}",
        )
        for i in range(2)
    ]
    try:
        for proc in procs:
            wait_for_health(proc)
        yield procs[0], procs[1]
    finally:
        for proc in procs:
            proc.stop()


def test_two_gateways_under_load_stay_together_under_one_ceiling(
    ceiling_pair: tuple[ServiceProcess, ServiceProcess],
    offline_vendor: FakeVendor,
    metadata: Metadata,
) -> None:
    offline_vendor.reset()
    # 500 prompt tokens + max_tokens 100 each: five calls fit in 3000. The answers are
    # scripted because, unlike a vendor, the demo model's default answer ignores max_tokens.
    offline_vendor.script(*[{"action": "answer", "content": "Noted. " * 20}] * 32)
    request = chat_request("word " * 400, max_tokens=100)
    channels = [grpc.insecure_channel(p.address) for p in ceiling_pair]
    stubs = [gateway_pb2_grpc.GatewayServiceStub(c) for c in channels]

    def call(i: int) -> gateway_pb2.ChatResponse | grpc.StatusCode:
        try:
            return stubs[i % 2].Chat(request, metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()

    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(call, range(32)))
    finally:
        for channel in channels:
            channel.close()

    answered = [r for r in results if isinstance(r, gateway_pb2.ChatResponse)]
    refused = [r for r in results if not isinstance(r, gateway_pb2.ChatResponse)]
    used = sum(r.usage.total_tokens for r in answered)
    assert len(answered) == 5 and len(refused) == 27
    assert used <= CEILING_TOKENS
    assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len(offline_vendor.requests()) == len(answered)
