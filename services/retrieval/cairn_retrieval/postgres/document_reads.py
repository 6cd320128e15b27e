"""A document as last ingested (GetDocument, reindex documents), and which
analyzer and chunking made each document."""

from __future__ import annotations

import json

from cairn_libs.db import Database
from cairn_retrieval.domain import StoredDocument
from cairn_retrieval.postgres.connection import translated


class PostgresDocumentReads:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def document(self, org_id: str, document_id: str) -> StoredDocument | None:
        """The document of `org_id` with that id as last ingested, or None."""
        with translated():
            row = await self._db.pool.fetchrow(
                "SELECT document_id, source, title, text, acl, metadata::text AS metadata "
                "FROM documents WHERE org_id = $1 AND document_id = $2",
                org_id,
                document_id,
            )
        if row is None:
            return None
        return StoredDocument(
            org_id=org_id,
            document_id=row["document_id"],
            source=row["source"],
            title=row["title"],
            text=row["text"],
            acl_keys=tuple(row["acl"]),
            metadata=json.loads(row["metadata"]),
        )

    async def index_versions(self) -> list[tuple[str, str, str, str, str]]:
        """(org, document id, source, analyzer, chunking) of every document."""
        with translated():
            rows = await self._db.pool.fetch(
                "SELECT org_id, document_id, source, analyzer, chunking FROM documents "
                "ORDER BY org_id, document_id"
            )
        return [tuple(r) for r in rows]
