-- vector_store: the identity (VectorStore.identity()) of the collection that holds
-- this document's points; '' when it has none. When the deployment points at
-- another store (QDRANT_URL, CAIRN_QDRANT_ENGINE or the collection changed), the
-- points are not there, so re-ingesting the document writes them again instead of
-- answering "unchanged" while dense search finds nothing of it.
ALTER TABLE documents ADD COLUMN vector_store text NOT NULL DEFAULT '';
