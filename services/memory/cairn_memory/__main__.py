"""`python -m cairn_memory`: serve cairn.memory.v1.MemoryService (default port 50053)."""

from __future__ import annotations

from cairn_libs.server import run_service
from cairn_memory.app import DEFAULT_PORT, MemoryApp

if __name__ == "__main__":
    run_service(MemoryApp.from_env, default_port=DEFAULT_PORT)
