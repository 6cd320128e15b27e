// The run the person is watching, kept small and explicit: one signal holding
// the run, its steps by span id (a STEP_STARTED is replaced by its
// STEP_FINISHED), the answer as it streams, and the last refusal. Fetching and
// streaming go through client.ts; this only decides what the screen shows.
import { signal } from "@preact/signals";
import type { Citation, ConversationTurn, Run, Step, StreamEvent } from "./api/types";
import { ApiError, api, streamRun } from "./client";
import { language } from "./i18n";

export interface LiveRun {
  runId: string;
  run: Run | null;
  steps: Step[];
  answer: string;
  error: ApiError | null;
  following: boolean;
  busy: boolean;
}

export interface Conversation {
  id: string;
  turns: ConversationTurn[];
  runIds: string[];
}

export const live = signal<LiveRun | null>(null);
/** The citation whose document is open (from the answer or a retrieval step). */
export const openedCitation = signal<Citation | null>(null);
export const conversation = signal<Conversation>(freshConversation());

export function freshConversation(): Conversation {
  return { id: crypto.randomUUID(), turns: [], runIds: [] };
}

let following: AbortController | null = null;

function update(change: (current: LiveRun) => Partial<LiveRun>): void {
  const current = live.value;
  if (current) live.value = { ...current, ...change(current) };
}

function stepKey(step: Step): string {
  return step.spanId || `${step.kind}:${step.seq}`;
}

/** Recorded steps in their order (seq); steps still running after them, by start. */
function inOrder(a: Step, b: Step): number {
  const seqA = a.seq || Number.MAX_SAFE_INTEGER;
  const seqB = b.seq || Number.MAX_SAFE_INTEGER;
  return seqA !== seqB ? seqA - seqB : (a.startedAt ?? "").localeCompare(b.startedAt ?? "");
}

export function mergeStep(steps: Step[], step: Step): Step[] {
  const key = stepKey(step);
  const at = steps.findIndex((s) => stepKey(s) === key);
  const merged = steps.slice();
  if (at < 0) merged.push(step);
  // a finished step never goes back to started when an announcement arrives late
  else if (!(merged[at]?.finishedAt && !step.finishedAt)) merged[at] = step;
  return merged.sort(inOrder);
}

function onEvent(runId: string, event: StreamEvent, onSettled?: (run: Run) => void): void {
  if (live.value?.runId !== runId) return;
  switch (event.kind) {
    case "RUN_EVENT_KIND_STEP_STARTED":
    case "RUN_EVENT_KIND_STEP_FINISHED":
      if (event.step) {
        const step = event.step;
        update((c) => ({ steps: mergeStep(c.steps, step) }));
      }
      break;
    case "RUN_EVENT_KIND_ANSWER":
      update((c) => ({ answer: c.answer + (event.answerDelta ?? "") }));
      break;
    case "RUN_EVENT_KIND_CONFIRMATION_PENDING":
    case "RUN_EVENT_KIND_RUN_FINISHED":
      if (event.run) {
        const run = event.run;
        update(() => ({ run }));
        onSettled?.(run);
      }
      break;
    default:
      break;
  }
}

/**
 * Follow a run's events until the stream ends; safe to call again (it replays).
 * `onSettled` hears the run each time it ends or waits for its person; `onEnd`,
 * that the stream is over.
 */
export function follow(runId: string, onSettled?: (run: Run) => void, onEnd?: () => void): void {
  following?.abort();
  const controller = new AbortController();
  following = controller;
  update(() => ({ following: true }));
  streamRun(runId, (event) => onEvent(runId, event, onSettled), controller.signal)
    .catch((exc: unknown) => {
      if (live.value?.runId === runId) update(() => ({ error: asApiError(exc) }));
    })
    .finally(() => {
      if (following === controller) update(() => ({ following: false }));
      onEnd?.();
    });
}

/** The run once it has ended or waits for its person, as its stream tells it. */
function untilSettled(runId: string): Promise<Run> {
  return new Promise((resolve, reject) => {
    let told = false;
    const tell = (run: Run): void => {
      if (!told) {
        told = true;
        resolve(run);
      }
    };
    follow(runId, tell, () => {
      // The stream ended without saying (a refusal, a dropped connection): ask.
      if (!told) {
        api.getRun(runId).then(
          ({ run }) => (run ? tell(run) : reject(new ApiError(0, 13, "GetRun answered without a run"))),
          (exc: unknown) => reject(asApiError(exc)),
        );
      }
    });
  });
}

