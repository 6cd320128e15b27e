// The run's trajectory as a timeline: each step's kind, a duration bar, status
// and span id, and what it did (model calls, tool calls, retrieval, memory
// reads, confirmations). Steps are drawn as their events arrive.
import type { Step } from "../api/types";
import { bool, detailOf, durationMs, list, num, obj, str, words, type Detail } from "../detail";
import { formatDuration, formatNumber, t } from "../i18n";
import { openedCitation } from "../live";
import type { MessageKey } from "../messages/en";

const KIND_KEYS: Record<string, MessageKey> = {
  STEP_KIND_MODEL_CALL: "step.kind.MODEL_CALL",
  STEP_KIND_TOOL_CALL: "step.kind.TOOL_CALL",
  STEP_KIND_RETRIEVAL: "step.kind.RETRIEVAL",
  STEP_KIND_MEMORY_READ: "step.kind.MEMORY_READ",
  STEP_KIND_CONFIRMATION_REQUESTED: "step.kind.CONFIRMATION_REQUESTED",
  STEP_KIND_CONFIRMATION_RESOLVED: "step.kind.CONFIRMATION_RESOLVED",
  STEP_KIND_CONVERSATION_ARCHIVE: "step.kind.CONVERSATION_ARCHIVE",
};

function json(value: unknown): string {
  return typeof value === "string" ? value : JSON.stringify(value, null, 2);
}

function ModelCall({ d }: { d: Detail }) {
  const usage = obj(d, "usage");
  const attempts = list(d, "attempts");
  const calls = list(d, "tool_calls");
  return (
    <>
      <p>
        {t("step.model", { provider: str(d, "provider"), model: str(d, "model") })} ·{" "}
        {t("step.tokens", { prompt: num(usage, "prompt_tokens"), completion: num(usage, "completion_tokens") })}
        {calls.length > 0 && <> · {t("step.wants", { tools: calls.map((c) => str(c, "name")).join(", ") })}</>}
      </p>
      {attempts.length > 0 && (
        <ol class="attempts" aria-label={t("step.attempts")}>
          {attempts.map((a, i) => (
            <li key={i}>
              {t("step.attempt", {
                provider: str(a, "provider"),
                outcome: str(a, "outcome").replace(/^ATTEMPT_OUTCOME_/, ""),
                latency: formatDuration(num(a, "latency_ms")),
              })}
            </li>
          ))}
        </ol>
      )}
    </>
  );
}

function ToolCall({ d }: { d: Detail }) {
  const result = d["result"];
  return (
    <>
      <details>
        <summary>{t("step.arguments")}</summary>
        <pre tabIndex={0}>{json(d["arguments"])}</pre>
      </details>
      {result !== undefined && (
        <details>
          <summary>
            {t("step.result", { bytes: num(d, "result_bytes") })}
            {bool(d, "truncated") && <span class="badge warning"> {t("step.truncated")}</span>}
          </summary>
          <pre tabIndex={0}>{json(result)}</pre>
        </details>
      )}
      {words(d, "labels").length > 0 && <p>{t("step.cites", { labels: words(d, "labels").join(", ") })}</p>}
    </>
  );
}

function Retrieval({ d }: { d: Detail }) {
  return (
    <>
      <p>
        {t("step.mode", { mode: str(d, "mode") || "—" })}
        {str(d, "mode_reason") && <> · {str(d, "mode_reason")}</>}
      </p>
      <ul class="plain">
        {list(d, "results").map((r, i) => (
          <li key={i}>
            <button
              type="button"
              class="link"
              aria-haspopup="dialog"
              onClick={() =>
                (openedCitation.value = {
                  label: str(r, "label"),
                  documentId: str(r, "document_id"),
                  chunkId: str(r, "chunk_id"),
                  source: str(r, "source"),
                  title: str(r, "title"),
                  charStart: num(r, "char_start"),
                  charEnd: num(r, "char_end"),
                })
              }
            >
              [{str(r, "label")}] {str(r, "title")}
            </button>{" "}
            <span class="meta">({str(r, "document_id")})</span>
          </li>
        ))}
      </ul>
    </>
  );
}

function MemoryRead({ d }: { d: Detail }) {
  return (
    <p>
      {t("step.recall", { count: num(d, "count"), mode: str(d, "mode") || "—" })}
      {str(d, "mode_reason") && <> · {str(d, "mode_reason")}</>}
    </p>
  );
}

function StepBody({ step }: { step: Step }) {
  const d = detailOf(step);
  switch (step.kind) {
    case "STEP_KIND_MODEL_CALL":
      return <ModelCall d={d} />;
    case "STEP_KIND_TOOL_CALL":
      return <ToolCall d={d} />;
    case "STEP_KIND_RETRIEVAL":
      return <Retrieval d={d} />;
    case "STEP_KIND_MEMORY_READ":
      return <MemoryRead d={d} />;
    default:
      return Object.keys(d).length > 0 ? (
        <details>
          <summary>{t("step.record")}</summary>
          <pre tabIndex={0}>{json(d)}</pre>
        </details>
      ) : null;
  }
}

export function Timeline({ steps }: { steps: Step[] }) {
  const durations = steps.map(durationMs);
  const longest = Math.max(1, ...durations.map((ms) => ms ?? 0));
  return (
    <ol class="timeline" aria-label={t("run.timeline")} data-testid="timeline">
      {steps.map((step, i) => {
        const ms = durations[i] ?? null;
        const running = !step.finishedAt;
        const failed = Boolean(step.error?.code);
        const status = running ? t("step.running") : failed ? t("step.failed") : t("step.done");
        return (
          <li key={step.spanId || i} class={`step ${running ? "running" : failed ? "failed" : "done"}`} data-step={step.kind} data-span={step.spanId}>
            <div class="step-head">
              <strong>{t(KIND_KEYS[step.kind ?? ""] ?? "step.kind.other")}</strong> <span>{step.name}</span>{" "}
              <span class={`badge ${failed ? "error" : ""}`}>{status}</span>
              <span class="meta"> {ms === null ? "" : formatDuration(ms)}</span>
            </div>
            <div class="bar" aria-hidden="true">
              <span style={{ width: `${running ? 100 : Math.max(2, ((ms ?? 0) / longest) * 100)}%` }} />
            </div>
            <StepBody step={step} />
            {failed && (
              <p class="error">
                {step.error?.code}: {step.error?.message}
              </p>
            )}
            <p class="meta">
              {t("step.span", { span: step.spanId ?? "" })}
              {step.seq ? <> · #{formatNumber(step.seq)}</> : null}
            </p>
          </li>
        );
      })}
    </ol>
  );
}
