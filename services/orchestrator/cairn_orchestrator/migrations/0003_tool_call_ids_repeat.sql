-- A tool call id is only unique within one model reply: some providers number the
-- calls of every reply from zero, so a run may propose two writes with the same id
-- in different turns. A confirmation is identified by its token alone.
ALTER TABLE confirmations DROP CONSTRAINT IF EXISTS confirmations_run_id_tool_call_id_key;
