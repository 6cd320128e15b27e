"""cairn retrieval: hybrid search (true BM25 in PostgreSQL, dense vectors in Qdrant,
fused with RRF) under one ACL pre-filter built from the caller's verified token."""
