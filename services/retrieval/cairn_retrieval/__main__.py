"""`python -m cairn_retrieval`: serve RetrievalService (default port 50052)."""

from __future__ import annotations

from cairn_libs.server import run_service
from cairn_retrieval.app import app_from_env

if __name__ == "__main__":
    run_service(app_from_env, default_port=50052)
