// How a refusal reads: the one denial for a 403, the service's own message for
// everything else; never a stack trace.
import type { ApiError } from "../client";
import { t } from "../i18n";

export function ErrorNotice({ error }: { error: ApiError | null }) {
  if (!error) return null;
  if (error.denied) {
    return (
      <p class="error" role="alert" data-testid="denial">
        {t("error.denied")} <span class="service-message">{error.message}</span>
      </p>
    );
  }
  return (
    <p class="error" role="alert" data-testid="service-error">
      {error.httpStatus === 0 ? t("error.unreachable") : t("error.service")} <span class="service-message">{error.message}</span>
    </p>
  );
}