export function asApiError(exc: unknown): ApiError {
  return exc instanceof ApiError ? exc : new ApiError(0, 2, exc instanceof Error ? exc.message : String(exc));
}

function settle(runId: string, run: Run): void {
  update(() => ({ run, runId, busy: false }));
  // The stream may have ended before the last steps (or never started): read
  // the whole trajectory once so the timeline is complete.
  api
    .trajectory(runId)
    .then((t) => update((c) => ({ steps: (t.steps ?? []).reduce(mergeStep, c.steps) })))
    .catch(() => undefined);
}

export async function ask(agent: string, input: string): Promise<void> {
  const conv = conversation.value;
  openedCitation.value = null;
  live.value = { runId: "", run: null, steps: [], answer: "", error: null, following: false, busy: true };
  try {
    // StartRun answers as soon as the run exists; its steps are drawn from the
    // stream as they happen, from the first.
    const { run: first } = await api.startRun({
      agent,
      input,
      conversationId: conv.id,
      messages: conv.turns,
      language: language.value,
      returnWhenStarted: true,
    });
    if (!first?.runId) throw new ApiError(0, 13, "StartRun answered without a run");
    const runId = first.runId;
    update(() => ({ runId, run: first }));
    conversation.value = { ...conversation.value, runIds: [...conv.runIds, runId] };
    const run = await untilSettled(runId);
    settle(runId, run);
    if (run.answer) {
      conversation.value = {
        ...conversation.value,
        turns: [...conv.turns, { role: "TURN_ROLE_USER", content: input }, { role: "TURN_ROLE_ASSISTANT", content: run.answer }],
      };
    }
  } catch (exc) {
    update(() => ({ error: asApiError(exc), busy: false }));
  }
}

/**
 * Approve or deny. The run's events are followed from the moment the decision
 * is sent, so what the approval sets going is drawn live; a refusal is returned
 * for the card to show, in the service's words.
 */
export async function resolve(runId: string, confirmationToken: string, decision: "DECISION_APPROVE" | "DECISION_DENY"): Promise<ApiError | null> {
  if (live.value?.runId !== runId) {
    openedCitation.value = null;
    live.value = { runId, run: null, steps: [], answer: "", error: null, following: false, busy: true };
  } else {
    // the card is answered: the run goes on (or the refusal below brings it back)
    update((c) => ({ run: c.run ? { ...c.run, state: "RUN_STATE_RUNNING", pendingConfirmation: undefined } : null, error: null }));
  }
  follow(runId);
  try {
    const { run } = await api.resolve(confirmationToken, { decision, note: "" });
    if (run) {
      settle(runId, run);
      // a run of this conversation that waited for the card now has its turn
      const conv = conversation.value;
      if (run.answer && conv.runIds.includes(runId)) {
        conversation.value = {
          ...conv,
          turns: [...conv.turns, { role: "TURN_ROLE_USER", content: run.input ?? "" }, { role: "TURN_ROLE_ASSISTANT", content: run.answer }],
        };
      }
    }
    return null;
  } catch (exc) {
    const error = asApiError(exc);
    update(() => ({ busy: false }));
    api
      .getRun(runId)
      .then(({ run }) => run && update(() => ({ run })))
      .catch(() => undefined);
    return error;
  }
}

export async function cancel(runId: string, reason: string): Promise<void> {
  try {
    const { run } = await api.cancelRun(runId, { reason });
    if (run) settle(runId, run);
  } catch (exc) {
    update(() => ({ error: asApiError(exc) }));
  }
}

/** Reopen a run (from past runs or the waiting list) with its whole trajectory. */
export async function open(runId: string): Promise<void> {
  following?.abort();
  openedCitation.value = null;
  live.value = { runId, run: null, steps: [], answer: "", error: null, following: false, busy: false };
  try {
    const [{ run }, trajectory] = await Promise.all([api.getRun(runId), api.trajectory(runId)]);
    update(() => ({ run: run ?? null, steps: (trajectory.steps ?? []).reduce(mergeStep, []) }));
    if (run?.state === "RUN_STATE_RUNNING") follow(runId);
  } catch (exc) {
    update(() => ({ error: asApiError(exc) }));
  }
}

export function stopFollowing(): void {
  following?.abort();
  following = null;
}
