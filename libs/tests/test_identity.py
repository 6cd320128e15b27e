from __future__ import annotations

import time
from pathlib import Path

import pytest

from cairn_libs.errors import Unauthenticated
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

    verifier.verify_caller(token)  # PyJWT's own clock still says valid

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
