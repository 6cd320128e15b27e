"""A started retrieval service leaves its start-up heap out of garbage collection:
a full collection walking the model, the modules and the descriptors stopped a
search for 192 ms in the search bench."""

from __future__ import annotations

import gc
from pathlib import Path

from cairn_libs.db import Database, load_migrations
from cairn_retrieval.app import MIGRATIONS, RetrievalApp
from cairn_retrieval.edge_store import EdgeVectorStore


async def test_starting_the_service_freezes_what_start_up_loaded(
    pg_url: str, tmp_path: Path
) -> None:
    app = RetrievalApp(
        database=Database(
            url=pg_url, schema="retrieval_heap", migrations=load_migrations(MIGRATIONS)
        ),
        vectors=EdgeVectorStore(path=str(tmp_path), collection="chunks", dimensions=3),
        embedder=None,
    )
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        await app.start()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        await app.stop()
