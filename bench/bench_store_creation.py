"""Store creation on an object store: requests and time to write a plan's token rows.

A store's creation writes ``input_ids`` and ``loss_mask`` from the plan, one object per C rows
each (issue 29: 200M tokens at C=256 are about 1.56M small PUTs from the one process that plans).
This bench creates the same store on moto's S3 server (127.0.0.1), through a proxy that counts
the requests, with the objects written one at a time (the baseline: hsx before) and
``CREATE_WRITERS`` at once (hsx now), alternating for ``--rounds``; it prints the PUT count, the
creation's seconds, their ratio, and both scaled linearly to ``--target-tokens``.

    .venv/bin/python bench/bench_store_creation.py [--tokens 2000000] [--rows-per-chunk 256]
        [--rounds 3] [--target-tokens 200000000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_dataset(path: Path, tokens: int, row_tokens: int = 2000) -> Path:
    """Pre-tokenized rows (input_ids, loss_mask): planning reads them without a tokenizer."""
    rng = random.Random(7)
    with path.open("w") as out:
        for start in range(0, tokens, row_tokens):
            size = min(row_tokens, tokens - start)
            ids = [rng.randrange(3, 500) for _ in range(size)]
            mask = [0] * (size // 4) + [1] * (size - size // 4)
            out.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def create_once(model: Path, dataset: Path, store: str, rows_per_chunk: int) -> float:
    from hsx.extraction.steps import plan_and_create_store
    from settings import HsxSettings

    settings = HsxSettings(
        model=model,
        dataset=str(dataset),
        store=store,
        layout={"rows_per_chunk": rows_per_chunk},
    )
    started = time.perf_counter()
    plan_and_create_store(settings)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--rows-per-chunk", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target-tokens", type=int, default=200_000_000)
    args = parser.parse_args()

    import fsspec

    from bench.bench_export import start_moto
    from hsx.data.tiny_models import ensure_tiny_models
    from hsx.store import zarr_store
    from tests.fault_proxy import FaultProxy

    server = start_moto()
    port = int(fsspec.config.conf["s3"]["endpoint_url"].rsplit(":", 1)[1])
    writers = zarr_store.CREATE_WRITERS
    try:
        with tempfile.TemporaryDirectory() as scratch, FaultProxy(port) as proxy:
            fsspec.config.conf["s3"]["endpoint_url"] = proxy.url
            model = ensure_tiny_models(Path(scratch) / "models")["tiny-llama"]
            dataset = write_dataset(Path(scratch) / "rows.jsonl", args.tokens)
            figures: dict[int, list[tuple[int, float]]] = {1: [], writers: []}
            for round_index in range(args.rounds):
                for threads in (1, writers):
                    # The baseline: this bench's own process, one side at a time.
                    zarr_store.CREATE_WRITERS = threads
                    before = proxy.requests["PUT"]
                    seconds = create_once(
                        model,
                        dataset,
                        f"s3://bench/create-{round_index}-{threads}",
                        args.rows_per_chunk,
                    )
                    puts = proxy.requests["PUT"] - before
                    figures[threads].append((puts, seconds))
                    print(
                        f"round {round_index}: {threads:2d} writer(s): {puts} PUTs in "
                        f"{seconds:.2f} s ({puts / seconds:.0f} PUT/s)",
                        flush=True,
                    )
            report(figures, writers, args)
    finally:
        zarr_store.CREATE_WRITERS = writers
        server.terminate()


def report(figures: dict[int, list[tuple[int, float]]], writers: int, args: Any) -> None:
    scale = args.target_tokens / args.tokens
    serial = statistics.median(s for _, s in figures[1])
    parallel = statistics.median(s for _, s in figures[writers])
    puts = figures[writers][0][0]
    print(
        f"STORE CREATION {args.tokens:,} tokens, C={args.rows_per_chunk}, moto S3 on 127.0.0.1: "
        f"{puts} PUTs; 1 writer {serial:.2f} s, {writers} writers {parallel:.2f} s "
        f"(speed-up {serial / parallel:.2f}x, medians of {args.rounds}); scaled to "
        f"{args.target_tokens:,} tokens: {puts * scale:,.0f} PUTs, {serial * scale / 60:.1f} min "
        f"-> {parallel * scale / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
