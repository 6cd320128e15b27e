"""Retrieval's PostgreSQL adapters: documents, chunks, postings, and the statistics that
make Okapi BM25 exact over any caller's visible set and fast to compute.

BM25 statistics (N, total chunk length, document frequencies) are kept per
audience, the chunks of one org sharing a source and an ACL, and changed in the
transaction that publishes or deletes the chunks they count. The caller's ACL
predicate admits an audience whole or not at all, so the caller's statistics
are sums over admitted audiences: never counted over the whole table (a global
df or N would let a forbidden document move a caller's scores, DESIGN I2), and
never recounted from the postings at query time. A write changes only the
rows of its own audience; nothing is cached outside the transaction that reads
it, so no statistic can be stale. A search reads its statistics and its
postings in one REPEATABLE READ snapshot. Which postings it reads is decided
by `bm25` (MaxScore); the scores are those of the exhaustive formula.
"""
