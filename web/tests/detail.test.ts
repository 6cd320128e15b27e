// The pure part of the panel: what a trajectory says was degraded, and the
// checked reads of a step's detail. Run by `make web` with node's test runner.
import assert from "node:assert/strict";
import { test } from "node:test";
import type { Step } from "../src/api/types.ts";
import { degradations, durationMs, list, num, str } from "../src/detail.ts";

const step = (kind: Step["kind"], detail: Record<string, unknown>): Step => ({ kind, detail: detail as Step["detail"] });

test("a keyword-only retrieval is named with the retrieval's own reason", () => {
  const found = degradations([step("STEP_KIND_RETRIEVAL", { mode: "KEYWORD_ONLY", mode_reason: "no embedder is configured" })]);
  assert.deepEqual(found, [{ kind: "keyword_only", reason: "no embedder is configured" }]);
});

test("a keyword-only search made by the model's tool call is named too, once", () => {
  const search = step("STEP_KIND_TOOL_CALL", { result: { mode: "KEYWORD_ONLY", mode_reason: "Qdrant is unreachable" } });
  assert.deepEqual(degradations([search, search]), [{ kind: "keyword_only", reason: "Qdrant is unreachable" }]);
});

test("a failed attempt before the answering provider reads as a failover", () => {
  const call = step("STEP_KIND_MODEL_CALL", {
    provider: "groq",
    model: "llama",
    attempts: [
      { provider: "openai", outcome: "RATE_LIMITED", latency_ms: 12 },
      { provider: "groq", outcome: "OK", latency_ms: 80 },
    ],
  });
  assert.deepEqual(degradations([call]), [{ kind: "failover", failed: "openai", outcome: "RATE_LIMITED", answeredBy: "groq" }]);
});

test("the offline demo model is named, and a healthy hybrid run names nothing", () => {
  assert.deepEqual(degradations([step("STEP_KIND_MODEL_CALL", { model: "cairn-offline-demo", attempts: [{ outcome: "OK" }] })]), [{ kind: "offline_model" }]);
  assert.deepEqual(
    degradations([step("STEP_KIND_RETRIEVAL", { mode: "HYBRID" }), step("STEP_KIND_MODEL_CALL", { model: "gpt", attempts: [{ outcome: "OK" }] })]),
    [],
  );
});

test("detail reads are checked: a wrong type is empty, never a crash", () => {
  assert.equal(str({ a: 1 }, "a"), "");
  assert.equal(num({ a: "12" }, "a"), 12);
  assert.equal(num({ a: "x" }, "a"), 0);
  assert.deepEqual(list({ a: "not a list" }, "a"), []);
  assert.equal(durationMs({ startedAt: "2026-01-01T00:00:00Z" }), null);
  assert.equal(durationMs({ startedAt: "2026-01-01T00:00:00Z", finishedAt: "2026-01-01T00:00:00.250Z" }), 250);
});
