"""Regenerate-then-extract with the model loaded once, against generate-then-plain-prefill with
two loads (issue 28's last figure), in one run. Greedy on both sides (the one-load path's rule).

- two loads (what a team does without hsx's one-load flow, at its best): a process with a plain
  vLLM engine regenerates every chunk (hsx's in-process generator, measured at 1.0 of
  ``LLM.generate``), ends; a second process loads the extraction engine in-process and extracts
  the regenerated dataset (plain prefill speed);
- one load: one `hsx serve` (the extraction engine, loaded once) generates for the regeneration
  (no extraction channel) and then captures for the extraction, as the `hsx-regenerate-extract`
  flow drives it, without Prefect's task cost.

Each side is timed by the wall clock of its processes, from the interpreter's start (engine
loads included: what one load saves), and by phase (engine load, generate, plan, extract).
Dummy weights load in seconds where a real checkpoint takes minutes (Kimi-K2.5: 18), so the
script also prints how much longer a load must take for one load to win: a real load adds its
excess twice to the two-load side and once to the one-load side.
The sides alternate for ``--rounds`` rounds; both regenerations must produce the same ids.

    python bench/bench_regenerate_extract.py [--conversations 400] [--max-tokens 256] [--rounds 2]
        [--config tests/fixtures/configs/llama-3.1-8b] [--tiny]

``--tiny`` runs it on the CPU with the tiny Llama (to test this script; CPU figures are not the
goal's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def engine_spec(tiny: bool, kv_cache_gib: float) -> dict[str, Any]:
    """The engine of every side (one at a time on the device)."""
    if tiny:
        return {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_gib": 0.5}
    return {
        "dtype": "bfloat16",
        "max_model_len": 8192,
        "kv_cache_memory_gib": kv_cache_gib,
        "max_num_batched_tokens": 16384,
        "max_num_seqs": 512,
        "load_format": "dummy",
    }


def regenerate_settings(spec: dict[str, Any], out: str, urls: list[str] | None) -> Any:
    from settings import RegenerateSettings

    engine = dict(spec["engine"])
    engine |= {"url": urls} if urls else {"in_process": True}
    return RegenerateSettings(
        model=Path(spec["model"]),
        dataset=Path(spec["dataset"]),
        out=out,
        engine=engine,
        generation={
            "max_tokens": spec["max_tokens"],
            # Greedy, within the small tokenizer's ids (dummy weights would pick ids of the
            # model's whole vocabulary, which it cannot decode).
            "sampling": {"temperature": 0, "allowed_token_ids": list(range(spec["vocabulary"]))},
            "conversations_per_chunk": spec["chunk"],
        },
    )


def extract_settings(spec: dict[str, Any], dataset: str, store: str, urls: list[str] | None) -> Any:
    from settings import HsxSettings

    engine = dict(spec["engine"])
    engine |= {"url": urls} if urls else {"in_process": True}
    if not spec["tiny"]:
        engine["batch_tokens"] = 65536
    return HsxSettings(
        model=Path(spec["model"]),
        dataset=Path(dataset),
        store=store,
        engine=engine,
        data={"max_length": spec["engine"]["max_model_len"] - 1},
        run={"preflight": False},
    )


def regenerate(spec: dict[str, Any], out: str, urls: list[str] | None) -> dict[str, Any]:
    """Every chunk, as the flow runs them (bench_regenerate.hsx_side); a local engine is started
    first and its start timed apart."""
    from bench_regenerate import hsx_side

    from hsx.regeneration.generators import LocalGenerator, make_generator
    from hsx.regeneration.output import RegeneratedOutput
    from hsx.regeneration.run import RegenerationRun, load_tokenizer, plan_regeneration

    settings = regenerate_settings(spec, out, urls)
    tokenizer = load_tokenizer(settings.model)
    plan = plan_regeneration(settings, tokenizer)
    output = RegeneratedOutput(out)
    output.open_or_create(plan.frozen, len(plan.chunks), plan.conversations)
    started = time.perf_counter()
    generator = make_generator(
        settings.model, settings.engine, settings.generation.request_timeout_s, plan.sampling
    )
    try:
        if isinstance(generator, LocalGenerator):
            generator.llm  # noqa: B018 (starts the engine)
        load_s = time.perf_counter() - started
        run = RegenerationRun(settings, tokenizer, plan, generator, output)
        generate_s, rows = hsx_side(run)
    finally:
        generator.close()
    Path(out, "bench-ids.json").write_text(json.dumps({r["id"]: r["input_ids"] for r in rows}))
    generated = sum(t["generated_tokens"] for r in rows for t in r["hsx_turns"])
    return {"engine_load_s": load_s, "generate_s": generate_s, "generated_tokens": generated}


def extract(
    spec: dict[str, Any], dataset: str, store: str, urls: list[str] | None
) -> dict[str, Any]:
    """Plan and create the store, start a local engine, then every chunk
    (bench_extract.extract_every_chunk), each timed."""
    import numpy as np
    from bench_extract import extract_every_chunk

    from hsx.engine.vllm_engine import get_engine
    from hsx.extraction.run import run_spec
    from hsx.extraction.steps import plan_and_create_store

    settings = extract_settings(spec, dataset, store, urls)
    started = time.perf_counter()
    summary = plan_and_create_store(settings)
    planned = time.perf_counter()
    if not urls:  # the engine ExtractionRun.open finds loaded (bench_serve.extraction_runner)
        engine = get_engine(settings.model, settings.engine, run_spec(settings).layer_ids)
        engine.extract([np.asarray([1, 2, 3])])
    loaded = time.perf_counter()
    records = extract_every_chunk(settings, summary)
    return {
        "plan_s": planned - started,
        "engine_load_s": loaded - planned,
        "extract_s": time.perf_counter() - loaded,
        "tokens": sum(r.tokens for r in records if r),
    }


def side_regenerate(spec: dict[str, Any], out: str) -> dict[str, Any]:
    """Two loads, first process: a plain engine in-process."""
    return regenerate(spec, out, None)


def side_extract(spec: dict[str, Any], dataset: str, store: str) -> dict[str, Any]:
    """Two loads, second process: the extraction engine in-process."""
    return extract(spec, dataset, store, None)


def side_one_load(spec: dict[str, Any], out: str, store: str) -> dict[str, Any]:
    """One `hsx serve` for both jobs; the server's start (its load) timed apart."""
    from bench_serve import Server

    started = time.perf_counter()
    server = Server(spec, Path(out).with_suffix(".serve.log"))  # a log of its own
    try:
        load_s = time.perf_counter() - started
        regenerated = regenerate(spec, out, [server.url])
        extracted = extract(spec, out, store, [server.url])
    finally:
        server.stop()
    return {**regenerated, **extracted, "engine_load_s": load_s}


