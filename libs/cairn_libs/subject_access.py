"""Who may see or erase everything held about a subject (subject access, I9).

One rule for every service that holds records about people: an org admin or privacy
officer, or the person themselves for their own USER subject. The memory service
applies it to Held and Forget; the orchestrator to ForgetCopies, so nobody erases
through the orchestrator what they could not erase with Forget.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

SUBJECT_ACCESS_ROLES: Final = frozenset({"admin", "privacy_officer"})


def may_handle_subject_records(
    subject_kind: str, subject_id: str, *, user_id: str, roles: Iterable[str]
) -> bool:
    """`subject_kind` is the kind's name (`USER`, `CANDIDATE`, ...)."""
    if SUBJECT_ACCESS_ROLES.intersection(roles):
        return True
    return subject_kind == "USER" and bool(subject_id) and subject_id == user_id
