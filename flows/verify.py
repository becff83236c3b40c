"""The verification flow alone: re-read a store and compare every committed chunk with its
checksums (a nightly audit of a store, or after copying it); with ``repair``, drop the commit
records of corrupt chunks so that the next extraction redoes exactly those.

It writes nothing to the store unless ``repair`` drops records (which the store's run records
keep); the result is the flow run's state (Failed when anything does not verify) and its
``hsx-verify`` artifact."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.verify import verify_task


class StoreNotVerifiedError(RuntimeError):
    """The store has missing or corrupt chunks (the artifact lists them)."""


@flow(name="hsx-verify", persist_result=False)
def verify_flow(store: str, repair: bool = False) -> dict[str, Any]:
    """Verify ``store`` (any fsspec URL); ``repair`` drops the commit records of corrupt chunks."""
    result = verify_task(store, repair=repair)
    if not result["ok"]:
        problems = "".join(f"\n  {p}" for p in result["problems"][:20])
        raise StoreNotVerifiedError(
            f"store {store}: expected every planned chunk committed and verified, found "
            f"{result['summary']}{problems}"
            + (f"\n  repair dropped chunks {result['repaired']}" if result["repaired"] else "")
        )
    return result
