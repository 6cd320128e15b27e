from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cairn_libs.acl import AclPredicate, acl_keys, document_reach
from cairn_libs.errors import InvalidInput
from cairn_libs.identity import Principal

names = st.sampled_from(["ana", "bo", "cy", "hr", "eng", "berlin", "paris"])


def test_empty_sources_are_refused_not_widened() -> None:
    with pytest.raises(InvalidInput, match="sources"):
        AclPredicate.for_caller(Principal(org_id="acme", user_id="ana"), [])


def test_sql_fragment_binds_org_sources_and_keys_as_parameters() -> None:
    predicate = AclPredicate.for_caller(
        Principal(org_id="acme", user_id="ana", roles=("hr",)), ["handbook", "handbook"]
    )
    clause, params = predicate.to_sql(alias="c", first_param=3)
    assert clause == "c.org_id = $3 AND c.source = ANY($4::text[]) AND c.acl && $5::text[]"
    assert params == ["acme", ["handbook"], ["user:ana", "role:hr"]]


def test_qdrant_filter_requires_org_source_and_an_acl_overlap() -> None:
    predicate = AclPredicate.for_caller(Principal(org_id="acme", user_id="ana"), ["handbook"])
    conditions = {c.key: c.match for c in predicate.to_qdrant_filter().must}  # type: ignore[union-attr]
    assert conditions["org_id"].value == "acme"  # type: ignore[union-attr]
    assert conditions["source"].any == ["handbook"]  # type: ignore[union-attr]
    assert conditions["acl"].any == ["user:ana"]  # type: ignore[union-attr]


@given(
    users=st.lists(names, max_size=3),
    roles=st.lists(names, max_size=3),
    caller_roles=st.lists(names, max_size=3),
    caller=names,
)
def test_a_caller_is_admitted_exactly_when_named_by_user_or_role(
    users: list[str], roles: list[str], caller_roles: list[str], caller: str
) -> None:
    predicate = AclPredicate.for_caller(
        Principal(org_id="acme", user_id=caller, roles=tuple(caller_roles)), ["s"]
    )
    keys = acl_keys(users=users, roles=roles)
    expected = caller in users or bool(set(caller_roles) & set(roles))
    assert predicate.admits(org_id="acme", source="s", acl=keys) is expected
    assert predicate.admits(org_id="other", source="s", acl=keys) is False


tricky = st.sampled_from(["acme", "ac", "me", 'a"c', "a,b", "s", "s\x1fx", "", "user:ana"])


@given(
    doc_org=tricky,
    doc_source=tricky,
    doc_groups=st.lists(tricky, max_size=3),
    caller_org=tricky.filter(bool),
    caller_sources=st.lists(tricky.filter(bool), min_size=1, max_size=3),
    caller_groups=st.lists(tricky, max_size=3),
)
def test_reach_keys_meet_exactly_when_the_three_conditions_hold(
    doc_org: str,
    doc_source: str,
    doc_groups: list[str],
    caller_org: str,
    caller_sources: list[str],
    caller_groups: list[str],
) -> None:
    predicate = AclPredicate.for_caller(
        Principal(org_id=caller_org, user_id="ana", groups=tuple(caller_groups)), caller_sources
    )
    keys = acl_keys(groups=doc_groups)
    meets = bool(set(document_reach(doc_org, doc_source, keys)) & set(predicate.reach()))
    assert meets is predicate.admits(org_id=doc_org, source=doc_source, acl=keys)
    (condition,) = predicate.to_qdrant_reach_filter().must  # type: ignore[misc]
    assert condition.key == "reach"  # type: ignore[union-attr]
    assert condition.match.any == predicate.reach()  # type: ignore[union-attr]
