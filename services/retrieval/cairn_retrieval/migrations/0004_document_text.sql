-- A document's text as ingested, so GetDocument can open a citation's document
-- whole (chunks overlap and skip the blanks between words, so they cannot give
-- it back exactly).
ALTER TABLE documents ADD COLUMN text text NOT NULL DEFAULT '';

-- Documents stored before this migration get their text stitched from their
-- ready chunks at their offsets, so every citation's char_start..char_end still
-- points at its chunk; a gap between two chunks (blanks only) becomes spaces.
-- Ingesting such a document again stores its exact text.
WITH pieces AS (
    SELECT org_id, document_id, ordinal, char_start, char_end, text,
           coalesce(max(char_end) OVER (
               PARTITION BY org_id, document_id ORDER BY ordinal
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
           ), 0) AS covered
    FROM chunks WHERE state = 'ready'
),
stitched AS (
    SELECT org_id, document_id,
           string_agg(
               CASE
                   WHEN char_end <= covered THEN ''
                   WHEN char_start >= covered THEN repeat(' ', char_start - covered) || text
                   ELSE substr(text, covered - char_start + 1)
               END,
               '' ORDER BY ordinal
           ) AS text
    FROM pieces GROUP BY org_id, document_id
)
UPDATE documents d SET text = s.text
FROM stitched s
WHERE d.org_id = s.org_id AND d.document_id = s.document_id;
