"""Extraction through `hsx serve` (issue 13) against in-process extraction and against plain
prefill through the same server, measured in one run (machines are noisy).

Three sides, each loaded once and kept loaded, timed in lockstep rounds (one pass of each per
round, the order rotating); the figures are the medians of the rounds' ratios:
- served: hsx's extraction of every work chunk into a fresh store, the chunks sent to an
  `hsx serve` server (engine.url) as the flow sends them (its concurrency), without Prefect;
- served-plain: the same token ids as completions to the same server with no extraction (no
  kv_transfer_params: the connector leaves them alone), one request per batch of
  engine.batch_tokens as hsx sends them, with as many tokens in flight;
- inproc: hsx's extraction with the engine in the extracting process (engine.url unset), in a
  process of its own, into a fresh store.

    .venv/bin/python bench/bench_serve.py [--rounds 5] [--conversations 400]   (CPU, tiny Llama)
    python3 bench/bench_serve.py --gpu  (the lent H200: the Llama-3.1-8B shape, dummy bf16)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from bench_extract import Child, extract_every_chunk  # noqa: E402 (after the path)


def bench_engine(gpu: bool, dtype: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Engine and data settings of both engines (server and in-process)."""
    if gpu:
        import torch

        total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        engine = {
            "dtype": "bfloat16",
            "max_model_len": 4096,
            # Two engines share the GPU, the server's and inproc's: under half of it each, the
            # 8B's 15 GiB of weights and ~5 GiB of activations aside (H200: 24, H100: 15 GiB).
            "kv_cache_memory_gib": min(24, int(total_gib * 0.45 - 20)),
            "gpu_memory_utilization": 0.45,
            "max_num_batched_tokens": 16384,
            "batch_tokens": 65536,
            "load_format": "dummy",
        }
        return engine, {"max_length": 4095}
    return {"dtype": dtype, "max_model_len": 2048, "kv_cache_memory_gib": 0.5}, {"max_length": 2047}


def bench_settings(spec: dict[str, Any], store: str, urls: list[str] | None) -> Any:
    from settings import HsxSettings

    engine = dict(spec["engine"])
    if urls is not None:
        engine["url"] = urls
    else:
        engine["in_process"] = True
    return HsxSettings(
        model=Path(spec["model"]),
        dataset=Path(spec["dataset"]),
        store=store,
        engine=engine,
        data=spec["data"],
        layout={"min_work_chunk_tokens": 4096},
        run={"preflight": False},
    )


def extraction_runner(
    spec: dict[str, Any], urls: list[str] | None
) -> Callable[..., dict[str, float]]:
    """hsx's extraction of every work chunk into a fresh store (planning excluded, engine
    loaded or server connected before the timer starts); ``keep``: the store's URL, kept."""
    from hsx.extraction.run import run_spec
    from hsx.extraction.steps import plan_and_create_store

    passes = 0
    scratch = Path(spec["scratch"])

    def warm_up(settings: Any) -> None:
        if urls is None:
            import numpy as np

            from hsx.engine.vllm_engine import get_engine

            engine = get_engine(settings.model, settings.engine, run_spec(settings).layer_ids)
            engine.extract([np.asarray([1, 2, 3])])
        else:
            from hsx.preflight.servers import check_servers

            result = check_servers(settings, run_spec(settings))
            if result.status.value == "fail":
                raise RuntimeError(f"server check: {result.summary}")

    def one_pass(keep: str | None = None) -> dict[str, float]:
        nonlocal passes
        store = keep or str(scratch / f"{'served' if urls else 'inproc'}-{passes}")
        settings = bench_settings(spec, store, urls)
        passes += 1
        summary = plan_and_create_store(settings)
        warm_up(settings)
        started = time.perf_counter()
        records = extract_every_chunk(settings, summary)
        seconds = time.perf_counter() - started
        tokens = sum(r.tokens for r in records if r)
        if keep is None:
            shutil.rmtree(settings.store, ignore_errors=True)
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}

    return one_pass


