// A citation opened: the cited chunk's text marked inside its whole document
// (GetDocument, under the reader's own rights).
import { useEffect, useRef, useState } from "preact/hooks";
import type { Citation, Document } from "../api/types";
import { ApiError, api } from "../client";
import { t } from "../i18n";
import { asApiError } from "../live";
import { ErrorNotice } from "./Notice";

/** Offsets count code points (the services are Python), not UTF-16 units. */
function slices(text: string, start: number, end: number): [string, string, string] {
  const points = Array.from(text);
  return [points.slice(0, start).join(""), points.slice(start, end).join(""), points.slice(end).join("")];
}

export function DocumentPane({ citation, onClose }: { citation: Citation; onClose: () => void }) {
  const [doc, setDoc] = useState<Document | null>(null);
  const [error, setError] = useState<ApiError | null>(null);
  const dialog = useRef<HTMLDialogElement>(null);
  const marked = useRef<HTMLElement>(null);
  useEffect(() => {
    dialog.current?.showModal();
    api
      .document(citation.documentId ?? "")
      .then((r) => setDoc(r.document ?? null))
      .catch((exc: unknown) => setError(asApiError(exc)));
  }, [citation.documentId]);
  useEffect(() => {
    marked.current?.scrollIntoView({ block: "center" });
  }, [doc]);
  const [before, chunk, after] = doc ? slices(doc.text ?? "", citation.charStart ?? 0, citation.charEnd ?? 0) : ["", "", ""];
  return (
    <dialog ref={dialog} class="document" aria-labelledby="doc-title" onClose={onClose} data-testid="document">
      <h2 id="doc-title">
        [{citation.label}] {citation.title}
      </h2>
      <p class="meta">{t("doc.source", { source: citation.source ?? "", id: citation.documentId ?? "" })}</p>
      <ErrorNotice error={error} />
      {!doc && !error && <p>{t("doc.loading")}</p>}
      {doc && (
        <div class="document-text">
          {before}
          <mark ref={marked} data-testid="cited-chunk">
            {chunk}
          </mark>
          {after}
        </div>
      )}
      <form method="dialog">
        <button type="submit" class="primary">
          {t("doc.close")}
        </button>
      </form>
    </dialog>
  );
}
