"""Which text may be kept: one sentence, and nothing that looks like a secret.

Pure functions over strings. Sentence counting is a small rule set (terminator,
whitespace, a capital, digit or opening quote next, and not after a known
abbreviation or an initial) rather than an NLP model: the rule is the contract a
caller can predict, and a miss only ever errs towards accepting a short text.

Secret detection names the kind of secret it saw and never returns the matched
text, so a refusal cannot echo the secret into logs or error messages. It leans
on two kept detectors rather than on patterns of our own: detect-secrets' vendor
plugins (AWS, Stripe, GitHub, GitLab, Slack, JWT, private-key headers, ...) and its
Shannon entropy, and python-stdnum's checksums (Luhn for cards, ISO 13616 for IBANs,
each country's rule for national ids), so a number is refused only when its check
digits say it is one. What they lack is written here: passwords stated in prose
in several languages, key bodies without their header, vendor keys newer than
detect-secrets 1.5 (fine-grained GitHub tokens, `sk-proj-` keys), AWS secret
access keys written without quotes, and the UK National Insurance number.

Which national ids are recognised, and why these: the ones whose written form or
check digits make a false alarm on ordinary numbers (phones, orders, dates) rare:
US SSN, UK NINO, Spain DNI and NIE, Italy codice fiscale, France NIR, Belgium
national number, Portugal Cartão de Cidadão, Sweden personnummer, Denmark CPR,
Finland HETU, Norway fødselsnummer, Poland PESEL, China resident id, Korea RRN, and
India Aadhaar in its grouped form. Ids that are nine to twelve bare digits with one
check digit (Netherlands BSN, German Steuer-IdNr, Japan My Number, Aadhaar ungrouped,
a US SSN without dashes) are refused only when named next to the number, since
one ordinary number in ten or eleven passes their checksum.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from detect_secrets.plugins.aws import AWSKeyDetector
from detect_secrets.plugins.azure_storage_key import AzureStorageKeyDetector
from detect_secrets.plugins.base import RegexBasedDetector
from detect_secrets.plugins.basic_auth import BasicAuthDetector
from detect_secrets.plugins.discord import DiscordBotTokenDetector
from detect_secrets.plugins.github_token import GitHubTokenDetector
from detect_secrets.plugins.gitlab_token import GitLabTokenDetector
from detect_secrets.plugins.high_entropy_strings import (
    Base64HighEntropyString,
    HexHighEntropyString,
)
from detect_secrets.plugins.jwt import JwtTokenDetector
from detect_secrets.plugins.keyword import KeywordDetector
from detect_secrets.plugins.mailchimp import MailchimpDetector
from detect_secrets.plugins.npm import NpmDetector
from detect_secrets.plugins.openai import OpenAIDetector
from detect_secrets.plugins.private_key import PrivateKeyDetector
from detect_secrets.plugins.pypi_token import PypiTokenDetector
from detect_secrets.plugins.sendgrid import SendGridDetector
from detect_secrets.plugins.slack import SlackDetector
from detect_secrets.plugins.square_oauth import SquareOAuthDetector
from detect_secrets.plugins.stripe import StripeDetector
from detect_secrets.plugins.telegram_token import TelegramBotTokenDetector
from detect_secrets.plugins.twilio import TwilioKeyDetector
from stdnum import iban, luhn
from stdnum.be import nn as be_nn
from stdnum.cn import ric as cn_ric
from stdnum.de import idnr as de_idnr
from stdnum.dk import cpr as dk_cpr
from stdnum.es import dni as es_dni
from stdnum.es import nie as es_nie
from stdnum.fi import hetu as fi_hetu
from stdnum.fr import nir as fr_nir
from stdnum.in_ import aadhaar as in_aadhaar
from stdnum.it import codicefiscale as it_codicefiscale
from stdnum.jp import in_ as jp_in
from stdnum.kr import rrn as kr_rrn
from stdnum.nl import bsn as nl_bsn
from stdnum.no import fodselsnummer as no_fodselsnummer
from stdnum.pl import pesel as pl_pesel
from stdnum.pt import cc as pt_cc
from stdnum.se import personnummer as se_personnummer
from stdnum.us import ssn as us_ssn

_TERMINATOR = re.compile(
    r"[.!?\u2026]+[\"'\u201d\u2019)\]]*\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9\u00c0-\u00dd])"
)
_ABBREVIATIONS: Final = frozenset(
    {
        "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e",
        "inc", "ltd", "co", "corp", "no", "nr", "approx", "dept", "est", "fig", "ca",
        "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov",
        "dec", "mon", "tue", "wed", "thu", "fri", "sat", "sun", "a.m", "p.m", "u.s",
        "u.k", "e.u", "ph.d", "cf", "al", "ave", "blvd", "mt", "gen", "gov", "rev",
    }
)  # fmt: skip


def sentence_count(text: str) -> int:
    """How many sentences `text` holds under cairn's rule (0 for blank text)."""
    stripped = text.strip()
    if not stripped:
        return 0
    count = 1
    for match in _TERMINATOR.finditer(stripped):
        if match.group().startswith(".") and _ends_with_abbreviation(stripped[: match.start()]):
            continue
        count += 1
    return count


