"""Regeneration against plain ``LLM.generate`` on the same engine, prompts and sampling, in one
run (issue 28's figure). One vLLM engine serves both sides (built once by hsx's generator):

- hsx: ``RegenerationRun.regenerate`` over every chunk, as the flow's tasks call it (turn by
  turn, each chunk's conversations together, rows serialized, written and committed);
- plain: for each turn index, one ``LLM.generate`` over every conversation's prompt of that turn
  as hsx recorded it (``input_ids[:prompt_tokens]``), with hsx's max_tokens and seeds: the same
  work in the fewest, largest calls, nothing written.

The sides alternate for ``--rounds`` rounds; the ratio is of generated tokens per second. Each
side's generated ids must be equal (same prompts, same seeds): asserted.

    python bench/bench_regenerate.py [--conversations 400] [--max-tokens 256] [--rounds 2]
        [--config tests/fixtures/configs/llama-3.1-8b] [--kv-cache-gib 40] [--tiny] [--child]

``--tiny`` runs it on the CPU with the tiny Llama (to test this script; CPU figures are not the
goal's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    from hsx.data.sample_data import write_jsonl
    from hsx.data.tiny_models import ensure_tiny_models, train_tokenizer

    if args.tiny:
        model = ensure_tiny_models(work / "models")["tiny-llama"]
    else:
        model = work / "model"
        model.mkdir(parents=True, exist_ok=True)
        config = json.loads((Path(args.config) / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(config, indent=1))
        train_tokenizer(model)  # a chat template and ids within the model's vocabulary
    dataset = write_jsonl(
        work / "conversations.jsonl", args.conversations, seed=7, chat_lengths=True
    )
    return model, dataset


def settings_for(
    args: argparse.Namespace, model: Path, dataset: Path, out: Path, vocabulary: int
) -> Any:
    """The run's settings. Sampling keeps to the tokenizer's ids (``allowed_token_ids``): dummy
    weights would otherwise generate ids of the model's whole vocabulary, which the small
    trained tokenizer cannot decode (every turn would be empty text)."""
    from settings import RegenerateSettings

    engine: dict[str, Any] = {"dtype": "bfloat16", "in_process": not args.child}
    if args.tiny:
        engine |= {"max_model_len": 2048, "kv_cache_memory_gib": 0.5, "dtype": "float32"}
    else:
        engine |= {
            "max_model_len": 8192,
            "kv_cache_memory_gib": args.kv_cache_gib,
            "max_num_batched_tokens": 16384,
            "max_num_seqs": 512,
            "load_format": "dummy",
        }
    return RegenerateSettings(
        model=model,
        dataset=dataset,
        out=str(out),
        engine=engine,
        generation={
            "max_tokens": args.max_tokens,
            "sampling": {
                "temperature": 0.7,
                "top_p": 0.95,
                "allowed_token_ids": list(range(vocabulary)),
            },
            "conversations_per_chunk": args.chunk,
        },
    )


def hsx_side(run: Any) -> tuple[float, list[dict[str, Any]]]:
    """Every chunk of the run, CHUNKS_IN_FLIGHT at a time as the flow runs them, timed from the
    first chunk's start to the last commit; the rows written."""
    from concurrent.futures import ThreadPoolExecutor

    from hsx.regeneration.run import CHUNKS_IN_FLIGHT

    started = time.perf_counter()
    with ThreadPoolExecutor(CHUNKS_IN_FLIGHT) as pool:
        list(pool.map(lambda index: run.regenerate(index, "bench", 1), range(len(run.plan.chunks))))
    seconds = time.perf_counter() - started
    rows = [
        json.loads(line)
        for index in range(len(run.plan.chunks))
        for line in Path(run.output.part_path(index)).read_text().splitlines()
    ]
    return seconds, rows


