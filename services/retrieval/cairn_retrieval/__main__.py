"""`python -m cairn_retrieval`: serve RetrievalService (default port 50052).

`python -m cairn_retrieval reindex vectors|documents` repairs the indexes from
what PostgreSQL holds instead (see cairn_retrieval.reindex)."""

from __future__ import annotations

import sys

from cairn_libs.server import run_service
from cairn_retrieval.app import app_from_env

if __name__ == "__main__":
    if sys.argv[1:2] == ["reindex"]:
        from cairn_retrieval.reindex import main

        sys.exit(main(sys.argv[2:]))
    run_service(app_from_env, default_port=50052)
