// One run, live or reopened: its state, answer with citations (each opens its
// document), what was degraded, the confirmation it waits for, Cancel, totals,
// the trace link, and the timeline.
import type { RunState } from "../api/types";
import type { PanelConfig } from "../auth";
import { degradations, durationMs } from "../detail";
import { formatDuration, formatNumber, t } from "../i18n";
import { cancel, openedCitation, type LiveRun } from "../live";
import type { MessageKey } from "../messages/en";
import { ConfirmationCard } from "./ConfirmationCard";
import { DocumentPane } from "./DocumentPane";
import { ErrorNotice } from "./Notice";
import { Timeline } from "./Timeline";

export const STATE_KEYS: Record<RunState, MessageKey> = {
  RUN_STATE_UNSPECIFIED: "state.UNSPECIFIED",
  RUN_STATE_RUNNING: "state.RUNNING",
  RUN_STATE_CONFIRMATION_PENDING: "state.CONFIRMATION_PENDING",
  RUN_STATE_COMPLETED: "state.COMPLETED",
  RUN_STATE_FAILED: "state.FAILED",
  RUN_STATE_BUDGET_EXHAUSTED: "state.BUDGET_EXHAUSTED",
  RUN_STATE_CANCELLED: "state.CANCELLED",
};

function traceLink(template: string, traceId: string): string {
  return template.replace("{trace_id}", encodeURIComponent(traceId));
}

export function RunView({ session, config }: { session: LiveRun; config: PanelConfig }) {
  const opened = openedCitation.value;
  const run = session.run;
  const state: RunState = run?.state ?? "RUN_STATE_RUNNING";
  const answer = run?.answer || session.answer;
  const notices = degradations(session.steps);
  const elapsed = session.steps.reduce((sum, s) => sum + (durationMs(s) ?? 0), 0);
  const pending = state === "RUN_STATE_CONFIRMATION_PENDING" ? run?.pendingConfirmation : undefined;
  const stillGoing = state === "RUN_STATE_RUNNING" || state === "RUN_STATE_CONFIRMATION_PENDING";
  return (
    <section class="run" aria-labelledby="run-title" data-testid="run" data-run-id={session.runId} data-state={state}>
      <h2 id="run-title">
        {t("run.title")} <span class={`badge state-${state}`} data-testid="run-state">{t(STATE_KEYS[state])}</span>
      </h2>
      <p class="sr-only" role="status" aria-live="polite">
        {t(STATE_KEYS[state])}
      </p>
      {run?.input && (
        <p class="question">
          <span class="meta">{t("run.asked")}</span> {run.input}
        </p>
      )}
      {answer && (
        <div class="answer" data-testid="answer">
          <h3>{t("run.answer")}</h3>
          <p>{answer}</p>
        </div>
      )}
      {run?.reason && !stillGoing && <p class="notice">{t("run.reason", { reason: run.reason })}</p>}
      {(run?.citations ?? []).length > 0 && (
        <div class="citations">
          <h3>{t("run.citations")}</h3>
          <ul class="plain" data-testid="citations">
            {(run?.citations ?? []).map((c) => (
              <li key={c.chunkId}>
                <button type="button" class="link" onClick={() => (openedCitation.value = c)} aria-haspopup="dialog">
                  [{c.label}] {c.title}
                </button>{" "}
                <span class="meta">{c.source}</span>
              </li>
            ))}
          </ul>
        </div>
      )}
      {notices.length > 0 && (
        <ul class="degraded" aria-label={t("run.degraded")} data-testid="degraded">
          {notices.map((n, i) => (
            <li key={i}>
              {n.kind === "keyword_only"
                ? t("degraded.keywordOnly", { reason: n.reason })
                : n.kind === "offline_model"
                  ? t("degraded.offline")
                  : t("degraded.failover", { failed: n.failed, outcome: n.outcome.replace(/^ATTEMPT_OUTCOME_/, ""), answeredBy: n.answeredBy })}
            </li>
          ))}
        </ul>
      )}
      {pending && <ConfirmationCard pending={pending} />}
      <ErrorNotice error={session.error} />
      {stillGoing && session.runId && (
        <button type="button" onClick={() => void cancel(session.runId, t("run.cancelReason"))}>
          {t("run.cancel")}
        </button>
      )}
      {run?.cancelledBy && <p class="notice">{t("run.cancelledBy", { who: run.cancelledBy })}</p>}
      <p class="meta totals" data-testid="totals">
        {t("run.totals", {
          tokens: formatNumber(run?.usage?.totalTokens ?? 0),
          calls: run?.usage?.modelCalls ?? 0,
          time: formatDuration(elapsed),
        })}
        {run?.traceId && (
          <>
            {" · "}
            {config.traceUrlTemplate ? (
              <a href={traceLink(config.traceUrlTemplate, run.traceId)} target="_blank" rel="noopener noreferrer" data-testid="trace-link">
                {t("run.trace", { trace: run.traceId })}
              </a>
            ) : (
              <span data-testid="trace-id">{t("run.trace", { trace: run.traceId })}</span>
            )}
          </>
        )}
      </p>
      <h3>{t("run.timeline")}</h3>
      {session.steps.length === 0 ? <p class="meta">{t("run.noSteps")}</p> : <Timeline steps={session.steps} />}
      {opened && <DocumentPane citation={opened} onClose={() => (openedCitation.value = null)} />}
    </section>
  );
}
