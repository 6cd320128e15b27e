// Past runs: ListRuns with a state filter and paging; each reopens its trajectory.
import { useEffect, useRef, useState } from "preact/hooks";
import type { Run, RunState } from "../api/types";
import { ApiError, api } from "../client";
import { formatDate, t } from "../i18n";
import { asApiError } from "../live";
import { ErrorNotice } from "./Notice";
import { STATE_KEYS } from "./RunView";

const PAGE = 10;

export function PastRuns({ onOpenRun }: { onOpenRun: (runId: string) => void }) {
  const [state, setState] = useState<RunState>("RUN_STATE_UNSPECIFIED");
  const [runs, setRuns] = useState<Run[]>([]);
  const [next, setNext] = useState("");
  const [error, setError] = useState<ApiError | null>(null);
  const [loading, setLoading] = useState(false);
  // only the answer to the latest request is drawn: a slower page for the
  // filter just left must not overwrite the one asked for now
  const latest = useRef(0);
  const load = (pageToken: string, append: boolean) => {
    const asked = ++latest.current;
    setLoading(true);
    setError(null);
    api
      .listRuns({ pageSize: PAGE, pageToken, state })
      .then((r) => {
        if (asked !== latest.current) return;
        setRuns((current) => (append ? [...current, ...(r.runs ?? [])] : (r.runs ?? [])));
        setNext(r.nextPageToken ?? "");
      })
      .catch((exc: unknown) => asked === latest.current && setError(asApiError(exc)))
      .finally(() => asked === latest.current && setLoading(false));
  };
  useEffect(() => load("", false), [state]);
  return (
    <section aria-labelledby="runs-title">
      <h1 id="runs-title">{t("runs.title")}</h1>
      <label for="state-filter">{t("runs.filter")}</label>
      <select id="state-filter" value={state} onChange={(e) => setState((e.currentTarget as HTMLSelectElement).value as RunState)}>
        {(Object.keys(STATE_KEYS) as RunState[]).map((s) => (
          <option key={s} value={s}>
            {s === "RUN_STATE_UNSPECIFIED" ? t("runs.all") : t(STATE_KEYS[s])}
          </option>
        ))}
      </select>
      <ErrorNotice error={error} />
      {runs.length === 0 && !loading && !error && <p>{t("runs.none")}</p>}
      <table class="runs" data-testid="past-runs">
        <caption class="sr-only">{t("runs.title")}</caption>
        <thead>
          <tr>
            <th scope="col">{t("runs.when")}</th>
            <th scope="col">{t("runs.agent")}</th>
            <th scope="col">{t("runs.question")}</th>
            <th scope="col">{t("runs.state")}</th>
          </tr>
        </thead>
        <tbody>
          {runs.map((r) => (
            <tr key={r.runId}>
              <td>{formatDate(r.createdAt)}</td>
              <td>{r.agent}</td>
              <td>
                <button type="button" class="link" onClick={() => r.runId && onOpenRun(r.runId)}>
                  {r.input}
                </button>
              </td>
              <td>{t(STATE_KEYS[r.state ?? "RUN_STATE_UNSPECIFIED"])}</td>
            </tr>
          ))}
        </tbody>
      </table>
      {next && (
        <button type="button" disabled={loading} onClick={() => load(next, true)}>
          {t("runs.more")}
        </button>
      )}
    </section>
  );
}
