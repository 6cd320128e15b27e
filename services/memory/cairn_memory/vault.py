"""How memory and archive text rests in PostgreSQL: plain, or sealed with AES-GCM.

With CAIRN_MEMORY_ENCRYPTION_KEY set, new text is sealed (a version byte, a fresh
96-bit nonce, the ciphertext and tag) with the org id as associated data, so a
sealed value copied into another org's row does not open. Without the key, sealed
text is unreadable and reported as such rather than guessed at.

Duplicate detection compares digests, not text: a keyed HMAC when a key exists
(a bare hash of a short sentence would be guessable), SHA-256 otherwise.

What encryption does not cover: embeddings, and the full-text search vector of
archived blocks (its lexemes are derived from the text), which searching needs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Final, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cairn_libs.errors import ConfigurationError

_FORMAT_V1: Final = b"\x01"
_NONCE_BYTES: Final = 12


@dataclass(frozen=True, slots=True)
class StoredText:
    """Exactly one of the two is set for live text; both are None once erased."""

    plain: str | None
    sealed: bytes | None


class TextVault(Protocol):
    def seal(self, text: str, *, org_id: str) -> StoredText: ...

    def open(self, stored: StoredText, *, org_id: str) -> str | None:
        """The text, or None when it is sealed and cannot be opened here."""
        ...

    def digest(self, normalised: str) -> bytes: ...


class PlainVault:
    """No key: text rests as written."""

    def seal(self, text: str, *, org_id: str) -> StoredText:
        return StoredText(plain=text, sealed=None)

    def open(self, stored: StoredText, *, org_id: str) -> str | None:
        if stored.sealed is not None:
            return None
        return stored.plain

    def digest(self, normalised: str) -> bytes:
        return hashlib.sha256(normalised.encode()).digest()


class AesGcmVault:
    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError(f"an AES-256-GCM key is 32 bytes, got {len(key)}")
        self._aead = AESGCM(key)
        self._digest_key = hmac.new(key, b"cairn-memory/text-digest/v1", hashlib.sha256).digest()

    def seal(self, text: str, *, org_id: str) -> StoredText:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, text.encode(), org_id.encode())
        return StoredText(plain=None, sealed=_FORMAT_V1 + nonce + sealed)

    def open(self, stored: StoredText, *, org_id: str) -> str | None:
        if stored.sealed is None:
            return stored.plain  # written before the key was set
        blob = stored.sealed
        if blob[:1] != _FORMAT_V1:
            return None
        nonce, sealed = blob[1 : 1 + _NONCE_BYTES], blob[1 + _NONCE_BYTES :]
        try:
            return self._aead.decrypt(nonce, sealed, org_id.encode()).decode()
        except InvalidTag:
            return None

    def digest(self, normalised: str) -> bytes:
        return hmac.new(self._digest_key, normalised.encode(), hashlib.sha256).digest()


def vault_from_key(encoded_key: str | None) -> TextVault:
    """A vault for the configured key (base64 of 32 bytes), or a plain one without."""
    if encoded_key is None or not encoded_key.strip():
        return PlainVault()
    try:
        key = base64.b64decode(encoded_key.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConfigurationError(
            "CAIRN_MEMORY_ENCRYPTION_KEY is not valid base64; give 32 random bytes, base64-encoded"
        ) from exc
    if len(key) != 32:
        raise ConfigurationError(
            f"CAIRN_MEMORY_ENCRYPTION_KEY decodes to {len(key)} bytes; give 32 random bytes, base64-encoded"
        )
    return AesGcmVault(key)