def _ends_with_abbreviation(before: str) -> bool:
    words = before.split()
    if not words:
        return False
    word = words[-1].lstrip("\"'(\u201c\u2018[").lower()
    if len(word) == 1 and word.isalpha():
        return True  # an initial, as in "J. Smith"
    return word in _ABBREVIATIONS


# --- secrets ------------------------------------------------------------------------

# The kinds a caller is told, one phrase each. Tests and callers match on these.
PRIVATE_KEY: Final = "a private key"
API_KEY: Final = "an API key"
AWS_ACCESS_KEY: Final = "an AWS access key"
AWS_SECRET_KEY: Final = "an AWS secret access key"
STRIPE_KEY: Final = "a Stripe secret key"
GITHUB_TOKEN: Final = "a GitHub token"
GITLAB_TOKEN: Final = "a GitLab token"
SLACK_TOKEN: Final = "a Slack token"
GOOGLE_API_KEY: Final = "a Google API key"
JSON_WEB_TOKEN: Final = "a JSON Web Token"
BEARER_TOKEN: Final = "a bearer token"
URL_CREDENTIALS: Final = "credentials in a URL"
VENDOR_TOKEN: Final = "a service access token"
PASSWORD: Final = "a password"
ONE_TIME_CODE: Final = "a one-time code"
CARD_NUMBER: Final = "a payment card number"
BANK_ACCOUNT: Final = "a bank account number (IBAN)"
RANDOM_KEY: Final = "a random-looking key or token"


def national_id(name: str) -> str:
    return f"a national identity number ({name})"


# detect-secrets scans lines of source; prose and archived turns are scanned per line,
# and a very long line in overlapping windows, so no plugin's pattern ever runs over
# more than a window (some scan to the end of their input for each candidate).
_WINDOW: Final = 4096
_OVERLAP: Final = 1024
_KEYWORD_WINDOW: Final = 512
_QUOTE_CHARS: Final = frozenset("'\"`")

_VENDOR_PLUGINS: Final[tuple[tuple[str, RegexBasedDetector], ...]] = (
    (PRIVATE_KEY, PrivateKeyDetector()),
    (AWS_ACCESS_KEY, AWSKeyDetector()),
    (STRIPE_KEY, StripeDetector()),
    (API_KEY, OpenAIDetector()),
    (GITHUB_TOKEN, GitHubTokenDetector()),
    (GITLAB_TOKEN, GitLabTokenDetector()),
    (SLACK_TOKEN, SlackDetector()),
    (URL_CREDENTIALS, BasicAuthDetector()),
    (VENDOR_TOKEN, AzureStorageKeyDetector()),
    (VENDOR_TOKEN, DiscordBotTokenDetector()),
    (VENDOR_TOKEN, MailchimpDetector()),
    (VENDOR_TOKEN, NpmDetector()),
    (VENDOR_TOKEN, PypiTokenDetector()),
    (VENDOR_TOKEN, SendGridDetector()),
    (VENDOR_TOKEN, SquareOAuthDetector()),
    (VENDOR_TOKEN, TelegramBotTokenDetector()),
    (VENDOR_TOKEN, TwilioKeyDetector()),
)
_JWT: Final = JwtTokenDetector()
# Quoted assignments (`api_key = "..."`, `"db_pass": "..."`), as in pasted config.
_KEYWORD: Final = KeywordDetector()

