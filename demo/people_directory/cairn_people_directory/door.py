"""Who is calling, decided by the directory itself from the tokens it is sent.

`authorization` must be a person's token (audience `cairn`, with an org): every
tool runs as that person. Beside it cairn sends its per-run actor token for the
audience `cairn-tools` (named `TOOL_AUDIENCE` here and in cairn's orchestrator;
no cairn service accepts it), which the directory reads for provenance only: the
run a request was made in. Listing the tools needs no person, so a cairn-tools
service token may list; it can never run a tool.
"""

from __future__ import annotations

from dataclasses import dataclass

from cairn_libs.errors import Unauthenticated
from cairn_libs.identity import Actor, Principal, TokenVerifier

TOOL_AUDIENCE = "cairn-tools"


def bearer(value: str) -> str:
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


@dataclass(frozen=True, slots=True)
class Door:
    people: TokenVerifier
    cairn_tools: TokenVerifier

    @classmethod
    def from_env(cls) -> Door:
        people = TokenVerifier.from_env()
        # A verifier of its own (not a copy): the verified-token cache must not be shared.
        tools = TokenVerifier(
            key=people.key,
            issuer=people.issuer,
            audience=TOOL_AUDIENCE,
            jwks_client=people.jwks_client,
        )
        return cls(people=people, cairn_tools=tools)

    def person(self, token: str) -> Principal:
        if not token:
            raise Unauthenticated("send the person's token as 'Bearer <token>'")
        return self.people.verify_caller(token)

    def provenance(self, token: str) -> Actor | None:
        """The run the call was made in, if cairn said so; a bad actor token is refused."""
        return self.cairn_tools.verify_actor(token) if token else None

    def may_list(self, token: str) -> bool:
        for check in (self.people.verify_caller, self.cairn_tools.verify_actor):
            try:
                check(token)
            except Unauthenticated:
                continue
            return True
        return False
