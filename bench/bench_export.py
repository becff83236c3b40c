"""Export and training-read benchmark, each against a raw baseline measured in the same run:

1. Export GB/s: hsx's export of a store (read the store, serialize each sample in the
   trainer's format, hash, write atomically, record) against, in the same round:
   - a raw write of the same bytes (the same files and sizes, plain writes, the same threads),
     the export's store already in the page cache: what the export's own work costs on top
     of writing its output. Goal: 0.8.
   - a raw copy, both sides cold: the store objects each unit reads, read as plain bytes, and
     the same files written, the same threads. Reading the store is part of any export; on a
     disk (or an S3 server) that reads no faster than it writes, a raw write alone is out of
     reach for any exporter.
2. Shuffled reading: hsx's training dataset read in shuffled batches (``__getitems__``: each
   storage object a batch touches read once) against a raw read of the same objects in the
   same order (the same objects per batch, each once, plain reads). Goal: 0.8.

Local disk, and with --s3 an S3-compatible server (moto's, on 127.0.0.1) for both: there, the
local store (in the page cache) exported to S3 against a raw write of the same files to S3,
and the S3 store's cold export against a raw copy (an object store has no page cache). The store is synthetic
(bf16 states of K layers x H; lengths like chat data): no engine is needed.

    .venv/bin/python bench/bench_export.py [--samples 600] [--hidden 2048] [--rounds 3] [--s3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
K = 4
ROW_ARRAYS = ("input_ids", "loss_mask", "hidden_states")  # what a training read touches


class _NoiseEngine:
    """bf16-range states from a seeded generator: an engine stand-in for a synthetic store."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
        return [
            torch.randn(
                int(p.shape[0]), K, self.hidden, generator=torch.Generator().manual_seed(int(p[0]))
            )
            for p in prompts
        ]


def make_store(url: str, samples: int, hidden: int) -> None:
    from hsx.extraction.chunk_extraction import RunContext, extract_chunk
    from hsx.extraction.host_pipeline import HostPipeline
    from hsx.plan.chunks import Plan, cut_chunks
    from hsx.plan.token_spool import TokenSpool
    from hsx.store.zarr_store import ExtractionStore
    from settings import PipelineSettings

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.4, 0.8, samples), 32, 4096).astype(np.int32)  # median ~600
    c = max(16, (16 << 20) // (K * hidden * 2))  # ~16 MiB objects, as hsx sizes them
    chunks, starts, rows = cut_chunks(
        lengths, np.arange(samples) * 10, np.arange(samples) + 1, c, 64 * c
    )
    spool = TokenSpool()
    for n in lengths.tolist():
        spool.append(
            rng.integers(1, 30000, n).astype(np.int32), (np.arange(n) % 3 > 0).astype(np.uint8)
        )
    plan = Plan(
        {"bench": "export", "rows_per_chunk": c}, lengths, starts, chunks, rows, c, tokens=spool
    )
    meta = {
        "num_layers_captured": K,
        "hidden_size": hidden,
        "logical_dtype": "bfloat16",
        "layer_ids": [2, 16, 29, 32],
        "model": {"num_hidden_layers": 32, "path": "none", "config_hash": "bench"},
    }
    store = ExtractionStore.open_or_create(url, plan, meta)
    with HostPipeline(PipelineSettings(), queue_limit=1 << 20) as host:
        for chunk in plan.chunks:
            extract_chunk(host, store, chunk, _NoiseEngine(hidden), 8192, RunContext("bench"))
    plan.close()


def _fs(url: str) -> tuple[Any, str]:
    from hsx.store.zarr_store import fs_and_root

    return fs_and_root(url)


def export_pass(store: str, out: str, writers: int) -> tuple[float, int, list[list[int]]]:
    """hsx's export (modelopt format: no model needed); seconds, bytes, file sizes per unit."""
    from hsx.trainers.export import Exporter, plan_export

    plan = plan_export(store, out, "modelopt", unit_samples=8)  # units for every writer
    exporter = Exporter(plan)
    started = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(exporter.export_unit, range(len(plan.units))))
    manifest = exporter.finish()
    seconds = time.perf_counter() - started
    files = manifest["files"]
    per_unit = [
        [int(files[path]["bytes"]) for path in (exporter.read_part(unit.index) or {})["files"]]
        for unit in plan.units
    ]
    return seconds, sum(sum(sizes) for sizes in per_unit), per_unit