# Keys newer than detect-secrets 1.5, or written in ways its patterns do not take.
_OWN_VENDOR_PATTERNS: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    (PRIVATE_KEY, re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")),
    (STRIPE_KEY, re.compile(r"(?<![A-Za-z0-9])(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{16,}")),
    (STRIPE_KEY, re.compile(r"(?<![A-Za-z0-9])whsec_[0-9A-Za-z]{24,}")),
    (API_KEY, re.compile(r"(?<![A-Za-z0-9])sk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_]{16,}")),
    (AWS_ACCESS_KEY, re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}(?![A-Z0-9])")),
    (
        GITHUB_TOKEN,
        re.compile(r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
    ),
    (GITLAB_TOKEN, re.compile(r"(?<![A-Za-z0-9])gl(?:pat|dt|ft|rt|soat)-[A-Za-z0-9_-]{20,}")),
    (SLACK_TOKEN, re.compile(r"(?<![A-Za-z0-9])xox[abposre]-[A-Za-z0-9-]{10,}")),
    (GOOGLE_API_KEY, re.compile(r"(?<![A-Za-z0-9])AIza[0-9A-Za-z_-]{30,}")),
    (BEARER_TOKEN, re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{20,}=*")),
)

# Six to eight digits standing alone: not a group of a phone number ("+1 10 100000").
_CODE_DIGITS: Final = r"(?<![\d+])(?<![\d+][ .-])\d{6,8}(?!\d)(?![ .-]\d)"
_ONE_TIME_CODE: Final = re.compile(
    rf"(?i)\b(?:code|otp|one[- ]time|verification|2fa|mfa|pin)\b\D{{0,24}}{_CODE_DIGITS}"
    rf"|{_CODE_DIGITS}\D{{0,24}}\b(?:code|otp|one[- ]time|verification|2fa|mfa|pin)\b"
)


def secret_kind(text: str) -> str | None:
    """The kind of secret `text` appears to contain ("an API key", ...), or None."""
    for screen in _SCREENS:
        kind = screen(text)
        if kind is not None:
            return kind
    return None


def _windows(text: str, *, size: int = _WINDOW, overlap: int = _OVERLAP) -> Iterator[str]:
    for line in text.splitlines() or [""]:
        if len(line) <= size:
            yield line
            continue
        for start in range(0, len(line), size - overlap):
            yield line[start : start + size]


def _vendor_key(text: str) -> str | None:
    for kind, pattern in _OWN_VENDOR_PATTERNS:
        if pattern.search(text):
            return kind
    for window in _windows(text):
        for kind, plugin in _VENDOR_PLUGINS:
            if any(True for _ in plugin.analyze_string(window)):
                return kind
        if any(True for _ in _JWT.analyze_string(window)):
            return JSON_WEB_TOKEN
    # The keyword plugin's patterns all need a quoted value, and each scans the rest of
    # its input per keyword it meets: small windows keep that linear in the text.
    for window in _windows(text, size=_KEYWORD_WINDOW, overlap=_KEYWORD_WINDOW // 2):
        if _QUOTE_CHARS.intersection(window) and any(True for _ in _KEYWORD.analyze_string(window)):
            return PASSWORD
    return None


# --- key bodies and random-looking strings -------------------------------------------

_B64: Final = Base64HighEntropyString()
_HEX: Final = HexHighEntropyString()
# A PEM body: base64 lines of 40-76 characters, one after another, without the
# BEGIN line (pasted from the middle of a file, or with the header cut off).
_PEM_BODY: Final = re.compile(
    r"(?<![A-Za-z0-9+/])(?:[A-Za-z0-9+/]{40,76}={0,2}[ \t]*\r?\n[ \t]*){2,}[A-Za-z0-9+/]*={0,2}"
)
_BASE64_RUN: Final = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{60,}={0,2}")
# The DER start of a private key, base64-encoded: PKCS#1 RSA and PKCS#8 open with
# SEQUENCE { INTEGER 0, ... }, SEC1 EC keys with SEQUENCE { INTEGER 1, ... }; an
# OpenSSH key with its magic "openssh-key-v1". Certificates and public keys open with
# a nested SEQUENCE instead, so they are not called private keys.
_OPENSSH_MAGIC: Final = "b3BlbnNzaC1rZXktdjE"
_TOKEN: Final = re.compile(r"[A-Za-z0-9+/=_-]{24,}")
_HEX_TOKEN: Final = re.compile(r"(?<![A-Za-z0-9])[0-9A-Fa-f]{32,}(?![A-Za-z0-9])")
_AWS_SECRET: Final = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{40}(?![A-Za-z0-9+/=])")


def _is_private_key_der(encoded: str) -> bool:
    if encoded.startswith(_OPENSSH_MAGIC):
        return True
    try:
        der = base64.b64decode(encoded[:64] + "=" * (-len(encoded[:64]) % 4))
    except (binascii.Error, ValueError):
        return False
    if len(der) < 8 or der[0] != 0x30:
        return False
    length_octets = der[1] - 0x80 if der[1] > 0x80 else 0
    body = der[2 + length_octets :]
    return len(body) >= 3 and body[0] == 0x02 and body[1] == 0x01 and body[2] in (0, 1)


def _key_body(text: str) -> str | None:
    for match in _PEM_BODY.finditer(text):
        if _is_private_key_der("".join(match.group().split())):
            return PRIVATE_KEY
    for match in _BASE64_RUN.finditer(text):
        if _is_private_key_der(match.group()):
            return PRIVATE_KEY
    if _OPENSSH_MAGIC in text:
        return PRIVATE_KEY
    return None


def _random_threshold(length: int) -> float:
    # A random alphanumeric string of n characters has entropy near log2(n) bits per
    # character until n nears the alphabet size: 0.9 below that keeps 99% of random
    # keys above the line and ordinary words (about 3.5-4 bits) well below it.
    return min(4.5, math.log2(length) - 0.9)


def _looks_random(token: str) -> bool:
    stripped = token.strip("=-_/")
    if len(stripped) < 24:
        return False
    if not any(c.isdigit() for c in stripped) or not any(c.isalpha() for c in stripped):
        return False
    return _B64.calculate_shannon_entropy(stripped) > _random_threshold(len(stripped))


def _random_string(text: str) -> str | None:
    for match in _AWS_SECRET.finditer(text):
        candidate = match.group()
        classes = (str.isdigit, str.islower, str.isupper, "+/".__contains__)
        kinds = sum(any(test(c) for c in candidate) for test in classes)
        entropy = _B64.calculate_shannon_entropy(candidate)
        # One key in four thousand draws no digit and no symbol; mixed-case words that
        # long stay near 4 bits, so letters alone need more entropy to count.
        if (kinds >= 3 and entropy > 4.0) or (kinds == 2 and entropy > 4.4):
            return AWS_SECRET_KEY
    for match in _TOKEN.finditer(text):
        if _looks_random(match.group()):
            return RANDOM_KEY
    for match in _HEX_TOKEN.finditer(text):
        candidate = match.group()
        if (
            any(c.isdigit() for c in candidate)
            and any(c.isalpha() for c in candidate)
            and _HEX.calculate_shannon_entropy(candidate) > 3.0
        ):
            return RANDOM_KEY
    return None


# --- payment cards and bank accounts --------------------------------------------------

# Four-digit groups (16 and 19 digits, and 13-15 written plainly), or Amex and Diners
# grouping (4-6-5, 4-6-4), one separator throughout: "50853550 2000-01-18" is an
# order number and a date. Not after a word character (the digits of an IBAN) or "+"
# ("+49 151 ..." is a phone number).
_CARD: Final = re.compile(
    r"(?<![\w+])\d{4}(?P<s>[ -]?)\d{4}(?P=s)\d{4}(?P=s)\d{1,4}(?:(?P=s)\d{1,3})?(?!\d)"
    r"|(?<![\w+])\d{4}(?P<t>[ -]?)\d{6}(?P=t)\d{4,5}(?!\d)"
)


def _card_brand_fits(digits: str) -> bool:
    """Whether the number opens with an issuer prefix that issues cards of its length:
    Luhn alone passes one number in ten, the issuer ranges make a chance match rare."""
    n = len(digits)
    two, four = int(digits[:2]), int(digits[:4])
    if digits[0] == "4":
        return n in (16, 19)  # Visa (13-digit Visa is retired)
    if 51 <= two <= 55 or 2221 <= four <= 2720 or 2200 <= four <= 2204:
        return n == 16  # Mastercard, Mir
    if two in (34, 37):
        return n == 15  # American Express
    if two == 36 or 300 <= int(digits[:3]) <= 305 or two in (38, 39):
        return 14 <= n <= 19  # Diners Club
    if 3528 <= four <= 3589:
        return 16 <= n <= 19  # JCB
    if digits.startswith(("6011", "65", "62")) or 644 <= int(digits[:3]) <= 649:
        return 16 <= n <= 19  # Discover, UnionPay
    if two == 50 or 56 <= two <= 69:
        return 16 <= n <= 19  # Maestro
    return False


def _card_number(text: str) -> str | None:
    for match in _CARD.finditer(text):
        digits = re.sub(r"\D", "", match.group())
        if 13 <= len(digits) <= 19 and _card_brand_fits(digits) and luhn.is_valid(digits):
            return CARD_NUMBER
    return None


_IBAN: Final = re.compile(r"(?<![A-Za-z0-9])[A-Za-z]{2}\d{2}(?:[ -]?[A-Za-z0-9]){10,32}")


def _bank_account(text: str) -> str | None:
    for match in _IBAN.finditer(text):
        compact = re.sub(r"[ -]", "", match.group()).upper()
        # The match may run on into the next word; every IBAN country has one
        # length, so each shorter prefix is tried and the checksum decides.
        for length in range(min(len(compact), 34), 14, -1):
            if iban.is_valid(compact[:length]):
                return BANK_ACCOUNT
    return None


# --- national identity numbers --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _NationalId:
    name: str
    pattern: re.Pattern[str]
    is_valid: Callable[[str], bool]


def _nid(name: str, pattern: str, is_valid: Callable[[str], bool]) -> _NationalId:
    return _NationalId(name, re.compile(pattern), is_valid)


# A match may not start or end inside a word, a longer number, a phone number
# ("+46 ...") or a run of digit groups ("+1 4781 2315 4210.00" is a phone number and
# an amount, not an Aadhaar number).
_B: Final = r"(?<![\w+-])(?<!\d[ .-])"
_E: Final = r"(?![\w-])(?![ .-]\d)"
_DIGITS_NAMED: Final = r"\b{names}\b\W{{0,12}}(?:\w+\W{{1,4}}){{0,3}}?"

_NINO_PREFIX: Final = r"(?!BG|GB|KN|NK|NT|TN|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]"


def _nino_is_valid(number: str) -> bool:
    return re.fullmatch(_NINO_PREFIX + r"\d{6}[A-D]", re.sub(r"\s", "", number)) is not None


_NATIONAL_IDS: Final[tuple[_NationalId, ...]] = (
    _nid("US SSN", _B + r"\d{3}[- ]\d{2}[- ]\d{4}" + _E, us_ssn.is_valid),
    _nid(
        "US SSN",
        _DIGITS_NAMED.format(names=r"(?i:ssn|social security(?: number| no\.?)?)")
        + r"(\d{9})"
        + _E,
        us_ssn.is_valid,
    ),
    _nid("UK NINO", _B + _NINO_PREFIX + r" ?\d{2} ?\d{2} ?\d{2} ?[A-D]" + _E, _nino_is_valid),
    _nid("ES DNI", _B + r"\d{8}-?[A-Z]" + _E, es_dni.is_valid),
    _nid("ES NIE", _B + r"[XYZ]-?\d{7}-?[A-Z]" + _E, es_nie.is_valid),
    _nid(
        "IT codice fiscale",
        _B + r"[A-Z]{6}[0-9LMNP-V]{2}[A-EHLMPR-T][0-9LMNP-V]{2}[A-Z][0-9LMNP-V]{3}[A-Z]" + _E,
        it_codicefiscale.is_valid,
    ),
    _nid(
        "FR NIR",
        _B + r"[12] ?\d{2} ?\d{2} ?(?:\d{2}|2[AB]) ?\d{3} ?\d{3} ?\d{2}" + _E,
        fr_nir.is_valid,
    ),
    _nid("BE national number", _B + r"\d{2}\.\d{2}\.\d{2}-\d{3}\.\d{2}" + _E, be_nn.is_valid),
    _nid("PT Cartão de Cidadão", _B + r"\d{8} ?\d ?[A-Z]{2}\d" + _E, pt_cc.is_valid),
    _nid("SE personnummer", _B + r"(?:\d{2})?\d{6}[-+]\d{4}" + _E, se_personnummer.is_valid),
    _nid("DK CPR", _B + r"\d{6}-\d{4}" + _E, dk_cpr.is_valid),
    _nid("FI HETU", _B + r"\d{6}[-+A-FU-Y]\d{3}[0-9A-Y]" + _E, fi_hetu.is_valid),
    _nid("NO fødselsnummer", _B + r"\d{6} ?\d{5}" + _E, no_fodselsnummer.is_valid),
    _nid("PL PESEL", _B + r"\d{11}" + _E, pl_pesel.is_valid),
    _nid("CN resident id", _B + r"\d{17}[\dXx]" + _E, cn_ric.is_valid),
    _nid("KR RRN", _B + r"\d{6}-\d{7}" + _E, kr_rrn.is_valid),
    _nid("IN Aadhaar", _B + r"[2-9]\d{3}[ -]\d{4}[ -]\d{4}" + _E, in_aadhaar.is_valid),
    _nid(
        "IN Aadhaar",
        _DIGITS_NAMED.format(names=r"(?i:aadhaar|aadhar|uidai)|आधार") + r"(\d{12})" + _E,
        in_aadhaar.is_valid,
    ),
    _nid(
        "NL BSN",
        _DIGITS_NAMED.format(names=r"(?i:bsn|burgerservicenummer|sofinummer)")
        + r"(\d{9}|\d{4}\.\d{2}\.\d{3})"
        + _E,
        nl_bsn.is_valid,
    ),
    _nid(
        "DE Steuer-IdNr",
        _DIGITS_NAMED.format(
            names=r"(?i:steuer-?id(?:entifikationsnummer)?|idnr|tax id(?:entification number)?)"
        )
        + r"(\d{2} ?\d{3} ?\d{3} ?\d{3})"
        + _E,
        de_idnr.is_valid,
    ),
    _nid(
        "JP My Number",
        _DIGITS_NAMED.format(names=r"(?i:my ?number|individual number)|マイナンバー|個人番号")
        + r"(\d{4}[ -]?\d{4}[ -]?\d{4})"
        + _E,
        jp_in.is_valid,
    ),
)


def _national_id(text: str) -> str | None:
    for rule in _NATIONAL_IDS:
        for match in rule.pattern.finditer(text):
            number = match.group(match.lastindex or 0)
            if rule.is_valid(number):
                return national_id(rule.name)
    return None


# --- passwords said in words -----------------------------------------------------------

# "<password word> [for the wiki] <is / ist / est / es / è / : / => <value>", in the
# languages cairn's people write. The value decides: a word that usually follows
# ("the password is changed monthly", "das Passwort ist abgelaufen") is not a secret.
_PASSWORD_WORDS: Final = (
    r"passwords?|passwd|pwd|passphrase|pass ?code|pass ?word|pin(?: code)?|"
    r"passw[oö]rt(?:er)?|kennw[oö]rt(?:er)?|geheimzahl|"
    r"mots? de passe|mdp|code secret|"
    r"contraseñas?|contrasenas?|clave de acceso|"
    r"parola d'ordine|senhas?|palavra-passe|"
    r"wachtwoord(?:en)?|lösenord(?:et)?|losenord|adgangskode(?:n)?|kodeord(?:et)?|passord(?:et)?|"
    r"salasana|has[łl]o|heslo|parola(?:m|sı|si)?|şifre(?:m|si|niz)?|sifre(?:m|si)?|"
    r"пароль|пароля|кодовое слово|κωδικός|كلمة المرور|كلمة السر|पासवर्ड"
)
_COPULAS: Final = (
    r"is|was|are|were|ist|lautet|war|heißt|heisst|est|était|etait|c'est|es|era|è|e'|é|"
    r"är|var|er|on|to|jest|je|este|это|был|была|είναι|هي|هو"
)
_CONNECTOR_WORDS: Final = (
    r"for|of|to|on|für|fur|von|vom|zum|zur|pour|de|du|des|para|del|per|di|voor|van|för|"
    r"til|на|для|от"
)
_QUOTES: Final = "\"'`\u201c\u201d\u2018\u2019\u00ab\u00bb\u201e"
_PASSWORD_STATED: Final = re.compile(
    rf"(?i)(?<!\w)(?:{_PASSWORD_WORDS})(?!\w)"
    rf"(?:(?:\s+(?:{_CONNECTOR_WORDS})(?:\s+[^\s:=.,;!?]{{1,30}}){{1,3}}?)?"
    rf"(?:\s*(?P<sign>:=|=>|[:=：—–-])|\s+(?P<copula>{_COPULAS})(?!\w)))?"
    rf"\s*(?P<quote>[{_QUOTES}]?)(?P<value>[^\s{_QUOTES}]+)"
)
# CJK writes the value straight after the particle: 我的密码是hunter2, パスワードはhunter2です.
_PASSWORD_STATED_CJK: Final = re.compile(
    r"(?:密码|密碼|口令|パスワード|暗証番号|비밀번호|암호|패스워드)"
    r"\s*(?:是|为|為|就是|：|:|は|는|은|=)\s*[\"'“「『]?(?P<value>[\x21-\x7e]{4,})"
)
# Words that follow "the password is" in ordinary sentences: function words, and
# adjectives and participles that describe a password without being one.
_NOT_A_VALUE: Final = frozenset(
    """
    the a an not no now still also being been always never usually often just only
    my your his her our their its this that these those same different here there
    changed reset set required needed expired expiring stored saved kept shared
    wrong right correct incorrect invalid valid weak strong secure insecure safe unsafe
    long short new old simple easy hard complex unique temporary personal private
    confidential secret hidden unknown missing empty blank case sensitive mandatory
    optional protected encrypted hashed forgotten lost locked required needed
    der die das ein eine kein keine nicht noch schon immer nie mein dein sein ihr unser
    falsch richtig sicher unsicher lang kurz neu alt leer geheim gesperrt abgelaufen
    le la les un une pas plus toujours jamais mon ton son notre votre leur faux vrai
    incorrect sûr nouveau nouvelle ancien ancienne vide secret
    el los las uno una ya siempre nunca mi tu su nuestro falsa falso correcta incorrecta
    segura seguro nueva nuevo vieja viejo larga corta vacía
    il lo gli una non sempre mai mio tuo suo nostro sbagliata giusta sicura nuova vecchia
    o os um uma não nao sempre nunca meu teu seu nosso errada certa segura nova velha
    het een niet geen nog altijd nooit mijn jouw zijn haar ons fout juist veilig nieuw oud
    inte ingen ikke ei aldri alltid min din sin vår fel riktig säker ny gammal
    nie jest błędne nowe stare
    """.split()  # noqa: SIM905 - a word list reads better as prose than as 200 literals
)
_PARTICIPLE: Final = re.compile(
    r"(?i)(?:ed|ing|ly|ig|lich|iert|ée|és|ées|ado|ada|ados|adas|ido|ida|idos|idas|ato|ata|"
    r"ito|ita|uto|uta)$|^ge\w+t$"
)


def _is_password_value(value: str, *, quoted: bool, stated: bool) -> bool:
    value = value.rstrip(".,;:!?)]}" + _QUOTES)
    has_digit_or_symbol = any(not c.isalpha() for c in value)
    if has_digit_or_symbol:
        return len(value) >= 4 and any(c.isalnum() for c in value)
    if quoted:
        return len(value) >= 3
    if not stated or len(value) < 5 or not value.isascii():
        return False  # a bare word after the keyword, or a non-Latin word, is prose
    folded = value.casefold()
    return folded not in _NOT_A_VALUE and not _PARTICIPLE.search(folded)


def _password(text: str) -> str | None:
    for match in _PASSWORD_STATED.finditer(text):
        stated = match.group("sign") is not None or match.group("copula") is not None
        quoted = bool(match.group("quote"))
        if _is_password_value(match.group("value"), quoted=quoted, stated=stated):
            return PASSWORD
    if _PASSWORD_STATED_CJK.search(text):
        return PASSWORD
    return None


def _one_time_code(text: str) -> str | None:
    return ONE_TIME_CODE if _ONE_TIME_CODE.search(text) else None


# Most specific first, so a refusal names what the secret is rather than what it looks like.
_SCREENS: Final[tuple[Callable[[str], str | None], ...]] = (
    _vendor_key,
    _key_body,
    _bank_account,  # before cards: a spaced IBAN holds groups of four digits
    _card_number,
    _national_id,
    _password,
    _one_time_code,
    _random_string,
)
