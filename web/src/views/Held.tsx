// What cairn holds about me: memories and profile facts with their provenance,
// Forget with a confirm step, and afterwards the erasure's record.
import { useEffect, useState } from "preact/hooks";
import type { Erasure, HeldResponse, Provenance, Subject } from "../api/types";
import { identity } from "../auth";
import { ApiError, api } from "../client";
import { formatDate, formatNumber, t } from "../i18n";
import { asApiError } from "../live";
import { ErrorNotice } from "./Notice";

function ProvenanceLine({ p }: { p: Provenance | undefined }) {
  if (!p) return null;
  const by =
    p.authorKind === "AUTHOR_KIND_MODEL"
      ? t("held.byAgent", { run: p.runId ?? "", who: p.onBehalfOf ?? "" })
      : t("held.byPerson", { who: p.authorId ?? "" });
  return (
    <p class="meta provenance">
      {by} · {t("held.written", { when: formatDate(p.createdAt) })}
      {p.expiresAt && <> · {t("held.until", { when: formatDate(p.expiresAt) })}</>}
    </p>
  );
}

function ErasureRecord({ e }: { e: Erasure }) {
  return (
    <li data-testid="erasure">
      {t("held.erasure", {
        when: formatDate(e.erasedAt),
        who: e.erasedBy ?? "",
        memories: e.memoriesErased ?? 0,
        facts: e.factsErased ?? 0,
        blocks: e.blocksErased ?? 0,
      })}
      {!e.copiesErased && <span class="badge warning"> {t("held.copiesPending")}</span>}
    </li>
  );
}

export function Held() {
  const me = identity.value;
  const subject: Subject = { kind: "SUBJECT_KIND_USER", id: me?.userId ?? "" };
  const [held, setHeld] = useState<HeldResponse | null>(null);
  const [error, setError] = useState<ApiError | null>(null);
  const [confirming, setConfirming] = useState(false);
  const [erased, setErased] = useState<Erasure | null>(null);
  const reload = () =>
    api
      .held({ subject, pageSize: 100, pageToken: "" })
      .then(setHeld)
      .catch((exc: unknown) => setError(asApiError(exc)));
  useEffect(() => {
    void reload();
  }, [me?.userId]);
  const forget = async () => {
    setConfirming(false);
    try {
      const r = await api.forget(subject);
      // what remains is read back before the erasure is announced
      await reload();
      setErased(r.erasure ?? null);
    } catch (exc) {
      setError(asApiError(exc));
    }
  };
  const memories = (held?.memories ?? []).filter((m) => m.state !== "MEMORY_STATE_ERASED");
  const facts = held?.profile ?? [];
  return (
    <section aria-labelledby="held-title">
      <h1 id="held-title">{t("held.title")}</h1>
      <p>{t("held.intro", { who: me?.title ?? "" })}</p>
      <ErrorNotice error={error} />
      {held === null && !error && <p>{t("common.loading")}</p>}
      {held && (
        <>
          <h2>{t("held.memories", { count: memories.length })}</h2>
          {memories.length === 0 ? (
            <p data-testid="held-empty">{t("held.noMemories")}</p>
          ) : (
            <ul class="plain" data-testid="held-memories">
              {memories.map((m) => (
                <li key={m.memoryId} class="memory">
                  <p>{m.text}</p>
                  <p class="meta">
                    {t("held.claim", { claim: (m.claimType ?? "").replace(/^CLAIM_TYPE_/, "") })}
                    {m.tags && m.tags.length > 0 && <> · {m.tags.join(", ")}</>} · {t("held.importance", { n: formatNumber(m.importance ?? 0) })}
                  </p>
                  <ProvenanceLine p={m.provenance} />
                </li>
              ))}
            </ul>
          )}
          {facts.length > 0 && (
            <>
              <h2>{t("held.profile")}</h2>
              <dl class="details">
                {facts.map((f) => (
                  <div key={f.factKey}>
                    <dt>{f.factKey}</dt>
                    <dd>
                      {f.value}
                      <ProvenanceLine p={f.provenance} />
                    </dd>
                  </div>
                ))}
              </dl>
            </>
          )}
          {(memories.length > 0 || facts.length > 0) &&
            (confirming ? (
              <div class="confirm" role="group" aria-labelledby="forget-confirm">
                <p id="forget-confirm">{t("held.forgetConfirm")}</p>
                <button type="button" class="danger" onClick={() => void forget()}>
                  {t("held.forgetYes")}
                </button>
                <button type="button" onClick={() => setConfirming(false)}>
                  {t("common.cancel")}
                </button>
              </div>
            ) : (
              <button type="button" class="danger" onClick={() => setConfirming(true)}>
                {t("held.forget")}
              </button>
            ))}
          {erased && (
            <p class="notice" role="status" data-testid="erased">
              {t("held.erasedNow")}
            </p>
          )}
          {(held.erasures ?? []).length > 0 && (
            <>
              <h2>{t("held.records")}</h2>
              <ul class="plain" data-testid="erasures">
                {(held.erasures ?? []).map((e, i) => (
                  <ErasureRecord key={i} e={e} />
                ))}
              </ul>
            </>
          )}
        </>
      )}
    </section>
  );
}
