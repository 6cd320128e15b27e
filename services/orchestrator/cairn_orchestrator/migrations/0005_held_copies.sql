-- Erasure reaches every copy (I9). A step that copied text about a subject (a recalled
-- memory or fact, an archived block, a proposed memory) names it here, so ForgetCopies
-- knows what to erase and where; the row itself is a copy and goes with the rest.
CREATE TABLE held_copies (
    org_id        text NOT NULL,
    subject_kind  text NOT NULL,
    subject_id    text NOT NULL,
    run_id        text NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
    copied_text   text NOT NULL,
    -- md5 only to key a row by its text (immutable, as a generated column needs).
    text_digest   text GENERATED ALWAYS AS (md5(copied_text)) STORED,
    PRIMARY KEY (org_id, subject_kind, subject_id, run_id, text_digest)
);

CREATE INDEX held_copies_by_run ON held_copies (run_id);
