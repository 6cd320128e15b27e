"""Who is calling: the verified caller (a Principal) and, when an agent acts for
that caller, the acting service with its run id (an Actor).

Tokens are JWTs. Authorization uses only the caller's token; provenance uses only
the actor's. Both are verified here with PyJWT against a public key (or a JWKS
URL in a deployment), so nothing in a request body can name a principal.

Asymmetric keys (EdDSA) rather than a shared secret: services verify with the
public key, and only the issuer (the identity provider, or `make run` in
development) holds the private one.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cairn_libs.errors import ConfigurationError, Unauthenticated

ALGORITHMS = ["EdDSA", "RS256", "ES256"]
DEFAULT_ISSUER = "cairn-dev"
DEFAULT_AUDIENCE = "cairn"
SERVICE_ROLE = "cairn:service"
CALLER_METADATA_KEY = "authorization"
ACTOR_METADATA_KEY = "x-cairn-actor"
VERIFIED_TOKENS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Principal:
    """The verified caller: what may be read or written is decided by this alone."""

    org_id: str
    user_id: str
    roles: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()

    @property
    def principal_keys(self) -> tuple[str, ...]:
        """The keys an ACL entry can match: user:, role:, group:."""
        return (
            (f"user:{self.user_id}",)
            + tuple(f"role:{r}" for r in self.roles)
            + tuple(f"group:{g}" for g in self.groups)
        )

    def has_role(self, role: str) -> bool:
        return role in self.roles


@dataclass(frozen=True, slots=True)
class Actor:
    """The service acting for a caller, with the run it acts in (provenance only)."""

    service: str
    run_id: str
    agent: str = ""


@dataclass(frozen=True, slots=True)
class CallIdentity:
    principal: Principal
    actor: Actor | None = None


@dataclass(slots=True)
class TokenVerifier:
    """Verifies caller and actor tokens with one key (or JWKS) and fixed claims."""

    key: Any
    issuer: str = DEFAULT_ISSUER
    audience: str = DEFAULT_AUDIENCE
    jwks_client: jwt.PyJWKClient | None = None
    leeway_seconds: float = 5.0
    # Claims of tokens already verified, by the exact token text. A caller sends the
    # same token with every call of a run, and a signature check costs more than
    # the rest of a gateway call's own work; a hit still checks expiry.
    _verified: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # A PEM key is parsed once, here, not by PyJWT on every token it checks
        # (a fresh token on every call paid that parse twice per gateway call).
        if isinstance(self.key, str | bytes):
            self.key = _public_key(self.key)

    @classmethod
    def from_env(cls) -> TokenVerifier:
        issuer = os.environ.get("CAIRN_JWT_ISSUER", DEFAULT_ISSUER)
        audience = os.environ.get("CAIRN_JWT_AUDIENCE", DEFAULT_AUDIENCE)
        jwks_url = os.environ.get("CAIRN_JWT_JWKS_URL")
        if jwks_url:
            return cls(
                key=None, issuer=issuer, audience=audience, jwks_client=jwt.PyJWKClient(jwks_url)
            )
        key_file = os.environ.get("CAIRN_JWT_PUBLIC_KEY_FILE")
        if not key_file:
            raise ConfigurationError(
                "no token verification key: set CAIRN_JWT_PUBLIC_KEY_FILE (a PEM public key) "
                "or CAIRN_JWT_JWKS_URL"
            )
        try:
            key = Path(key_file).read_bytes()
        except OSError as exc:
            raise ConfigurationError(
                f"CAIRN_JWT_PUBLIC_KEY_FILE={key_file!r} cannot be read ({exc.strerror}); "
                "point it at a PEM public key"
            ) from None
        try:
            return cls(key=key, issuer=issuer, audience=audience)
        except ValueError as exc:
            raise ConfigurationError(
                f"CAIRN_JWT_PUBLIC_KEY_FILE={key_file!r} is not a PEM public key ({exc}); "
                "point it at one (EdDSA, RSA or EC)"
            ) from None

    def _decode(self, token: str) -> dict[str, Any]:
        claims = self._verified.get(token)
        if claims is not None:
            if time.time() <= claims["exp"] + self.leeway_seconds:
                return claims
            self._verified.pop(token, None)
        # Only claims of the right types are kept (_verify checks them): the cache
        # compares `exp` with the clock on every later use, and a string there once
        # broke every call after the first with INTERNAL.
        claims = self._verify(token)
        if len(self._verified) >= VERIFIED_TOKENS_KEPT:
            self._verified.pop(next(iter(self._verified)), None)  # the oldest
        self._verified[token] = claims
        return claims

    def _verify(self, token: str) -> dict[str, Any]:
        try:
            key = self.key
            if self.jwks_client is not None:
                key = self.jwks_client.get_signing_key_from_jwt(token).key
            # PyJWT checks the signature, issuer and audience; the times are checked
            # below, once every claim is known to have its type (PyJWT reads
            # `"exp": "123"` as a number and `"exp": true` as an expiry in 1970).
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=ALGORITHMS,
                audience=self.audience,
                issuer=self.issuer,
                options={
                    "require": ["exp", "iss", "aud", "sub"],
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
        except jwt.PyJWTError as exc:
            raise Unauthenticated("token invalid") from exc
        except (TypeError, ValueError, OverflowError) as exc:
            # What PyJWT raises for some malformed tokens instead of its own errors.
            raise Unauthenticated("token invalid: a claim has the wrong type") from exc
        check_claim_types(claims)
        now = time.time()
        if now > claims["exp"] + self.leeway_seconds:
            raise Unauthenticated("token expired")
        if now < claims.get("nbf", 0) - self.leeway_seconds:
            raise Unauthenticated("token invalid: not valid yet (nbf)")
        if now < claims.get("iat", 0) - self.leeway_seconds:
            raise Unauthenticated("token invalid: issued in the future (iat)")
        return claims

    def verify_caller(self, token: str) -> Principal:
        claims = self._decode(token)
        org = claims.get("org")
        if not isinstance(org, str) or not org:
            raise Unauthenticated("token invalid: no org claim")
        return Principal(
            org_id=org,
            user_id=str(claims["sub"]),
            roles=_str_tuple(claims.get("roles")),
            groups=_str_tuple(claims.get("groups")),
        )

    def verify_actor(self, token: str) -> Actor:
        claims = self._decode(token)
        if SERVICE_ROLE not in _str_tuple(claims.get("roles")):
            raise Unauthenticated("actor token invalid: not a service credential")
        run_id = claims.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            raise Unauthenticated("actor token invalid: no run_id claim")
        return Actor(service=str(claims["sub"]), run_id=run_id, agent=str(claims.get("agent", "")))


# A NumericDate (RFC 7519) that datetime and a float clock can both hold: from
# 1970 to the end of year 9999.
_LATEST_NUMERIC_DATE = 253_402_300_799
_NUMERIC_DATE_CLAIMS = ("exp", "iat", "nbf")
_STRING_CLAIMS = ("iss", "sub", "org", "run_id", "agent", "jti")
_STRING_LIST_CLAIMS = ("roles", "groups")


def check_claim_types(claims: dict[str, Any]) -> None:
    """Raise Unauthenticated unless every claim cairn reads has the type it reads.

    Signed by a trusted key is not the same as well-formed: an issuer's bug (or a
    test) can sign `"exp": "tomorrow"` or `"roles": "admin"`. Such a token is
    refused on its first use and every later one, before any work."""
    for name in _NUMERIC_DATE_CLAIMS:
        if name not in claims and name != "exp":
            continue
        value = claims.get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 <= value <= _LATEST_NUMERIC_DATE
        ):
            raise Unauthenticated(
                f"token invalid: claim {name!r} must be a NumericDate (seconds since 1970)"
            )
    for name in _STRING_CLAIMS:
        if name in claims and not isinstance(claims[name], str):
            raise Unauthenticated(f"token invalid: claim {name!r} must be a string")
    if not claims.get("sub"):
        raise Unauthenticated("token invalid: claim 'sub' is empty")
    audience = claims.get("aud")
    if not (
        isinstance(audience, str)
        or (isinstance(audience, list) and all(isinstance(a, str) for a in audience))
    ):
        raise Unauthenticated("token invalid: claim 'aud' must be a string or a list of strings")
    for name in _STRING_LIST_CLAIMS:
        value = claims.get(name, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise Unauthenticated(f"token invalid: claim {name!r} must be a list of strings")
    # Org, user, roles and run become keys of every row a service writes; text
    # PostgreSQL cannot keep would fail there, far from the cause.
    for name in (*_STRING_CLAIMS, *_STRING_LIST_CLAIMS):
        value = claims.get(name)
        texts = value if isinstance(value, list) else [value]
        if any(isinstance(t, str) and "\x00" in t for t in texts):
            raise Unauthenticated(f"token invalid: claim {name!r} contains U+0000")


def _str_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, list | tuple):
        return tuple(str(v) for v in value)
    return ()


@dataclass(slots=True)
class TokenIssuer:
    """Mints tokens. Used by `make run` for demo callers and by the orchestrator for
    its own per-run service credential; a deployment's callers get theirs from the
    company's identity provider."""

    private_key: Any
    issuer: str = DEFAULT_ISSUER
    audience: str = DEFAULT_AUDIENCE
    algorithm: str = "EdDSA"
    key_id: str = field(default="cairn-dev")

    @classmethod
    def from_file(
        cls, path: str | Path, *, issuer: str = DEFAULT_ISSUER, audience: str = DEFAULT_AUDIENCE
    ) -> TokenIssuer:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        return cls(private_key=key, issuer=issuer, audience=audience)

    def caller_token(
        self,
        *,
        org_id: str,
        user_id: str,
        roles: Sequence[str] = (),
        groups: Sequence[str] = (),
        ttl_seconds: float = 3600,
        now: float | None = None,
    ) -> str:
        issued = time.time() if now is None else now
        claims = {
            "iss": self.issuer,
            "aud": self.audience,
            "sub": user_id,
            "org": org_id,
            "roles": list(roles),
            "groups": list(groups),
            "iat": int(issued),
            "exp": int(issued + ttl_seconds),
            "jti": uuid.uuid4().hex,
        }
        return jwt.encode(
            claims, self.private_key, algorithm=self.algorithm, headers={"kid": self.key_id}
        )

    def actor_token(
        self, *, service: str, run_id: str, agent: str = "", ttl_seconds: float = 3600
    ) -> str:
        issued = time.time()
        claims = {
            "iss": self.issuer,
            "aud": self.audience,
            "sub": service,
            "roles": [SERVICE_ROLE],
            "run_id": run_id,
            "agent": agent,
            "iat": int(issued),
            "exp": int(issued + ttl_seconds),
        }
        return jwt.encode(
            claims, self.private_key, algorithm=self.algorithm, headers={"kid": self.key_id}
        )


def generate_dev_keypair(directory: Path) -> tuple[Path, Path]:
    """Write an Ed25519 key pair for development, once; later calls reuse it."""
    directory.mkdir(parents=True, exist_ok=True)
    private_path = directory / "dev_signing_key.pem"
    public_path = directory / "dev_signing_key.pub.pem"
    if not private_path.exists():
        key = Ed25519PrivateKey.generate()
        private_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        private_path.chmod(0o600)
        public_path.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    return private_path, public_path


def _public_key(pem: str | bytes) -> Any:
    """A PEM public key as the key object PyJWT verifies with; ValueError if it is not one."""
    return serialization.load_pem_public_key(pem.encode() if isinstance(pem, str) else pem)
