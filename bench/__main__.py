"""`make bench`: measure, print a table, write bench/results.json.

Each figure is {name, value, unit, parameters}. Nothing here asserts a speed; the
figures are for people to read and compare across commits.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.figures import Figure

RESULTS = Path(__file__).parent / "results.json"
# suite name -> "module:function"; each function is `async def (*, quick: bool) -> list[Figure]`.
SUITES = {
    "gateway": "bench.gateway_overhead:run_gateway_overhead",
    "retrieval": "bench.retrieval_search:run_retrieval",
    "quality": "bench.retrieval_quality:run_quality",
    "memory": "bench.memory_recall:run_memory",
    "run": "bench.run_latency:run_orchestration",
    "cancel": "bench.run_cancel:run_cancel",
    "rest": "bench.restproxy:run_restproxy",
    "replicas": "bench.replicas:run_replicas",
    "tools": "bench.tool_sources:run_tool_sources",
    "panel": "bench.panel:run_panel",
}


def _suite(name: str) -> Callable[..., Awaitable[list[Figure]]]:
    module_name, _, function = SUITES[name].partition(":")
    module = importlib.import_module(module_name)
    suite: Callable[..., Awaitable[list[Figure]]] = getattr(module, function)
    return suite


def _previous_figures() -> list[dict[str, Any]]:
    try:
        previous = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        return []
    figures = previous.get("figures", []) if isinstance(previous, dict) else []
    return [f for f in figures if isinstance(f, dict)]


def _soak(argv: list[str]) -> int:
    """`python -m bench soak --minutes N`: bench/replicas.py's bounded soak; it prints
    as it goes and ends with its figures (not written to results.json)."""
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=_soak.__doc__)
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the soak")
    parser.add_argument("--lanes", type=int, default=16, help="concurrent callers")
    args = parser.parse_args(argv)
    from bench.replicas import soak

    table = Table(title=f"cairn soak, {args.minutes:g} min")
    for column in ("name", "value", "unit", "parameters"):
        table.add_column(column)
    for f in asyncio.run(soak(args.minutes, lanes=args.lanes)):
        table.add_row(f.name, f"{f.value:,.3f}", f.unit, json.dumps(f.parameters, sort_keys=True))
    Console(width=max(Console().width, 140)).print(table)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["soak"]:
        return _soak(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=sorted(SUITES), action="append")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 140))
    figures: list[tuple[str, Figure]] = []
    for name in args.only or list(SUITES):
        try:
            suite = _suite(name)
        except ModuleNotFoundError as exc:
            # Said out loud rather than skipped silently: the table shows what was not measured.
            console.print(f"[yellow]bench {name}: not written yet ({exc.name})[/]")
            continue
        console.print(f"[bold]bench[/] {name} …")
        figures.extend((name, f) for f in asyncio.run(suite(quick=args.quick)))
    table = Table(title="cairn benchmarks")
    table.add_column("name", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("unit", no_wrap=True)
    table.add_column("parameters")
    for _, f in figures:
        table.add_row(f.name, f"{f.value:,.3f}", f.unit, json.dumps(f.parameters, sort_keys=True))
    console.print(table)
    ran = {name for name, _ in figures}
    # A partial run (--only) replaces its own suites' figures and keeps the others.
    kept = [f for f in _previous_figures() if f.get("suite") not in ran]
    fresh = [{"suite": name, **f.as_dict(), "quick": args.quick} for name, f in figures]
    RESULTS.write_text(
        json.dumps(
            {
                "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
                "figures": kept + fresh,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
