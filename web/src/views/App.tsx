// The panel's frame: who is signed in, the language, the four views, and a
// boundary so that nothing unexpected ever shows a stack trace.
import { Component, type ComponentChildren } from "preact";
import { useEffect, useRef } from "preact/hooks";
import { signal } from "@preact/signals";
import { identity, signOut, type PanelConfig } from "../auth";
import { LANGUAGES, language, setLanguage, t, type Language } from "../i18n";
import { open, stopFollowing } from "../live";
import type { MessageKey } from "../messages/en";
import { Ask } from "./Ask";
import { Held } from "./Held";
import { PastRuns } from "./PastRuns";
import { SignIn } from "./SignIn";
import { Waiting } from "./Waiting";

export type View = "ask" | "waiting" | "runs" | "me";
const VIEWS: { view: View; path: string; key: MessageKey }[] = [
  { view: "ask", path: "/", key: "nav.ask" },
  { view: "waiting", path: "/waiting", key: "nav.waiting" },
  { view: "runs", path: "/runs", key: "nav.runs" },
  { view: "me", path: "/me", key: "nav.me" },
];

/** /runs/{run_id} reopens one run: a link to it carries no token, only the id. */
function linkedRun(pathname: string): string | null {
  const m = /^\/runs\/([^/]+)$/.exec(pathname);
  return m?.[1] ? decodeURIComponent(m[1]) : null;
}

function viewOf(pathname: string): View {
  if (linkedRun(pathname)) return "ask";
  return VIEWS.find((v) => v.path === pathname)?.view ?? "ask";
}

export const view = signal<View>(viewOf(location.pathname));

export function go(next: View): void {
  view.value = next;
  const path = VIEWS.find((v) => v.view === next)?.path ?? "/";
  if (location.pathname !== path) history.pushState(null, "", path);
}

addEventListener("popstate", () => {
  view.value = viewOf(location.pathname);
});

class Boundary extends Component<{ children: ComponentChildren }, { failed: boolean }> {
  override state = { failed: false };
  static override getDerivedStateFromError(): { failed: boolean } {
    return { failed: true };
  }
  override render() {
    if (this.state.failed) {
      return (
        <p class="error" role="alert">
          {t("error.unexpected")}{" "}
          <button type="button" onClick={() => this.setState({ failed: false })}>
            {t("common.retry")}
          </button>
        </p>
      );
    }
    return this.props.children;
  }
}

export function App({ config, failure }: { config: PanelConfig; failure: string }) {
  const me = identity.value;
  const mainRef = useRef<HTMLElement>(null);
  const current = view.value;
  useEffect(() => {
    document.title = `cairn · ${t(VIEWS.find((v) => v.view === current)?.key ?? "nav.ask")}`;
  }, [current, language.value]);
  const showRun = (runId: string) => {
    view.value = "ask";
    history.pushState(null, "", `/runs/${encodeURIComponent(runId)}`);
    mainRef.current?.focus();
  };
  const openRun = (runId: string) => {
    showRun(runId);
    void open(runId);
  };
  useEffect(() => {
    const runId = linkedRun(location.pathname);
    if (me && runId) void open(runId);
  }, [me?.userId]);
  return (
    <>
      <a class="skip" href="#main">
        {t("nav.skip")}
      </a>
      <header class="top">
        <span class="brand">cairn</span>
        {me && (
          <nav aria-label={t("nav.label")}>
            <ul>
              {VIEWS.map((v) => (
                <li key={v.view}>
                  <a
                    href={v.path}
                    aria-current={current === v.view ? "page" : undefined}
                    onClick={(e) => {
                      e.preventDefault();
                      go(v.view);
                    }}
                  >
                    {t(v.key)}
                  </a>
                </li>
              ))}
            </ul>
          </nav>
        )}
        <div class="who">
          <label for="language">{t("nav.language")}</label>
          <select id="language" value={language.value} onChange={(e) => setLanguage((e.currentTarget as HTMLSelectElement).value as Language)}>
            {LANGUAGES.map((l) => (
              <option key={l} value={l} lang={l}>
                {l === "en" ? "English" : "简体中文"}
              </option>
            ))}
          </select>
          {me && (
            <>
              <span data-testid="signed-in-as">
                {t("nav.signedInAs", { who: me.title })}
                {me.development && <span class="badge warning"> {t("signIn.devOnly")}</span>}
              </span>
              <button
                type="button"
                onClick={() => {
                  stopFollowing();
                  signOut();
                }}
              >
                {t("nav.signOut")}
              </button>
            </>
          )}
        </div>
      </header>
      <Boundary>
        {!me ? (
          <SignIn config={config} failure={failure} />
        ) : (
          <main id="main" ref={mainRef} tabIndex={-1}>
            {current === "ask" && <Ask config={config} />}
            {current === "waiting" && <Waiting onOpenRun={openRun} onResolved={showRun} />}
            {current === "runs" && <PastRuns onOpenRun={openRun} />}
            {current === "me" && <Held />}
          </main>
        )}
      </Boundary>
    </>
  );
}
