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
    health_status,
    log_events,
    serving,
    start_fake_provider,
    start_service,
    wait_for_health,
    wait_for_http,
    wait_until,
)
from services.gateway.tests.gateway_support import FakeVendor, chat_request
from services.gateway.tests.test_gateway_process_calls import retry_delay_seconds

Metadata = tuple[tuple[str, str], ...]


@pytest.fixture(scope="module")
def module_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-setups")


@pytest.fixture(scope="module")
def offline_vendor(module_logs: Path) -> Iterator[FakeVendor]:
    vendor = FakeVendor(
        "offline", start_fake_provider(port=free_port(), log_dir=module_logs, name="offline")
    )
    try:
        wait_for_http(vendor.process)
        yield vendor
    finally:
        vendor.stop()


@pytest.fixture(scope="module")
def offline_gateway(
    offline_vendor: FakeVendor, service_env: dict[str, str], module_logs: Path
) -> Iterator[ServiceProcess]:
    env = {
        **service_env,
        "CAIRN_GATEWAY_CONFIG": "",
        "CAIRN_OFFLINE_MODEL_URL": f"{offline_vendor.url}/v1",
        "CAIRN_EMBEDDER": "none",
    }
    with serving("gateway", env=env, log_dir=module_logs, suffix="-offline") as proc:
        yield proc


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
        "    timeout_seconds: 1\n    retry_backoff_seconds: 0.05\n    models: {balanced: m}\n"
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


# --- operators: what start-up says, and what a deployment mistake reads as ----------

UNSET_KEY = "CAIRN_TEST_NEVER_SET_KEY"


def events_named(proc: ServiceProcess, event: str) -> list[dict[str, object]]:
    return [e for e in log_events(proc) if e.get("event") == event]


@pytest.fixture(scope="module")
def half_keyed_gateway(
    offline_vendor: FakeVendor, service_env: dict[str, str], module_logs: Path
) -> Iterator[ServiceProcess]:
    """Two providers; the one serving deep and embeddings names a key variable that is
    unset. Started at WARNING, the level an operator quiets a busy gateway with."""
    config = module_logs / "half-keyed.yaml"
    config.write_text(
        "providers:\n"
        f"  - name: keyed\n    base_url: {offline_vendor.url}/v1\n    api_key_env: {UNSET_KEY}\n"
        "    embedding_model: keyed-embed\n"
        "    models: {balanced: keyed-balanced, deep: keyed-deep}\n"
        f"  - name: open\n    base_url: {offline_vendor.url}/v1\n"
        "    models: {balanced: open-balanced}\n"
    )
    env = {
        **service_env,
        "CAIRN_GATEWAY_CONFIG": str(config),
        "CAIRN_LOG_LEVEL": "WARNING",
        "CAIRN_EMBEDDER": "local",
    }
    env.pop(UNSET_KEY, None)
    with serving("gateway", env=env, log_dir=module_logs, suffix="-half-keyed") as proc:
        yield proc


def test_at_warning_level_start_up_still_says_which_configuration_was_loaded(
    half_keyed_gateway: ServiceProcess,
) -> None:
    (loaded,) = events_named(half_keyed_gateway, "gateway.config_loaded")
    providers = {e["provider"]: e for e in events_named(half_keyed_gateway, "gateway.provider")}

    assert loaded["source"].endswith("half-keyed.yaml")  # type: ignore[union-attr]
    assert loaded["providers"] == ["keyed", "open"] and loaded["usable"] == ["open"]
    assert loaded["unusable"] == {"keyed": f"its key variable {UNSET_KEY} is not set"}
    assert loaded["keys_set"] == {UNSET_KEY: False}
    assert loaded["tiers"] == {"fast": [], "balanced": ["open"], "deep": []}
    # The unusable provider is a warning of its own, with why; the usable one is
    # info, filtered out at this level like every other info line.
    assert set(providers) == {"keyed"}
    assert providers["keyed"]["level"] == "warning" and providers["keyed"]["usable"] is False
    assert not events_named(half_keyed_gateway, "rpc.ok")


