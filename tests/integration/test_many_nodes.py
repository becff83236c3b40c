"""Many nodes on one machine, as issue 29 sets them up: three "nodes" on 127.0.0.1, each its own
`hsx serve` on the tiny Llama and its own Prefect worker (pool hsx-gpu, its own PREFECT_HOME,
HSX_ENGINE__URL = its server); one Prefect server with the zombie automation; a parent worker
on pool hsx-cpu; moto's S3 server behind the counting proxy as the one store. The parent
(`extract-fanout`) plans once and starts one `extract-item` run per work item; every chunk is
committed once; then one node is killed with SIGKILL mid-item, its run is declared Crashed by
the automation, and the parent resubmits only its uncommitted chunks to a live node."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
import pytest

from hsx.store.zarr_store import ExtractionStore
from tests.api_log import ApiLogTally
from tests.cli import hsx
from tests.conftest import REPO_ROOT
from tests.fault_proxy import FaultProxy
from tests.prefect_stack import Stack, running_stack
from tests.servers import ServeProcess, moto_s3, s3_config

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]

BUCKET = "hsx-nodes"
NODES = 3
HEARTBEAT_S = 30  # Prefect's minimum
ZOMBIE_WINDOW_S = 60  # two heartbeats: a run silent this long is marked Crashed


def _run_settings(store: str, samples: int, item_minutes: float) -> dict[str, Any]:
    """A run's partial parameters: chunks of >= 1024 tokens, items of ``item_minutes`` at 1000
    tokens/s (0.001: one chunk each; 0.05: about three), the parent polling every second."""
    return {
        "settings": {
            "store": store,
            "data": {"max_samples": samples},
            "layout": {"rows_per_chunk": 256, "min_work_chunk_tokens": 1024},
            "run": {"preflight": False, "retries": 1, "retry_delay_seconds": 0},
        },
        "fanout": {
            "item_minutes": item_minutes,
            "node_tokens_per_s": 1000,
            "poll_s": 1,
            "max_resubmits": 2,
        },
    }


def _children(stack: Stack, parent: str) -> list[dict[str, Any]]:
    runs = stack.call(
        "POST",
        "/flow_runs/filter",
        json={"flow_runs": {"parent_flow_run_id": {"any_": [parent]}}, "limit": 200},
    ).json()
    return list(runs)


def _first_log(stack: Stack, run_id: str, pattern: str) -> str | None:
    logs = stack.call(
        "POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
    ).json()
    return next((log["message"] for log in logs if re.search(pattern, log["message"])), None)


def _commit_puts(proxy: FaultProxy, store_name: str) -> Counter[int]:
    """PUTs of each chunk's commit record seen at the proxy, by chunk index."""
    counts: Counter[int] = Counter()
    for (method, path), count in proxy.paths.items():
        found = re.search(rf"/{store_name}/commits/chunk-(\d+)\.json$", path)
        if method == "PUT" and found:
            counts[int(found.group(1))] += count
    return counts


def _per_node(store: ExtractionStore) -> dict[str, dict[str, float]]:
    """Chunks, tokens and tokens/s (over each node's first start to last commit) per server."""
    by_server: dict[str, list[Any]] = defaultdict(list)
    for record in store.committed_chunks().values():
        by_server[record.extra["engine_server"]["url"]].append(record)
    figures = {}
    for url, records in sorted(by_server.items()):
        start = min(datetime.fromisoformat(r.started_at) for r in records)
        end = max(datetime.fromisoformat(r.finished_at) for r in records)
        tokens = sum(int(r.tokens) for r in records)
        figures[url] = {
            "chunks": len(records),
            "tokens": tokens,
            "tokens_per_s": round(tokens / max((end - start).total_seconds(), 1e-3), 1),
        }
    return figures


