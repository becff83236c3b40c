"""On a GPU: the copier's fp8 path (quantized on the device, packed, copied to pinned memory)
against the CPU's quantization of the same rows, bit for bit; and the bytes it moves.

    python3 bench/gpu_fp8_copier.py   # prints FP8-COPIER OK or what differed
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.engine.copier import DeviceToHostCopier
from hsx.store.fp8_states import pack, unpack


@dataclass
class _Job:
    key: str
    num_tokens: int


def main() -> int:
    if not torch.cuda.is_available():
        print("FP8-COPIER SKIPPED: no CUDA device")
        return 0
    blocks, block_size, layers, hidden = 512, 16, 4, 7168
    generator = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(blocks, block_size, layers, hidden, device="cuda", generator=generator).to(
        torch.bfloat16
    )
    cache *= (
        torch.tensor([0.05, 1.0, 30.0, 900.0], device="cuda")
        .view(1, 1, layers, 1)
        .to(torch.bfloat16)
    )
    cache[3, 2, 1] = 0  # an all-zero vector: scale 0
    index = torch.randperm(blocks, device="cuda")[:256]
    jobs = [_Job("a", 1000), _Job("b", 3000 - 8), _Job("c", 96)]
    starts = [0, 1008, 4000]
    delivered: dict[str, torch.Tensor] = {}
    done = threading.Event()

    def deliver(key: str, rows: torch.Tensor | BaseException) -> None:
        if isinstance(rows, BaseException):
            raise rows
        delivered[key] = rows.clone()
        if len(delivered) == len(jobs):
            done.set()

    for encode, name in ((None, "bf16"), (pack, "fp8 packed")):
        delivered.clear()
        done.clear()
        copier = DeviceToHostCopier(torch.device("cuda"), deliver)
        started = time.perf_counter()
        copier.submit(cache, index, jobs, starts, None, encode)
        done.wait(60)
        seconds = time.perf_counter() - started
        copier.close()
        moved = sum(rows.nbytes for rows in delivered.values())
        print(f"{name}: {moved / 1e6:.1f} MB delivered in {seconds * 1e3:.1f} ms")
    rows = cache[index].reshape(-1, layers, hidden).cpu()  # [tokens, K, H] as gathered
    bad = []
    for job, start in zip(jobs, starts, strict=True):
        q, scales = unpack(delivered[job.key])
        expected_q, expected_scales = unpack(pack(rows[start : start + job.num_tokens]))
        if not torch.equal(q, expected_q) or not torch.equal(
            scales.view(torch.int32), expected_scales.view(torch.int32)
        ):
            bad.append(job.key)
            differ = (q != expected_q).nonzero()
            print(
                f"{job.key}: {differ.shape[0]} of {q.numel()} fp8 bytes differ (first at "
                f"{differ[:3].tolist()}: device {q[tuple(differ[0])].item() if len(differ) else '-'}, "
                f"cpu {expected_q[tuple(differ[0])].item() if len(differ) else '-'}); scales equal: "
                f"{torch.equal(scales, expected_scales)}, max rel diff "
                f"{float(((scales - expected_scales).abs() / expected_scales.abs().clamp_min(1e-30)).max()):.3e}"
            )
    print(
        "FP8-COPIER OK: device packing bit-equal to the CPU's"
        if not bad
        else f"FP8-COPIER DIFF {bad}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
