// Who is signed in. The access token is held in this module's memory for the
// life of the tab: never in localStorage or sessionStorage, never in a URL, never
// logged. Development offers the dev stack's demo people (only when the proxy
// was given their file); a deployment signs in with OpenID Connect, authorization
// code with PKCE, against the configured issuer.
import { signal } from "@preact/signals";

export interface PanelConfig {
  oidc: { issuer: string; clientId: string; scopes: string } | null;
  traceUrlTemplate: string;
  devIdentities: boolean;
}

export interface DevIdentity {
  id: string;
  title: string;
  roles: string[];
  token: string;
}

export interface Identity {
  userId: string;
  org: string;
  roles: string[];
  title: string;
  development: boolean;
}

const token = signal<string | null>(null);
export const identity = signal<Identity | null>(null);
/** Why the person was sent back to sign in (the service's message), if they were. */
export const signInNotice = signal<string>("");

export function currentToken(): string | null {
  return token.value;
}

/** The claims the panel shows (who you are); the services verify the token, not this. */
function claims(jwt: string): Record<string, unknown> {
  const part = jwt.split(".")[1] ?? "";
  try {
    const text = atob(part.replace(/-/g, "+").replace(/_/g, "/"));
    const bytes = Uint8Array.from(text, (c) => c.charCodeAt(0));
    const value: unknown = JSON.parse(new TextDecoder().decode(bytes));
    return typeof value === "object" && value !== null ? (value as Record<string, unknown>) : {};
  } catch {
    return {};
  }
}

function strings(value: unknown): string[] {
  return Array.isArray(value) ? value.filter((v): v is string => typeof v === "string") : [];
}

export function signIn(accessToken: string, options: { title?: string; development: boolean }): void {
  const c = claims(accessToken);
  const userId = typeof c["sub"] === "string" ? c["sub"] : "";
  token.value = accessToken;
  signInNotice.value = "";
  identity.value = {
    userId,
    org: typeof c["org"] === "string" ? c["org"] : "",
    roles: strings(c["roles"]),
    title: options.title || userId,
    development: options.development,
  };
}

export function signOut(): void {
  token.value = null;
  identity.value = null;
}

/** A 401 from any call: the token is gone or no longer good; back to sign-in. */
export function signedOut(message: string): void {
  signOut();
  signInNotice.value = message;
}

export async function loadConfig(): Promise<PanelConfig> {
  const response = await fetch("/panel/config.json", { cache: "no-store" });
  if (!response.ok) throw new Error(`GET /panel/config.json: ${response.status}`);
  return (await response.json()) as PanelConfig;
}

export async function loadDevIdentities(): Promise<DevIdentity[]> {
  const response = await fetch("/panel/dev-identities", { cache: "no-store" });
  if (!response.ok) return [];
  const body = (await response.json()) as { identities?: DevIdentity[] };
  return body.identities ?? [];
}

// --- OpenID Connect, authorization code with PKCE -------------------------------

interface Discovery {
  authorization_endpoint: string;
  token_endpoint: string;
}

// The verifier must survive the round trip to the issuer and back, which leaves
// this page; it is not a token and is removed as soon as it is used.
const PKCE_KEY = "cairn.oidc.pending";

function base64url(bytes: Uint8Array): string {
  let text = "";
  for (const b of bytes) text += String.fromCharCode(b);
  return btoa(text).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function randomString(): string {
  return base64url(crypto.getRandomValues(new Uint8Array(32)));
}

async function discover(issuer: string): Promise<Discovery> {
  const response = await fetch(`${issuer}/.well-known/openid-configuration`, { cache: "no-store" });
  if (!response.ok) throw new Error(`${issuer}/.well-known/openid-configuration: ${response.status}`);
  return (await response.json()) as Discovery;
}

function redirectUri(): string {
  return `${location.origin}/`;
}

export async function beginOidcSignIn(oidc: NonNullable<PanelConfig["oidc"]>): Promise<void> {
  const discovery = await discover(oidc.issuer);
  const verifier = randomString();
  const state = randomString();
  const challenge = base64url(new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(verifier))));
  sessionStorage.setItem(PKCE_KEY, JSON.stringify({ verifier, state }));
  const url = new URL(discovery.authorization_endpoint);
  url.search = new URLSearchParams({
    response_type: "code",
    client_id: oidc.clientId,
    redirect_uri: redirectUri(),
    scope: oidc.scopes,
    state,
    code_challenge: challenge,
    code_challenge_method: "S256",
  }).toString();
  location.assign(url.toString());
}

/**
 * Back from the issuer with ?code=&state=: the code leaves the address bar at
 * once, then is exchanged (with the verifier) for the access token, which is
 * kept in memory. Returns whether a sign-in was completed.
 */
export async function completeOidcSignIn(oidc: PanelConfig["oidc"]): Promise<boolean> {
  const params = new URLSearchParams(location.search);
  const code = params.get("code");
  const returnedState = params.get("state");
  const issuerError = params.get("error");
  if (!code && !issuerError) return false;
  history.replaceState(null, "", location.pathname);
  const pending = sessionStorage.getItem(PKCE_KEY);
  sessionStorage.removeItem(PKCE_KEY);
  if (issuerError) throw new Error(issuerError);
  if (!oidc || !pending || !code) throw new Error("no sign-in was started from this tab");
  const { verifier, state } = JSON.parse(pending) as { verifier: string; state: string };
  if (state !== returnedState) throw new Error("the sign-in's state does not match the one this tab sent");
  const discovery = await discover(oidc.issuer);
  const response = await fetch(discovery.token_endpoint, {
    method: "POST",
    headers: { "Content-Type": "application/x-www-form-urlencoded" },
    body: new URLSearchParams({
      grant_type: "authorization_code",
      code,
      redirect_uri: redirectUri(),
      client_id: oidc.clientId,
      code_verifier: verifier,
    }).toString(),
    cache: "no-store",
  });
  if (!response.ok) throw new Error(`the issuer refused the sign-in (${response.status})`);
  const body = (await response.json()) as { access_token?: string };
  if (!body.access_token) throw new Error("the issuer sent no access token");
  signIn(body.access_token, { development: false });
  return true;
}
