"""Generation on the extraction engine against a plain engine, same model, prompts and seeds.

hsx's extraction engine is vLLM with the ``extract_hidden_states`` speculative method (and, for
`hsx serve`, hsx's connector). Regenerating through it would load the model once for both jobs;
this measures whether its generations are those of a plain engine:

- greedy: the generated ids of both sides must be equal;
- sampled (temperature 0.8, top_p 0.95, one seed per request): the share of generated tokens
  equal to the token before them (a plain engine on random weights almost never repeats), and
  the share of requests whose ids equal the plain side's;
- tokens/s of each side over the same greedy requests.

Each side runs in its own process (one engine at a time on the device).

    python bench/bench_capture_sampling.py [--model models/tiny-llama] [--requests 300]
        [--max-tokens 32] [--dtype float32]
    # on a GPU: Llama-3.1-8B's shape, dummy weights (prompts are ids: any tokenizer will do)
    python bench/bench_capture_sampling.py --config tests/fixtures/configs/llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --requests 256 --max-tokens 128 --kv-cache-gib 20
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from queue import Empty
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def side(capture: bool, args: argparse.Namespace, queue: Any) -> None:
    """One engine's generations: greedy ids, sampled ids, greedy tokens/s."""
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": 1024,
        # Every prompt prefilled whole: vLLM's CPU worker fails a seeded request whose prefill
        # is split ("CPU Generator does not use offset").
        "max_num_batched_tokens": 32 * args.requests,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "seed": 0,
        "load_format": args.load_format,
    }
    if args.kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    if capture:  # as hsx.engine.options builds it (the connector only moves the states)
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}},
        }
    llm = LLM(**kwargs)
    prompts = [
        {"prompt_token_ids": [1, *[(7 * i + 3 * j) % 900 + 10 for j in range(24)]]}
        for i in range(args.requests)
    ]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:8], greedy)  # warm-up
    started = time.perf_counter()
    greedy_out = llm.generate(prompts, greedy)
    seconds = time.perf_counter() - started
    sampled_params = [
        SamplingParams(
            max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True
        )
        for i in range(args.requests)
    ]
    sampled_out = llm.generate(prompts, sampled_params)
    queue.put(
        {
            "greedy": [list(o.outputs[0].token_ids) for o in greedy_out],
            "sampled": [list(o.outputs[0].token_ids) for o in sampled_out],
            "greedy_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in greedy_out) / seconds,
        }
    )
    llm.llm_engine.engine_core.shutdown()  # its processes end now, not when the device is needed


def model_of_shape(config_dir: Path) -> str:
    """A model folder with ``config_dir``'s config.json and a small trained tokenizer (the
    weights come from --load-format dummy)."""
    import tempfile

    from hsx.data.tiny_models import train_tokenizer

    model = Path(tempfile.mkdtemp(prefix="hsx-shape-"))
    (model / "config.json").write_text((config_dir / "config.json").read_text())
    train_tokenizer(model)
    return str(model)


def repeat_rate(outputs: list[list[int]]) -> float:
    pairs = [(a, b) for ids in outputs for a, b in itertools.pairwise(ids)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def run_side(capture: bool, args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=side, args=(capture, args, queue))
    process.start()
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            result = queue.get(timeout=5)
        except Empty:
            if not process.is_alive():
                raise RuntimeError(
                    f"{'capture' if capture else 'plain'} side: expected its results, found its "
                    f"process exited with {process.exitcode} (its log is above)"
                ) from None
            continue
        process.join(timeout=120)
        if process.is_alive():
            process.kill()
        return dict(result)
    process.kill()
    raise TimeoutError(f"expected a side within --timeout {args.timeout} s, found none")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models/tiny-llama"))
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--config", help="a config.json folder: a model of that shape is made")
    args = parser.parse_args()
    if args.config:
        args.model = model_of_shape(Path(args.config))
    plain = run_side(False, args)
    capture = run_side(True, args)
    same_greedy = sum(a == b for a, b in zip(plain["greedy"], capture["greedy"], strict=True))
    same_sampled = sum(a == b for a, b in zip(plain["sampled"], capture["sampled"], strict=True))
    report = {
        "requests": args.requests,
        "greedy_equal": f"{same_greedy}/{args.requests}",
        "sampled_equal": f"{same_sampled}/{args.requests}",
        "sampled_repeat_rate_plain": round(repeat_rate(plain["sampled"]), 4),
        "sampled_repeat_rate_capture": round(repeat_rate(capture["sampled"]), 4),
        "greedy_tokens_per_s_plain": round(plain["greedy_tokens_per_s"], 1),
        "greedy_tokens_per_s_capture": round(capture["greedy_tokens_per_s"], 1),
        "capture_over_plain_tokens_per_s": round(
            capture["greedy_tokens_per_s"] / plain["greedy_tokens_per_s"], 3
        ),
    }
    print("CAPTURE-SAMPLING " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
