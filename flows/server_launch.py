"""``prefect server start`` as infra/prefect-up.sh runs it, with one change for SQLite: every
transaction the server begins is ``BEGIN IMMEDIATE`` (it takes SQLite's write lock at once,
waiting up to the busy timeout for it).

Why: Prefect 3.7.7 begins its transactions DEFERRED unless they lock rows. A deferred
transaction that reads, then writes, cannot wait for the lock in WAL mode: when another
connection wrote since its read, SQLite answers "database is locked" at once, whatever the busy
timeout (Prefect's own comment in its SQLite setup says so, and that IMMEDIATE resolves it).
The worker's polls (``mark_deployments_ready``) and heartbeats do exactly that beside a flow
run's writes: 170 ERROR tracebacks in 17 minutes (issue 44), 266 in 11 minutes of a test stack,
each retried. With IMMEDIATE they wait their turn (SQLite takes one writer at a time either
way). PostgreSQL is unchanged.

Run: ``python -m flows.server_launch server start --host 127.0.0.1 --port 4200``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any


def immediate_sqlite_transactions() -> bool:
    """Patch the installed Prefect's SQLite configuration as the module says; False (Prefect
    unchanged) where it has no ``begin_transaction`` with ``with_for_update`` to rely on."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    original = getattr(AioSqliteConfiguration, "begin_transaction", None)
    if original is None:
        return False
    if getattr(original, "_hsx_patched", False):
        return True

    @asynccontextmanager
    async def begin_transaction(
        self: Any, session: Any, with_for_update: bool = False
    ) -> AsyncIterator[Any]:
        # with_for_update=True is what makes Prefect's own code begin IMMEDIATE.
        async with original(self, session, with_for_update=True) as transaction:
            yield transaction

    begin_transaction._hsx_patched = True  # type: ignore[attr-defined]
    AioSqliteConfiguration.begin_transaction = begin_transaction  # type: ignore[method-assign]
    return True


def main() -> None:
    if not immediate_sqlite_transactions():
        print(
            "hsx: this Prefect's SQLite configuration has no begin_transaction; unpatched",
            file=sys.stderr,
        )
    from prefect.cli import app

    sys.argv[0] = "prefect"
    sys.exit(app())


if __name__ == "__main__":
    main()
