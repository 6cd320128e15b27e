"""Runs, steps and confirmations in PostgreSQL (schema `orchestrator`): the schema's
name and migrations, and the one store app.py wires in.

Every statement about a run or a confirmation narrows by org_id (I5); the two
maintenance sweeps (runs whose lease ran out, confirmations past their expiry)
scan across orgs by design and then act on each row by its own org and id.

Ownership. A run is driven by the one orchestrator process holding its lease
(`lease_owner`, `lease_until`, renewed as it records steps and by a heartbeat).
Every write a driver makes is fenced on that ownership: a process whose lease ran
out and whose run was taken over gets RunTakenOver and writes nothing more.

Each concern is its own class in pg/ (runs and steps, confirmations, cancels,
leases and sweeps, copies), over one base (pg/base.py: the pool, the lease owner,
error translation, the fence). They share one lease owner, because the ports
overlap: RunStore asks for conversation_subjects (copies), ConfirmationStore for
cancels and leases. So `PostgresRunStore` is all of them on one pool, and app.py
hands that one object to every port.
"""

from __future__ import annotations

from pathlib import Path

from cairn_libs.db import Migration, load_migrations
from cairn_orchestrator.pg.cancels import PgCancels
from cairn_orchestrator.pg.confirmations import PgConfirmations
from cairn_orchestrator.pg.copies import PgCopies
from cairn_orchestrator.pg.leases import PgLeases
from cairn_orchestrator.pg.runs import PgRuns

SCHEMA = "orchestrator"
MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def migrations() -> list[Migration]:
    return load_migrations(MIGRATIONS_DIR)


class PostgresRunStore(PgRuns, PgCopies, PgConfirmations, PgCancels, PgLeases):
    """ports.RunStore, ports.ConfirmationStore and ports.CopyStore, one lease owner."""
