-- How each document's postings and chunks were made: the analyzer (tokens.py:
-- 'snowball-english', 'plain', ...) and the chunking (chunking.py: the token
-- counter, the window, the title budget). A document made otherwise than the
-- service now would make it is not "unchanged" on re-ingest, and
-- `python -m cairn_retrieval reindex documents` remakes every such document
-- from its stored text. '' marks documents stored before this migration:
-- unstemmed terms, no title terms, chunks sized by a word estimate.
ALTER TABLE documents
    ADD COLUMN analyzer text NOT NULL DEFAULT '',
    ADD COLUMN chunking text NOT NULL DEFAULT '';
