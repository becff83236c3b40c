"""GPU benchmark, in one call on the lent H200 (../shared/gpu/README.md brings vLLM there):
hsx extraction against plain prefill on the same engine settings and the same tokens, the
store on /dev/shm (memory: no disk limit) and on the local disk, for both engine homes
(in-process and child process), `verify` against a raw read of the same files, a raw write
with hsx's concurrency, and where hsx's time goes (engine step, device-to-host copy, append =
copy + hash into staging, write, commit).

    python bench/bench_gpu.py [--conversations 800] [--config tests/fixtures/configs/llama-3.1-8b]
        [--disk-dir /var/tmp/hsx-bench] [--sides plain,inproc,child] [--tiny]

Each side runs in its own process (a GPU engine's memory is only surely freed when its process
ends); every side processes the same token ids, asserted. Plain prefill gets its best case: one
``generate`` over all prompts (the engine never drains between calls). hsx's timed pass is the
whole job: planning (tokenize, write ids and masks), extraction, checksums and commits.
``--tiny`` runs the same on the CPU with the tiny Llama (to test this script).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The multi-GPU docs: NVLink multicast stays off in every process hsx starts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def settings_for(args: argparse.Namespace, store: str, in_process: bool) -> Any:
    from settings import HsxSettings

    engine: dict[str, Any] = {"dtype": "bfloat16", "in_process": in_process}
    if args.tiny:
        engine |= {"max_model_len": 2048, "kv_cache_memory_gib": 0.5}
        data = {"max_length": 2047}
    else:
        engine |= {
            "max_model_len": 4096,
            "kv_cache_memory_gib": args.kv_cache_gib,
            "max_num_batched_tokens": 16384,
            "batch_tokens": 65536,
            "load_format": "dummy",
        }
        data = {"max_length": 4095}
    return HsxSettings(
        model=Path(args.model_dir),
        dataset=Path(args.dataset),
        store=store,
        engine=engine,
        data=data,
        run={"preflight": False},
    )


def tokenized(settings: Any) -> list[Any]:
    from hsx.data.tokenization import iter_conversations, tokenize_conversation
    from hsx.plan.building import load_tokenizer

    tokenizer = load_tokenizer(settings.model)
    return [
        tokenize_conversation(tokenizer, c.messages, settings.data.max_length)
        for c in iter_conversations(settings.dataset)
    ]


def side_plain(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hsx.engine.options import engine_kwargs

    settings = settings_for(args, "memory://unused", True)
    kwargs = engine_kwargs(settings.model, settings.engine, (2,), "unused", "")
    kwargs.pop("speculative_config")
    kwargs.pop("kv_transfer_config")
    started = time.perf_counter()
    llm = LLM(**kwargs)
    load = time.perf_counter() - started
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
    passes = []
    for _ in range(args.passes):
        started = time.perf_counter()
        samples = tokenized(settings)
        tokenize_s = time.perf_counter() - started
        prompts = [TokensPrompt(prompt_token_ids=s.input_ids.tolist()) for s in samples]
        gen_started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)  # one call: the engine never drains
        generate_s = time.perf_counter() - gen_started
        tokens = sum(s.num_tokens for s in samples)
        passes.append(
            {
                "tokens": tokens,
                "seconds": tokenize_s + generate_s,
                "generate_seconds": generate_s,
                "tokens_per_s": tokens / (tokenize_s + generate_s),
                "generate_tokens_per_s": tokens / generate_s,
            }
        )
    return {"side": "plain", "load_seconds": load, "passes": passes}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def drop_page_cache(files: list[Path]) -> None:
    """Evict the files from the page cache, so a read measures the store, not memory (on
    /dev/shm the files are memory and stay)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(path: Path, threads: int) -> float:
    """Seconds to read every file under ``path`` with ``threads`` readers (the verify baseline)."""
    files = [f for f in path.rglob("*") if f.is_file()]
    drop_page_cache(files)

    local = threading.local()

    def read(file: Path) -> int:
        # Its best case: each thread reads into one buffer it reuses (no fresh pages).
        buffer = getattr(local, "buffer", None)
        if buffer is None:
            buffer = local.buffer = bytearray(16 << 20)
        with open(file, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
        return 0

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, files))
    return time.perf_counter() - started


