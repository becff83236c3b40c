"""hsx's states against HF transformers, per architecture family, on the machine it runs on
(written for the GPU: vLLM 0.26 there, bench/run_on_h200.sh brings it; runs on the CPU too).

For each family (hsx.model.families; default: all of them):
1. preflight on the family's real full-size config (tests/fixtures/configs/), with its probe: a
   reduced copy of the architecture, seeded weights, through hsx's whole path, compared with HF
   float32 (bfloat16 for MLA on GPUs);
2. the family's tiny model (hsx.data.tiny_families, built here with its HF class), every layer
   id through the engine, one prompt per step and six in one batch, against HF float32.

Each prints ``PARITY <family> ...`` lines: the check results, then max abs diff per layer id.

    python bench/gpu_parity.py [FAMILY ...] [--dtype float32|bfloat16] [--skip-preflight]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Triton's float32 dots default to TF32 on GPUs (5.7e-3..2.1e-2 against HF on the H200).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def preflight(name: str, fixture: str) -> None:
    from hsx.preflight.run import run_preflight

    started = time.perf_counter()
    report = run_preflight(ROOT / "tests" / "fixtures" / "configs" / fixture)
    print(f"== {name} ({fixture}): preflight {time.perf_counter() - started:.1f} s", flush=True)
    for result in report.results:
        if result.check == "tokenizer":
            continue  # a config-only folder has none
        print(f"PARITY {name} {result.check}: {result.status.value.upper()}: {result.summary}")
        for line in result.details[:8]:
            print(f"    {line}")


def tiny(name: str, root: Path, dtype: str) -> None:
    from hsx.data.tiny_families import TINY_FAMILIES, ensure_tiny_family
    from hsx.data.tokenization import iter_conversations, tokenize_conversation
    from hsx.engine.vllm_engine import close_all_engines, get_engine
    from hsx.plan.building import load_tokenizer
    from hsx.preflight.hf_reference import hf_hidden_states, load_hf_model
    from settings import EngineSettings

    if name not in TINY_FAMILIES:
        print(f"PARITY {name} tiny: no tiny model of this family (hsx.data.tiny_families)")
        return
    started = time.perf_counter()
    model = ensure_tiny_family(root, name)
    layers = int(json.loads((model / "config.json").read_text())["num_hidden_layers"])
    layer_ids = tuple(range(layers + 1))
    tokenizer = load_tokenizer(model)
    conversations = iter_conversations(ROOT / "data" / "sample_conversations.jsonl")
    prompts = [
        tokenize_conversation(tokenizer, c.messages, 2047).input_ids
        for c, _ in zip(conversations, range(6), strict=False)
    ]
    try:
        engine = get_engine(
            model,
            EngineSettings(dtype=dtype, max_model_len=2048, kv_cache_memory_gib=1.0),
            layer_ids,
        )
        alone = [engine.extract([prompt])[0] for prompt in prompts]
        batched = engine.extract(prompts)
    except Exception as exc:  # a family this engine cannot run: say why, go on
        print(f"PARITY {name} tiny {dtype}: ENGINE FAILED: {exc!r}"[:2000], flush=True)
        return
    finally:
        close_all_engines()
    references = hf_hidden_states(load_hf_model(model), prompts, layer_ids)
    for label, states in (("one prompt per step", alone), ("six in one batch", batched)):
        worst = [
            max(
                float((s[:, j].float().cpu() - r[:, j]).abs().max())
                for s, r in zip(states, references, strict=True)
            )
            for j in range(len(layer_ids))
        ]
        print(
            f"PARITY {name} tiny {dtype} {label}: max abs diff per id "
            + ", ".join(f"{i}: {w:.2e}" for i, w in zip(layer_ids, worst, strict=True)),
            flush=True,
        )
    largest = max(float(r.abs().max()) for r in references)
    print(f"    values up to {largest:.2f}; {time.perf_counter() - started:.1f} s", flush=True)


def main() -> None:
    from hsx.model.families import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=f"of {[f.name for f in FAMILIES]}")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--skip-preflight", action="store_true")
    args = parser.parse_args()
    known = {f.name: f for f in FAMILIES}
    unknown = [name for name in args.families if name not in known]
    if unknown:
        parser.error(f"expected families among {sorted(known)}, found {unknown}")
    root = Path(tempfile.mkdtemp(prefix="hsx-families-"))
    for name in args.families or list(known):
        family = known[name]
        if not args.skip_preflight:
            preflight(name, family.fixture)
        tiny(name, root, args.dtype)


if __name__ == "__main__":
    main()
