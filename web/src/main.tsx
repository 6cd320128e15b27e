// Start: read the panel's settings from the proxy, finish an OpenID Connect
// sign-in if the issuer just sent the person back, then draw the panel.
import { render } from "preact";
import { completeOidcSignIn, loadConfig, type PanelConfig } from "./auth";
import { language } from "./i18n";
import "./styles.css";
import { App } from "./views/App";

async function start(): Promise<void> {
  document.documentElement.lang = language.value;
  const root = document.getElementById("app");
  if (!root) return;
  let config: PanelConfig = { oidc: null, traceUrlTemplate: "", devIdentities: false };
  let failure = "";
  try {
    config = await loadConfig();
    await completeOidcSignIn(config.oidc);
  } catch (exc) {
    failure = exc instanceof Error ? exc.message : String(exc);
  }
  render(<App config={config} failure={failure} />, root);
}

void start();
