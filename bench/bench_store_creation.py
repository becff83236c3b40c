"""Store creation on an object store: requests and time to write a plan's token rows.

A store's creation writes ``input_ids`` and ``loss_mask`` from the plan (issue 29: in objects of
C rows, 200M tokens at C=256 were about 1.56M small PUTs from the one process that plans).
This bench creates the same store on moto's S3 server (127.0.0.1), through a proxy that counts
the requests, three ways alternating for ``--rounds``: C-row objects written one at a time (hsx
before issue 29), C-row objects ``CREATE_WRITERS`` at once, and the token arrays in their own
larger objects (``layout.token_rows_per_object``, hsx now); it prints the PUT counts, the
creation's seconds against the first, and both scaled linearly to ``--target-tokens``.

    .venv/bin/python bench/bench_store_creation.py [--tokens 2000000] [--rows-per-chunk 256]
        [--rounds 3] [--target-tokens 200000000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_dataset(path: Path, tokens: int, row_tokens: int = 2000) -> Path:
    """Pre-tokenized rows (input_ids, loss_mask): planning reads them without a tokenizer."""
    rng = np.random.default_rng(7)
    with path.open("w") as out:
        for start in range(0, tokens, row_tokens):
            size = min(row_tokens, tokens - start)
            ids = ",".join(map(str, rng.integers(3, 500, size).tolist()))
            mask = ",".join(["0"] * (size // 4) + ["1"] * (size - size // 4))
            out.write(f'{{"input_ids": [{ids}], "loss_mask": [{mask}]}}\n')
    return path


def create_once(
    model: Path, dataset: Path, store: str, rows_per_chunk: int, token_rows: int | None
) -> float:
    from hsx.extraction.steps import plan_and_create_store
    from settings import HsxSettings

    settings = HsxSettings(
        model=model,
        dataset=str(dataset),
        store=store,
        layout={"rows_per_chunk": rows_per_chunk, "token_rows_per_object": token_rows},
    )
    started = time.perf_counter()
    plan_and_create_store(settings)
    return time.perf_counter() - started


# (name, writers, token objects of C rows?): hsx before issue 29, then each of its two steps.
SIDES = [
    ("C-row objects, 1 writer", 1, True),
    ("C-row objects, 16 writers", 16, True),
    ("large objects, 16 writers", 16, False),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--rows-per-chunk", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target-tokens", type=int, default=200_000_000)
    parser.add_argument(
        "--sides", default="0,1,2", help="which of SIDES to run (e.g. 2: hsx now only, at scale)"
    )
    args = parser.parse_args()
    sides = [SIDES[int(i)] for i in args.sides.split(",")]

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
            figures: dict[str, list[tuple[int, float]]] = {name: [] for name, _, _ in sides}
            for round_index in range(args.rounds):
                for side, (name, threads, c_rows) in enumerate(sides):
                    # The baselines: this bench's own process, one side at a time.
                    zarr_store.CREATE_WRITERS = threads
                    before = proxy.requests["PUT"]
                    seconds = create_once(
                        model,
                        dataset,
                        f"s3://bench/create-{round_index}-{side}",
                        args.rows_per_chunk,
                        args.rows_per_chunk if c_rows else None,
                    )
                    puts = proxy.requests["PUT"] - before
                    figures[name].append((puts, seconds))
                    print(
                        f"round {round_index}: {name}: {puts} PUTs in {seconds:.2f} s "
                        f"({puts / seconds:.0f} PUT/s)",
                        flush=True,
                    )
            report(figures, sides, args)
    finally:
        zarr_store.CREATE_WRITERS = writers
        server.terminate()


def report(
    figures: dict[str, list[tuple[int, float]]], sides: list[tuple[str, int, bool]], args: Any
) -> None:
    scale = args.target_tokens / args.tokens
    base_name = sides[0][0]
    base = statistics.median(s for _, s in figures[base_name])
    print(
        f"STORE CREATION {args.tokens:,} tokens, C={args.rows_per_chunk}, moto S3 on 127.0.0.1 "
        f"(medians of {args.rounds}; planning included), scaled to {args.target_tokens:,} tokens:"
    )
    for name, _, _ in sides:
        puts = figures[name][0][0]
        seconds = statistics.median(s for _, s in figures[name])
        print(
            f"  {name:<28} {puts:>7,} PUTs {seconds:7.2f} s  time {seconds / base:.3f} of "
            f"{base_name!r}; {puts * scale:>12,.0f} PUTs, {seconds * scale / 60:6.1f} min"
        )


if __name__ == "__main__":
    main()
