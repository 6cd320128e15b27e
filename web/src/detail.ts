// Reading a step's detail (a google.protobuf.Struct, so `unknown` to the types):
// small checked accessors instead of casts, and the degraded-answer notices the
// trajectory implies (I11: say which part is missing).
import type { Step } from "./api/types";

export type Detail = Record<string, unknown>;

export function detailOf(step: Step): Detail {
  const d: unknown = step.detail;
  return typeof d === "object" && d !== null && !Array.isArray(d) ? (d as Detail) : {};
}

export function str(d: Detail, key: string): string {
  const v = d[key];
  return typeof v === "string" ? v : "";
}

export function num(d: Detail, key: string): number {
  const v = d[key];
  return typeof v === "number" ? v : typeof v === "string" && v !== "" && Number.isFinite(Number(v)) ? Number(v) : 0;
}

export function bool(d: Detail, key: string): boolean {
  return d[key] === true;
}

export function list(d: Detail, key: string): Detail[] {
  const v = d[key];
  return Array.isArray(v) ? v.filter((x): x is Detail => typeof x === "object" && x !== null) : [];
}

export function words(d: Detail, key: string): string[] {
  const v = d[key];
  return Array.isArray(v) ? v.filter((x): x is string => typeof x === "string") : [];
}

export function obj(d: Detail, key: string): Detail {
  const v = d[key];
  return typeof v === "object" && v !== null && !Array.isArray(v) ? (v as Detail) : {};
}

export function durationMs(step: Step): number | null {
  if (!step.startedAt || !step.finishedAt) return null;
  const ms = Date.parse(step.finishedAt) - Date.parse(step.startedAt);
  return Number.isFinite(ms) && ms >= 0 ? ms : null;
}

/** The offline demo model's name, as the gateway labels it in every answer. */
export const OFFLINE_MODEL = "cairn-offline-demo";

export type Degradation =
  | { kind: "keyword_only"; reason: string }
  | { kind: "offline_model" }
  | { kind: "failover"; failed: string; outcome: string; answeredBy: string };

export function degradations(steps: Step[]): Degradation[] {
  const found: Degradation[] = [];
  const seen = new Set<string>();
  const add = (key: string, value: Degradation): void => {
    if (!seen.has(key)) {
      seen.add(key);
      found.push(value);
    }
  };
  for (const step of steps) {
    const d = detailOf(step);
    if ((step.kind === "STEP_KIND_RETRIEVAL" || step.kind === "STEP_KIND_TOOL_CALL") && str(d, "mode") === "KEYWORD_ONLY") {
      add(`kw:${str(d, "mode_reason")}`, { kind: "keyword_only", reason: str(d, "mode_reason") });
    }
    const result = obj(d, "result");
    if (step.kind === "STEP_KIND_TOOL_CALL" && str(result, "mode") === "KEYWORD_ONLY") {
      add(`kw:${str(result, "mode_reason")}`, { kind: "keyword_only", reason: str(result, "mode_reason") });
    }
    if (step.kind === "STEP_KIND_MODEL_CALL") {
      if (str(d, "model") === OFFLINE_MODEL) add("offline", { kind: "offline_model" });
      for (const attempt of list(d, "attempts")) {
        const outcome = str(attempt, "outcome");
        if (outcome && outcome !== "OK" && outcome !== "ATTEMPT_OUTCOME_OK") {
          const failed = str(attempt, "provider");
          add(`fo:${failed}:${outcome}`, { kind: "failover", failed, outcome, answeredBy: str(d, "provider") });
        }
      }
    }
  }
  return found;
}
