// Signing in: the dev stack's demo people (development only) or the
// organisation's OpenID Connect issuer. Nothing here is shown once signed in.
import { useEffect, useState } from "preact/hooks";
import { beginOidcSignIn, loadDevIdentities, signIn, signInNotice, type DevIdentity, type PanelConfig } from "../auth";
import { t } from "../i18n";

export function SignIn({ config, failure }: { config: PanelConfig; failure: string }) {
  const [people, setPeople] = useState<DevIdentity[]>([]);
  const [problem, setProblem] = useState(failure);
  useEffect(() => {
    if (config.devIdentities) void loadDevIdentities().then(setPeople);
  }, [config.devIdentities]);
  const notice = signInNotice.value;
  return (
    <main id="main" class="sign-in" aria-labelledby="sign-in-title">
      <h1 id="sign-in-title">{t("signIn.title")}</h1>
      <p>{t("signIn.intro")}</p>
      {notice && (
        <p class="notice" role="status">
          {t("signIn.ended")} <span class="service-message">{notice}</span>
        </p>
      )}
      {problem && (
        <p class="error" role="alert">
          {t("signIn.failed")} <span class="service-message">{problem}</span>
        </p>
      )}
      {config.oidc && (
        <button
          type="button"
          class="primary"
          onClick={() => {
            const oidc = config.oidc;
            if (oidc) beginOidcSignIn(oidc).catch((exc: unknown) => setProblem(exc instanceof Error ? exc.message : String(exc)));
          }}
        >
          {t("signIn.oidc")}
        </button>
      )}
      {config.devIdentities && (
        <section class="dev-identities" aria-labelledby="dev-title">
          <h2 id="dev-title">
            {t("signIn.devTitle")} <span class="badge warning">{t("signIn.devOnly")}</span>
          </h2>
          <p>{t("signIn.devIntro")}</p>
          <ul class="plain">
            {people.map((person) => (
              <li key={person.id}>
                <button type="button" onClick={() => signIn(person.token, { title: person.title, development: true })}>
                  {t("signIn.as", { name: person.title })}
                </button>
              </li>
            ))}
          </ul>
        </section>
      )}
      {!config.oidc && !config.devIdentities && <p class="error">{t("signIn.unconfigured")}</p>}
    </main>
  );
}
