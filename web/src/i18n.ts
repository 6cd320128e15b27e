// Every string the panel shows comes from a message catalog; dates, numbers and
// durations go through Intl. The choice of language is remembered in
// localStorage (it is not a secret; the token never is stored).
import { computed, signal } from "@preact/signals";
import { en, type MessageKey } from "./messages/en";
import { zhHans } from "./messages/zh-Hans";

export type Language = "en" | "zh-Hans";
export const LANGUAGES: readonly Language[] = ["en", "zh-Hans"];
const catalogs: Record<Language, Record<MessageKey, string>> = { en, "zh-Hans": zhHans };
const STORAGE_KEY = "cairn.language";

function initial(): Language {
  try {
    const stored = localStorage.getItem(STORAGE_KEY);
    if (stored === "en" || stored === "zh-Hans") return stored;
  } catch {
    // storage may be off; fall through to the browser's preference
  }
  return navigator.language.toLowerCase().startsWith("zh") ? "zh-Hans" : "en";
}

export const language = signal<Language>(initial());

export function setLanguage(next: Language): void {
  language.value = next;
  try {
    localStorage.setItem(STORAGE_KEY, next);
  } catch {
    // not remembered, still switched
  }
  document.documentElement.lang = next;
}

export function t(key: MessageKey, params: Record<string, string | number> = {}): string {
  const text = catalogs[language.value][key];
  return text.replace(/\{(\w+)\}/g, (whole, name: string) => {
    const value = params[name];
    return value === undefined ? whole : typeof value === "number" ? formatNumber(value) : value;
  });
}

const formats = computed(() => ({
  dateTime: new Intl.DateTimeFormat(language.value, { dateStyle: "medium", timeStyle: "medium" }),
  number: new Intl.NumberFormat(language.value),
  ms: new Intl.NumberFormat(language.value, { style: "unit", unit: "millisecond", maximumFractionDigits: 0 }),
  seconds: new Intl.NumberFormat(language.value, { style: "unit", unit: "second", maximumFractionDigits: 2 }),
}));

export function formatDate(iso: string | undefined): string {
  if (!iso) return "";
  const when = new Date(iso);
  return Number.isNaN(when.getTime()) || when.getTime() <= 0 ? "" : formats.value.dateTime.format(when);
}

export function formatNumber(value: number | string | undefined): string {
  const n = typeof value === "string" ? Number(value) : (value ?? 0);
  return formats.value.number.format(Number.isFinite(n) ? n : 0);
}

export function formatDuration(ms: number): string {
  return ms < 1000 ? formats.value.ms.format(ms) : formats.value.seconds.format(ms / 1000);
}
