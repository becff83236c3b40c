"""What one Prefect server takes: requests per second and latency under the many-node call mix.

Issue 29 asks for the simulation's API load (bench/simulate_nodes.py: mean and peak requests per
second for 64 nodes) against what one Prefect server was measured to take. This bench starts
the server as a team does (infra/prefect-up.sh, PostgreSQL or SQLite, through the tests' stack
helper), makes ``--runs`` flow runs of the ``extract-item`` deployment, and drives it with the
request mix the three-node test counted in the server's access log (each child reading its own
run, the workers' polls for scheduled runs, deployment reads, log batches, the parent's filtered
reads, state changes), from ``C`` concurrent clients that each send their next request once the
last one answered (closed loop), for ``--seconds`` per step, ``C`` rising per ``--clients``.
It prints, per step, requests per second, latency p50/p99 and errors; the capacity is the
highest rate whose p99 stays under ``--p99-limit-ms``. The load generator shares this machine's
cores with the server (and PostgreSQL): the figures are a floor for a server on its own host.

    .venv/bin/python bench/bench_prefect_server.py [--database postgres] [--clients 1,4,16,64]
        [--seconds 20] [--write bench/measured/prefect-server-capacity.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Requests of the three-node test's first run, by kind (README: 658 in all; these six are the
# ones it names, 405 of them): the weights of the mix.
MIX = {
    "read_own_run": 130,  # GET /flow_runs/{id}: each child's state watch
    "poll_scheduled": 88,  # POST /work_pools/{pool}/get_scheduled_flow_runs: the workers
    "read_deployment": 51,  # GET /deployments/{id}
    "write_logs": 50,  # POST /logs/: a batch of run logs
    "filter_runs": 46,  # POST /flow_runs/filter: the parent's one read of its children
    "set_state": 40,  # POST /flow_runs/{id}/set_state: a state change (a database write)
}


@dataclass
class Step:
    clients: int
    seconds: float
    requests: int
    errors: int
    per_s: float
    p50_ms: float
    p99_ms: float
    by_kind: dict[str, int]


class Load:
    """The ids the mix needs, made once: a deployment, its pool, ``runs`` flow runs Running."""

    def __init__(self, api: str, runs: int) -> None:
        self.api = api
        with httpx.Client(base_url=api, timeout=30) as http:
            deployment = http.get("/deployments/name/hsx-extract-item/extract-item")
            deployment.raise_for_status()
            self.deployment_id = deployment.json()["id"]
            self.pool = deployment.json()["work_pool_name"]
            self.run_ids = []
            for n in range(runs):
                body = {"name": f"bench-{n}", "state": {"type": "RUNNING"}}
                path = f"/deployments/{self.deployment_id}/create_flow_run"
                for wait_s in (0.5, 1, 2, 4, 8, 0):  # 503 while SQLite's writer is busy
                    made = http.post(path, json=body)
                    if made.status_code != 503 or not wait_s:
                        break
                    time.sleep(wait_s)
                made.raise_for_status()
                self.run_ids.append(made.json()["id"])

    async def send(self, http: httpx.AsyncClient, kind: str, rng: random.Random) -> httpx.Response:
        run_id = rng.choice(self.run_ids)
        if kind == "read_own_run":
            return await http.get(f"/flow_runs/{run_id}")
        if kind == "poll_scheduled":
            return await http.post(f"/work_pools/{self.pool}/get_scheduled_flow_runs", json={})
        if kind == "read_deployment":
            return await http.get(f"/deployments/{self.deployment_id}")
        if kind == "write_logs":
            now = datetime.now(UTC).isoformat()
            batch = [
                {
                    "name": "prefect.flow_runs",
                    "level": 20,
                    "message": f"chunk {i} committed",
                    "timestamp": now,
                    "flow_run_id": run_id,
                }
                for i in range(5)
            ]
            return await http.post("/logs/", json=batch)
        if kind == "filter_runs":
            body = {
                "flow_runs": {"id": {"any_": rng.sample(self.run_ids, min(8, len(self.run_ids)))}}
            }
            return await http.post("/flow_runs/filter", json=body)
        if kind == "set_state":
            body = {"state": {"type": "RUNNING", "name": "Running"}, "force": True}
            return await http.post(f"/flow_runs/{run_id}/set_state", json=body)
        raise ValueError(f"expected one of {sorted(MIX)}, found {kind!r}")


async def _client(
    load: Load, until: float, seed: int, latencies: list[float], tally: Counter[str]
) -> None:
    rng = random.Random(seed)
    kinds, weights = list(MIX), list(MIX.values())
    async with httpx.AsyncClient(base_url=load.api, timeout=60) as http:
        while time.monotonic() < until:
            kind = rng.choices(kinds, weights)[0]
            sent = time.monotonic()
            try:
                answer = await load.send(http, kind, rng)
                ok = answer.status_code < 400
            except httpx.HTTPError:
                ok = False
            latencies.append(time.monotonic() - sent)
            tally[kind if ok else "error"] += 1


def run_step(load: Load, clients: int, seconds: float) -> Step:
    latencies: list[float] = []
    tally: Counter[str] = Counter()

    async def all_clients() -> None:
        until = time.monotonic() + seconds
        await asyncio.gather(*(_client(load, until, n, latencies, tally) for n in range(clients)))

    started = time.monotonic()
    asyncio.run(all_clients())
    elapsed = time.monotonic() - started
    ordered = sorted(latencies)
    return Step(
        clients=clients,
        seconds=round(elapsed, 2),
        requests=len(ordered),
        errors=tally["error"],
        per_s=round(len(ordered) / elapsed, 1),
        p50_ms=round(statistics.median(ordered) * 1000, 1),
        p99_ms=round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 1),
        by_kind=dict(tally),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--clients", default="1,4,16,64", help="concurrent clients per step")
    parser.add_argument("--seconds", type=float, default=20.0, help="per step")
    parser.add_argument("--runs", type=int, default=64, help="flow runs the mix reads and writes")
    parser.add_argument("--p99-limit-ms", type=float, default=1000.0)
    parser.add_argument("--write", type=Path, help="the result as JSON (bench/measured/...)")
    args = parser.parse_args(argv)
    from tests.prefect_stack import running_stack

    steps = [int(c) for c in args.clients.split(",")]
    with running_stack(args.database, workers=()) as stack:
        load = Load(stack.api, args.runs)
        run_step(load, 1, min(3.0, args.seconds))  # untimed: connections, caches, plans
        results = []
        for clients in steps:
            step = run_step(load, clients, args.seconds)
            results.append(step)
            print(
                f"clients {clients:4d}: {step.per_s:8.1f} requests/s  p50 {step.p50_ms:7.1f} ms  "
                f"p99 {step.p99_ms:8.1f} ms  errors {step.errors}  ({step.requests} in {step.seconds} s)",
                flush=True,
            )
    within = [s for s in results if s.p99_ms <= args.p99_limit_ms and not s.errors]
    capacity = max((s.per_s for s in within), default=0.0)
    print(
        f"PREFECT SERVER ({args.database}, {os.cpu_count()} cores shared with the load): "
        f"{capacity:.0f} requests/s with p99 <= {args.p99_limit_ms:g} ms; "
        f"best {max(s.per_s for s in results):.0f}/s"
    )
    if args.write:
        record = {
            "database": args.database,
            "cores": os.cpu_count(),
            "p99_limit_ms": args.p99_limit_ms,
            "capacity_per_s": capacity,
            "mix": MIX,
            "steps": [asdict(s) for s in results],
            "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        args.write.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
