// Every call the panel makes to the REST proxy, and the one place a token is
// attached: the token lives in auth.ts's memory and goes only into the
// Authorization header, never into a URL, a log or storage.
import type {
  CancelBody,
  CancelResponse,
  ForgetRequest,
  ForgetResponse,
  GetDocumentResponse,
  GetRunResponse,
  HeldRequest,
  HeldResponse,
  ListAgentsResponse,
  ListPendingResponse,
  ListRunsResponse,
  ResolveBody,
  ResolveResponse,
  RpcStatus,
  RunState,
  StartRunRequest,
  StartRunResponse,
  StreamEvent,
  Subject,
  TrajectoryResponse,
} from "./api/types";
import { currentToken, signedOut } from "./auth";

/** A refusal from a service (or the proxy), with the service's own message. */
export class ApiError extends Error {
  constructor(
    readonly httpStatus: number,
    readonly code: number,
    message: string,
  ) {
    super(message);
    this.name = "ApiError";
  }
  get denied(): boolean {
    return this.httpStatus === 403;
  }
  get unauthenticated(): boolean {
    return this.httpStatus === 401;
  }
}

function isStatus(value: unknown): value is RpcStatus {
  return typeof value === "object" && value !== null && "message" in value;
}

function headers(json: boolean): Headers {
  const h = new Headers({ Accept: "application/json" });
  const token = currentToken();
  if (token) h.set("Authorization", `Bearer ${token}`);
  if (json) h.set("Content-Type", "application/json");
  return h;
}

async function refusal(response: Response): Promise<ApiError> {
  let body: unknown = null;
  try {
    body = await response.json();
  } catch {
    // not JSON: the status line is all there is
  }
  const status = isStatus(body) ? body : isStatus((body as { error?: unknown } | null)?.error) ? (body as { error: RpcStatus }).error : null;
  const error = new ApiError(response.status, status?.code ?? 0, status?.message || response.statusText || String(response.status));
  if (error.unauthenticated) signedOut(error.message);
  return error;
}

async function call<T>(method: "GET" | "POST", path: string, body?: object): Promise<T> {
  let response: Response;
  try {
    response = await fetch(path, {
      method,
      headers: headers(body !== undefined),
      body: body === undefined ? null : JSON.stringify(body),
      cache: "no-store",
    });
  } catch (exc) {
    throw new ApiError(0, 14, exc instanceof Error ? exc.message : String(exc));
  }
  if (!response.ok) throw await refusal(response);
  return (await response.json()) as T;
}

const enc = encodeURIComponent;

export const api = {
  listAgents: () => call<ListAgentsResponse>("GET", "/v1/agents"),
  startRun: (request: StartRunRequest) => call<StartRunResponse>("POST", "/v1/runs", request),
  getRun: (runId: string) => call<GetRunResponse>("GET", `/v1/runs/${enc(runId)}`),
  trajectory: (runId: string) => call<TrajectoryResponse>("GET", `/v1/runs/${enc(runId)}/trajectory`),
  listRuns: (options: { pageSize: number; pageToken?: string; state?: RunState }) => {
    const query = new URLSearchParams({ pageSize: String(options.pageSize) });
    if (options.pageToken) query.set("pageToken", options.pageToken);
    if (options.state && options.state !== "RUN_STATE_UNSPECIFIED") query.set("state", options.state);
    return call<ListRunsResponse>("GET", `/v1/runs?${query.toString()}`);
  },
  cancelRun: (runId: string, body: CancelBody) => call<CancelResponse>("POST", `/v1/runs/${enc(runId)}:cancel`, body),
  pending: () => call<ListPendingResponse>("GET", "/v1/confirmations"),
  resolve: (confirmationToken: string, body: ResolveBody) =>
    call<ResolveResponse>("POST", `/v1/confirmations/${enc(confirmationToken)}:resolve`, body),
  held: (request: HeldRequest) => call<HeldResponse>("POST", "/v1/memory/subjects:held", request),
  forget: (subject: Subject) => call<ForgetResponse>("POST", "/v1/memory/subjects:forget", { subject } satisfies ForgetRequest),
  document: (documentId: string) => call<GetDocumentResponse>("GET", `/v1/retrieval/documents/${enc(documentId)}`),
};

/**
 * Follow a run's events (GET /v1/runs/{id}/events, newline-delimited JSON) with
 * fetch and a reader: EventSource could not send Authorization. Each
 * {"result": ...} line is handed to `onEvent` as soon as it arrives; a final
 * {"error": ...} line is thrown as the ApiError it is, never read as a clean end.
 */
export async function streamRun(runId: string, onEvent: (event: StreamEvent) => void, signal: AbortSignal): Promise<void> {
  let response: Response;
  try {
    response = await fetch(`/v1/runs/${enc(runId)}/events`, { headers: headers(false), signal, cache: "no-store" });
  } catch (exc) {
    if (signal.aborted) return;
    throw new ApiError(0, 14, exc instanceof Error ? exc.message : String(exc));
  }
  if (!response.ok || !response.body) throw await refusal(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  const handle = (line: string): void => {
    if (!line.trim()) return;
    const parsed = JSON.parse(line) as { result?: StreamEvent; error?: RpcStatus };
    if (parsed.error) throw new ApiError(response.status, parsed.error.code ?? 0, parsed.error.message ?? "");
    if (parsed.result) onEvent(parsed.result);
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += value;
      let newline = buffered.indexOf("\n");
      while (newline >= 0) {
        handle(buffered.slice(0, newline));
        buffered = buffered.slice(newline + 1);
        newline = buffered.indexOf("\n");
      }
    }
    handle(buffered);
  } catch (exc) {
    if (signal.aborted) return;
    throw exc;
  }
}
