"""The error fp8 states add, per captured layer, against HF transformers' own bf16 spread on the
tiny models (the probe's reduced models): HF in fp32 is the reference; "bf16 spread" is HF in
bf16 against it, "fp8" is the fp32 states stored as hsx's fp8 (per-vector scales) and read back.
A ratio below 1 means fp8 storage costs less accuracy than running the model in bf16 does.

    python bench/bench_fp8_error.py [--samples 16]

Prints, per model and layer id: the mean and max relative L2 error per state vector of each,
and their ratio (fp8 / bf16 spread) of the means.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def relative_l2(found: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per state vector ``[tokens, K]``: ||found - reference|| / ||reference||."""
    return (found - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)


def measure(model_dir: Path, samples: int) -> None:
    from hsx.data.tokenization import iter_conversations, tokenize_conversation
    from hsx.model.config import read_config
    from hsx.model.layers import default_layer_ids
    from hsx.plan.building import load_tokenizer
    from hsx.preflight.hf_reference import hf_hidden_states, load_hf_model
    from hsx.store.fp8_states import dequantize, quantize

    tokenizer = load_tokenizer(model_dir)
    conversations = list(iter_conversations(ROOT / "data" / "sample_conversations.jsonl"))[:samples]
    prompts = [tokenize_conversation(tokenizer, c.messages, 2047).input_ids for c in conversations]
    text = read_config(model_dir).get("text_config") or read_config(model_dir)
    layer_ids = default_layer_ids(int(text["num_hidden_layers"]))
    fp32, bf16 = load_hf_model(model_dir), load_hf_model(model_dir, torch.bfloat16)
    reference = hf_hidden_states(fp32, prompts, layer_ids)  # each [tokens, K, H] float32
    spread = hf_hidden_states(bf16, prompts, layer_ids)
    fp8_err = torch.cat(
        [relative_l2(dequantize(*quantize(r), torch.float32), r) for r in reference]
    )  # [tokens, K]
    bf16_err = torch.cat(
        [relative_l2(s.float(), r) for s, r in zip(spread, reference, strict=True)]
    )
    print(f"\n{model_dir.name}: {len(prompts)} samples, {fp8_err.shape[0]} tokens")
    print("| layer id | fp8 mean | fp8 max | HF bf16 mean | HF bf16 max | fp8/bf16 (means) |")
    print("|---|---|---|---|---|---|")
    for k, layer in enumerate(layer_ids):
        f, b = fp8_err[:, k], bf16_err[:, k]
        print(
            f"| {layer} | {float(f.mean()):.4f} | {float(f.max()):.4f} | {float(b.mean()):.4f} | "
            f"{float(b.max()):.4f} | {float(f.mean() / b.mean()):.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    from hsx.data.tiny_models import ensure_tiny_models

    models = ensure_tiny_models(Path(tempfile.gettempdir()) / "hsx-bench-models")
    for name in ("tiny-llama", "tiny-deepseek-v3"):
        measure(models[name], args.samples)


if __name__ == "__main__":
    main()
