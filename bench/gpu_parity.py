"""On the GPU: hsx's preflight on the public Llama-3.1-8B and DeepSeek-V3 configs. Its static
checks run against the installed vLLM (layout names, cache shape, EngineArgs fields, signatures)
and its probe extracts a reduced copy of each architecture (seeded weights) through hsx's whole
path and compares every captured state with HF transformers in float32.

    python bench/gpu_parity.py [llama-3.1-8b deepseek-v3]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from hsx.preflight.run import run_preflight

    names = sys.argv[1:] or ["llama-3.1-8b", "deepseek-v3"]
    for name in names:
        started = time.perf_counter()
        report = run_preflight(ROOT / "tests" / "fixtures" / "configs" / name)
        print(f"== {name}: {time.perf_counter() - started:.1f} s")
        for result in report.results:
            print(f"PARITY {name} {result.check}: {result.status.value.upper()}: {result.summary}")
            for line in result.details[:6]:
                print(f"    {line}")
    # float32 on the GPU, reported (not judged): vLLM's Triton attention uses TF32 dots.
    from hsx.model.config import read_config, text_config
    from hsx.preflight.probe import run_probe
    from settings import EngineSettings

    config = read_config(ROOT / "tests" / "fixtures" / "configs" / "llama-3.1-8b")
    fp32 = run_probe(
        config, text_config(config), (2, 16, 29, 32), 1, EngineSettings(), dtype="float32"
    )
    print(f"PARITY llama-3.1-8b probe float32: {fp32.status.value.upper()}: {fp32.summary[:300]}")


if __name__ == "__main__":
    main()
