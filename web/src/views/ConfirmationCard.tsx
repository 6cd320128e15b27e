// A write the agent wants to make, shown as its card before anything is written:
// summary, details, warnings, expiry, and Approve / Deny.
import { useState } from "preact/hooks";
import type { PendingConfirmation } from "../api/types";
import type { ApiError } from "../client";
import { formatDate, language, t } from "../i18n";
import { resolve } from "../live";
import { ErrorNotice } from "./Notice";

export function ConfirmationCard({
  pending,
  headingLevel = 3,
  onResolved,
}: {
  pending: PendingConfirmation;
  headingLevel?: 2 | 3;
  onResolved?: (runId: string) => void;
}) {
  const [error, setError] = useState<ApiError | null>(null);
  const [busy, setBusy] = useState(false);
  const card = pending.card ?? {};
  const Heading = headingLevel === 2 ? "h2" : "h3";
  const id = `card-${pending.confirmationToken?.slice(0, 12) ?? ""}`;
  const decide = async (decision: "DECISION_APPROVE" | "DECISION_DENY") => {
    if (!pending.runId || !pending.confirmationToken) return;
    setBusy(true);
    const refused = await resolve(pending.runId, pending.confirmationToken, decision);
    setError(refused);
    setBusy(false);
    if (!refused) onResolved?.(pending.runId);
  };
  return (
    <article class="card" aria-labelledby={id} data-testid="confirmation-card" lang={card.language || undefined}>
      <Heading id={id}>
        <span class="badge">{t("card.needsYou")}</span> {card.summary}
      </Heading>
      {card.languageFallback && (
        <p class="notice" data-testid="card-fallback" lang={language.value}>
          {t("card.fallback")}
        </p>
      )}
      {(card.details ?? []).length > 0 && (
        <dl class="details">
          {(card.details ?? []).map((d, i) => (
            <div key={i}>
              <dt>{d.label}</dt>
              <dd>{d.value}</dd>
            </div>
          ))}
        </dl>
      )}
      {(card.warnings ?? []).length > 0 && (
        <ul class="warnings" aria-label={t("card.warnings")}>
          {(card.warnings ?? []).map((w, i) => (
            <li key={i}>{w}</li>
          ))}
        </ul>
      )}
      <p class="meta">
        {t("card.tool", { tool: pending.toolName ?? "" })} · {t("card.expires", { when: formatDate(pending.expiresAt) })}
      </p>
      <div class="actions">
        <button type="button" class="primary" disabled={busy} onClick={() => void decide("DECISION_APPROVE")}>
          {t("card.approve")}
        </button>
        <button type="button" disabled={busy} onClick={() => void decide("DECISION_DENY")}>
          {t("card.deny")}
        </button>
      </div>
      <ErrorNotice error={error} />
    </article>
  );
}