def store_objects_of_units(store: str, units: list[Any]) -> list[list[str]]:
    """Per export unit, the store objects (ids, masks, states) its samples touch."""
    from hsx.store.reader import HiddenStatesReader

    reader = HiddenStatesReader(store)
    starts, lengths = reader.store.sample_rows(0, reader.num_samples)
    c = reader.store.rows_per_chunk
    _, root = _fs(store)
    keys = {name: reader.store.array(name).metadata for name in ROW_ARRAYS}
    per_unit = []
    for unit in units:
        objects = sorted(
            {
                o
                for s in unit.samples
                for o in range(int(starts[s]) // c, -(-int(starts[s] + lengths[s]) // c))
            }
        )
        per_unit.append(
            [
                f"{root}/{name}/{keys[name].encode_chunk_key((o,) + (0,) * (len(keys[name].shape) - 1))}"
                for name in ROW_ARRAYS
                for o in objects
            ]
        )
    return per_unit


def raw_copy_pass(
    store: str, out: str, sizes: list[list[int]], writers: int, reads: list[list[str]] | None
) -> float:
    """Per unit: its store objects read as plain bytes (``reads``; None: a raw write only),
    then files of its sizes written with plain writes (no serialization, hash or rename)."""
    fs, root = _fs(out)
    store_fs, _ = _fs(store)
    payloads = {size: os.urandom(size) for unit in sizes for size in unit}
    fs.makedirs(f"{root}/raw", exist_ok=True)

    def unit(index: int) -> None:
        for path in (reads or [[]] * len(sizes))[index]:
            store_fs.cat_file(path)
        for n, size in enumerate(sizes[index]):
            fs.pipe_file(f"{root}/raw/{index:06d}-{n:04d}", payloads[size])

    started = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(unit, range(len(sizes))))
    return time.perf_counter() - started


def warm(store: str, reads: list[list[str]]) -> None:
    """The store's objects read once, into the page cache."""
    fs, _ = _fs(store)
    for path in sorted({path for unit in reads for path in unit}):
        fs.cat_file(path)


def read_pass(store: str, batches: list[list[int]]) -> tuple[float, int]:
    """hsx's dataset in shuffled batches: seconds, bytes of states delivered."""
    from hsx.trainers.datasets import SpeculatorsDataset

    dataset = SpeculatorsDataset(store)
    started = time.perf_counter()
    nbytes = 0
    for batch in batches:
        for item in dataset.__getitems__(batch):
            nbytes += item["hidden_states"].nbytes + item["verifier_last_hidden_states"].nbytes
    return time.perf_counter() - started, nbytes


def raw_read_pass(
    store: str, batches: list[list[int]], arrays: tuple[str, ...] = ROW_ARRAYS
) -> tuple[float, int]:
    """The objects of ``arrays`` that each batch touches, each once, in the same order: plain
    sequential reads. By default the same objects hsx's dataset reads (ids, masks, states)."""
    from hsx.store.reader import HiddenStatesReader

    reader = HiddenStatesReader(store)
    starts, lengths = reader.store.sample_rows(0, reader.num_samples)
    c = reader.store.rows_per_chunk
    fs, root = _fs(store)
    keys = {name: reader.store.array(name).metadata for name in arrays}
    paths = []
    for batch in batches:
        samples = [int(reader.available_samples[p]) for p in batch]
        objects = sorted(
            {
                o
                for s in samples
                for o in range(int(starts[s]) // c, -(-int(starts[s] + lengths[s]) // c))
            }
        )
        paths.append(
            [
                f"{root}/{name}/{keys[name].encode_chunk_key((o,) + (0,) * (len(keys[name].shape) - 1))}"
                for name in arrays
                for o in objects
            ]
        )
    started = time.perf_counter()
    nbytes = 0
    for group in paths:
        for path in group:
            nbytes += len(fs.cat_file(path))
    return time.perf_counter() - started, nbytes


def drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError):  # root only: cold reads on both sides
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def start_moto() -> subprocess.Popen[bytes]:
    import fsspec

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    fsspec.config.conf["s3"] = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "k",
        "secret": "s",
    }
    fsspec.filesystem("s3").mkdir("bench")
    return server