class Timeline:
    """Samples the pipeline every 50 ms while a pass runs: what the store wrote, how busy the
    engine was, how much the write budget held, how many objects waited for an I/O thread. The
    report bins it, so a slow pass shows which stage ran dry or backed up, and when."""

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.host: Any = None  # the run's HostPipeline, once extract_every_chunk built it
        self.samples: list[tuple[float, ...]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Timeline:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from hsx import timings

        while not self._stop.wait(self.period):
            host = self.host
            stages = timings.snapshot()

            def get(name: str, field: str, stages: dict[str, Any] = stages) -> float:
                stage = stages.get(name) or stages.get(f"engine:{name}")
                return float(getattr(stage, field)) if stage else 0.0

            self.samples.append(
                (
                    time.perf_counter() - self._started,
                    get("write", "nbytes"),
                    get("engine_step", "seconds"),
                    get("append", "nbytes"),
                    float(host.write_budget.used) if host else 0.0,
                    float(host.io_pool._work_queue.qsize()) if host else 0.0,
                    float(host.engine_queue.queued) if host else 0.0,
                )
            )

    def binned(self, width: float = 0.5) -> list[dict[str, float]]:
        rows, last = [], (0.0,) * 7
        edge = width
        for sample in self.samples:
            if sample[0] >= edge:
                dt = sample[0] - last[0] or width
                rows.append(
                    {
                        "t": round(sample[0], 2),
                        "write_gbs": round((sample[1] - last[1]) / dt / 1e9, 2),
                        "engine_busy": round((sample[2] - last[2]) / dt, 2),
                        "append_gbs": round((sample[3] - last[3]) / dt / 1e9, 2),
                        "budget_mib": round(sample[4] / 2**20),
                        "io_queued": int(sample[5]),
                        "engine_queued_k": round(sample[6] / 1000),
                    }
                )
                last, edge = sample, edge + width
        return rows


def side_hsx(args: argparse.Namespace, in_process: bool) -> dict[str, Any]:
    import numpy as np
    from bench_extract import extract_every_chunk

    from hsx import timings
    from hsx.engine.vllm_engine import close_all_engines, get_engine
    from hsx.extraction.run import run_spec
    from hsx.extraction.steps import plan_and_create_store
    from hsx.store.verify import READERS, verify_store
    from hsx.store.zarr_store import ExtractionStore

    locations = {"shm": Path("/dev/shm/hsx-bench"), "disk": Path(args.disk_dir)}
    first = settings_for(args, str(locations["shm"] / "warm.zarr"), in_process)
    started = time.perf_counter()
    engine = get_engine(first.model, first.engine, run_spec(first).layer_ids)
    load = time.perf_counter() - started
    engine.extract([np.asarray([1, 2, 3])])  # warm-up, as for plain
    passes = []
    try:
        for spec in args.stores.split(","):
            # "disk" or "disk:io_threads=16:write_budget_mib=8192": pipeline settings per pass;
            # "shm:on_bad_states=off": the captured-state checks off (their cost, measured).
            # "shm:store_dtype=fp8_e4m3": fp8 states (capture settings go to settings.capture).
            where, *tunables = spec.split(":")
            checks = [t for t in tunables if t.startswith(("on_bad_states=", "store_dtype="))]
            tunables = [t for t in tunables if t not in checks]
            folder = locations[where] / _pass_folder(spec)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            url = str(folder / "run.zarr")
            settings = settings_for(args, url, in_process)
            if tunables:
                pipeline = {k: int(v) for k, v in (t.split("=") for t in tunables)}
                settings = settings.model_copy(
                    update={"pipeline": settings.pipeline.model_copy(update=pipeline)}
                )
            if checks:
                capture = dict(t.split("=", 1) for t in checks)
                settings = settings.model_copy(
                    update={"capture": settings.capture.model_copy(update=capture)}
                )
            # The engine process sends its totals since it started: keep them to subtract.
            engine_before = {k: v for k, v in timings.snapshot().items() if k.startswith("engine:")}
            timings.reset()
            pass_started = time.perf_counter()
            with Timeline() as timeline:
                summary = plan_and_create_store(settings)
                plan_s = time.perf_counter() - pass_started
                records = extract_every_chunk(
                    settings, summary, lambda host: setattr(timeline, "host", host)
                )
                seconds = time.perf_counter() - pass_started
            stages = {}
            for k, v in timings.snapshot().items():
                if k in engine_before:
                    b = engine_before[k]
                    v = timings.Stage(v.seconds - b.seconds, v.count - b.count, v.nbytes - b.nbytes)
                stages[k] = vars(v)
            tokens = sum(r.tokens for r in records if r)
            nbytes = _dir_bytes(Path(url))
            drop_page_cache([f for f in Path(url).rglob("*") if f.is_file()])
            verify_started = time.perf_counter()
            report = verify_store(ExtractionStore.open(url))
            verify_s = time.perf_counter() - verify_started
            raw_s = raw_read(Path(url), threads=READERS)
            passes.append(
                {
                    "store": spec,
                    "tokens": tokens,
                    "seconds": seconds,
                    "plan_seconds": plan_s,
                    "tokens_per_s": tokens / seconds,
                    "extract_tokens_per_s": tokens / (seconds - plan_s),
                    "bytes": nbytes,
                    "bytes_per_token": nbytes / max(tokens, 1),
                    "store_gb_per_s": nbytes / seconds / 1e9,
                    "verify_ok": report.ok,
                    "verify_gb_per_s": nbytes / verify_s / 1e9,
                    "raw_read_gb_per_s": nbytes / raw_s / 1e9,
                    "stages": stages,
                    "timeline": timeline.binned(),
                }
            )
            print(json.dumps({"progress": passes[-1]}), file=sys.stderr, flush=True)
            if where != "shm":  # /dev/shm stores stay for the fp8 comparison below
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        close_all_engines()
    side = "hsx-in-process" if in_process else "hsx-child-process"
    stores = {
        p["store"]: str(locations["shm"] / _pass_folder(p["store"]) / "run.zarr") for p in passes
    }
    fp8_error = fp8_against_plain(stores.get("shm"), stores.get("shm:store_dtype=fp8_e4m3"))
    shutil.rmtree(locations["shm"], ignore_errors=True)
    return {"side": side, "load_seconds": load, "passes": passes, "fp8_error": fp8_error}


def _pass_folder(spec: str) -> str:
    """The folder of one pass's store: "shm:store_dtype=fp8_e4m3" -> "shm-store_dtype-fp8_e4m3"."""
    return spec.replace(":", "-").replace("=", "-")


def fp8_against_plain(
    plain_url: str | None, fp8_url: str | None, samples: int = 64
) -> list[dict[str, float]] | None:
    """Per captured layer, the error of the fp8 store against the plain (bf16) store of the
    same run on its first ``samples`` samples, over the state vectors of that layer: max and
    mean of max|fp8 - bf16| / max|bf16|, and max and mean of ||fp8 - bf16|| / ||bf16||."""
    if not plain_url or not fp8_url or not Path(fp8_url).exists() or not Path(plain_url).exists():
        return None
    import torch

    from hsx.store.reader import HiddenStatesReader

    plain, fp8 = HiddenStatesReader(plain_url), HiddenStatesReader(fp8_url)
    chosen = plain.available_samples[:samples].tolist()
    per_vector: list[torch.Tensor] = []  # [tokens, K] each
    l2: list[torch.Tensor] = []
    for a, b in zip(plain.samples(chosen), fp8.samples(chosen), strict=True):
        x, y = a.hidden_states.float(), b.hidden_states.float()  # [tokens, K, H]
        diff = (y - x).abs()
        per_vector.append(diff.amax(-1) / x.abs().amax(-1).clamp_min(1e-30))
        l2.append(diff.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30))
    vec, rel = torch.cat(per_vector), torch.cat(l2)  # [tokens, K]
    return [
        {
            "layer_id": int(layer),
            "max_rel_to_vector_max": float(vec[:, k].max()),
            "mean_rel_to_vector_max": float(vec[:, k].mean()),
            "max_rel_l2": float(rel[:, k].max()),
            "mean_rel_l2": float(rel[:, k].mean()),
        }
        for k, layer in enumerate(plain.layer_ids)
    ]


