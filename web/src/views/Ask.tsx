// Ask: choose an agent, ask, follow up in the same conversation, and watch the run.
import { useEffect, useState } from "preact/hooks";
import type { Agent } from "../api/types";
import type { PanelConfig } from "../auth";
import { ApiError, api } from "../client";
import { t } from "../i18n";
import { ask, asApiError, conversation, freshConversation, live } from "../live";
import { ErrorNotice } from "./Notice";
import { RunView } from "./RunView";

export function Ask({ config }: { config: PanelConfig }) {
  const [agents, setAgents] = useState<Agent[]>([]);
  const [agent, setAgent] = useState("");
  const [question, setQuestion] = useState("");
  const [error, setError] = useState<ApiError | null>(null);
  useEffect(() => {
    api
      .listAgents()
      .then((r) => {
        const list = r.agents ?? [];
        setAgents(list);
        setAgent((current) => current || list[0]?.name || "");
      })
      .catch((exc: unknown) => setError(asApiError(exc)));
  }, []);
  const session = live.value;
  const busy = Boolean(session?.busy);
  const turns = conversation.value.turns;
  const chosen = agents.find((a) => a.name === agent);
  const submit = (event: Event) => {
    event.preventDefault();
    const text = question.trim();
    if (!text || !agent || busy) return;
    setQuestion("");
    void ask(agent, text);
  };
  return (
    <section aria-labelledby="ask-title">
      <h1 id="ask-title">{t("ask.title")}</h1>
      <ErrorNotice error={error} />
      <form class="ask" onSubmit={submit}>
        <label for="agent">{t("ask.agent")}</label>
        <select id="agent" value={agent} onChange={(e) => setAgent((e.currentTarget as HTMLSelectElement).value)}>
          {agents.map((a) => (
            <option key={a.name} value={a.name}>
              {a.name}
            </option>
          ))}
        </select>
        {chosen?.description && <p class="meta">{chosen.description}</p>}
        <label for="question">{turns.length > 0 ? t("ask.followUp") : t("ask.question")}</label>
        <textarea id="question" rows={3} value={question} onInput={(e) => setQuestion((e.currentTarget as HTMLTextAreaElement).value)} />
        <div class="actions">
          <button type="submit" class="primary" disabled={busy || !agent}>
            {t("ask.submit")}
          </button>
          {turns.length > 0 && (
            <button
              type="button"
              onClick={() => {
                conversation.value = freshConversation();
                live.value = null;
              }}
            >
              {t("ask.newConversation")}
            </button>
          )}
        </div>
      </form>
      {turns.length > 0 && (
        <section class="conversation" aria-labelledby="conversation-title">
          <h2 id="conversation-title">{t("ask.conversation")}</h2>
          <ol class="plain">
            {turns.map((turn, i) => (
              <li key={i} class={turn.role === "TURN_ROLE_USER" ? "turn user" : "turn assistant"}>
                <span class="meta">{turn.role === "TURN_ROLE_USER" ? t("ask.you") : t("ask.assistant")}</span> {turn.content}
              </li>
            ))}
          </ol>
        </section>
      )}
      {session && <RunView session={session} config={config} />}
    </section>
  );
}
