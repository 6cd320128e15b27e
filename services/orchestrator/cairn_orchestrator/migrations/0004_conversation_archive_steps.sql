-- Archiving earlier conversation is a step of its own kind, not a memory read.
ALTER TABLE steps DROP CONSTRAINT IF EXISTS steps_kind_check;
ALTER TABLE steps ADD CONSTRAINT steps_kind_check CHECK (kind IN (
    'MODEL_CALL', 'TOOL_CALL', 'RETRIEVAL', 'MEMORY_READ',
    'CONFIRMATION_REQUESTED', 'CONFIRMATION_RESOLVED', 'CONVERSATION_ARCHIVE'));
