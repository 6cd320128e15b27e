"""`python -m cairn_orchestrator`: serve OrchestratorService (default port 50054)."""

from __future__ import annotations

from cairn_libs.server import run_service
from cairn_orchestrator.app import DEFAULT_PORT, OrchestratorApp

if __name__ == "__main__":
    run_service(OrchestratorApp.from_env, default_port=DEFAULT_PORT)
