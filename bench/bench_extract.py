"""Extraction benchmark: ratios against baselines measured in the same run (machines are noisy).

1. tokens/s of hsx's extraction (vLLM extract_hidden_states + hsx connector, Zarr write,
   checksums, commit) against the same engine settings doing plain prefill (max_tokens=1, greedy,
   no extraction), on the same token ids: 400 conversations of chat length (median ~670 tokens,
   as the ShareGPT/UltraChat data drafters train on), then the 3000 short ones of x10 (~86
   tokens: the worst case, where vLLM's per-request costs weigh most). Both engines stay
   loaded, in two processes, and each round times one pass of each back to back, in
   alternating order (--rounds). The median of the rounds' ratios is the figure: a round
   compares passes seconds apart, while these machines drift over minutes (the same side
   measured 22-48k tok/s within an hour).
2. Store write GB/s (hsx's ChunkWriter: Zarr + streaming xxh3 checksums, work chunks written
   by concurrent tasks as the flow runs them) against a raw file write of the same bytes, both
   buffered and both O_DIRECT: 1 GiB (--write-mib) of samples of chat-like lengths whose states
   sit in page-aligned buffers, as the connector hands them over; --write-passes alternating
   pass pairs, the median of their ratios the figure.
3. Peak RSS of extraction (3 passes) for the bundled dataset and for ten times as many
   conversations: it must not grow with the dataset.

    .venv/bin/python bench/bench_extract.py [--model tiny-llama] [--rounds 8]
        [--write-mib 1024] [--write-passes 12] [--only throughput|write|memory]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
# Plain prefill gets large generate() calls (its best case); hsx queues batches continuously.
PLAIN_BATCH_TOKENS = 16384
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _settings(model: Path, dataset: Path, store: str, dtype: str):  # type: ignore[no-untyped-def]
    from settings import HsxSettings

    return HsxSettings(
        model=model,
        dataset=dataset,
        store=store,
        engine={"dtype": dtype, "max_model_len": 2048, "kv_cache_memory_gib": 0.5},
        data={"max_length": 2047},
        layout={"min_work_chunk_tokens": 4096},
    )


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pass_result(tokens: int, started: float, cpu_started: float) -> dict[str, float]:
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_seconds": _cpu_seconds() - cpu_started,
    }


def plain_runner(model: Path, dataset: Path, dtype: str) -> Callable[[], dict[str, float]]:
    """Plain prefill: the same engine settings without extraction. Returns one timed pass."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hsx.data.tokenization import iter_conversations, tokenize_conversation
    from hsx.engine.options import engine_kwargs
    from hsx.extraction.chunk_extraction import batches
    from hsx.plan.building import load_tokenizer

    settings = _settings(model, dataset, "memory://unused", dtype)
    kwargs = engine_kwargs(model, settings.engine, (2,), "unused", "")
    kwargs.pop("speculative_config")
    kwargs.pop("kv_transfer_config")
    tokenizer = load_tokenizer(model)
    samples = [
        tokenize_conversation(tokenizer, c.messages, settings.data.max_length)
        for c in iter_conversations(dataset)
    ]
    llm = LLM(**kwargs)
    # Greedy and no detokenizing, as hsx asks of the engine: the leanest plain prefill.
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)  # warm-up

    def one_pass() -> dict[str, float]:
        started, cpu_started = time.perf_counter(), _cpu_seconds()
        tokens = 0
        for batch in batches(samples, PLAIN_BATCH_TOKENS):
            llm.generate(
                [TokensPrompt(prompt_token_ids=s.input_ids.tolist()) for s in batch],
                params,
                use_tqdm=False,
            )
            tokens += sum(s.num_tokens for s in batch)
        return _pass_result(tokens, started, cpu_started)

    return one_pass


