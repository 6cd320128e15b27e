"""The ACL predicate, defined once and compiled to both stores (DESIGN I2, I5).

A document's ACL is stored as one array of principal keys (`user:alice`,
`role:hr`, `group:berlin`). The caller may read a chunk when the chunk is in the
caller's org, in one of the requested sources, and its key array overlaps the
caller's keys. The same three conditions are compiled to a SQL fragment and to a
Qdrant filter, so the two stores cannot disagree about what a caller may see.

They can also be folded into one condition: a point carries the reach keys of its
document (one per ACL key: org, source and key together) and a caller asks for the
reach keys of its predicate (one per source and principal key). The two sets meet
exactly when all three conditions hold, and one payload index answers it, where
three conditions cost an engine a lookup per candidate for the two that match
nearly everything (org and source).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from qdrant_client.http import models as qm

from cairn_libs.errors import InvalidInput
from cairn_libs.identity import Principal

ORG_FIELD = "org_id"
SOURCE_FIELD = "source"
ACL_FIELD = "acl"
REACH_FIELD = "reach"


def reach_key(org_id: str, source: str, key: str) -> str:
    """One (org, source, ACL key) as one string; JSON, so no value can forge another."""
    return json.dumps([org_id, source, key], separators=(",", ":"))


def document_reach(org_id: str, source: str, acl: Sequence[str]) -> list[str]:
    """The reach keys a document's points carry."""
    return sorted({reach_key(org_id, source, key) for key in acl})


def acl_keys(
    *, users: Sequence[str] = (), roles: Sequence[str] = (), groups: Sequence[str] = ()
) -> list[str]:
    """A document ACL as the key array both stores hold."""
    return sorted(
        {f"user:{u}" for u in users if u}
        | {f"role:{r}" for r in roles if r}
        | {f"group:{g}" for g in groups if g}
    )


@dataclass(frozen=True, slots=True)
class AclPredicate:
    org_id: str
    principal_keys: tuple[str, ...]
    sources: tuple[str, ...]

    @classmethod
    def for_caller(cls, principal: Principal, sources: Sequence[str]) -> AclPredicate:
        if not principal.org_id:
            raise InvalidInput("a predicate needs an org; the caller's token carried none")
        cleaned = tuple(sorted({s for s in sources if s}))
        if not cleaned:
            # I7: an empty list means no knowledge; it is never widened to "all".
            raise InvalidInput("sources must name at least one source; an empty list reads nothing")
        return cls(
            org_id=principal.org_id, principal_keys=principal.principal_keys, sources=cleaned
        )

    def to_sql(self, *, alias: str, first_param: int) -> tuple[str, list[object]]:
        """A WHERE fragment over `alias` using numbered parameters from `first_param`."""
        p = first_param
        clause = (
            f"{alias}.org_id = ${p} AND {alias}.source = ANY(${p + 1}::text[]) "
            f"AND {alias}.acl && ${p + 2}::text[]"
        )
        return clause, [self.org_id, list(self.sources), list(self.principal_keys)]

    def to_qdrant_filter(self) -> qm.Filter:
        return qm.Filter(
            must=[
                qm.FieldCondition(key=ORG_FIELD, match=qm.MatchValue(value=self.org_id)),
                qm.FieldCondition(key=SOURCE_FIELD, match=qm.MatchAny(any=list(self.sources))),
                qm.FieldCondition(key=ACL_FIELD, match=qm.MatchAny(any=list(self.principal_keys))),
            ]
        )

    def reach(self) -> list[str]:
        """The reach keys this caller may meet: one per source and principal key."""
        return sorted(
            {reach_key(self.org_id, s, k) for s in self.sources for k in self.principal_keys}
        )

    def to_qdrant_reach_filter(self) -> qm.Filter:
        """The same predicate as one condition on REACH_FIELD (see the module doc)."""
        return qm.Filter(
            must=[qm.FieldCondition(key=REACH_FIELD, match=qm.MatchAny(any=self.reach()))]
        )

    def admits(self, *, org_id: str, source: str, acl: Sequence[str]) -> bool:
        """The same predicate in plain Python, for tests and in-memory checks."""
        return (
            org_id == self.org_id
            and source in self.sources
            and bool(set(acl) & set(self.principal_keys))
        )
