"""`make bench`: measure, print a table, write bench/results.json.

Each figure is {name, value, unit, parameters}. Nothing here asserts a speed; the
figures are for people to read and compare across commits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.figures import Figure
from bench.gateway_overhead import run_gateway_overhead
from bench.run_latency import run_orchestration

RESULTS = Path(__file__).parent / "results.json"
SUITES = {"gateway": run_gateway_overhead, "run": run_orchestration}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=sorted(SUITES), action="append")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = parser.parse_args()
    console = Console()
    figures: list[Figure] = []
    for name in args.only or list(SUITES):
        console.print(f"[bold]bench[/] {name} …")
        figures.extend(asyncio.run(SUITES[name](quick=args.quick)))
    table = Table(title="cairn benchmarks")
    for column in ("name", "value", "unit", "parameters"):
        table.add_column(column)
    for f in figures:
        table.add_row(f.name, f"{f.value:,.3f}", f.unit, json.dumps(f.parameters, sort_keys=True))
    console.print(table)
    RESULTS.write_text(
        json.dumps(
            {
                "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
                "figures": [f.as_dict() for f in figures],
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