def plain_side(
    llm: Any, rows: list[dict[str, Any]], sampling: dict[str, Any], max_tokens: int, limit: int
) -> tuple[float, int, int]:
    """One generate per turn index over every conversation's recorded prompt: seconds, tokens
    generated, and how many turns came out other than hsx's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    turns = max(len(row["hsx_turns"]) for row in rows)
    seconds, tokens, different = 0.0, 0, 0
    for k in range(turns):
        asked = [(row, row["hsx_turns"][k]) for row in rows if len(row["hsx_turns"]) > k]
        prompts = [
            TokensPrompt(prompt_token_ids=r["input_ids"][: t["prompt_tokens"]]) for r, t in asked
        ]
        params = [
            SamplingParams(
                **sampling,
                max_tokens=min(max_tokens, limit - t["prompt_tokens"]),
                seed=t["seed"],
            )
            for _, t in asked
        ]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds += time.perf_counter() - started
        for (row, turn), output in zip(asked, outputs, strict=True):
            ids = list(output.outputs[0].token_ids)
            tokens += len(ids)
            start = turn["prompt_tokens"]
            different += ids != row["input_ids"][start : start + turn["generated_tokens"]]
    return seconds, tokens, different


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=256, help="conversations per chunk")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--config", default=str(ROOT / "tests/fixtures/configs/llama-3.1-8b"))
    parser.add_argument("--kv-cache-gib", type=float, default=40.0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--child", action="store_true", help="the engine core in a child process (vLLM's default)"
    )
    args = parser.parse_args()
    if args.tiny:
        args.conversations, args.max_tokens, args.chunk = min(args.conversations, 24), 16, 8

    from hsx.regeneration.generators import LocalGenerator
    from hsx.regeneration.output import RegeneratedOutput
    from hsx.regeneration.run import RegenerationRun, load_tokenizer, plan_regeneration

    work = Path(tempfile.mkdtemp(prefix="hsx-bench-regen-"))
    try:
        model, dataset = prepare(args, work)
        tokenizer = load_tokenizer(model)
        base = settings_for(args, model, dataset, work / "out-0", len(tokenizer))
        generator = LocalGenerator(model, base.engine)
        results: dict[str, list[float]] = {"hsx": [], "plain": [], "ratio": []}
        for round_index in range(args.rounds + 1):  # round 0 warms the engine up
            settings = settings_for(
                args, model, dataset, work / f"out-{round_index}", len(tokenizer)
            )
            plan = plan_regeneration(settings, tokenizer)
            output = RegeneratedOutput(settings.out)
            output.open_or_create(plan.frozen, len(plan.chunks), plan.conversations)
            run = RegenerationRun(settings, tokenizer, plan, generator, output)
            hsx_s, rows = hsx_side(run)
            generated = sum(t["generated_tokens"] for row in rows for t in row["hsx_turns"])
            plain_s, plain_tokens, different = plain_side(
                generator.llm,
                rows,
                settings.generation.sampling,
                settings.generation.max_tokens,
                plan.max_model_len,
            )
            hsx_rate, plain_rate = generated / hsx_s, plain_tokens / plain_s
            print(
                f"round {round_index}{' (warm-up)' if round_index == 0 else ''}: hsx "
                f"{generated} tokens in {hsx_s:.2f} s = {hsx_rate:.0f} tokens/s; plain "
                f"{plain_tokens} tokens in {plain_s:.2f} s = {plain_rate:.0f} tokens/s; ratio "
                f"{hsx_rate / plain_rate:.3f}; turns generated otherwise by plain: {different} "
                f"of {sum(len(r['hsx_turns']) for r in rows)}",
                flush=True,
            )
            if round_index:
                results["hsx"].append(hsx_rate)
                results["plain"].append(plain_rate)
                results["ratio"].append(hsx_rate / plain_rate)
            shutil.rmtree(settings.out, ignore_errors=True)
        print(
            f"REGENERATION {len(rows)} conversations, max_tokens {args.max_tokens}, chunks of "
            f"{args.chunk}, engine core {'in a child process' if args.child else 'in-process'}: "
            f"hsx/plain tokens/s median {statistics.median(results['ratio']):.3f} "
            f"(rounds {', '.join(f'{r:.3f}' for r in results['ratio'])}); hsx "
            f"{statistics.median(results['hsx']):.0f} tokens/s, plain "
            f"{statistics.median(results['plain']):.0f} tokens/s"
        )
        generator.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