def test_three_nodes_commit_every_chunk_once_and_a_dead_node_is_replaced(tmp_path: Path) -> None:
    with (
        moto_s3(tmp_path / "moto.log") as s3_port,
        FaultProxy(s3_port) as proxy,
        pytest.MonkeyPatch.context() as patch,
    ):
        s3 = {"FSSPEC_S3": json.dumps(s3_config(proxy.url)), "AWS_DEFAULT_REGION": "us-east-1"}
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        patch.setitem(fsspec.config.conf, "s3", s3_config(proxy.url))
        fsspec.filesystem("s3").mkdir(BUCKET)
        # The deployments' default model (infra/prefect-up.sh builds it too, but the servers
        # start first: their URLs go into the workers' environment).
        built = hsx("make-tiny-models", str(REPO_ROOT / "models"))
        assert built.returncode == 0, built.stdout + built.stderr
        servers = [
            ServeProcess(
                REPO_ROOT / "models" / "tiny-llama", tmp_path, "--no-probe", name=f"node{n}"
            )
            for n in range(NODES)
        ]
        try:
            for server in servers:  # the three load at once, as nodes do
                server.launch()
            for server in servers:
                server.wait_ready()
            _three_nodes(servers, proxy, s3, tmp_path)
        finally:
            for server in servers:
                server.stop()


def _three_nodes(
    servers: list[ServeProcess], proxy: FaultProxy, s3: dict[str, str], tmp_path: Path
) -> None:
    common = {**s3, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}
    workers = [{**common, "HSX_WORKER_POOL": "hsx-cpu"}] + [
        {
            **common,
            "HSX_ENGINE__URL": server.url,
            "PREFECT_HOME": str(tmp_path / f"node{n}-prefect"),
            "HSX_WORKER_LIMIT": "1",
        }
        for n, server in enumerate(servers)
    ]
    os.environ["HSX_ZOMBIE_WINDOW_S"] = str(ZOMBIE_WINDOW_S)  # read by infra/prefect-up.sh
    os.environ["PREFECT_SERVER_LOGGING_LEVEL"] = "INFO"  # its access log: the API requests
    try:
        # PostgreSQL, as a team runs a server that many nodes share (and its restart below).
        with running_stack("postgres", workers=workers) as stack:
            _all_chunks_once(stack, servers, proxy, s3)
            dead = _a_killed_and_a_frozen_node(stack, servers, proxy, s3)
            alive = [server for n, server in enumerate(servers) if n != dead]
            _a_crashed_parent_is_retried(stack, alive, proxy, s3)
            _a_restarted_prefect_server(stack, alive, proxy)
    finally:
        os.environ.pop("HSX_ZOMBIE_WINDOW_S", None)
        os.environ.pop("PREFECT_SERVER_LOGGING_LEVEL", None)


def _all_chunks_once(
    stack: Stack, servers: list[ServeProcess], proxy: FaultProxy, s3: dict[str, str]
) -> None:
    url = f"s3://{BUCKET}/fanout.zarr"
    with ApiLogTally(stack.home / f"server-{stack.port}.log") as api:
        started, started_wall = time.monotonic(), time.time()
        parent = stack.run("hsx-extract-fanout", "extract-fanout", _run_settings(url, 96, 0.001))
        done = stack.wait(parent, timeout=600)
        wall = time.monotonic() - started
        calls = api.window(started, started + wall)
    assert done["state_type"] == "COMPLETED", done["state"]["message"]
    store = ExtractionStore.open(url)
    chunks = [c.index for c in store.work_chunks]
    assert sorted(store.committed_chunks()) == chunks and store.collisions() == []
    # One commit PUT per chunk at the store's endpoint: nothing committed twice.
    assert _commit_puts(proxy, "fanout.zarr") == Counter({index: 1 for index in chunks})
    children = _children(stack, parent)
    assert len(children) == len(chunks)  # one item per chunk, each run once
    assert all(c["state_type"] == "COMPLETED" for c in children)
    nodes = _per_node(store)
    assert len(nodes) >= 2, nodes  # the items spread over the nodes
    for server in servers:  # one model load per node, whatever ran there
        assert server.log().count("hsx serve: loading") == 1, server.log()[-2000:]
    verified = hsx("verify", url, env=s3)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    listed = hsx("runs", "--json", env=stack.env)
    (row,) = [r for r in json.loads(listed.stdout) if r["id"] == parent]  # `hsx runs` lists it
    assert row["state"] == "Completed" and row["store"] == url, row
    assert row["committed"] == len(chunks), row
    print(
        f"\n3 nodes: {len(chunks)} chunks in {len(children)} items, {wall:.1f} s; per node "
        f"{json.dumps(nodes)}; S3 requests {dict(proxy.requests)}"
    )
    # Every request the server answered meanwhile: the parent's, the children's, the four
    # workers' polls (every 2 s here) and the runs' heartbeats.
    assert calls.requests > 0 and calls.websockets > 0, calls
    busiest = ", ".join(f"{route} {n}" for route, n in calls.by_path.most_common(8))
    print(
        f"Prefect API over the run: {calls.requests} requests, {calls.requests / len(chunks):.1f} "
        f"per chunk, {calls.mean_per_s:.1f}/s mean, {calls.peak_per_s}/s peak (1 s), "
        f"{calls.websockets} websockets opened; busiest: {busiest}"
    )
    # What the simulation counts: the requests from the first item's creation to the last
    # item's end (its time 0 to its makespan), not the parent's planning and verify around them.
    created = min(datetime.fromisoformat(c["created"]) for c in children).timestamp()
    ended = max(datetime.fromisoformat(c["end_time"]) for c in children).timestamp()
    items = api.window(started + created - started_wall, started + ended - started_wall)
    print(
        f"Prefect API over the items ({items.seconds:.1f} s): {items.requests} requests, "
        f"{items.mean_per_s:.1f}/s mean, {items.peak_per_s}/s peak (1 s)"
    )
    measured = {
        **_measured(store, children),
        "api_requests": items.requests,
        "api_per_chunk": round(items.requests / len(chunks), 2),
        "api_mean_per_s": round(items.mean_per_s, 2),
        "api_peak_per_s": items.peak_per_s,
    }
    print("measured (bench/simulate_nodes.py --compare): " + json.dumps(measured))