@pytest.mark.parametrize(
    ("request_", "names"),
    [
        (chat_request(tier=gateway_pb2.TIER_DEEP), ["tier 'deep'", "'keyed'", UNSET_KEY]),
        (chat_request(tier=gateway_pb2.TIER_FAST), ["no provider for tier 'fast'", "balanced"]),
        (chat_request(model="keyed-deep"), ["model 'keyed-deep'", "'keyed'", UNSET_KEY]),
    ],
    ids=["tier served only by a keyless provider", "tier nobody serves", "model of a keyless"],
)
def test_a_deployment_mistake_is_failed_precondition_naming_the_tier_and_why(
    half_keyed_gateway: ServiceProcess,
    metadata: Metadata,
    request_: gateway_pb2.ChatRequest,
    names: list[str],
) -> None:
    with grpc.insecure_channel(half_keyed_gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Chat(request_, metadata=metadata, timeout=10)

    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    for name in names:
        assert name in (refused.value.details() or "")


def test_the_usable_provider_still_answers_and_the_default_embedder_is_not_swapped(
    half_keyed_gateway: ServiceProcess, metadata: Metadata
) -> None:
    with grpc.insecure_channel(half_keyed_gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        answered = stub.Chat(chat_request(), metadata=metadata, timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(gateway_pb2.EmbedRequest(texts=["x"]), metadata=metadata, timeout=10)

    assert answered.provider == "open"
    # The deployment's embedding model is keyed's; the local model must not stand in.
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'keyed-embed'" in (refused.value.details() or "")


def test_a_gateway_with_no_usable_provider_is_not_serving_and_says_why(
    offline_vendor: FakeVendor, service_env: dict[str, str], module_logs: Path, metadata: Metadata
) -> None:
    config = module_logs / "no-key.yaml"
    config.write_text(
        f"providers:\n  - name: keyed\n    base_url: {offline_vendor.url}/v1\n"
        f"    api_key_env: {UNSET_KEY}\n    models: {{balanced: m}}\n"
    )
    env = {**service_env, "CAIRN_GATEWAY_CONFIG": str(config)}
    env.pop(UNSET_KEY, None)
    proc = start_service("gateway", port=free_port(), env=env, log_dir=module_logs, suffix="-nokey")
    try:
        # The first readiness check, whatever it finds, is logged: wait for it.
        (health,) = wait_until(lambda: events_named(proc, "service.health"), timeout=30)
        assert health["serving"] is False
        assert health_status(proc.address) == "NOT_SERVING"
        (alarm,) = events_named(proc, "gateway.no_usable_provider")
        assert alarm["level"] == "error"
        with grpc.insecure_channel(proc.address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Chat(chat_request(), metadata=metadata, timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no model provider is usable" in (refused.value.details() or "")
        assert UNSET_KEY in (refused.value.details() or "")
    finally:
        proc.stop()


def test_a_base_url_that_ends_in_chat_completions_stops_the_gateway_at_start_up(
    service_env: dict[str, str], module_logs: Path
) -> None:
    config = module_logs / "suffixed.yaml"
    config.write_text(
        "providers:\n  - name: groq\n"
        "    base_url: https://api.groq.com/openai/v1/chat/completions\n"
        "    models: {balanced: m}\n"
    )
    proc = start_service(
        "gateway",
        port=free_port(),
        env={**service_env, "CAIRN_GATEWAY_CONFIG": str(config)},
        log_dir=module_logs,
        suffix="-suffixed",
    )
    try:
        returncode = proc.process.wait(timeout=30)
    finally:
        proc.stop()

    # One JSON line like every other event, not a traceback through the start-up code.
    assert returncode == 2
    assert "Traceback" not in proc.log_text()
    (refused,) = events_named(proc, "service.config_invalid")
    error = str(refused["error"])
    assert "(groq).base_url 'https://api.groq.com/openai/v1/chat/completions'" in error
    assert "write 'https://api.groq.com/openai/v1'" in error


# --- two replicas, one ceiling ---------------------------------------------------

# The issue's own number: a deployment ceiling of 8,000 tokens a minute must be safe.
CEILING_TOKENS = 8000
PROMPT = "word " * 400  # 2000 characters: 500 prompt tokens
MAX_TOKENS = 500  # reserved up front: 1000 tokens per call
ANSWER = "Noted."  # really used: 500 + 2 = 502 tokens per call


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
        "    max_retries: 0\n    models: {balanced: metered-model}\n"
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


def test_two_gateways_under_load_stay_together_under_one_ceiling_of_8000_tokens(
    ceiling_pair: tuple[ServiceProcess, ServiceProcess],
    offline_vendor: FakeVendor,
    metadata: Metadata,
) -> None:
    """Both replicas are loaded at once until the shared ceiling refuses everything.

    Before a call each gateway reserves its estimate (prompt + max_tokens = 1000);
    afterwards it settles to the usage the vendor reported (502). Without settling,
    8 calls would fit; with it, calls keep being admitted while the settled usage
    plus one more estimate fits: 13 settled (6526) + 1000 <= 8000, 14 settled (7028)
    + 1000 > 8000, so exactly 14 once nothing is in flight. At no moment may what
    the vendor received pass 8000, however the calls interleave.
    """
    offline_vendor.reset()
    offline_vendor.script(*[{"action": "answer", "content": ANSWER}] * 64)
    request = chat_request(PROMPT, max_tokens=MAX_TOKENS)
    channels = [grpc.insecure_channel(p.address) for p in ceiling_pair]
    stubs = [gateway_pb2_grpc.GatewayServiceStub(c) for c in channels]

    def call(i: int) -> tuple[int, gateway_pb2.ChatResponse | grpc.RpcError]:
        try:
            return i % 2, stubs[i % 2].Chat(request, metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return i % 2, exc

    try:
        # Load from both replicas at once...
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(call, range(32)))
        # ...then, with nothing in flight, alternate until both refuse in a row.
        refusals_in_a_row, i = 0, 0
        while refusals_in_a_row < 2:
            result = call(i)
            results.append(result)
            refusals_in_a_row = (
                0 if isinstance(result, gateway_pb2.ChatResponse) else refusals_in_a_row + 1
            )
            i += 1
    finally:
        for channel in channels:
            channel.close()

    answered = [r for _, r in results if isinstance(r, gateway_pb2.ChatResponse)]
    refused = [r for _, r in results if isinstance(r, grpc.RpcError)]
    received = offline_vendor.requests()
    # What the vendor counts: every request it received, at the usage it reported.
    assert len(received) == len(answered)
    assert sum(r.usage.total_tokens for r in answered) <= CEILING_TOKENS
    assert {r.usage.total_tokens for r in answered} == {502}
    # Settling gave back what the estimate over-reserved: 14 calls, not 8.
    assert len(answered) == 14
    assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(retry_delay_seconds(r) is not None for r in refused)
    assert {r["body"]["max_tokens"] for r in received} == {MAX_TOKENS}
    # Both replicas sent calls: the ceiling held across them, not within one.
    assert {replica for replica, r in results if isinstance(r, gateway_pb2.ChatResponse)} == {0, 1}
