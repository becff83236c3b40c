"""Audit benchmark: what `hsx audit` costs, and the end-of-run audit's share of an extraction.

1. extraction: the real extraction flow (in-process, a Prefect test server) on the tiny Llama
   over chat-length conversations (--conversations, median ~670 tokens), its end-of-run audit
   (run.audit_positions, default 2,048) timed in the same run: the share of the flow's wall time
   (goal: under 2%). Then the whole store audited (every row): seconds per 1,000 positions.
2. head: the part that grows with the model, at real shapes with synthetic weights (the final
   norm and LM head through ``hsx.audit.OutputHead``, the layer statistics through
   ``LayerScan``): seconds per 1,000 positions, on the CPU and on CUDA when present.

    .venv/bin/python bench/bench_audit.py [--conversations 200] [--only extraction|head]
        [--devices cpu,cuda] [--head-positions 256]

The GPU figure needs no vLLM for part 2: `python bench/bench_audit.py --only head`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

# (name, hidden, vocabulary, captured layers): the shapes whose head cost is measured.
SHAPES = (
    ("tiny-llama", 256, 2048, 4),
    ("Llama-3.1-8B", 4096, 128_256, 4),
    ("DeepSeek-V3 / Kimi-K2", 7168, 129_280, 4),
)


def bench_extraction(models: Path, conversations: int, positions: int) -> None:
    import torch

    torch.cpu._init_amx()  # an engine built in this process must ask for AMX first (FACTS.md)
    from prefect.testing.utilities import prefect_test_harness

    from hsx.audit import audit_store
    from hsx.data.sample_data import write_jsonl
    from hsx.data.tiny_models import ensure_tiny_models
    from settings import HsxSettings

    model = ensure_tiny_models(models)["tiny-llama"]
    with tempfile.TemporaryDirectory(prefix="hsx-bench-audit-") as scratch:
        data = write_jsonl(Path(scratch) / "chat.jsonl", conversations, seed=0, chat_lengths=True)
        store = str(Path(scratch) / "store.zarr")
        settings = HsxSettings(
            model=model,
            dataset=data,
            store=store,
            engine={"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_gib": 0.5},
            data={"max_length": 2047},
            layout={"min_work_chunk_tokens": 4096},
            run={"audit_positions": positions},
        )
        with prefect_test_harness(server_startup_timeout=120):
            from flows.extract import extract_flow

            summary = extract_flow(settings)
        wall, audit = float(summary["wall_seconds"]), float(summary["audit_seconds"])
        print(
            f"extraction (tiny Llama, bf16, {conversations} chat-length conversations, "
            f"{summary['tokens']:,} tokens, {summary['chunks']} work chunks): wall {wall:.1f} s "
            f"(preflight, plan, extract at {summary['extract_tokens_per_s']:,.0f} tokens/s, "
            f"verify, audit)"
        )
        print(
            f"end-of-run audit ({summary['audit_rows']:,} rows of run.audit_positions "
            f"{positions:,}, its Prefect task included): {audit:.3f} s = "
            f"{100 * audit / wall:.2f}% of the extraction's wall time (goal < 2%): "
            f"{summary['audit']}"
        )
        started = time.perf_counter()
        report = audit_store(store, model, positions=0)
        seconds = time.perf_counter() - started
        print(
            f"whole-store audit (every row, {report.rows_read:,} rows, CPU): {seconds:.2f} s = "
            f"{1000 * seconds / report.rows_read:.3f} s per 1,000 positions "
            f"(head, layer statistics, reading; the head's load and the data's shape included)"
        )


def bench_head(devices: list[str], positions: int) -> None:
    """Seconds per 1,000 positions of the head (norm, LM head, top-5, log-sum-exp, 3 shifts)
    and of the layer statistics, at each shape, on each device."""
    import numpy as np
    import torch

    from hsx.audit.head import HeadSource, OutputHead
    from hsx.audit.layer_stats import LayerScan
    from hsx.audit.results import ChunkAudit
    from hsx.audit.scope import Window
    from hsx.trainers.final_norm import FinalNorm

    for device in devices:
        if device == "cuda" and not torch.cuda.is_available():
            print("cuda: no CUDA device here; skipped")
            continue
        label = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        for name, hidden, vocab, layers in SHAPES:
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(vocab, hidden, generator=generator).to(torch.bfloat16)
            target = torch.device(device)
            norm = FinalNorm(torch.ones(hidden, device=target), 1e-6, "bench")
            if device == "cpu":
                weight = weight.float() if weight.numel() <= 1 << 26 else weight
            else:
                weight = weight.to(target)
            source = HeadSource("bench", False, "bench", vocab, device, str(weight.dtype))
            head = OutputHead(norm, weight, source)
            states = torch.randn(positions, layers, hidden, generator=generator)  # [n, K, H]
            targets = torch.randint(0, vocab, (positions, 3), generator=generator)
            head.score(states[:8, -1], targets[:8])  # warm-up (CUDA context, kernels)
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            head.score(states[:, -1], targets)
            if device == "cuda":
                torch.cuda.synchronize()
            scored = time.perf_counter() - started
            audit = ChunkAudit(0, 1, positions, positions)
            scan = LayerScan(audit, list(range(layers)), np.zeros(positions, np.int64), 0)
            started = time.perf_counter()
            scan.add([Window(0, 0, positions, 0, positions)], [states], [None])
            scan.finish()
            scanned = time.perf_counter() - started
            print(
                f"{label}, {name} (H {hidden}, V {vocab:,}, K {layers}): head "
                f"{1000 * scored / positions:.3f} s, layer statistics (CPU) "
                f"{1000 * scanned / positions:.3f} s per 1,000 positions"
            )
            del weight, head
            if device == "cuda":
                torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--positions", type=int, default=2048, help="run.audit_positions")
    parser.add_argument("--head-positions", type=int, default=256)
    parser.add_argument("--devices", default="cpu,cuda")
    parser.add_argument("--only", choices=("extraction", "head"))
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    args = parser.parse_args()
    if args.only in (None, "extraction"):
        bench_extraction(args.models, args.conversations, args.positions)
    if args.only in (None, "head"):
        bench_head(args.devices.split(","), args.head_positions)


if __name__ == "__main__":
    main()
