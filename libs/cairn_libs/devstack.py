"""`make run`: the whole system on its embedded defaults, shown working.

Starts (or reuses) the embedded PostgreSQL, the offline demo model, the four
services (CAIRN_REPLICAS of each, default 1) and the REST proxy (built from
services/restproxy) as separate processes, ingests the bundled handbook, asks one question
as two callers with different rights, prints each answer with its citations and
trajectory, then keeps the stack up until Ctrl-C. The demo people directory
(demo/people_directory, a company system reached as a tool source) starts before
the orchestrator, and the `people` agent is asked one question as each caller too.
Then Tom asks the `assistant` agent to remember a preference: its confirmation
card is printed, the demo approves it, and a second question recalls it. Everything lives under
`state/`, so a second `make run` reuses keys, database and vectors.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

import httpx
from google.protobuf import json_format
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from cairn.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from cairn.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from cairn_libs.clients import call_metadata, sync_channel
from cairn_libs.demo_corpus import handbook_documents, load_handbook
from cairn_libs.identity import TokenIssuer, generate_dev_keypair
from cairn_libs.stack import (
    REPO_ROOT,
    ServiceProcess,
    build_restproxy,
    health_status,
    replica_target,
    replicas_setting,
    stack_env,
    start_embedded_postgres,
    start_fake_provider,
    start_process,
    start_replicas,
    start_restproxy,
    stop_embedded_postgres,
    wait_for_health,
    wait_for_http,
)

STATE = REPO_ROOT / "state"
PORTS = {"gateway": 50051, "retrieval": 50052, "memory": 50053, "orchestrator": 50054}
# With CAIRN_REPLICAS=N, replica i of a service listens on its port + 100 * i.
REPLICAS = replicas_setting()
REPLICA_PORTS = {name: [port + 100 * i for i in range(REPLICAS)] for name, port in PORTS.items()}
TARGETS = {
    name: replica_target([f"127.0.0.1:{p}" for p in ports]) for name, ports in REPLICA_PORTS.items()
}
OFFLINE_MODEL_PORT = 8089
# The demo people directory: its ToolService (gRPC) and its MCP server (HTTP).
PEOPLE_DIRECTORY_PORTS = (50061, 50062)
PEOPLE_QUESTION = "How many open positions do my teams have?"
# The memory cycle: Tom asks the assistant to keep a preference, approves its card,
# and a later question recalls it.
REMEMBER_REQUEST = "Please remember that I prefer meetings in the morning."
RECALL_QUESTION = "What do you know about me?"
REST_PORT = 8080
REST_URL = f"http://127.0.0.1:{REST_PORT}"
console = Console(width=max(Console().width, 120))


def _start_all(env: dict[str, str]) -> list[ServiceProcess]:
    logs = STATE / "logs"
    started: list[ServiceProcess] = []
    model = start_fake_provider(port=OFFLINE_MODEL_PORT, log_dir=logs)
    wait_for_http(model)
    started.append(model)
    for name, ports in REPLICA_PORTS.items():
        if health_status(f"127.0.0.1:{ports[0]}") == "SERVING":
            console.print(f"[yellow]{name} is already serving on :{ports[0]}; reusing it[/]")
            continue
        started.extend(start_replicas(name, ports=ports, env=env, log_dir=logs))
    for proc in started[1:]:
        wait_for_health(proc, timeout=90)
        console.print(f"[green]✓[/] {proc.name:<13} SERVING on {proc.address}")
    return started


PANEL_DIST = REPO_ROOT / "web" / "dist"


def _panel_env(issuer: TokenIssuer) -> dict[str, str]:
    """The proxy serves the built panel (`make run` builds it with `make web`) and
    offers the demo people as one-click sign-ins: development only, from a file of
    tokens minted here (the proxy mints nothing)."""
    if not (PANEL_DIST / "index.html").exists():
        console.print(
            "[yellow]web/dist is not built (`make web`); the REST proxy serves no panel[/]"
        )
        return {}
    corpus = load_handbook()
    people = [
        {
            "id": caller["user"],
            "title": caller["title"],
            "roles": caller["roles"],
            "token": issuer.caller_token(
                org_id=corpus["org"],
                user_id=caller["user"],
                roles=caller["roles"],
                ttl_seconds=86400,
            ),
        }
        for caller in corpus["callers"]
    ]
    identities = STATE / "dev-identities.json"
    identities.write_text(json.dumps(people))
    identities.chmod(0o600)
    return {"CAIRN_PANEL_DIR": str(PANEL_DIST), "CAIRN_PANEL_DEV_IDENTITIES_FILE": str(identities)}


def _panel_help(corpus: dict[str, Any]) -> None:
    if not (PANEL_DIST / "index.html").exists():
        return
    people = " or ".join(c["title"] for c in corpus["callers"])
    console.print(
        Panel(
            f"Open {REST_URL}/ in a browser and sign in as {people} with one click\n"
            "(those demo identities are development only: the proxy offers them because\n"
            "CAIRN_PANEL_DEV_IDENTITIES_FILE points at state/dev-identities.json).\n"
            "Ask the assistant to remember something to see a confirmation card.",
            title="the web panel",
            expand=False,
        )
    )


def _start_restproxy(env: dict[str, str], issuer: TokenIssuer) -> ServiceProcess | None:
    """The REST proxy on :8080 in front of the services, serving the web panel;
    None when one already answers there (a second `make run`)."""
    try:
        if httpx.get(f"{REST_URL}/healthz", timeout=1).status_code == 200:
            console.print(
                f"[yellow]the REST proxy is already serving on :{REST_PORT}; reusing it[/]"
            )
            return None
    except httpx.HTTPError:
        pass
    build_restproxy()
    proxy = start_restproxy(
        port=REST_PORT,
        addresses=TARGETS,
        env={**env, **_panel_env(issuer)},
        log_dir=STATE / "logs",
    )
    wait_for_http(proxy)
    ready = httpx.get(f"{REST_URL}/readyz", timeout=10).json()
    console.print(
        f"[green]✓[/] {proxy.name:<13} REST on {REST_URL} (backends: {ready['backends']})"
    )
    return proxy


def _start_people_directory(env: dict[str, str]) -> ServiceProcess | None:
    """The demo people directory, before the orchestrator lists its tools; None
    when one already serves (a second `make run`)."""
    grpc_port, mcp_port = PEOPLE_DIRECTORY_PORTS
    env["CAIRN_PEOPLE_DIRECTORY_GRPC_ADDR"] = f"127.0.0.1:{grpc_port}"
    if health_status(f"127.0.0.1:{grpc_port}") == "SERVING":
        console.print(f"[yellow]the people directory is already serving on :{grpc_port}[/]")
        return None
    proc = start_process(
        "people-directory",
        [sys.executable, "-m", "cairn_people_directory"],
        env={**env, "CAIRN_PORT": str(grpc_port), "CAIRN_MCP_PORT": str(mcp_port)},
        log_dir=STATE / "logs",
        address=f"127.0.0.1:{grpc_port}",
    )
    wait_for_health(proc, timeout=60)
    console.print(
        f"[green]✓[/] {'people-dir':<13} SERVING tools on {proc.address} (gRPC) "
        f"and http://127.0.0.1:{mcp_port}/mcp (MCP)"
    )
    return proc


def _ingest(corpus: dict[str, Any], issuer: TokenIssuer) -> None:
    ingester = corpus["ingester"]
    token = issuer.caller_token(
        org_id=corpus["org"], user_id=ingester["user"], roles=ingester["roles"]
    )
    documents = handbook_documents(corpus)
    with sync_channel(TARGETS["retrieval"]) as ch:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(ch)
        outcomes = []
        for progress in stub.IngestDocuments(
            retrieval_pb2.IngestDocumentsRequest(documents=documents),
            metadata=call_metadata(token),
            timeout=300,
        ):
            outcomes.append(
                retrieval_pb2.DocumentOutcome.Name(progress.result.outcome).removeprefix(
                    "DOCUMENT_OUTCOME_"
                )
            )
        stats = stub.Stats(retrieval_pb2.StatsRequest(), metadata=call_metadata(token), timeout=30)
    summary = ", ".join(f"{outcomes.count(o)} {o.lower()}" for o in sorted(set(outcomes)))
    console.print(
        f"[green]✓[/] ingested the handbook: {summary}; "
        f"{stats.chunks} chunks, {stats.embedded_chunks} embedded ({stats.embedder or 'no embedder'})"
    )


def _ask(
    corpus: dict[str, Any],
    caller: dict[str, Any],
    issuer: TokenIssuer,
    *,
    agent: str = "handbook",
    question: str = "",
) -> None:
    token = issuer.caller_token(org_id=corpus["org"], user_id=caller["user"], roles=caller["roles"])
    with sync_channel(TARGETS["orchestrator"]) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        run = stub.StartRun(
            orchestrator_pb2.StartRunRequest(agent=agent, input=question or corpus["question"]),
            metadata=call_metadata(token),
            timeout=120,
        ).run
        trajectory = stub.GetTrajectory(
            orchestrator_pb2.GetTrajectoryRequest(run_id=run.run_id),
            metadata=call_metadata(token),
            timeout=30,
        )
    state = orchestrator_pb2.RunState.Name(run.state).removeprefix("RUN_STATE_")
    body = f"[bold]Q:[/] {escape(run.input)}\n[bold]A:[/] {escape(run.answer or '(no answer)')}"
    if run.reason:
        body += f"\n[red]{state}: {escape(run.reason)}[/]"
    if run.citations:
        body += "\n[bold]Citations:[/]"
        for c in run.citations:
            body += escape(
                f"\n  [{c.label}] {c.title} — {c.document_id}, chars {c.char_start}-{c.char_end}"
            )
    else:
        body += "\n[bold]Citations:[/] none"
    console.print(
        Panel(body, title=f"{caller['title']} · run {run.run_id} · {state}", expand=False)
    )
    table = Table(
        title=f"trajectory of {run.run_id} (trace {trajectory.trace_id})", show_lines=False
    )
    for column in ("#", "step", "name", "span id", "what happened"):
        table.add_column(column, overflow="fold")
    for step in trajectory.steps:
        detail = json_format.MessageToDict(step.detail)
        kind = orchestrator_pb2.StepKind.Name(step.kind).removeprefix("STEP_KIND_")
        table.add_row(
            str(step.seq),
            kind,
            step.name,
            step.span_id,
            escape(_summarise(kind, detail, step.error.message)),
        )
    console.print(table)


def _remember_cycle(corpus: dict[str, Any], issuer: TokenIssuer) -> None:
    """remember -> card -> approve -> recalled, as Tom with the `assistant` agent:
    the write waits for his yes, and the next run reads what was kept."""
    tom = next(c for c in corpus["callers"] if c["user"] == "tom")
    token = issuer.caller_token(org_id=corpus["org"], user_id=tom["user"], roles=tom["roles"])
    metadata = call_metadata(token)
    with sync_channel(TARGETS["orchestrator"]) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(ch)
        run = stub.StartRun(
            orchestrator_pb2.StartRunRequest(agent="assistant", input=REMEMBER_REQUEST),
            metadata=metadata,
            timeout=120,
        ).run
        if run.state != orchestrator_pb2.RUN_STATE_CONFIRMATION_PENDING:
            state = orchestrator_pb2.RunState.Name(run.state)
            console.print(
                f"[red]the remember run did not ask for a confirmation ({state}): {escape(run.reason)}[/]"
            )
            return
        pending = run.pending_confirmation
        card = pending.card
        body = f"[bold]Q:[/] {escape(run.input)}\n[bold]Card:[/] {escape(card.summary)}"
        for d in card.details:
            body += f"\n  {escape(d.label)}: {escape(d.value)}"
        for warning in card.warnings:
            body += f"\n  [yellow]! {escape(warning)}[/]"
        console.print(
            Panel(
                body,
                title=f"{tom['title']} · run {run.run_id} · CONFIRMATION_PENDING",
                expand=False,
            )
        )
        done = stub.ResolveConfirmation(
            orchestrator_pb2.ResolveConfirmationRequest(
                confirmation_token=pending.confirmation_token,
                decision=orchestrator_pb2.DECISION_APPROVE,
                note="approved by make run's demo",
            ),
            metadata=metadata,
            timeout=120,
        ).run
        state = orchestrator_pb2.RunState.Name(done.state).removeprefix("RUN_STATE_")
        console.print(
            f"[green]✓[/] {tom['title']} approved it; run {done.run_id} is {state}: {escape(done.answer or done.reason)}"
        )
    _ask(corpus, tom, issuer, agent="assistant", question=RECALL_QUESTION)


def _summarise(kind: str, detail: dict[str, Any], error: str) -> str:
    """One line per step for the terminal; the full record is in GetTrajectory."""
    if error:
        return f"error: {error}"
    if kind == "MEMORY_READ":
        return f"{int(detail.get('count', 0))} memories, recall mode {detail.get('mode', '?')}"
    if kind == "RETRIEVAL":
        docs = ", ".join(f"{r['label']}={r['document_id']}" for r in detail.get("results", []))
        return f"{detail.get('mode', '?')}: {docs}"
    if kind == "MODEL_CALL":
        usage = detail.get("usage", {})
        calls = ", ".join(c["name"] for c in detail.get("tool_calls", []))
        wants = f", wants {calls}" if calls else ""
        return (
            f"{detail.get('provider')}/{detail.get('model')}: "
            f"{int(usage.get('prompt_tokens', 0))}+{int(usage.get('completion_tokens', 0))} tokens, "
            f"{len(detail.get('attempts', []))} attempt(s), finish {detail.get('finish_reason')}{wants}"
        )
    if kind == "TOOL_CALL":
        labels = ",".join(detail.get("labels", []))
        source = (
            f" from {detail['source']} ({detail.get('transport')})" if "source" in detail else ""
        )
        return f"args {json.dumps(detail.get('arguments'))} -> {labels or 'result'}{source}" + (
            " (truncated)" if detail.get("truncated") else ""
        )
    return json.dumps(detail)[:120]


def _grpcurl_help(corpus: dict[str, Any], issuer: TokenIssuer) -> None:
    tokens = STATE / "tokens"
    tokens.mkdir(parents=True, exist_ok=True)
    for caller in [*corpus["callers"], corpus["ingester"]]:
        path = tokens / f"{caller['user']}.jwt"
        path.write_text(
            issuer.caller_token(
                org_id=corpus["org"],
                user_id=caller["user"],
                roles=caller["roles"],
                ttl_seconds=86400,
            )
        )
    console.print(
        Panel(
            "Tokens for the demo callers are in state/tokens/ (valid 24 h). With grpcurl (reflection is on):\n\n"
            f"  grpcurl -plaintext 127.0.0.1:{PORTS['orchestrator']} list\n"
            f'  grpcurl -plaintext -H "authorization: Bearer $(cat state/tokens/tom.jwt)" \\\n'
            f'    -d \'{{"agent": "handbook", "input": "How many days of leave do I get?"}}\' \\\n'
            f"    127.0.0.1:{PORTS['orchestrator']} cairn.orchestrator.v1.OrchestratorService/StartRun\n"
            f"  grpcurl -plaintext 127.0.0.1:{PORTS['retrieval']} grpc.health.v1.Health/Check\n\n"
            f"Over REST (the proxy at {REST_URL}; contract at {REST_URL}/openapi.json):\n\n"
            f'  curl -s -H "Authorization: Bearer $(cat state/tokens/tom.jwt)" \\\n'
            f'    -d \'{{"agent": "handbook", "input": "How many days of leave do I get?"}}\' \\\n'
            f"    {REST_URL}/v1/runs\n"
            f'  curl -sN -H "Authorization: Bearer $(cat state/tokens/tom.jwt)" \\\n'
            f"    {REST_URL}/v1/runs/RUN_ID/events\n\n"
            "Ingest your own files (the docs-bot token may ingest):\n"
            "  .venv/bin/python -m cairn_retrieval.ingest_cli --token-file state/tokens/docs-bot.jwt \\\n"
            "    --source handbook --role employee PATH...\n\n"
            "Logs: state/logs/. The stack stays up until Ctrl-C.",
            title="call it yourself",
            expand=False,
        )
    )


def _stop_postgres() -> None:
    """Stop the embedded PostgreSQL and say so; if it cannot be stopped here, say
    that it is still running and how to stop it, rather than leave it unsaid."""
    try:
        stop_embedded_postgres(STATE / "pg")
    except Exception as exc:  # whatever pg_ctl says, the person must hear the outcome
        console.print(
            f"[yellow]PostgreSQL may still be running ({type(exc).__name__}); "
            "stop it with: .venv/bin/python -m cairn_libs.devstack --stop[/]"
        )
        return
    console.print(
        "PostgreSQL stopped; its data stays in ./state for the next `make run` "
        "(`make clean-state` removes it)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stop", action="store_true", help="stop the embedded PostgreSQL and exit")
    parser.add_argument(
        "--no-wait", action="store_true", help="exit after the demo instead of staying up"
    )
    args = parser.parse_args()
    if args.stop:
        stop_embedded_postgres(STATE / "pg")
        return 0

    STATE.mkdir(exist_ok=True)
    private_key, public_key = generate_dev_keypair(STATE / "keys")
    issuer = TokenIssuer.from_file(private_key)
    console.print("[bold]cairn[/] · starting on embedded defaults (state in ./state)")
    pg_url = start_embedded_postgres(STATE / "pg")
    console.print(f"[green]✓[/] PostgreSQL with pgvector at {pg_url}")
    processes: list[ServiceProcess] = []
    try:
        env = stack_env(
            database_url=pg_url,
            keys=(private_key, public_key),
            qdrant_path=STATE / "qdrant",
            model_url=f"http://127.0.0.1:{OFFLINE_MODEL_PORT}",
            addresses=TARGETS,
        )
        directory = _start_people_directory(env)
        processes = ([directory] if directory is not None else []) + _start_all(env)
        proxy = _start_restproxy(env, issuer)
        if proxy is not None:
            processes.append(proxy)
        corpus = load_handbook()
        _ingest(corpus, issuer)
        for caller in corpus["callers"]:
            _ask(corpus, caller, issuer)
        for caller in corpus["callers"]:
            _ask(corpus, caller, issuer, agent="people", question=PEOPLE_QUESTION)
        _remember_cycle(corpus, issuer)
        _grpcurl_help(corpus, issuer)
        _panel_help(corpus)
        if not args.no_wait:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            while all(p.process.poll() is None for p in processes):
                time.sleep(0.5)
            dead = [p.name for p in processes if p.process.poll() is not None]
            console.print(f"[red]stopped because {', '.join(dead)} exited; see state/logs/[/]")
            return 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        console.print("stopping…")
        for proc in reversed(processes):
            proc.stop()
        _stop_postgres()


if __name__ == "__main__":
    sys.exit(main())