def raw_write(folder: Path, total: int, threads: int, object_bytes: int = 16 << 20) -> float:
    """GB/s of O_DIRECT writes of 16 MiB objects with ``threads`` writers (hsx's I/O pool)."""
    import numpy as np

    from hsx.store.local_io import aligned_empty, write_local_atomic

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    buffer = aligned_empty((object_bytes,), np.dtype(np.uint8))
    buffer.fill(7)
    count = max(1, total // object_bytes)
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(
            pool.map(
                lambda i: write_local_atomic(
                    str(folder / f"o{i}"), memoryview(buffer), direct=True
                ),
                range(count),
            )
        )
    seconds = time.perf_counter() - started
    shutil.rmtree(folder, ignore_errors=True)
    return count * object_bytes / seconds / 1e9


def prepare(args: argparse.Namespace, work: Path) -> None:
    from hsx.data.sample_data import write_jsonl
    from hsx.data.tiny_models import ensure_tiny_models, train_tokenizer

    if args.tiny:
        args.model_dir = str(ensure_tiny_models(work / "models")["tiny-llama"])
    else:
        model = work / "model"
        model.mkdir(parents=True, exist_ok=True)
        config = json.loads((Path(args.config) / "config.json").read_text())
        # "num_hidden_layers=8,n_routed_experts=64": a shape that fits one card.
        for item in filter(None, args.config_override.split(",")):
            key, value = item.split("=", 1)
            config[key] = json.loads(value)
            if config[key] is None:  # "quantization_config=null": dummy bf16 weights
                del config[key]
        (model / "config.json").write_text(json.dumps(config, indent=1))
        train_tokenizer(model)  # ids < its vocabulary, a subset of the model's
        args.model_dir = str(model)
    args.dataset = str(
        write_jsonl(work / "conversations.jsonl", args.conversations, seed=7, chat_lengths=True)
    )


def run_side(args: argparse.Namespace, side: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--side", side]
    for key in (
        "conversations",
        "disk_dir",
        "model_dir",
        "dataset",
        "passes",
        "stores",
        "kv_cache_gib",
    ):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    command += ["--tiny"] if args.tiny else []
    started = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, timeout=args.side_timeout)
    if out.returncode != 0:
        from hsx.engine.platform import exit_description

        tail = (out.stdout[-2000:] + out.stderr[-4000:]).strip()
        return {"side": side, "error": f"{exit_description(out.returncode)}: {tail}"}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = time.perf_counter() - started
    return result


def report(results: list[dict[str, Any]], raw_write_gbs: float | None) -> None:
    plain = next((r for r in results if r["side"] == "plain" and "passes" in r), None)
    best_plain = max((p["tokens_per_s"] for p in plain["passes"]), default=0.0) if plain else 0.0
    print(
        "\n| side | store | tokens | tokens/s | vs plain | store GB/s | bytes/token | verify GB/s | raw read GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    if plain:
        for p in plain["passes"]:
            print(
                f"| plain | - | {p['tokens']:,} | {p['tokens_per_s']:,.0f} (generate {p['generate_tokens_per_s']:,.0f}) | 1 | - | - | - | - |"
            )
    for r in results:
        if "error" in r:
            print(f"| {r['side']} | ERROR | {r['error'][:300]} |")
            continue
        if r["side"] == "plain":
            continue
        for p in r["passes"]:
            if plain and p["tokens"] != plain["passes"][0]["tokens"]:
                raise SystemExit(
                    f"token counts differ: plain {plain['passes'][0]['tokens']}, {r['side']} {p['tokens']}"
                )
            ratio = p["tokens_per_s"] / best_plain if best_plain else float("nan")
            print(
                f"| {r['side']} | {p['store']} | {p['tokens']:,} | {p['tokens_per_s']:,.0f} | {ratio:.3f} | "
                f"{p['store_gb_per_s']:.2f} | {p['bytes_per_token']:,.0f} | {p['verify_gb_per_s']:.2f} | "
                f"{p['raw_read_gb_per_s']:.2f} |"
            )
    if raw_write_gbs is not None:
        print(f"\nraw O_DIRECT write of the disk, hsx's concurrency: {raw_write_gbs:.2f} GB/s")
    for r in results:
        if r.get("fp8_error"):
            print(
                f"\nfp8 against the bf16 states of the same run ({r['side']}, per captured layer):"
            )
            for e in r["fp8_error"]:
                print(
                    f"- layer {e['layer_id']}: |d|/max|x| per vector max {e['max_rel_to_vector_max']:.4f} "
                    f"mean {e['mean_rel_to_vector_max']:.4f}; relative L2 per vector max "
                    f"{e['max_rel_l2']:.4f} mean {e['mean_rel_l2']:.4f}"
                )
    print("\nwhere hsx's time goes (seconds summed over threads; bytes):")
    for r in results:
        for p in r.get("passes", []):
            if "stages" in p:
                line = ", ".join(
                    f"{k} {v['seconds']:.1f}s/{v['count']}"
                    + (f" {v['nbytes'] / 1e9:.1f}GB" if v["nbytes"] else "")
                    for k, v in sorted(p["stages"].items())
                )
                print(
                    f"- {r['side']} {p['store']} ({p['seconds']:.1f}s wall, plan {p['plan_seconds']:.1f}s): {line}"
                )
    print("\ntimeline (0.5 s bins: store GB/s written, engine busy fraction, GB/s appended, write")
    print("budget held MiB, objects waiting for an I/O thread, tokens queued at the engine):")
    for r in results:
        for p in r.get("passes", []):
            if p.get("timeline"):
                print(f"- {r['side']} {p['store']}:")
                print(
                    "  "
                    + " ".join(
                        f"{b['t']:.1f}:{b['write_gbs']:.2f}/{b['engine_busy']:.2f}/"
                        f"{b['append_gbs']:.2f}/{b['budget_mib']}/{b['io_queued']}/{b['engine_queued_k']}k"
                        for b in p["timeline"]
                    )
                )
    print("\nRESULTS " + json.dumps({"results": results, "raw_write_gb_per_s": raw_write_gbs}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=800)
    parser.add_argument("--config", default=str(ROOT / "tests/fixtures/configs/llama-3.1-8b"))
    parser.add_argument("--config-override", default="", help="key=json,... into config.json")
    parser.add_argument("--kv-cache-gib", type=float, default=40)
    parser.add_argument("--disk-dir", default="/var/tmp/hsx-bench")
    parser.add_argument("--sides", default="plain,inproc,child")
    parser.add_argument("--stores", default="shm,disk")
    parser.add_argument("--passes", type=int, default=2, help="plain prefill passes")
    parser.add_argument("--side-timeout", type=int, default=420)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--side")
    parser.add_argument("--model-dir")
    parser.add_argument("--dataset")
    args = parser.parse_args()
    if args.side:
        sides = {
            "plain": lambda: side_plain(args),
            "inproc": lambda: side_hsx(args, True),
            "child": lambda: side_hsx(args, False),
        }
        print(json.dumps(sides[args.side]()), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="hsx-gpu-bench-"))
    prepare(args, work)

    def disk_raw_write() -> float | None:
        if "disk" not in args.stores:
            return None
        from hsx.extraction.host_pipeline import DEFAULT_IO_THREADS

        total = 4 << 30 if args.tiny else 8 << 30
        return raw_write(Path(args.disk_dir) / "raw", total, DEFAULT_IO_THREADS)

    # Before and after the sides: a virtual disk's speed can change while it is written.
    raw_before = disk_raw_write()
    if raw_before is not None:
        print(json.dumps({"raw_write_before_gb_per_s": raw_before}), flush=True)
    results = []
    for side in args.sides.split(","):
        results.append(run_side(args, side))
        print(
            json.dumps(
                {"done": side, "summary": {k: v for k, v in results[-1].items() if k != "passes"}}
            )[:2000],
            flush=True,
        )
    raw = disk_raw_write()
    if raw_before is not None:
        print(f"\nraw O_DIRECT write before the sides: {raw_before:.2f} GB/s")
    report(results, raw)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
