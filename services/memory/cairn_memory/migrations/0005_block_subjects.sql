-- Erasure reaches archived blocks (I9). A block names whom it is about; Forget of any
-- of them blanks the block to a tombstone (content, label, search terms and digest
-- gone; number, conversation and erased_at kept, so r<N> still resolves and says why).
CREATE TABLE block_subjects (
    block_number  bigint NOT NULL REFERENCES blocks (block_number) ON DELETE CASCADE,
    org_id        text NOT NULL,
    subject_kind  text NOT NULL,
    subject_id    text NOT NULL,
    PRIMARY KEY (block_number, subject_kind, subject_id)
);

CREATE INDEX block_subjects_by_subject ON block_subjects (org_id, subject_kind, subject_id);

-- Blocks archived before subjects were recorded are about the person who archived them.
INSERT INTO block_subjects (block_number, org_id, subject_kind, subject_id)
SELECT block_number, org_id, 'USER', archived_by FROM blocks
ON CONFLICT DO NOTHING;

ALTER TABLE blocks ADD COLUMN erased_at timestamptz;

ALTER TABLE erasures
    ADD COLUMN blocks_erased integer NOT NULL DEFAULT 0,
    ADD COLUMN copies_erased boolean NOT NULL DEFAULT false;
