"""A rate limit after tools were called, with real processes: two offline model
processes behind a real gateway configured to fail over from `first` to `second`.

The gateway refuses to move a turn holding tool calls to another provider, so
the orchestrator re-runs the whole turn from the question without the tool
history (the gateway may then fail over), unless the run carried a confirmation:
then it ends FAILED with the reason and nothing is replayed anywhere."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cairn.orchestrator.v1 import orchestrator_pb2 as pb
from cairn_libs.identity import TokenIssuer
from cairn_libs.stack import (
    free_port,
    start_fake_provider,
    start_service,
    wait_for_health,
    wait_for_http,
)
from services.orchestrator.tests.orchestrator_process_support import (
    SCRIBE_SPEC,
    Orchestrator,
    chat_requests,
    control,
    detail,
    kinds,
    notes,
    resolve,
    script,
    start_run,
    tool_messages,
    trajectory,
)


@dataclass
class FailoverStack:
    first: str
    second: str
    orchestrator: Orchestrator
    pg_url: str


def gateway_config(first: str, second: str) -> str:
    # No retries on the same provider and no cooldowns: each scripted 429 is one
    # refusal, so the tests decide exactly what the gateway sees.
    return f"""\
providers:
  - name: first
    base_url: {first}/v1
    models: {{fast: first-model, balanced: first-model, deep: first-model}}
    max_retries: 0
    cooldown_after_failures: 100
  - name: second
    base_url: {second}/v1
    models: {{fast: second-model, balanced: second-model, deep: second-model}}
    max_retries: 0
    cooldown_after_failures: 100
"""


@pytest.fixture(scope="module")
def failover_stack(
    service_env: dict[str, str], pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FailoverStack]:
    base = tmp_path_factory.mktemp("orchestrator-failover")
    logs = base / "logs"
    agents = base / "agents"
    agents.mkdir()
    (agents / "scribe.yaml").write_text(SCRIBE_SPEC)
    ports = {name: free_port() for name in ("first", "second", "gateway")}
    models = [
        start_fake_provider(port=ports[name], log_dir=logs, name=name)
        for name in ("first", "second")
    ]
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ("first", "second")}
    config = base / "gateway.yaml"
    config.write_text(gateway_config(urls["first"], urls["second"]))
    env = {
        **service_env,
        "CAIRN_GATEWAY_CONFIG": str(config),
        "CAIRN_AGENTS_DIR": str(agents),
        "CAIRN_GATEWAY_ADDR": f"127.0.0.1:{ports['gateway']}",
        "CAIRN_RETRIEVAL_ADDR": "none",
        "CAIRN_MEMORY_ADDR": "none",
        "CAIRN_TEST_WRITE_TOOL": "1",
    }
    gateway = start_service(
        "gateway", port=ports["gateway"], env=env, log_dir=logs, suffix="-failover"
    )
    orchestrator = Orchestrator(env=env, log_dir=logs)
    try:
        for model in models:
            wait_for_http(model)
        wait_for_health(gateway, timeout=90)
        orchestrator.start()
        yield FailoverStack(urls["first"], urls["second"], orchestrator, pg_url)
    finally:
        orchestrator.stop()
        gateway.stop()
        for model in models:
            model.stop()


@pytest.fixture(autouse=True)
def fresh_scripts(failover_stack: FailoverStack) -> None:
    for url in (failover_stack.first, failover_stack.second):
        control(url, "reset", {})


def test_a_rate_limit_after_tools_reruns_the_turn_from_the_question_on_the_next_provider(
    failover_stack: FailoverStack, issuer: TokenIssuer, new_org: str
) -> None:
    alice = issuer.caller_token(org_id=new_org, user_id="alice")
    asked = f"What do the notes say about tea? ({uuid.uuid4().hex[:8]})"
    script(
        failover_stack.first,
        {"action": "tool_call", "name": "search_knowledge", "arguments": {"query": "tea"}},
        {"action": "status", "status": 429},
        {"action": "status", "status": 429},
    )
    script(failover_stack.second, {"action": "answer", "content": "Nothing about tea, sorry."})

    run = start_run(failover_stack.orchestrator.address, alice, "scribe", asked)

    assert run.state == pb.RUN_STATE_COMPLETED, run.reason
    assert run.answer == "Nothing about tea, sorry."
    steps = trajectory(failover_stack.orchestrator.address, alice, run.run_id)
    assert kinds(steps) == ["MODEL_CALL", "TOOL_CALL", "MODEL_CALL", "MODEL_CALL"]
    refused, rerun = steps[2], steps[3]
    assert refused.error.code == "gateway.resource_exhausted"
    assert "re-run from the question" in detail(refused)["rerun"]
    assert detail(rerun)["provider"] == "second"
    assert [a["provider"] for a in detail(rerun)["attempts"]] == ["first", "second"]
    # The second provider was sent the question, not the first provider's tool history.
    (sent,) = chat_requests(failover_stack.second, containing=asked)
    assert tool_messages(sent) == [] and [m["role"] for m in sent] == ["system", "user"]
    assert len(chat_requests(failover_stack.first, containing=asked)) == 3


def test_a_run_that_carried_a_confirmation_is_never_replayed_on_another_provider(
    failover_stack: FailoverStack, issuer: TokenIssuer, new_org: str
) -> None:
    alice = issuer.caller_token(org_id=new_org, user_id="alice")
    asked = f"Please note that I like tea ({uuid.uuid4().hex[:8]})."
    script(
        failover_stack.first,
        {"action": "tool_call", "name": "append_note", "arguments": {"text": "likes tea"}},
        {"action": "status", "status": 429},
    )
    run = start_run(failover_stack.orchestrator.address, alice, "scribe", asked)
    assert run.state == pb.RUN_STATE_CONFIRMATION_PENDING

    done = resolve(
        failover_stack.orchestrator.address, alice, run.pending_confirmation.confirmation_token
    )

    assert done.state == pb.RUN_STATE_FAILED
    assert "carried a confirmed write" in done.reason and "not replayed" in done.reason
    assert notes(failover_stack.pg_url, new_org) == [("likes tea", 1)]
    assert chat_requests(failover_stack.second, containing=asked) == []
    assert len(chat_requests(failover_stack.first, containing=asked)) == 2
    steps = trajectory(failover_stack.orchestrator.address, alice, run.run_id)
    assert kinds(steps)[-1] == "MODEL_CALL" and steps[-1].error.code == (
        "gateway.resource_exhausted"
    )
