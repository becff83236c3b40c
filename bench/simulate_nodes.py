"""Discrete-event simulation of hsx on N GPU nodes through Prefect work pools.

One parent flow submits W child runs (one per work item of C chunks of T tokens), then polls all
of them with one filtered read per poll period. Each node loads the model once, then its worker
polls the pool and runs at most ``limit`` children; a child computes its chunks and commits each
(store objects, then a put-if-absent commit record) through a cluster-wide S3 PUT rate. Nodes
can be killed (Prefect's zombie automation marks their run Crashed, the parent resubmits the
uncommitted chunks) or SIGSTOPped (a late commit must collide, not count twice). Standard
library only, deterministic for a seed.

    .venv/bin/python bench/simulate_nodes.py --preset kimi-k2.5-64x8 [--nodes 32] [--seed 1]
        [--inputs measured.json] [--compare measured.json] [--dump-inputs inputs.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import random
import statistics
import typing
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1024 * 1024


@dataclass
class Inputs:
    """Everything the simulation assumes; defaults are a small single-machine run."""

    nodes: int = 3
    limit: int = 1  # child runs at a time per node (worker concurrency limit)
    total_tokens: int = 98_304
    tokens_per_chunk: int = 2048  # T: tokens of one work chunk (one Prefect task)
    chunks_per_item: int = 8  # C: chunks of one work item (one child flow run)
    model_load_s: float = 20.0
    node_tokens_per_s: float = 2000.0
    jitter_sigma: float = 0.1  # lognormal sigma of a chunk's compute time (mean kept at 1)
    child_start_s: float = 3.0  # worker spawns the child process, imports, loads its flow
    worker_poll_s: float = 1.0
    parent_poll_s: float = 2.0
    plan_s: float = 0.0  # parent's planning and store creation before the first submission
    submit_s: float = 0.05  # wall time of one run_deployment(timeout=0)
    api_calls_per_submit: int = 2  # read deployment + create flow run
    api_calls_per_chunk: int = 3  # task run create + Running + Completed
    api_calls_per_run: int = 6  # flow run states, logs: at its start and at its end
    # The share of a run's calls made while its process starts (states, its deployment, the
    # worker's PATCH, logs), spread over child_start_s; the rest over api_end_s at its end.
    api_start_share: float = 0.5
    api_end_s: float = 2.0
    heartbeat_s: float = 5.0
    # A child reads its own state this often (timeouts.state_watch_s): one API request per
    # running child per period, the largest share measured in the 3-node run. 0 = not modelled.
    state_watch_s: float = 2.0
    zombie_window_s: float = 30.0
    automation_latency_s: float = 5.0  # trigger fired -> Crashed state set
    puts_per_chunk: int = 1  # store objects of one chunk (one more PUT: its commit record)
    puts_per_s: float = 3500.0  # cluster-wide S3 PUT rate (one prefix)
    put_latency_s: float = 0.01
    max_resubmits: int = 3
    kills: list[tuple[int, float]] = field(default_factory=list)  # (node, time)
    restart_s: float | None = None  # a killed node back after this (then reloads); None = dead
    stops: list[tuple[int, float, float]] = field(default_factory=list)  # (node, time, stop_s)
    seed: int = 0
    horizon_s: float = 30 * 86400.0  # safety stop of the event loop

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Inputs:
        # A typo in a measured JSON must not silently fall back to a default.
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"unknown inputs: {sorted(unknown)}")
        values = dict(raw)
        values["kills"] = [(int(n), float(t)) for n, t in values.get("kills", [])]
        values["stops"] = [(int(n), float(t), float(s)) for n, t, s in values.get("stops", [])]
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> Inputs:
        raw = json.loads(text)
        return cls.from_dict(raw.get("inputs", raw))


def three_node_test() -> Inputs:
    """The three-node test's run (tests/integration/test_many_nodes.py, 2026-12-07, this 2-core
    machine, Prefect on PostgreSQL; bench/measured/three-node-test-2026-12-07*.json, two runs):
    9 one-chunk items, 8,710 tokens, chunks of 1.07-1.24 s; API requests counted from the first
    item's creation to the last one's end (the simulation's span). Fitted to them: the child's
    start (11.5 s: the worker's pickup to its first chunk), the API calls per child run (40; the
    508-519 requests less the polls, submissions and state watches) and the spread of a run's
    end calls (2 s). Against the runs: item p50 28.4 s vs 26.4 and 27.9, makespan 43.5 s vs 40.5
    and 43.7, requests 523 vs 508 and 519, 12.0/s mean vs 12.6 and 11.9, peak 31/s vs 35 and 31
    (all within 15%; the peak moves a few requests with where the one-second bins fall)."""
    return Inputs(
        nodes=3,
        limit=1,
        total_tokens=8710,
        tokens_per_chunk=968,
        chunks_per_item=1,
        model_load_s=0.0,  # the servers are loaded before the run
        node_tokens_per_s=908.0,  # 968 tokens in 1.066 s (the chunks' mean)
        child_start_s=11.5,
        worker_poll_s=2.0,
        parent_poll_s=1.0,
        api_calls_per_run=40,
        heartbeat_s=30.0,
        zombie_window_s=60.0,
        kills=[(1, 20.0)],
        restart_s=None,
    )


def kimi_k25_64x8() -> Inputs:
    tokens_per_s = 20_000.0  # ASSUMPTION: prefill-only Kimi-K2.5 (1T MoE) per 8-GPU node
    bytes_per_token = 4 * 7168 * 2  # 56 KiB: K=4 captured layers x H=7168 x bf16
    rows_per_object = 256  # C rows per Zarr object: 14 MiB objects, near hsx's 16 MiB aim
    chunk_tokens = 256 * 1024  # ASSUMPTION: a work chunk of 256 samples of ~1 Ki tokens
    item_chunks = round(600 * tokens_per_s / chunk_tokens)  # ~10 minutes of one node
    assert rows_per_object * bytes_per_token == 14 * MIB
    return Inputs(
        nodes=64,
        total_tokens=200_000_000,
        tokens_per_chunk=chunk_tokens,
        chunks_per_item=item_chunks,
        model_load_s=1080.0,
        node_tokens_per_s=tokens_per_s,
        child_start_s=10.0,  # ASSUMPTION: process spawn + imports + connecting to the server
        worker_poll_s=10.0,
        parent_poll_s=10.0,
        api_calls_per_chunk=3,
        api_calls_per_run=8,
        heartbeat_s=30.0,
        zombie_window_s=90.0,
        automation_latency_s=10.0,  # ASSUMPTION: Prefect's proactive trigger evaluation
        puts_per_chunk=math.ceil(chunk_tokens / rows_per_object),
        puts_per_s=3500.0,  # S3's documented PUT rate per prefix
        put_latency_s=0.1,  # ASSUMPTION: one 14 MiB PUT
        kills=[(0, 1080.0 + 300.0)],  # mid-way through the first items
        restart_s=60.0,
    )


PRESETS: dict[str, Callable[[], Inputs]] = {
    "three-node-test": three_node_test,
    "kimi-k2.5-64x8": kimi_k25_64x8,
}


@dataclass
class Failover:
    kind: str  # "kill" or "stop"
    node: int
    at_s: float
    crashed_s: float | None = None
    resubmit_started_s: float | None = None
    redone_committed_s: float | None = None

    def delays(self) -> tuple[float | None, float | None, float | None]:
        marks = (self.crashed_s, self.resubmit_started_s, self.redone_committed_s)
        return tuple(None if m is None else m - self.at_s for m in marks)  # type: ignore[return-value]


@dataclass
class Run:
    """One child flow run: one work item, executed by at most one child process."""

    id: int
    chunks: list[int]
    resubmits: int
    failover: Failover | None = None  # the failover this run redoes
    state: str = "Scheduled"  # Scheduled, Running, Completed, Crashed
    node: int | None = None
    pos: int = 0  # next chunk (index into chunks)
    in_flight: int | None = None
    alive: bool = False  # the child process exists
    stopped: bool = False
    gen: int = 0  # bumped to cancel this child's pending events (kill, stop)
    step: Callable[[Run], None] | None = None
    due_s: float = 0.0
    compute_s: float = 0.0
    sharing: int = 1  # children of its node computing when its chunk started
    crash: Failover | None = None  # the failover that ended this run
    last_hb_s: float = 0.0
    created_s: float | None = None  # created in Prefect (the parent's submission)
    started_s: float | None = None
    ended_s: float | None = None


@dataclass
class Node:
    index: int
    alive: bool = True
    gen: int = 0  # bumped on kill: stale load/poll events are dropped
    first_ready_s: float | None = None
    restart_pending: bool = False
    running: list[Run] = field(default_factory=list)
    busy_s: float = 0.0
    tokens: int = 0


@dataclass
class SimResult:
    makespan_s: float
    gpu_idle_share: float
    item_p50_s: float
    item_p99_s: float
    node_tokens_per_s: list[float]
    api_requests: int
    api_per_chunk: float
    api_mean_per_s: float
    api_peak_per_s: int
    api_by_second: list[int]  # [seconds of the run]: requests in each
    s3_puts: int
    failovers: list[Failover]
    failover_crashed_s: float | None  # worst case over failovers
    failover_started_s: float | None
    failover_redone_s: float | None
    chunks_total: int
    chunks_committed: int
    chunks_redone: int
    chunks_in_flight_at_kills: int
    tokens_wasted: int
    commit_collisions: int
    chunks_committed_twice: int
    chunks_lost: int
    runs_submitted: int
    items_failed: list[int]


class Simulation:
    def __init__(self, inputs: Inputs) -> None:
        self.p = inputs
        self.rng = random.Random(inputs.seed)
        self.heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = itertools.count()  # ties broken by insertion order: deterministic
        self.now = 0.0
        self.end_s: float | None = None  # when the parent flow ended: the makespan
        self.nodes = [Node(i) for i in range(inputs.nodes)]
        self.n_chunks = math.ceil(inputs.total_tokens / inputs.tokens_per_chunk)
        self.queue: deque[Run] = deque()  # the work pool's scheduled runs, FIFO
        self.runs: list[Run] = []
        self.open: list[Run] = []  # submitted, not yet seen terminal by the parent
        self.failed: list[int] = []
        self.api: Counter[int] = Counter()  # requests per 1-second window
        self.s3_free_s = 0.0
        self.s3_puts = 0
        self.commits: Counter[int] = Counter()
        self.collisions = 0
        self.chunk_starts: Counter[int] = Counter()
        self.lost_to: dict[int, Failover] = {}
        self.failovers: list[Failover] = []
        self.wasted = 0
        self.in_flight_at_kills = 0

    # -- the event loop ---------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, args))

    def run(self) -> SimResult:
        for node in self.nodes:
            self.at(0.0, self.node_start, node)
        for index, t in self.p.kills:
            self.at(t, self.kill, self.nodes[index])
        for index, t, stop_s in self.p.stops:
            self.at(t, self.stop, self.nodes[index], stop_s)
        self.at(self.p.plan_s, self.submit_plan)
        # After the parent ends, stopped children still resume and try their late commits:
        # the loop drains them (worker polls and parent polls no longer reschedule).
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            if t > self.p.horizon_s:
                break
            self.now = t
            fn(*args)
        return self.result()

    def call_api(self, count: int) -> None:
        self.api[int(self.now)] += count

    def call_api_spread(self, count: int, start_s: float, end_s: float) -> None:
        """``count`` requests evenly over [start_s, end_s]: a child's process makes its
        start's calls as it comes up and its end's as it winds down, not in one instant."""
        span = end_s - start_s
        for i in range(count):
            self.api[int(start_s + span * (i + 0.5) / count)] += 1

    def run_calls_at_start(self) -> int:
        return round(self.p.api_calls_per_run * self.p.api_start_share)

    def s3_put(self, count: int) -> float:
        # One FIFO server at the cluster-wide PUT rate: a batch waits for those before it.
        start = max(self.now, self.s3_free_s)
        self.s3_free_s = start + count / self.p.puts_per_s
        self.s3_puts += count
        return self.s3_free_s + self.p.put_latency_s

    def node_of(self, run: Run) -> Node:
        assert run.node is not None, "a run without a node has no child"
        return self.nodes[run.node]

    def chunk_tokens(self, chunk: int) -> int:
        return min(self.p.tokens_per_chunk, self.p.total_tokens - chunk * self.p.tokens_per_chunk)

    # -- nodes and workers ------------------------------------------------------------------
    def node_start(self, node: Node) -> None:
        node.alive, node.restart_pending = True, False
        self.at(self.now + self.p.model_load_s, self.node_ready, node, node.gen)

    def node_ready(self, node: Node, gen: int) -> None:
        if gen != node.gen:
            return  # killed while loading
        if node.first_ready_s is None:
            node.first_ready_s = self.now
        self.worker_poll(node, gen)

    def worker_poll(self, node: Node, gen: int) -> None:
        if gen != node.gen or self.end_s is not None:
            return  # killed, or the parent is done: the pool is empty for good
        self.call_api(1)
        while self.queue and len(node.running) < self.p.limit:
            self.claim(self.queue.popleft(), node)
        self.at(self.now + self.p.worker_poll_s, self.worker_poll, node, gen)

    def claim(self, run: Run, node: Node) -> None:
        # The worker marks the run Running as it spawns the child: from here a dead node
        # leaves a run without heartbeats, which the zombie automation catches.
        run.state, run.node, run.alive, run.last_hb_s = "Running", node.index, True, self.now
        node.running.append(run)
        self.schedule(run, self.p.child_start_s, self.child_begin)

    # -- the child process ------------------------------------------------------------------
    def schedule(self, run: Run, delay: float, step: Callable[[Run], None]) -> None:
        run.step, run.due_s = step, self.now + delay
        self.at(run.due_s, self.fire, run, run.gen)

    def fire(self, run: Run, gen: int) -> None:
        if gen == run.gen and run.step is not None:
            run.step(run)

    def heartbeat(self, run: Run, gen: int) -> None:
        if gen != run.gen:
            return
        self.call_api(1)
        run.last_hb_s = self.now
        self.at(self.now + self.p.heartbeat_s, self.heartbeat, run, gen)

    def state_watch(self, run: Run, gen: int) -> None:
        if gen != run.gen:
            return
        self.call_api(1)
        self.at(self.now + self.p.state_watch_s, self.state_watch, run, gen)

    def watch_state(self, run: Run) -> None:
        """The child's state watch: its first read one period from now."""
        if self.p.state_watch_s > 0:
            self.at(self.now + self.p.state_watch_s, self.state_watch, run, run.gen)

    def child_begin(self, run: Run) -> None:
        run.started_s = self.now
        self.call_api_spread(self.run_calls_at_start(), self.now - self.p.child_start_s, self.now)
        if run.failover is not None and run.failover.resubmit_started_s is None:
            run.failover.resubmit_started_s = self.now
        self.heartbeat(run, run.gen)
        self.watch_state(run)
        self.start_chunk(run)

    def start_chunk(self, run: Run) -> None:
        if run.state != "Running":
            return self.child_exit(run)  # Crashed meanwhile: its next state change is refused
        if run.pos == len(run.chunks):
            return self.finish(run)
        chunk = run.chunks[run.pos]
        run.in_flight = chunk
        self.chunk_starts[chunk] += 1
        self.call_api(self.p.api_calls_per_chunk // 2)
        # Children of one node share its GPUs: approximated by the count at the chunk's start.
        run.sharing = len(self.node_of(run).running)
        jitter = self.rng.lognormvariate(-(self.p.jitter_sigma**2) / 2, self.p.jitter_sigma)
        run.compute_s = self.chunk_tokens(chunk) / self.p.node_tokens_per_s * jitter * run.sharing
        self.schedule(run, run.compute_s, self.computed)

    def computed(self, run: Run) -> None:
        self.node_of(run).busy_s += run.compute_s / run.sharing
        self.schedule(run, self.s3_put(self.p.puts_per_chunk) - self.now, self.objects_written)

    def objects_written(self, run: Run) -> None:
        # The commit record goes after the objects: a record never names a missing object.
        self.schedule(run, self.s3_put(1) - self.now, self.record_written)

    def record_written(self, run: Run) -> None:
        chunk = run.in_flight
        assert chunk is not None
        self.call_api(self.p.api_calls_per_chunk - self.p.api_calls_per_chunk // 2)
        if self.commits[chunk]:  # put-if-absent refused: someone committed it first
            self.collisions += 1
            self.wasted += self.chunk_tokens(chunk)
        else:
            self.commits[chunk] += 1
            self.node_of(run).tokens += self.chunk_tokens(chunk)
            failover = self.lost_to.get(chunk)
            if failover is not None and failover.redone_committed_s is None:
                failover.redone_committed_s = self.now
        run.in_flight, run.pos = None, run.pos + 1
        self.start_chunk(run)

    def finish(self, run: Run) -> None:
        at_end = self.p.api_calls_per_run - self.run_calls_at_start()
        self.call_api_spread(at_end, self.now, self.now + self.p.api_end_s)
        run.state, run.ended_s = "Completed", self.now
        self.child_exit(run)

    def child_exit(self, run: Run) -> None:
        run.alive, run.step = False, None
        run.gen += 1
        node = self.node_of(run)
        if run in node.running:
            node.running.remove(run)

    # -- failures ---------------------------------------------------------------------------
    def kill(self, node: Node) -> None:
        if not node.alive:
            return
        node.alive = False
        node.gen += 1
        for run in list(node.running):
            failover = Failover("kill", node.index, self.now)
            self.failovers.append(failover)
            if run.in_flight is not None:
                self.in_flight_at_kills += 1
                self.wasted += self.chunk_tokens(run.in_flight)
                self.lost_to[run.in_flight] = failover
                if run.step == self.computed and not run.stopped:  # partial compute: GPU time
                    node.busy_s += (run.compute_s - (run.due_s - self.now)) / run.sharing
            self.child_exit(run)
            self.watch_heartbeats(run, failover)
        if self.p.restart_s is not None:
            node.restart_pending = True
            self.at(self.now + self.p.restart_s, self.node_start, node)

    def stop(self, node: Node, stop_s: float) -> None:
        for run in node.running:
            if not run.alive or run.stopped:
                continue
            failover = Failover("stop", node.index, self.now)
            self.failovers.append(failover)
            if run.in_flight is not None:
                self.lost_to[run.in_flight] = failover
            run.stopped = True
            run.gen += 1  # freezes its pending step and its heartbeats
            self.watch_heartbeats(run, failover)
            self.at(self.now + stop_s, self.resume, run, run.due_s - self.now)

    def resume(self, run: Run, remaining_s: float) -> None:
        if not run.alive:
            return  # killed while stopped
        run.stopped = False
        run.gen += 1
        assert run.step is not None
        self.schedule(run, remaining_s, run.step)
        self.heartbeat(run, run.gen)  # the missed heartbeat timer fires at once
        self.watch_state(run)

    def watch_heartbeats(self, run: Run, failover: Failover) -> None:
        # The automation's trigger would fire one window after the last heartbeat seen.
        due = run.last_hb_s + self.p.zombie_window_s
        self.at(max(due, self.now), self.zombie_check, run, run.last_hb_s, failover)

    def zombie_check(self, run: Run, last_hb_s: float, failover: Failover) -> None:
        if run.state == "Running" and run.last_hb_s == last_hb_s:
            self.at(self.now + self.p.automation_latency_s, self.mark_crashed, run, failover)

    def mark_crashed(self, run: Run, failover: Failover) -> None:
        if run.state == "Running":
            run.state, run.ended_s, run.crash = "Crashed", self.now, failover
            failover.crashed_s = self.now

    # -- the parent flow --------------------------------------------------------------------
    def submit_plan(self) -> None:
        chunks = list(range(self.n_chunks))
        items = [
            chunks[i : i + self.p.chunks_per_item]
            for i in range(0, len(chunks), self.p.chunks_per_item)
        ]
        self.submit_all([(item, 0, None) for item in items])
        self.at(self.now + len(items) * self.p.submit_s + self.p.parent_poll_s, self.parent_poll)

    def submit_all(self, items: list[tuple[list[int], int, Failover | None]]) -> None:
        # Submissions are sequential API calls from the one parent process.
        for offset, (chunks, resubmits, failover) in enumerate(items):
            run = Run(len(self.runs), chunks, resubmits, failover)
            self.runs.append(run)
            self.open.append(run)
            self.at(self.now + (offset + 1) * self.p.submit_s, self.enqueue, run)

    def enqueue(self, run: Run) -> None:
        run.created_s = self.now
        self.call_api(self.p.api_calls_per_submit)
        self.queue.append(run)

    def parent_poll(self) -> None:
        self.call_api(1)  # one filtered read of all children's states
        retry: list[tuple[list[int], int, Failover | None]] = []
        for run in [r for r in self.open if r.state in ("Completed", "Crashed")]:
            self.open.remove(run)
            if run.state == "Crashed":
                retry.extend(self.retry_of(run))
        self.submit_all(retry)
        if not self.open:
            self.end_s = self.now
        elif not any(n.alive or n.restart_pending for n in self.nodes):
            self.failed.extend(r.id for r in self.open)  # no node left to run them
            self.end_s = self.now
        else:
            self.at(self.now + self.p.parent_poll_s, self.parent_poll)

    def retry_of(self, run: Run) -> list[tuple[list[int], int, Failover | None]]:
        left = [c for c in run.chunks if not self.commits[c]]
        if not left:
            return []
        if run.resubmits >= self.p.max_resubmits:
            self.failed.append(run.id)
            return []
        return [(left, run.resubmits + 1, run.crash)]

    # -- results ----------------------------------------------------------------------------
    def result(self) -> SimResult:
        end = self.now if self.end_s is None else self.end_s
        # From the run's creation to its end, as the three-node test measures it: the wait for
        # a free node, the worker's pickup and the child's start are part of an item's time.
        items = sorted(
            r.ended_s - r.created_s
            for r in self.runs
            if r.state == "Completed" and r.created_s is not None and r.ended_s is not None
        )
        ready = [n for n in self.nodes if n.first_ready_s is not None and n.first_ready_s < end]
        after_load = [(n, end - (n.first_ready_s or 0.0)) for n in ready]
        total_after = sum(span for _, span in after_load)
        busy = sum(min(n.busy_s, span) for n, span in after_load)
        api_total = sum(self.api.values())
        committed = sum(1 for c in range(self.n_chunks) if self.commits[c])
        crashed = [f.delays() for f in self.failovers if f.crashed_s is not None]
        return SimResult(
            makespan_s=end,
            gpu_idle_share=1 - busy / total_after if total_after else 1.0,
            item_p50_s=percentile(items, 0.50),
            item_p99_s=percentile(items, 0.99),
            node_tokens_per_s=[n.tokens / span if span else 0.0 for n, span in after_load],
            api_requests=api_total,
            api_per_chunk=api_total / max(self.n_chunks, 1),
            api_mean_per_s=api_total / end if end else 0.0,
            api_peak_per_s=max(self.api.values(), default=0),
            api_by_second=[self.api.get(t, 0) for t in range(math.ceil(end) + 1)],
            s3_puts=self.s3_puts,
            failovers=self.failovers,
            failover_crashed_s=worst(d[0] for d in crashed),
            failover_started_s=worst(d[1] for d in crashed),
            failover_redone_s=worst(d[2] for d in crashed),
            chunks_total=self.n_chunks,
            chunks_committed=committed,
            chunks_redone=sum(1 for count in self.chunk_starts.values() if count > 1),
            chunks_in_flight_at_kills=self.in_flight_at_kills,
            tokens_wasted=self.wasted,
            commit_collisions=self.collisions,
            chunks_committed_twice=sum(1 for count in self.commits.values() if count > 1),
            chunks_lost=self.n_chunks - committed,
            runs_submitted=len(self.runs),
            items_failed=sorted(self.failed),
        )


def percentile(values: list[float], q: float) -> float:
    """Nearest rank of sorted ``values``; 0 when empty."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def worst(values: Iterable[float | None]) -> float | None:
    """The largest delay; None when a failover never reached that mark (or there was none)."""
    seen = list(values)
    if not seen or any(v is None for v in seen):
        return None
    return max(v for v in seen if v is not None)


def simulate(inputs: Inputs) -> SimResult:
    return Simulation(inputs).run()


def compare(
    measured: dict[str, Any], simulated: SimResult, keys: Iterable[str], tolerance: float = 0.15
) -> list[str]:
    """The keys whose simulated figure is off the measured one by more than ``tolerance``
    (relative; an absolute difference where the measured figure is 0)."""
    off = []
    for key in keys:
        want, got = measured[key], getattr(simulated, key)
        if got is None or want is None:
            if got is not want:
                off.append(key)
        elif abs(got - want) > tolerance * abs(want) or (want == 0 and got != 0):
            off.append(key)
    return off


# -- one Prefect server's measured capacity -------------------------------------------------
@dataclass
class ServerLoad:
    """The simulated requests against what one server was measured to serve per second."""

    capacity_per_s: float
    mean_share: float
    peak_share: float
    seconds_over: int  # seconds whose requests exceed the capacity
    worst_wait_s: float  # the longest a request waits behind a backlog (a FIFO server)


def server_load(by_second: list[int], capacity_per_s: float) -> ServerLoad:
    """A backlog that grows by each second's requests past ``capacity_per_s`` and drains at it."""
    if capacity_per_s <= 0:
        raise ValueError(f"expected a capacity above 0 requests/s, found {capacity_per_s}")
    backlog = worst = 0.0
    for arrived in by_second:
        backlog = max(0.0, backlog + arrived - capacity_per_s)
        worst = max(worst, backlog)
    seconds = max(len(by_second), 1)
    return ServerLoad(
        capacity_per_s=capacity_per_s,
        mean_share=sum(by_second) / seconds / capacity_per_s,
        peak_share=max(by_second, default=0) / capacity_per_s,
        seconds_over=sum(1 for n in by_second if n > capacity_per_s),
        worst_wait_s=worst / capacity_per_s,
    )


def print_server_load(path: Path, result: SimResult) -> None:
    measured = json.loads(path.read_text())
    try:
        capacity = float(measured["capacity_per_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SystemExit(
            f"{path}: expected bench/bench_prefect_server.py's JSON with capacity_per_s, "
            f"found keys {sorted(measured) if isinstance(measured, dict) else type(measured)}"
        ) from exc
    load = server_load(result.api_by_second, capacity)
    print(
        f"ONE PREFECT SERVER ({path.name}: {capacity:.0f} requests/s measured, "
        f"{measured.get('database', '?')}, {measured.get('cores', '?')} cores):"
    )
    print_table(
        [
            ("mean / peak of its capacity", f"{load.mean_share:.1%} / {load.peak_share:.1%}"),
            ("seconds over capacity", f"{load.seconds_over} of {len(result.api_by_second)}"),
            ("longest wait behind the backlog", f"{load.worst_wait_s:.1f} s"),
        ]
    )


# -- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--inputs", type=Path, help="JSON of Inputs fields (or {'inputs': ...})")
    parser.add_argument(
        "--compare", type=Path, help="JSON of measured figures (or {'results': ...})"
    )
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument(
        "--server-capacity",
        type=Path,
        help="bench/bench_prefect_server.py's JSON: the API load against one server's capacity",
    )
    parser.add_argument("--dump-inputs", type=Path, help="write the final inputs as JSON")
    parser.add_argument("--kill", action="append", metavar="NODE@SECONDS", help="replaces kills")
    parser.add_argument("--stop", action="append", metavar="NODE@SECONDS@STOP_S")
    parser.add_argument("--no-failures", action="store_true", help="drop all kills and stops")
    hints = typing.get_type_hints(Inputs)
    for f in dataclasses.fields(Inputs):
        if f.name not in ("kills", "stops"):
            # SUPPRESS: only the flags given override the preset and the JSON.
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                type=value_parser(hints[f.name]),
                default=argparse.SUPPRESS,
            )
    return parser


def value_parser(hint: Any) -> Callable[[str], Any]:
    if hint is int:
        return int
    if hint is float:
        return float
    if float in typing.get_args(hint):  # float | None: "none" means None

        def optional_float(text: str) -> float | None:
            return None if text.lower() == "none" else float(text)

        return optional_float
    raise TypeError(f"no command-line parser for {hint}")


def load_inputs(args: argparse.Namespace) -> Inputs:
    """Preset (or defaults), then the JSON file, then the command line's flags."""
    values = dataclasses.asdict(PRESETS[args.preset]() if args.preset else Inputs())
    if args.inputs:
        raw = json.loads(args.inputs.read_text())
        values.update(raw.get("inputs", raw))
    names = {f.name for f in dataclasses.fields(Inputs)}
    values.update({k: v for k, v in vars(args).items() if k in names})
    if args.no_failures:
        values["kills"], values["stops"] = [], []
    if args.kill:
        values["kills"] = [tuple(spec.split("@")) for spec in args.kill]
    if args.stop:
        values["stops"] = [tuple(spec.split("@")) for spec in args.stop]
    return Inputs.from_dict(values)


def result_rows(result: SimResult) -> list[tuple[str, str]]:
    rates = sorted(result.node_tokens_per_s)
    rows = [
        ("makespan", f"{result.makespan_s:,.1f} s ({result.makespan_s / 60:.1f} min)"),
        ("GPU idle share (after load)", f"{result.gpu_idle_share:.1%}"),
        ("item time p50 / p99", f"{result.item_p50_s:,.1f} s / {result.item_p99_s:,.1f} s"),
        (
            "node tokens/s min / median / max",
            f"{rates[0]:,.0f} / {statistics.median(rates):,.0f} / {rates[-1]:,.0f}"
            if rates
            else "-",
        ),
        ("nodes that committed work", f"{sum(1 for r in rates if r > 0)} / {len(rates)}"),
        ("API requests", f"{result.api_requests:,}"),
        ("API per chunk", f"{result.api_per_chunk:.2f}"),
        ("API per s mean / peak (1 s)", f"{result.api_mean_per_s:.2f} / {result.api_peak_per_s}"),
        ("S3 PUTs", f"{result.s3_puts:,}"),
        ("runs submitted", f"{result.runs_submitted} ({len(result.items_failed)} failed)"),
    ]
    for f in result.failovers:
        names = ("Crashed", "resubmit started", "redone chunk committed")
        marks = ", ".join(
            f"-> {name} {'never' if d is None else f'{d:.1f} s'}"
            for name, d in zip(names, f.delays(), strict=True)
        )
        rows.append((f"{f.kind} node {f.node} at {f.at_s:.0f} s", marks))
    rows += [
        ("chunks committed / total", f"{result.chunks_committed:,} / {result.chunks_total:,}"),
        ("chunks redone", str(result.chunks_redone)),
        ("tokens wasted", f"{result.tokens_wasted:,}"),
        ("commit collisions (refused)", str(result.commit_collisions)),
        ("chunks committed twice (must be 0)", str(result.chunks_committed_twice)),
        ("chunks lost (must be 0)", str(result.chunks_lost)),
    ]
    return rows


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def print_comparison(path: Path, result: SimResult, tolerance: float) -> list[str]:
    raw = json.loads(path.read_text())
    measured = raw.get("results", raw)
    known = {f.name for f in dataclasses.fields(SimResult)}
    keys = [k for k in measured if k in known and isinstance(measured[k], int | float | None)]
    off = compare(measured, result, keys, tolerance)
    print(f"COMPARE with {path} (tolerance {tolerance:.0%}):")
    for key in keys:
        want, got = measured[key], getattr(result, key)
        ratio = f"{got / want:.3f}" if want and got is not None else "-"
        flag = "OFF" if key in off else "ok"
        print(f"  {key:<24} measured {want!s:>14}  simulated {got!s:>14}  ratio {ratio:>7}  {flag}")
    return off


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    inputs = load_inputs(args)
    if args.dump_inputs:
        args.dump_inputs.write_text(inputs.to_json())
    chunks = math.ceil(inputs.total_tokens / inputs.tokens_per_chunk)
    print(
        f"SIMULATION {args.preset or 'defaults'}: {inputs.nodes} nodes x limit {inputs.limit}, "
        f"{inputs.total_tokens:,} tokens = {chunks:,} chunks of {inputs.tokens_per_chunk:,} "
        f"tokens in {math.ceil(chunks / inputs.chunks_per_item)} items of "
        f"{inputs.chunks_per_item} chunks (~{inputs.chunks_per_item * inputs.tokens_per_chunk / inputs.node_tokens_per_s:,.0f} s each); "
        f"seed {inputs.seed}; kills {inputs.kills}, restart_s {inputs.restart_s}; stops {inputs.stops}"
    )
    result = simulate(inputs)
    print_table(result_rows(result))
    if args.server_capacity:
        print_server_load(args.server_capacity, result)
    if args.compare:
        return 1 if print_comparison(args.compare, result, args.tolerance) else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
