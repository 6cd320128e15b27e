from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jwt
import pytest

from cairn_libs.errors import ConfigurationError, Unauthenticated
from cairn_libs.identity import TokenIssuer, TokenVerifier, generate_dev_keypair


@pytest.fixture(scope="module")
def verifier(dev_keys: tuple[Path, Path]) -> TokenVerifier:
    return TokenVerifier(key=dev_keys[1].read_bytes())


def test_a_valid_caller_token_becomes_a_principal(
    issuer: TokenIssuer, verifier: TokenVerifier
) -> None:
    token = issuer.caller_token(org_id="acme", user_id="ana", roles=["hr"], groups=["berlin"])
    principal = verifier.verify_caller(token)
    assert (principal.org_id, principal.user_id) == ("acme", "ana")
    assert principal.principal_keys == ("user:ana", "role:hr", "group:berlin")


def test_a_token_signed_with_another_key_is_refused(
    tmp_path: Path, verifier: TokenVerifier
) -> None:
    other = TokenIssuer.from_file(generate_dev_keypair(tmp_path)[0])
    with pytest.raises(Unauthenticated, match="token invalid"):
        verifier.verify_caller(other.caller_token(org_id="acme", user_id="ana"))


def test_an_expired_token_is_refused(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    token = issuer.caller_token(
        org_id="acme", user_id="ana", now=time.time() - 7200, ttl_seconds=60
    )
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.verify_caller(token)


def test_a_caller_token_without_org_is_refused(
    issuer: TokenIssuer, verifier: TokenVerifier
) -> None:
    with pytest.raises(Unauthenticated, match="org"):
        verifier.verify_caller(issuer.caller_token(org_id="", user_id="ana"))


def test_a_caller_token_cannot_pass_as_an_actor(
    issuer: TokenIssuer, verifier: TokenVerifier
) -> None:
    with pytest.raises(Unauthenticated, match="service credential"):
        verifier.verify_actor(issuer.caller_token(org_id="acme", user_id="ana", roles=["admin"]))


def test_an_actor_token_carries_its_run(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    actor = verifier.verify_actor(
        issuer.actor_token(service="orchestrator", run_id="run-1", agent="handbook")
    )
    assert (actor.service, actor.run_id, actor.agent) == ("orchestrator", "run-1", "handbook")


def test_a_verified_token_is_checked_again_once_past_its_expiry(
    issuer: TokenIssuer, dev_keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier = TokenVerifier(key=dev_keys[1].read_bytes(), leeway_seconds=0)
    token = issuer.caller_token(org_id="acme", user_id="ana", ttl_seconds=60)
    checked: list[str] = []
    verify = TokenVerifier._verify

    def counting(self: TokenVerifier, raw: str) -> dict[str, object]:
        checked.append(raw)
        return verify(self, raw)

    monkeypatch.setattr(TokenVerifier, "_verify", counting)
    verifier.verify_caller(token)
    verifier.verify_caller(token)
    assert len(checked) == 1  # the second call was answered from what was verified
    expired_at = time.time() + 61
    monkeypatch.setattr(time, "time", lambda: expired_at)

    with pytest.raises(Unauthenticated, match="expired"):
        verifier.verify_caller(token)

    assert len(checked) == 2


def test_a_tampered_copy_of_a_verified_token_is_refused(
    issuer: TokenIssuer, verifier: TokenVerifier
) -> None:
    token = issuer.caller_token(org_id="acme", user_id="ana")
    verifier.verify_caller(token)
    header, payload, signature = token.split(".")
    forged = ".".join(
        [header, payload, signature[:-4] + ("AAAA" if signature[-4:] != "AAAA" else "BBBB")]
    )

    with pytest.raises(Unauthenticated, match="token invalid"):
        verifier.verify_caller(forged)


def _signed(issuer: TokenIssuer, **claims: object) -> str:
    """A token signed by the trusted key with exactly these claims over the usual ones."""
    now = int(time.time())
    body: dict[str, object] = {
        "iss": issuer.issuer,
        "aud": issuer.audience,
        "sub": "ana",
        "org": "acme",
        "roles": [],
        "iat": now,
        "exp": now + 3600,
    }
    body.update(claims)
    # PyJWS signs any payload; jwt.encode would refuse some of these claims itself.
    payload = json.dumps(body).encode()
    return jwt.PyJWS().encode(payload, issuer.private_key, algorithm=issuer.algorithm)


MALFORMED_CLAIMS = {
    "exp as a string": {"exp": str(int(time.time()) + 3600)},
    "exp past year 9999": {"exp": 10**400},
    "exp infinite": {"exp": math.inf},
    "nbf as a string": {"nbf": "soon"},
    "exp as a bool": {"exp": True},
    "iat as a string": {"iat": "now"},
    "iss as a number": {"iss": 5},
    "sub empty": {"sub": ""},
    "org as a list": {"org": ["acme"]},
    "roles as a string": {"roles": "admin"},
    "roles with numbers": {"roles": [1, 2]},
    "groups as an object": {"groups": {"staff": True}},
    "aud as a list with a number": {"aud": ["cairn", 5]},
    "org with U+0000": {"org": "acme\x00"},
    "sub with U+0000": {"sub": "tom\x00"},
    "a role with U+0000": {"roles": ["admin\x00"]},
}


@pytest.mark.parametrize("claims", MALFORMED_CLAIMS.values(), ids=list(MALFORMED_CLAIMS))
def test_a_signed_token_with_a_malformed_claim_is_unauthenticated_on_every_use(
    issuer: TokenIssuer, dev_keys: tuple[Path, Path], claims: dict[str, object]
) -> None:
    verifier = TokenVerifier(key=dev_keys[1].read_bytes())
    token = _signed(issuer, **claims)

    for _ in range(3):
        with pytest.raises(Unauthenticated, match="token invalid"):
            verifier.verify_caller(token)


def test_a_signed_actor_token_with_a_malformed_run_id_is_unauthenticated(
    issuer: TokenIssuer, verifier: TokenVerifier
) -> None:
    token = _signed(issuer, roles=["cairn:service"], run_id=["run-1"])

    with pytest.raises(Unauthenticated, match="token invalid"):
        verifier.verify_actor(token)


def test_a_missing_public_key_file_is_a_configuration_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nowhere.pem"
    monkeypatch.delenv("CAIRN_JWT_JWKS_URL", raising=False)
    monkeypatch.setenv("CAIRN_JWT_PUBLIC_KEY_FILE", str(missing))

    with pytest.raises(ConfigurationError, match="nowhere.pem"):
        TokenVerifier.from_env()


def test_a_key_file_that_is_not_a_pem_public_key_stops_start_up_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "public.pem"
    bad.write_text("not a key\n")
    monkeypatch.setenv("CAIRN_JWT_PUBLIC_KEY_FILE", str(bad))
    monkeypatch.delenv("CAIRN_JWT_JWKS_URL", raising=False)
    with pytest.raises(ConfigurationError) as refused:
        TokenVerifier.from_env()
    assert str(bad) in str(refused.value) and "PEM public key" in str(refused.value)


def test_the_verifier_parses_its_pem_key_once_not_on_every_token(
    dev_keys: tuple[Path, Path],
) -> None:
    verifier = TokenVerifier(key=dev_keys[1].read_bytes())
    assert not isinstance(verifier.key, bytes | str)
    issuer = TokenIssuer.from_file(dev_keys[0])
    token = issuer.caller_token(org_id="acme", user_id="maria", roles=["manager"])
    assert verifier.verify_caller(token).user_id == "maria"