def hsx_runner(
    model: Path, dataset: Path, dtype: str, store: str
) -> Callable[[], dict[str, float]]:
    """hsx's extraction of every work chunk into a fresh store. Returns one timed pass (engine
    load and planning excluded, as for plain)."""
    import numpy as np

    from hsx.engine.vllm_engine import get_engine
    from hsx.extraction.run import run_spec
    from hsx.extraction.steps import plan_and_create_store

    passes = 0

    def one_pass() -> dict[str, float]:
        nonlocal passes
        settings = _settings(model, dataset, f"{store}-{passes}", dtype)
        passes += 1
        summary = plan_and_create_store(settings)
        engine = get_engine(settings.model, settings.engine, run_spec(settings).layer_ids)
        engine.extract([np.asarray([1, 2, 3])])  # warm-up, as for plain
        started, cpu_started = time.perf_counter(), _cpu_seconds()
        records = extract_every_chunk(settings, summary)
        result = _pass_result(sum(r.tokens for r in records if r), started, cpu_started)
        shutil.rmtree(settings.store, ignore_errors=True)
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return result

    return one_pass


def extract_every_chunk(
    settings: Any, summary: Any, watch: Callable[[Any], None] | None = None
) -> list[Any]:
    """Every pending work chunk of a planned store, as the flow runs them (one run object, as
    many chunks at once as fill the engine's queue), without Prefect's task cost. The commit
    records. ``watch`` gets the run's host pipeline first (bench_gpu's timeline samples it)."""
    from hsx.extraction.chunk_extraction import RunContext
    from hsx.extraction.run import ExtractionRun

    with ExtractionRun.open(settings) as run:
        if watch is not None:
            watch(run.host)
        concurrency = run.concurrency(summary.tokens, summary.chunks)
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(
                pool.map(lambda index: run.extract(index, RunContext("bench")), summary.pending)
            )


def serve(one_pass: Callable[[], dict[str, float]]) -> None:
    """Child side of the lockstep: say "ready" once the engine is loaded, then run one timed
    pass per line read from stdin, printing each result as a JSON line."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "pass":
            return
        print(json.dumps(one_pass()), flush=True)


class Child:
    """A benchmark child process kept loaded between passes (see ``serve``)."""

    def __init__(self, kind: str, *args: str, script: str = __file__) -> None:
        # Both sides run with the allocator hsx's CLI uses (tcmalloc where installed, as vLLM's
        # CPU docs recommend), so the comparison is fair.
        from flows.allocator import preload_env

        self.kind = kind
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            [sys.executable, script, "--child", kind, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=ROOT,
            env=preload_env(dict(os.environ)),
        )
        self._read()  # {"ready": true}: the engine is loaded

    def _read(self) -> dict[str, float]:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith("{"):
                return cast(dict[str, float], json.loads(line))
        self._stderr.seek(0)
        from hsx.engine.platform import exit_description

        raise RuntimeError(
            f"{self.kind} child ended ({exit_description(self._proc.wait())}):\n"
            f"{self._stderr.read()[-4000:]}"
        )

    def one_pass(self) -> dict[str, float]:
        return self.ask("pass")

    def ask(self, line: str) -> dict[str, float]:
        """One line to the child (a pass, or what its own loop takes); its JSON answer."""
        assert self._proc.stdin is not None
        time.sleep(1.0)  # each pass starts on a quiet machine: the other side's threads asleep
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=120)
        self._stderr.close()


def bench_throughput(
    model: Path, dataset: Path, label: str, dtype: str, rounds: int, scratch: Path
) -> None:
    """Both engines loaded at once, in two processes; each round times one pass of each,
    back to back, in alternating order. A round's ratio compares passes seconds apart, so the
    machine's drift over minutes (27-43k tok/s for the same side) cancels; the median over the
    rounds is the figure, and the spread is printed with it."""
    plain = Child("serve-plain", str(model), str(dataset), dtype)
    hsx = Child("serve-hsx", str(model), str(dataset), dtype, str(scratch / "t.zarr"))
    pairs: list[tuple[dict[str, float], dict[str, float]]] = []
    try:
        for number in range(rounds):
            order = (plain, hsx) if number % 2 == 0 else (hsx, plain)
            results = {child.kind: child.one_pass() for child in order}
            pairs.append((results["serve-plain"], results["serve-hsx"]))
            print(
                f"  round {number}: plain {results['serve-plain']['tokens_per_s']:,.0f} tok/s, "
                f"hsx {results['serve-hsx']['tokens_per_s']:,.0f} tok/s -> "
                f"{results['serve-hsx']['tokens_per_s'] / results['serve-plain']['tokens_per_s']:.3f}",
                flush=True,
            )
    finally:
        plain.close()
        hsx.close()
    import numpy as np

    ratios = np.array([h["tokens_per_s"] / p["tokens_per_s"] for p, h in pairs])
    quartiles = np.percentile(ratios, [25, 75])
    best = max(h["tokens_per_s"] for _, h in pairs) / max(p["tokens_per_s"] for p, _ in pairs)
    print(
        f"[throughput, {label}] hsx extraction / plain prefill ({int(pairs[0][1]['tokens']):,} tokens a "
        f"pass): median of {rounds} rounds {np.median(ratios):.3f} (target >= 0.9; quartiles "
        f"{quartiles[0]:.3f}-{quartiles[1]:.3f}, range {ratios.min():.3f}-{ratios.max():.3f}; "
        f"best pass of each side {best:.3f})"
    )


def child_hsx_passes(
    model: Path, dataset: Path, dtype: str, store: str, passes: int
) -> dict[str, Any]:
    """``passes`` passes of hsx's extraction in one process; the last pass's result (with the
    process's peak RSS)."""
    one_pass = hsx_runner(model, dataset, dtype, store)
    results = [one_pass() for _ in range(passes)]
    return results[-1]


def run_child(kind: str, *args: str) -> dict[str, float]:
    from flows.allocator import preload_env

    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
        env=preload_env(dict(os.environ)),
    )
    if out.returncode != 0:
        from hsx.engine.platform import exit_description

        raise RuntimeError(
            f"{kind} child failed ({exit_description(out.returncode)}):\n{out.stderr[-4000:]}"
        )
    return cast(dict[str, float], json.loads(out.stdout.strip().splitlines()[-1]))


