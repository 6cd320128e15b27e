-- Archived blocks expire too. A verbatim conversation block is at least as personal
-- as a memory, so it is not kept forever: its expiry is set when it is archived
-- (CAIRN_MEMORY_BLOCK_TTL_DAYS, by default the memories' time to live) and the same
-- periodic job purges it. Blocks archived before this migration get 90 days from
-- their creation, the default.
ALTER TABLE blocks ADD COLUMN expires_at timestamptz;
UPDATE blocks SET expires_at = created_at + interval '90 days';
ALTER TABLE blocks ALTER COLUMN expires_at SET NOT NULL;
CREATE INDEX blocks_by_expiry ON blocks (expires_at);

-- The upkeep job looks for active memories kept while no embedder was configured;
-- without this (normally empty) index that look-up reads the whole table every round.
CREATE INDEX memories_unembedded ON memories (created_at)
    WHERE state = 'ACTIVE' AND embedding IS NULL;