def _measured(store: ExtractionStore, children: list[dict[str, Any]]) -> dict[str, float]:
    """What the simulation is fed and compared with: each item's time from its run's creation
    to its end (worker pickup, process start, chunks, exit), the engine's chunk seconds, the
    tokens, and the span from the first item's creation to the last one's end."""
    commits = store.committed_chunks().values()
    created = [datetime.fromisoformat(c["created"]) for c in children]
    ended = [datetime.fromisoformat(c["end_time"]) for c in children]
    items = sorted((e - c).total_seconds() for c, e in zip(created, ended, strict=True))
    chunk_s = [float(r.seconds) for r in commits]
    return {
        "items": len(children),
        "tokens": sum(int(r.tokens) for r in commits),
        "chunk_seconds_mean": round(sum(chunk_s) / len(chunk_s), 3),
        "item_p50_s": round(items[len(items) // 2], 2),
        "makespan_s": round((max(ended) - min(created)).total_seconds(), 2),
    }


def _a_killed_and_a_frozen_node(
    stack: Stack, servers: list[ServeProcess], proxy: FaultProxy, s3: dict[str, str]
) -> int:
    """In one run, while each of two nodes extracts an item: one is killed (kill -9 of its
    worker, its item run and its server, as a power loss) and the other frozen (SIGSTOP of its
    worker, item run and server) past the zombie window. The automation declares both item runs
    Crashed (one window for both), the parent resubmits their uncommitted chunks to the third
    node; the frozen node, thawed once its chunks were redone, commits nothing more: its late
    run abandons before its commit or loses the put-if-absent (a collision recorded). Every
    chunk is committed once and verifies. Returns the dead node."""
    url = f"s3://{BUCKET}/killed.zarr"
    parent = stack.run("hsx-extract-fanout", "extract-fanout", _run_settings(url, 160, 0.05))
    (victim, killed_run), (frozen_node, frozen_run) = _nodes_mid_item(stack, servers, parent, 2)
    store = ExtractionStore.open(url)
    frozen_groups = [
        stack.workers[frozen_node + 1].pid,
        int(servers[frozen_node].info()["server_pid"]),
    ]
    for group in frozen_groups:
        os.killpg(group, signal.SIGSTOP)
    killed_at, killed_wall = time.monotonic(), datetime.now(UTC)
    os.killpg(stack.workers[victim + 1].pid, signal.SIGKILL)
    servers[victim].kill_server()
    time.sleep(1)  # a commit PUT already on the wire lands
    committed_before = set(store.committed_chunks())
    frozen_commits = _committed_by(store, frozen_run)
    try:
        crashed_after = _wait_state(stack, killed_run, "CRASHED", ZOMBIE_WINDOW_S + 120) - killed_at
        _wait_state(stack, frozen_run, "CRASHED", ZOMBIE_WINDOW_S + 120)
        done = stack.wait(parent, timeout=600)  # their chunks redone on the third node
        assert done["state_type"] == "COMPLETED", done["state"]["message"]
    finally:
        for group in frozen_groups:
            os.killpg(group, signal.SIGCONT)
    frozen = _flow_process_or_none(frozen_run)
    deadline = time.monotonic() + 60
    while frozen is not None and Path(f"/proc/{frozen}").exists() and time.monotonic() < deadline:
        time.sleep(1)  # the late run sees it is Crashed and ends
    chunks = [c.index for c in store.work_chunks]
    commits = store.committed_chunks()
    assert sorted(commits) == chunks
    assert set(commits) >= committed_before  # nothing committed before was redone
    assert _committed_by(store, frozen_run) == frozen_commits  # nothing committed once thawed
    refused = Counter(int(c["chunk_index"]) for c in store.collisions())
    for collision in store.collisions():  # a late commit refused: the first one stands
        assert commits[collision["chunk_index"]].run_id == collision["winner"]["run_id"]
    # One commit PUT per chunk; a second only where a late commit was refused.
    puts = _commit_puts(proxy, "killed.zarr")
    assert all(puts[i] == 1 + refused[i] for i in chunks), (puts, refused)
    after = [i for i in chunks if i not in committed_before]
    dead_or_frozen = {servers[victim].url, servers[frozen_node].url}
    assert all(commits[i].extra["engine_server"]["url"] not in dead_or_frozen for i in after)
    retried = [c for c in _children(stack, parent) if c["name"].endswith("-try2")]
    assert retried and all(c["state_type"] == "COMPLETED" for c in retried)
    redone: list[int] = []
    for item_run in (killed_run, frozen_run):
        (item,) = [c for c in _children(stack, parent) if c["id"] == item_run]
        item_name = item["name"].rsplit("-try", 1)[0]
        redo_runs = {c["id"] for c in retried if c["name"].startswith(item_name)}
        redone_here = [i for i in after if commits[i].run_id in redo_runs]
        assert redone_here, (item_name, retried)
        redone += redone_here
    resubmitted = min(datetime.fromisoformat(c["created"]) for c in retried) - killed_wall
    last_redone = max(datetime.fromisoformat(commits[i].finished_at) for i in redone) - killed_wall
    assert crashed_after >= ZOMBIE_WINDOW_S - HEARTBEAT_S  # not before the window
    verified = hsx("verify", url, env=s3)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    late = stack.flow_run(frozen_run)["state"]
    print(
        f"\nkill -9 of node {victim} and SIGSTOP of node {frozen_node} mid-item: Crashed after "
        f"{crashed_after:.0f} s, resubmitted after {resubmitted.total_seconds():.0f} s, the last "
        f"redone chunk committed after {last_redone.total_seconds():.0f} s; {len(redone)} chunks "
        f"redone ({sum(int(commits[i].tokens) for i in redone)} tokens), 0 lost, 0 committed "
        f"twice, {sum(refused.values())} late commits refused; the thawed run ended "
        f"{late['name']} ({(late.get('message') or '')[:120]})"
    )
    return victim


def _a_crashed_parent_is_retried(
    stack: Stack, servers: list[ServeProcess], proxy: FaultProxy, s3: dict[str, str]
) -> None:
    """The parent's process killed while its children run, then the UI's Retry: attempt 2
    re-attaches to the children attempt 1 made (their idempotency keys): none runs twice."""
    url = f"s3://{BUCKET}/parent.zarr"
    parent = stack.run("hsx-extract-fanout", "extract-fanout", _run_settings(url, 96, 0.02))
    _a_node_mid_item(stack, servers, parent)
    before = {c["name"] for c in _children(stack, parent)}
    os.kill(_flow_process(parent), signal.SIGKILL)
    crashed = stack.wait(parent, timeout=120)
    assert crashed["state_type"] == "CRASHED", crashed["state"]
    stack.retry_like_the_ui(parent)
    done = stack.wait(parent, timeout=600)
    assert done["state_type"] == "COMPLETED", done["state"]["message"]
    assert done["run_count"] == 2
    children = _children(stack, parent)
    names = Counter(c["name"] for c in children)
    assert all(count == 1 for count in names.values()), names  # no item started twice
    assert before <= set(names) and all(name.endswith("-try1") for name in names)
    store = ExtractionStore.open(url)
    chunks = [c.index for c in store.work_chunks]
    assert sorted(store.committed_chunks()) == chunks and store.collisions() == []
    assert _commit_puts(proxy, "parent.zarr") == Counter({index: 1 for index in chunks})
    print(
        f"\nparent killed with {len(before)} children started, retried: {len(children)} "
        "children in all, each once"
    )


def _a_restarted_prefect_server(stack: Stack, alive: list[ServeProcess], proxy: FaultProxy) -> None:
    """The Prefect server stopped mid-run and started again (same port, same PostgreSQL): the
    parent waits out the outage, the items go on or are resubmitted; every chunk committed
    once."""
    url = f"s3://{BUCKET}/restarted.zarr"
    parent = stack.run("hsx-extract-fanout", "extract-fanout", _run_settings(url, 160, 0.05))
    _a_node_mid_item(stack, alive, parent)
    stack.restart_server(outage_s=5.0)  # same port, same PostgreSQL database
    done = stack.wait(parent, timeout=600)
    assert done["state_type"] == "COMPLETED", done["state"]["message"]
    store = ExtractionStore.open(url)
    chunks = [c.index for c in store.work_chunks]
    assert sorted(store.committed_chunks()) == chunks
    puts = _commit_puts(proxy, "restarted.zarr")
    refused = Counter(int(c["chunk_index"]) for c in store.collisions())
    # One commit per chunk; a second PUT only where a collision was recorded (refused).
    assert all(puts[i] == 1 + refused[i] for i in chunks), (puts, refused)
    print(
        f"\nPrefect server restarted mid-run: parent Completed, {len(chunks)} chunks committed "
        f"once, {sum(refused.values())} late commits refused"
    )


def _committed_by(store: ExtractionStore, run_id: str) -> set[int]:
    return {i for i, r in store.committed_chunks().items() if r.run_id == run_id}


def _flow_process_or_none(run_id: str) -> int | None:
    try:
        return _flow_process(run_id)
    except AssertionError:
        return None


def _flow_process(run_id: str) -> int:
    """The pid of the process running flow run ``run_id`` (Prefect's worker gives it the run's
    id in PREFECT__FLOW_RUN_ID)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PREFECT__FLOW_RUN_ID={run_id}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process runs flow run {run_id}")


def _a_node_mid_item(stack: Stack, servers: list[ServeProcess], parent: str) -> tuple[int, str]:
    """The node running an item that has started extracting, and that item's run."""
    (found,) = _nodes_mid_item(stack, servers, parent, 1)
    return found


def _nodes_mid_item(
    stack: Stack, servers: list[ServeProcess], parent: str, count: int
) -> list[tuple[int, str]]:
    """``count`` distinct nodes, each running an item of ``parent`` that has started
    extracting, with that item's run."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found: dict[int, str] = {}
        for child in _children(stack, parent):
            if child["state_type"] != "RUNNING":
                continue
            said = _first_log(stack, child["id"], r"work chunks of .* on http://")
            for n, server in enumerate(servers):
                if said and said.endswith(server.url):
                    found.setdefault(n, str(child["id"]))
        if len(found) >= count:
            return sorted(found.items())[:count]
        time.sleep(0.5)
    raise AssertionError(f"not {count} items of {parent} running on distinct nodes after 300 s")


def _wait_state(stack: Stack, run_id: str, state: str, timeout: float) -> float:
    """The monotonic time at which run ``run_id`` was seen in ``state``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stack.flow_run(run_id)["state_type"] == state:
            return time.monotonic()
        time.sleep(1)
    raise AssertionError(
        f"run {run_id} not {state} after {timeout} s: {stack.flow_run(run_id)['state']}"
    )