def bench_write(total_bytes: int, repeats: int, scratch: Path, direct: bool) -> dict[str, float]:
    """hsx's ChunkWriter (Zarr + checksums) against a raw write of the same bytes, both buffered
    or both with O_DIRECT (hsx's default for local stores)."""
    import numpy as np
    import torch

    from hsx.data.tokenization import TokenizedSample
    from hsx.plan.chunks import Plan, WorkChunk, auto_rows_per_chunk, cut_chunks
    from hsx.store.zarr_store import ExtractionStore

    k, h = 4, 4096  # a mid-size model's rows: 32 KiB per token in bf16
    c = auto_rows_per_chunk(2 * k * h, 16 << 20)  # hsx's default: 16 MiB objects (C=512)
    # Conversation lengths of a chat dataset: log-normal, median 800 tokens, in [64, 4096].
    rng = np.random.default_rng(0)
    drawn = np.clip(rng.lognormal(np.log(800), 0.8, 4 * total_bytes // (2 * k * h * 800)), 64, 4096)
    ends = np.cumsum(drawn.astype(np.int32)) * (2 * k * h)
    lengths = drawn.astype(np.int32)[: max(int(np.searchsorted(ends, total_bytes)), 1)]
    chunks, starts, rows = cut_chunks(
        lengths, np.zeros(len(lengths), np.int64), np.ones(len(lengths), np.int64), c, 16384
    )
    from hsx.plan.token_spool import TokenSpool

    spool = TokenSpool()
    for length in lengths.tolist():
        spool.append(np.arange(length, dtype=np.int32), np.ones(length, dtype=np.uint8))
    plan = Plan({"bench": True}, lengths, starts, chunks, rows, c, tokens=spool)
    from hsx.store.local_io import aligned_cpu_tensor

    # Results come from the connector's page-aligned buffers: the same here.
    longest = int(lengths.max())
    states = aligned_cpu_tensor((longest, k, h), torch.bfloat16)
    states.copy_(torch.randn(longest, k, h))
    samples = [
        TokenizedSample(np.arange(n, dtype=np.int32), np.ones(n, dtype=np.uint8), False)
        for n in lengths.tolist()
    ]
    aligned = states.view(torch.int16).numpy().view(np.uint8).reshape(longest, -1)
    whole = sum(
        1
        for start, n in zip(starts.tolist(), lengths.tolist(), strict=True)
        for _ in range(-(-start // c) * c, start + n - c + 1, c)
    )
    print(
        f"  {len(lengths)} samples of median {int(np.median(lengths))} tokens; "
        f"{whole}/{rows // c} Zarr chunks lie whole inside a sample",
        flush=True,
    )
    from hsx.extraction.chunk_extraction import ChunkWriter
    from hsx.extraction.host_pipeline import CHUNKS_IN_FLIGHT, HostPipeline
    from settings import PipelineSettings

    host = HostPipeline(PipelineSettings(), queue_limit=1)  # writes only: no engine queue

    def settle() -> None:
        # Page-cache writeback of the previous pass throttles the next one: start each pass with
        # no dirty pages, so neither side pays for the other.
        os.sync()
        time.sleep(0.5)

    cpu: dict[str, float] = {"raw": float("inf"), "hsx": float("inf")}

    def raw_pass() -> float:
        raw_path = scratch / "raw.bin"
        settle()
        started, cpu_started = time.perf_counter(), _cpu_seconds()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(raw_path, flags, 0o644)
        try:
            for n in lengths.tolist():
                os.write(fd, memoryview(aligned[:n]))
        finally:
            os.close(fd)
        seconds = time.perf_counter() - started
        cpu["raw"] = min(cpu["raw"], _cpu_seconds() - cpu_started)
        raw_path.unlink()
        return seconds

    def hsx_pass() -> float:
        url = str(scratch / "w.zarr")
        meta = {
            "num_layers_captured": k,
            "hidden_size": h,
            "logical_dtype": "bfloat16",
            "layer_ids": [1, 2, 3, 4],
        }
        ExtractionStore.open_or_create(url, plan, meta)
        store = ExtractionStore.open(url, mode="r+", direct_io=direct)
        settle()
        started, cpu_started = time.perf_counter(), _cpu_seconds()

        def write_chunk(chunk: WorkChunk) -> None:
            writer = ChunkWriter(host, store, chunk)
            for index in range(chunk.sample_start, chunk.sample_end):
                writer.append([samples[index]], [states[: samples[index].num_tokens]])
            writer.finish()

        # Work chunks are written by concurrent tasks, as the flow runs them (CHUNKS_IN_FLIGHT).
        with ThreadPoolExecutor(CHUNKS_IN_FLIGHT) as chunk_tasks:
            list(chunk_tasks.map(write_chunk, plan.chunks))
        seconds = time.perf_counter() - started
        cpu["hsx"] = min(cpu["hsx"], _cpu_seconds() - cpu_started)
        shutil.rmtree(url)
        return seconds

    best_raw, best_hsx = float("inf"), float("inf")
    pair_ratios: list[float] = []  # raw time / hsx time of each pass: hsx speed relative to raw
    for rep in range(repeats):  # alternate the order: neither side always goes first
        first, second = (raw_pass, hsx_pass) if rep % 2 == 0 else (hsx_pass, raw_pass)
        times = {first: first(), second: second()}
        print(
            f"  write pass {rep} ({'O_DIRECT' if direct else 'buffered'}): raw "
            f"{times[raw_pass]:.3f} s, hsx {times[hsx_pass]:.3f} s",
            flush=True,
        )
        best_raw, best_hsx = min(best_raw, times[raw_pass]), min(best_hsx, times[hsx_pass])
        pair_ratios.append(times[raw_pass] / times[hsx_pass])
    nbytes = int(lengths.sum()) * 2 * k * h
    return {
        "bytes": nbytes,
        "raw_gb_per_s": nbytes / best_raw / 1e9,
        "hsx_gb_per_s": nbytes / best_hsx / 1e9,
        "raw_cpu_s": cpu["raw"],
        "hsx_cpu_s": cpu["hsx"],
        "median_pair_ratio": float(np.median(pair_ratios)),
        "q25": float(np.percentile(pair_ratios, 25)),
        "q75": float(np.percentile(pair_ratios, 75)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs="+")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--rounds", type=int, default=8, help="throughput rounds (a pass each side)"
    )
    parser.add_argument("--write-mib", type=int, default=1024)
    parser.add_argument("--write-passes", type=int, default=12, help="write passes per side")
    parser.add_argument("--only", choices=["throughput", "write", "memory"], default=None)
    args = parser.parse_args()
    if args.child:
        from hsx.engine.platform import enable_fault_reports, request_amx

        # Each child builds its own engine, plain vLLM included: ask for AMX as hsx's engines
        # do (vLLM's CPU kernels use it where it exists, and die of SIGILL without it), and
        # report a fault with every thread's traceback.
        request_amx()
        enable_fault_reports()
        kind, model, dataset, dtype, *rest = args.child
        if kind == "serve-plain":
            serve(plain_runner(Path(model), Path(dataset), dtype))
        elif kind == "serve-hsx":
            serve(hsx_runner(Path(model), Path(dataset), dtype, rest[0]))
        else:
            print(
                json.dumps(
                    child_hsx_passes(Path(model), Path(dataset), dtype, rest[0], int(rest[1]))
                )
            )
        return

    from hsx.data.sample_data import write_jsonl
    from hsx.data.tiny_models import ensure_tiny_models

    model = ensure_tiny_models(ROOT / "models")[args.model]
    scratch = Path(tempfile.mkdtemp(prefix="hsx-bench-", dir=ROOT))
    try:
        small = ROOT / "data" / "sample_conversations.jsonl"
        large = write_jsonl(scratch / "x10.jsonl", 3000, seed=0)
        chat = write_jsonl(scratch / "chat.jsonl", 400, seed=0, chat_lengths=True)
        from flows.allocator import preload_env

        allocator = preload_env(dict(os.environ)).get("LD_PRELOAD") or "glibc malloc"
        print(
            f"model {model.name}, dtype {args.dtype}, allocator {allocator}; "
            "datasets: bundled (300 short conversations), x10 (3000 short), chat (400 of chat "
            "length: median ~670 tokens, as ShareGPT/UltraChat)",
            flush=True,
        )
        if args.only in (None, "throughput"):
            # Chat-length conversations are what drafters are trained on; the short ones show
            # the worst case, where vLLM's per-request costs weigh most.
            for label, data in (("chat-length conversations", chat), ("short x10", large)):
                bench_throughput(model, data, label, args.dtype, args.rounds, scratch)

        if args.only in (None, "write"):
            for direct in (False, True):
                write = bench_write(args.write_mib << 20, args.write_passes, scratch, direct)
                print(
                    f"[store write, {'O_DIRECT (hsx default)' if direct else 'buffered'}] raw "
                    f"file {write['raw_gb_per_s']:.2f} GB/s ({write['raw_cpu_s']:.2f} CPU s); "
                    f"hsx Zarr+xxh3 {write['hsx_gb_per_s']:.2f} GB/s "
                    f"({write['hsx_cpu_s']:.2f} CPU s) ({write['bytes'] / 2**20:,.0f} MiB) -> "
                    f"median of the {args.write_passes} pass pairs {write['median_pair_ratio']:.3f} "
                    f"(target >= 0.9; quartiles {write['q25']:.3f}-{write['q75']:.3f}; best pass of "
                    f"each side {write['hsx_gb_per_s'] / write['raw_gb_per_s']:.3f})",
                    flush=True,
                )

        if args.only in (None, "memory"):
            # The same number of passes in each process: peak RSS is a high-water mark.
            passes = str(3)
            peaks = {
                name: run_child(
                    "hsx", str(model), str(data), args.dtype, str(scratch / f"m{name}.zarr"), passes
                )["peak_rss_mib"]
                for name, data in (("bundled", small), ("x10", large))
            }
            print(
                f"[memory] peak RSS over 3 passes: bundled {peaks['bundled']:,.0f} MiB; x10 "
                f"{peaks['x10']:,.0f} MiB -> ratio {peaks['x10'] / peaks['bundled']:.3f} "
                "(target <= 1.10)"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
