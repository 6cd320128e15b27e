// Waiting for you: every confirmation card the person has pending.
import { useEffect, useState } from "preact/hooks";
import type { PendingConfirmation } from "../api/types";
import { ApiError, api } from "../client";
import { t } from "../i18n";
import { asApiError } from "../live";
import { ConfirmationCard } from "./ConfirmationCard";
import { ErrorNotice } from "./Notice";

export function Waiting({ onOpenRun, onResolved }: { onOpenRun: (runId: string) => void; onResolved: (runId: string) => void }) {
  const [pending, setPending] = useState<PendingConfirmation[] | null>(null);
  const [error, setError] = useState<ApiError | null>(null);
  const reload = () =>
    api
      .pending()
      .then((r) => setPending(r.confirmations ?? []))
      .catch((exc: unknown) => setError(asApiError(exc)));
  useEffect(() => {
    void reload();
  }, []);
  return (
    <section aria-labelledby="waiting-title">
      <h1 id="waiting-title">{t("waiting.title")}</h1>
      <ErrorNotice error={error} />
      {pending === null && !error && <p>{t("common.loading")}</p>}
      {pending?.length === 0 && <p data-testid="waiting-empty">{t("waiting.none")}</p>}
      <ul class="plain" data-testid="waiting">
        {(pending ?? []).map((p) => (
          <li key={p.confirmationToken}>
            <ConfirmationCard pending={p} headingLevel={2} onResolved={onResolved} />
            <button type="button" class="link" onClick={() => p.runId && onOpenRun(p.runId)}>
              {t("waiting.openRun")}
            </button>
          </li>
        ))}
      </ul>
      <button type="button" onClick={() => void reload()}>
        {t("common.refresh")}
      </button>
    </section>
  );
}
