-- Archiving the same block twice in one conversation returns the block already kept
-- (the orchestrator may retry, or restart and archive again). The digest is keyed
-- by the vault when text is sealed, so it reveals nothing a dictionary could test.
ALTER TABLE blocks ADD COLUMN content_digest bytea;
CREATE INDEX blocks_by_digest ON blocks (org_id, conversation_id, content_digest)
    WHERE content_digest IS NOT NULL;