def bench(where: str, base: str, args: argparse.Namespace) -> None:
    store = f"{base}/store.zarr"
    started = time.perf_counter()
    make_store(store, args.samples, args.hidden)
    print(
        f"[{where}] store of {args.samples} samples (K={K}, H={args.hidden}, bf16) in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    ratios: list[float] = []
    copy_ratios: list[float] = []
    read_ratios: list[float] = []
    rng = np.random.default_rng(1)
    for round_index in range(args.rounds):
        out = f"{base}/export-{round_index}"
        if not args.read_only:
            export_figures(where, store, out, args, ratios, copy_ratios)
        order = rng.permutation(args.samples)
        batches = [order[i : i + args.batch].tolist() for i in range(0, len(order), args.batch)]
        drop_caches()
        hsx_s, delivered = read_pass(store, batches)
        drop_caches()
        raw_s, raw_bytes = raw_read_pass(store, batches)
        drop_caches()
        states_s, _ = raw_read_pass(store, batches, ("hidden_states",))
        read_ratios.append(raw_s / hsx_s)
        print(
            f"[{where}] shuffled read {len(order) / hsx_s:,.0f} samples/s, {delivered / hsx_s / 1e9:.2f} GB/s of "
            f"states; raw read of the same objects (ids, masks, states) {raw_bytes / raw_s / 1e9:.2f} GB/s: "
            f"ratio {raw_s / hsx_s:.3f}; of the state objects alone: ratio {states_s / hsx_s:.3f}",
            flush=True,
        )
    export = (
        f"export/raw write {statistics.median(ratios):.3f} (store warm; goal 0.8), "
        if ratios
        else ""
    )
    if copy_ratios:
        export += f"export/raw copy {statistics.median(copy_ratios):.3f} (cold), "
    print(
        f"[{where}] median of {args.rounds}: {export}"
        f"shuffled read/raw read {statistics.median(read_ratios):.3f} (goal 0.8)",
        flush=True,
    )


def export_figures(
    where: str,
    store: str,
    out: str,
    args: argparse.Namespace,
    ratios: list[float],
    copy_ratios: list[float],
) -> None:
    """One round of the export figures (see the module docstring); its folders removed after."""
    from hsx.trainers.export import plan_export

    units = plan_export(store, f"{out}-cold", "modelopt", unit_samples=8).units
    reads = store_objects_of_units(store, units)
    drop_caches()
    cold, nbytes, sizes = export_pass(store, f"{out}-cold", args.writers)
    drop_caches()
    raw = raw_copy_pass(store, f"{out}-copy", sizes, args.writers, reads)
    copy_ratios.append(raw / cold)
    print(
        f"[{where}] export {nbytes / cold / 1e9:.2f} GB/s (cold), raw copy (the same store "
        f"objects read, the same bytes written) {nbytes / raw / 1e9:.2f} GB/s: ratio {raw / cold:.3f}",
        flush=True,
    )
    folders = [f"{out}-cold", f"{out}-copy"]
    if where == "local":  # the baseline: the export's own work on top of its writes
        drop_caches()
        warm(store, reads)
        seconds, nbytes, sizes = export_pass(store, f"{out}-warm", args.writers)
        drop_caches()
        raw = raw_copy_pass(store, f"{out}-raw", sizes, args.writers, None)
        ratios.append(raw / seconds)
        print(
            f"[{where}] export {nbytes / seconds / 1e9:.2f} GB/s (store in the page cache), "
            f"raw write {nbytes / raw / 1e9:.2f} GB/s: ratio {raw / seconds:.3f}",
            flush=True,
        )
        folders += [f"{out}-warm", f"{out}-raw"]
    for folder in folders:
        fs, root = _fs(folder)
        fs.rm(root, recursive=True)


def export_to_s3_figures(store: str, args: argparse.Namespace) -> None:
    """A local store (in the page cache) exported to S3 against a raw write of the same files
    to S3: the issue's baseline where the writes go to an object store."""
    from hsx.trainers.export import plan_export

    ratios = []
    for round_index in range(args.rounds):
        out = f"s3://bench/from-local-{round_index}"
        reads = store_objects_of_units(
            store, plan_export(store, out, "modelopt", unit_samples=8).units
        )
        drop_caches()
        warm(store, reads)
        seconds, nbytes, sizes = export_pass(store, out, args.writers)
        raw = raw_copy_pass(store, f"{out}-raw", sizes, args.writers, None)
        ratios.append(raw / seconds)
        print(
            f"[local -> s3] export {nbytes / seconds / 1e9:.2f} GB/s (local store in the page "
            f"cache), raw write to S3 {nbytes / raw / 1e9:.2f} GB/s: ratio {raw / seconds:.3f}",
            flush=True,
        )
        for folder in (out, f"{out}-raw"):
            fs, root = _fs(folder)
            fs.rm(root, recursive=True)
    print(
        f"[local -> s3] median of {args.rounds}: export/raw write {statistics.median(ratios):.3f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--s3", action="store_true", help="also on moto's S3 server")
    parser.add_argument("--read-only", action="store_true", help="only the shuffled-read figure")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="hsx-bench-export-", dir=os.environ.get("BENCH_DIR"))
    try:
        bench("local", scratch, args)
        if args.s3:
            server = start_moto()
            try:
                if not args.read_only:
                    export_to_s3_figures(f"{scratch}/store.zarr", args)
                bench("s3", "s3://bench/run", args)
            finally:
                server.terminate()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
