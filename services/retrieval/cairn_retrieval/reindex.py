"""`python -m cairn_retrieval reindex vectors|documents`: the repairs of
`cairn_retrieval.repair`, run once with the service's own settings.

A module of its own because it builds the whole service from the environment
(`app_from_env`), which itself wires `repair`: kept in `repair`, the two would
import each other.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from cairn_libs.errors import CairnError, ConfigurationError
from cairn_retrieval.app import app_from_env
from cairn_retrieval.domain import Outcome
from cairn_retrieval.errors import VectorStoreUnavailable
from cairn_retrieval.postgres.document_reads import PostgresDocumentReads
from cairn_retrieval.postgres.vector_ledger import PostgresVectorLedger
from cairn_retrieval.repair import rebuild_vectors, remake_stale_documents


async def _reindex(what: str) -> int:
    app = app_from_env()
    try:
        if not await app.database.ready():
            print(
                "reindex: the retrieval database is not reachable (DATABASE_URL)", file=sys.stderr
            )
            return 1
        if what == "vectors":
            if app.embedder is None:
                print(
                    "reindex vectors: no embedder is configured, so no collection is searched; "
                    "set CAIRN_RETRIEVAL_EMBEDDER or CAIRN_EMBEDDER",
                    file=sys.stderr,
                )
                return 2
            rebuilt = await rebuild_vectors(
                PostgresVectorLedger(app.database),
                app.vectors,
                model_id=app.embedder.model_id,
                dimensions=app.embedder.dimensions,
            )
            print(
                f"reindex vectors: {app.vectors.location()} rebuilt as store "
                f"{rebuilt.store_id}: {rebuilt.points} points from PostgreSQL "
                f"({rebuilt.documents} documents), nothing embedded"
            )
            return 0
        counts = await remake_stale_documents(app.ingestor, PostgresDocumentReads(app.database))
        print(
            "reindex documents: "
            + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
            if counts
            else "reindex documents: every document is indexed as this service indexes"
        )
        return 1 if counts.get(Outcome.FAILED.value) else 0
    except VectorStoreUnavailable as exc:
        print(f"reindex {what}: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await app.stop()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cairn_retrieval reindex",
        description="Repair retrieval's indexes from what PostgreSQL holds, with the "
        "service's own settings (DATABASE_URL, QDRANT_URL or CAIRN_QDRANT_PATH, ...). "
        "With an embedded store, stop the service first: its folder is locked.",
    )
    parser.add_argument(
        "what",
        choices=("vectors", "documents"),
        help="vectors: rebuild the vector collection from PostgreSQL's vectors, embedding "
        "nothing; documents: remake documents indexed by another analyzer or chunking",
    )
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_reindex(args.what))
    except (ConfigurationError, CairnError) as exc:
        print(f"reindex {args.what}: {exc}", file=sys.stderr)
        return 2