def serve_child(one_pass: Callable[..., dict[str, float]]) -> None:
    """The in-process side's loop: "pass" (a timed pass) or "keep URL" (a pass whose store is
    kept, for the comparison of states), one JSON answer per line."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["pass"]:
            print(json.dumps(one_pass()), flush=True)
        elif command[:1] == ["keep"]:
            print(json.dumps(one_pass(keep=command[1])), flush=True)
        else:
            return


def compare_served_and_inproc(spec: dict[str, Any], urls: list[str], inproc: Child) -> str:
    """One more pass of each side keeping its store: the served states against the in-process
    engine's, sample by sample (the same engine settings and tokens)."""
    from tests.stores import compare_stores

    scratch = Path(spec["scratch"])
    served, local = str(scratch / "keep-served"), str(scratch / "keep-inproc")
    extraction_runner(spec, urls)(keep=served)
    inproc.ask(f"keep {local}")
    difference = compare_stores(served, local)
    shutil.rmtree(served, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    return (
        f"served states vs in-process states: {difference.samples} samples, "
        f"{difference.tokens:,} tokens, the same token ids and masks; max |diff| "
        f"{difference.max_abs_hidden:.3g}"
    )


def plain_runner(spec: dict[str, Any], urls: list[str]) -> Callable[[], dict[str, float]]:
    """The same token ids through the same servers, without extraction, batched and queued as
    hsx batches and queues them (one engine queue's worth per server, batches dealt in turn)."""
    import httpx
    from bench_gpu import tokenized

    from hsx.engine.homes import engine_queue_tokens
    from hsx.extraction.chunk_extraction import batches

    settings = bench_settings(spec, "memory://unused", urls)
    samples = tokenized(settings)
    batch_tokens = settings.engine.batch_tokens
    in_flight = max(1, engine_queue_tokens(settings) // batch_tokens)  # one engine's per server
    name = Path(spec["model"]).name
    groups = [[s.input_ids.tolist() for s in batch] for batch in batches(samples, batch_tokens)]
    tokens = sum(s.num_tokens for s in samples)

    async def run() -> float:
        limits = [asyncio.Semaphore(in_flight) for _ in urls]
        clients = [httpx.AsyncClient(base_url=url, timeout=3600) for url in urls]
        try:

            async def send(server: int, prompts: list[list[int]]) -> None:
                async with limits[server]:
                    body = {"model": name, "prompt": prompts, "max_tokens": 1, "temperature": 0.0}
                    response = await clients[server].post("/v1/completions", json=body)
                    response.raise_for_status()

            await asyncio.gather(*(send(i, [[1, 2, 3]]) for i in range(len(urls))))  # warm-up
            started = time.perf_counter()
            await asyncio.gather(*(send(i % len(urls), g) for i, g in enumerate(groups)))
            return time.perf_counter() - started
        finally:
            for client in clients:
                await client.aclose()

    def one_pass() -> dict[str, float]:
        seconds = asyncio.run(run())
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}

    return one_pass


class Server:
    """`hsx serve` with the bench's engine settings, in a process of its own."""

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        engine = spec["engine"]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "HSX_SERVER__STATE_DIR": str(Path(spec["scratch"]) / "serve-state"),
            "HSX_ENGINE__MAX_NUM_BATCHED_TOKENS": str(engine.get("max_num_batched_tokens", 8192)),
        }
        command = [
            sys.executable,
            "-m",
            "flows.cli",
            "serve",
            spec["model"],
            "--port",
            str(self.port),
        ]
        command += ["--dtype", engine["dtype"], "--max-model-len", str(engine["max_model_len"])]
        command += ["--kv-cache-gib", str(engine["kv_cache_memory_gib"]), "--no-probe"]
        if "load_format" in engine:
            command += ["--load-format", engine["load_format"]]
        if "gpu_memory_utilization" in engine:
            env["HSX_ENGINE__GPU_MEMORY_UTILIZATION"] = str(engine["gpu_memory_utilization"])
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env
            )
        deadline = time.monotonic() + 900
        while "hsx serve: ready at" not in log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                from hsx.engine.platform import exit_description

                ended = exit_description(self.process.poll())
                raise RuntimeError(f"hsx serve did not start ({ended}):\n{log.read_text()[-4000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def lockstep(sides: dict[str, Callable[[], dict[str, float]]], rounds: int) -> list[dict[str, Any]]:
    names = list(sides)
    results = []
    for number in range(rounds):
        order = names[number % len(names) :] + names[: number % len(names)]
        found: dict[str, Any] = {}
        for name in order:
            time.sleep(1.0)  # each pass starts on a quiet machine
            found[name] = sides[name]()
        results.append(found)
        ratios = ", ".join(
            f"served/{n} {found['served']['tokens_per_s'] / found[n]['tokens_per_s']:.3f}"
            for n in names
            if n != "served"
        )
        print(
            f"  round {number}: "
            + ", ".join(f"{n} {found[n]['tokens_per_s']:,.0f} tok/s" for n in names)
            + f" -> {ratios}",
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", nargs=2, help="internal: inproc SPEC_JSON")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", help="CPU: the tiny Llama's dtype")
    parser.add_argument(
        "--servers",
        type=int,
        default=1,
        help="servers of one run (>1: on one GPU they share it, and no in-process side runs)",
    )
    parser.add_argument("--config", default=str(ROOT / "tests/fixtures/configs/llama-3.1-8b"))
    parser.add_argument(
        "--config-override", default="", help="key=json,... over the config (bench_gpu.prepare)"
    )
    args = parser.parse_args()
    if args.child:
        spec = json.loads(Path(args.child[1]).read_text())
        serve_child(extraction_runner(spec, None))
        return

    from hsx.data.sample_data import write_jsonl

    scratch = Path(
        tempfile.mkdtemp(prefix="hsx-bench-serve-", dir="/dev/shm" if args.gpu else None)
    )
    servers: list[Server] = []
    inproc: Child | None = None
    try:
        if args.gpu:
            from bench_gpu import prepare

            args.tiny, args.model_dir = False, None
            prepare(args, scratch)
            model = args.model_dir
        else:
            from hsx.data.tiny_models import ensure_tiny_models

            model = str(ensure_tiny_models(ROOT / "models")["tiny-llama"])
        engine, data = bench_engine(args.gpu, args.dtype)
        spec = {"model": model, "engine": engine, "data": data, "scratch": str(scratch)}
        datasets = {
            "chat-length conversations": write_jsonl(
                scratch / "chat.jsonl", args.conversations, seed=7, chat_lengths=True
            )
        }
        if not args.gpu:  # short ones: where per-request costs weigh most
            datasets["short conversations (bundled x10)"] = write_jsonl(
                scratch / "short.jsonl", 3000, seed=0
            )
        if args.gpu and args.servers > 2:  # the GPU's memory shared by every server
            engine["gpu_memory_utilization"] = round(0.9 / args.servers, 2)
            engine["kv_cache_memory_gib"] = engine["kv_cache_memory_gib"] * 2 // args.servers
        servers = [Server(spec, scratch / f"serve-{i}.log") for i in range(args.servers)]
        urls = [server.url for server in servers]
        print(f"model {Path(model).name}, engine {engine}; servers {urls}", flush=True)
        for label, dataset in datasets.items():
            spec["dataset"] = str(dataset)
            spec_path = scratch / "spec.json"
            spec_path.write_text(json.dumps(spec))
            sides = {
                "served": extraction_runner(spec, urls),
                "served-plain": plain_runner(spec, urls),
            }
            if args.servers == 1:
                inproc = Child("inproc", str(spec_path), script=__file__)
                sides["inproc"] = inproc.one_pass
            results = lockstep(sides, args.rounds)
            if inproc is not None:
                print("  " + compare_served_and_inproc(spec, urls, inproc), flush=True)
                inproc.close()
                inproc = None
            tokens = int(results[0]["served"]["tokens"])
            ratios = {
                key: _median(
                    [r["served"]["tokens_per_s"] / r[key]["tokens_per_s"] for r in results]
                )
                for key in sides
                if key != "served"
            }
            speeds = {n: _median([r[n]["tokens_per_s"] for r in results]) for n in sides}
            print(
                f"[{label}, {len(urls)} server(s), {tokens:,} tokens a pass, median of "
                f"{args.rounds} rounds] hsx through `hsx serve` / plain prefill through the same "
                f"server(s): {ratios['served-plain']:.3f}"
                + (
                    f"; / in-process hsx extraction: {ratios['inproc']:.3f}"
                    if "inproc" in ratios
                    else ""
                )
                + " (tokens/s: "
                + ", ".join(f"{n} {v:,.0f}" for n, v in speeds.items())
                + ")",
                flush=True,
            )
    finally:
        if inproc is not None:
            inproc.close()
        for server in servers:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