def run_side(spec_path: Path, *side: str) -> tuple[dict[str, Any], float]:
    """One side in a process of its own (a GPU engine's memory is surely freed when it ends):
    its JSON answer and its wall-clock seconds, the interpreter's start included."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--side", *side, "--spec", str(spec_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        from hsx.engine.platform import exit_description

        raise RuntimeError(
            f"side {side[0]}: {exit_description(done.returncode)}:\n{done.stderr[-6000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1]), seconds


def one_round(spec_path: Path, scratch: Path, number: int) -> dict[str, Any]:
    two_out, two_store = str(scratch / f"two-out-{number}"), str(scratch / f"two-{number}.zarr")
    one_out, one_store = str(scratch / f"one-out-{number}"), str(scratch / f"one-{number}.zarr")
    regenerated, regenerate_wall = run_side(spec_path, "regenerate", two_out)
    extracted, extract_wall = run_side(spec_path, "extract", two_out, two_store)
    one, one_wall = run_side(spec_path, "one", one_out, one_store)
    two_ids = json.loads(Path(two_out, "bench-ids.json").read_text())
    one_ids = json.loads(Path(one_out, "bench-ids.json").read_text())
    same = sum(one_ids.get(key) == ids for key, ids in two_ids.items())
    for path in (two_out, two_store, one_out, one_store):
        shutil.rmtree(path, ignore_errors=True)
    return {
        "regenerate": {"wall_s": regenerate_wall, **regenerated},
        "extract": {"wall_s": extract_wall, **extracted},
        "one": {"wall_s": one_wall, **one},
        "same_ids": same,
        "rows": len(two_ids),
    }


def _phases(side: dict[str, Any]) -> str:
    named = ("engine_load_s", "generate_s", "plan_s", "extract_s")
    return ", ".join(f"{k[:-2]} {side[k]:.1f}" for k in named if k in side)


def report(rounds: list[dict[str, Any]]) -> None:
    extras, ratios = [], []
    for number, found in enumerate(rounds):
        regenerated, extracted, one = found["regenerate"], found["extract"], found["one"]
        two_s = regenerated["wall_s"] + extracted["wall_s"]
        extras.append(one["wall_s"] - two_s)
        ratios.append(one["wall_s"] / two_s)
        print(
            f"round {number}: two loads {two_s:.1f} s = regenerate process "
            f"{regenerated['wall_s']:.1f} ({_phases(regenerated)}) + extract process "
            f"{extracted['wall_s']:.1f} ({_phases(extracted)}); one load {one['wall_s']:.1f} s "
            f"({_phases(one)}); one/two {one['wall_s'] / two_s:.3f}; generated "
            f"{regenerated['generated_tokens']} vs {one['generated_tokens']} tokens, extracted "
            f"{extracted['tokens']} vs {one['tokens']}; same regenerated ids "
            f"{found['same_ids']}/{found['rows']}",
            flush=True,
        )
    extra = statistics.median(extras)
    generate = statistics.median(
        r["one"]["generate_s"] / r["regenerate"]["generate_s"] for r in rounds
    )
    extract = statistics.median(r["one"]["extract_s"] / r["extract"]["extract_s"] for r in rounds)
    # A real checkpoint adds (its load - this one's) to every load: twice on the two-load side,
    # once on the one-load side, so one load wins once that difference passes `extra`.
    verdict = (
        f"one load is faster once a load takes {extra:.1f} s longer than here"
        if extra > 0
        else f"one load is faster by {-extra:.1f} s already with dummy weights"
    )
    print(
        f"REGENERATE-EXTRACT one load / two loads wall time median "
        f"{statistics.median(ratios):.3f} (rounds {', '.join(f'{r:.3f}' for r in ratios)}); "
        f"{verdict}; phase time one/two: generate {generate:.3f}, extract {extract:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--side", nargs="+", help="internal: one side in this process")
    parser.add_argument("--spec", help="internal: the run's spec (JSON)")
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=256, help="conversations per chunk")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--config", default=str(ROOT / "tests/fixtures/configs/llama-3.1-8b"))
    parser.add_argument("--kv-cache-gib", type=float, default=40.0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--no-warm-up", action="store_true", help="no untimed round first (a machine already warm)"
    )
    args = parser.parse_args()
    if args.side:
        spec = json.loads(Path(args.spec).read_text())
        name, rest = args.side[0], args.side[1:]
        sides = {"regenerate": side_regenerate, "extract": side_extract, "one": side_one_load}
        found = sides[name](spec, *rest)
        print(json.dumps(found), flush=True)
        return
    if args.tiny:
        args.conversations, args.max_tokens, args.chunk = min(args.conversations, 24), 16, 8

    from bench_regenerate import prepare

    from hsx.regeneration.run import load_tokenizer

    scratch = Path(tempfile.mkdtemp(prefix="hsx-bench-regen-extract-", dir=_scratch_parent()))
    try:
        model, dataset = prepare(args, scratch)
        spec = {
            "model": str(model),
            "dataset": str(dataset),
            "engine": engine_spec(args.tiny, args.kv_cache_gib),
            "max_tokens": args.max_tokens,
            "chunk": args.chunk,
            "vocabulary": len(load_tokenizer(model)),
            "tiny": args.tiny,
            "scratch": str(scratch),
        }
        spec_path = scratch / "spec.json"
        spec_path.write_text(json.dumps(spec))
        if not args.no_warm_up:
            one_round(spec_path, scratch, -1)  # warms the machine's caches (CUDA, imports, files)
        rounds = [one_round(spec_path, scratch, number) for number in range(args.rounds)]
        report(rounds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _scratch_parent() -> str | None:
    """/dev/shm where it is large (the GPU machine: the stores are memory-speed on both sides)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).total > 64 << 30:
        return str(shm)
    return None


if __name__ == "__main__":
    main()
