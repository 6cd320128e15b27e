-- The person's language travels with the run: a run resumed after a confirmation,
-- on whichever replica, writes its cards in the language it was asked in.
-- language_fallback: they asked for one cairn has no text in, so cards are English.
-- cancelled_by: the person who stopped the run with CancelRun.
ALTER TABLE runs
    ADD COLUMN language          text NOT NULL DEFAULT 'en' CHECK (language IN ('en', 'zh-Hans')),
    ADD COLUMN language_fallback boolean NOT NULL DEFAULT false,
    ADD COLUMN cancelled_by      text NOT NULL DEFAULT '';

-- ListRuns narrowed to one state, newest first, for one person or the whole org.
CREATE INDEX runs_by_owner_state ON runs (org_id, user_id, state, created_at DESC, run_id DESC);
CREATE INDEX runs_by_org_state ON runs (org_id, state, created_at DESC, run_id DESC);
