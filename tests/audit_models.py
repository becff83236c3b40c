"""A small model folder (config.json, its final norm and LM head as safetensors) and real stores
written through hsx's own writer from states built for it, for the audit's unit tests: at every
loss-masked position the final state points at the next token through the model's norm and
head, as a target's greedy output would; the other layers are noise of their own scale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsx.data.regenerated import FORMAT_NAME, MANIFEST
from hsx.extraction.chunk_extraction import RunContext, extract_chunk
from hsx.extraction.host_pipeline import HostPipeline
from hsx.plan.building import config_hash
from hsx.plan.chunks import Plan, cut_chunks
from hsx.plan.token_spool import TokenSpool
from hsx.store.zarr_store import ExtractionStore

H = V = 64  # hidden size and vocabulary
LAYERS = 4  # decoder layers: id 4 is the final pre-norm state
LAYER_IDS = (1, 2, 4)
LENGTHS = (20, 35, 12, 40, 28, 50, 16, 33, 24, 45)


def model_config(tied: bool = False) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "num_hidden_layers": LAYERS,
        "vocab_size": V,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
    }


def write_model(folder: Path, tied: bool = False, head: bool = True, seed: int = 0) -> Path:
    """A model folder whose head is the identity plus noise and whose norm weight is not 1
    (so that a state stored after the norm is told from one before it by the weight)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weight = torch.eye(V, H) + 0.05 * torch.randn(V, H, generator=generator)  # [V, H]
    tensors = {"model.norm.weight": 0.5 + torch.rand(H, generator=generator)}
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    if head or tied:
        tensors[name] = weight.to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model_config(tied)))
    return folder


def _norm_weight(model: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))["model.norm.weight"].float()


def sample_tokens(index: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ids; the second half of the sample is loss-masked (an assistant turn)."""
    rng = np.random.default_rng(1000 + index)
    mask = np.zeros(length, dtype=np.uint8)
    mask[length // 2 :] = 1
    return rng.integers(0, V, length).astype(np.int32), mask


class GreedyEngine:
    """States ``[tokens, K, H]``: the final layer at t points at token t+1 (scaled by a norm
    that varies by position, divided by the norm weight); the last position, and the other
    layers, are noise of their own scale."""

    def __init__(self, model: Path) -> None:
        self.weight = _norm_weight(model)  # [H]

    def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
        out = []
        for prompt in prompts:
            n = len(prompt)
            generator = torch.Generator().manual_seed(int(prompt.sum()) + n)
            states = torch.randn(n, len(LAYER_IDS), H, generator=generator)  # [n, K, H]
            states[:, :-1] *= torch.tensor([3.0, 6.0])[None, :, None]
            following = torch.as_tensor(prompt[1:], dtype=torch.long)
            scale = 2 + 18 * torch.rand(n - 1, 1, generator=generator)  # [n-1, 1]
            direction = torch.nn.functional.one_hot(following, H).float() * 4 / self.weight
            states[:-1, -1] = scale * (direction + 0.05 * states[:-1, -1])
            out.append(states)
        return out


def make_plan(
    lengths: tuple[int, ...] = LENGTHS, c: int = 16, work: int = 64, token_rows: int | None = None
) -> Plan:
    arr = np.asarray(lengths, dtype=np.int32)
    chunks, starts, rows = cut_chunks(
        arr, np.arange(len(arr)) * 10, np.arange(len(arr)) + 1, c, work
    )
    spool = TokenSpool()
    for index, length in enumerate(lengths):
        spool.append(*sample_tokens(index, length))
    inputs = {"test": "audit", "rows_per_chunk": c, "work_chunk_tokens": work}
    return Plan(
        inputs, arr, starts, chunks, rows, c, tokens=spool, token_rows_per_object=token_rows
    )


def greedy_dataset(folder: Path, model: Path, sampling: dict[str, Any] | None = None) -> Path:
    """The manifest of an `hsx regenerate` output made greedily by ``model``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    manifest = {
        "format": FORMAT_NAME,
        "version": 1,
        "chunks": 0,
        "frozen_inputs": {
            "model_config_hash": config_hash(config),
            "sampling": {"temperature": 0} if sampling is None else sampling,
        },
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def write_store(
    host: HostPipeline,
    url: str,
    model: Path,
    dataset: Path | str = "original.jsonl",
    encoding: str = "plain",
    chunks: int | None = None,
    token_rows: int | None = None,
) -> str:
    """A store of ``make_plan()`` through hsx's writer (commits, checksums), its first
    ``chunks`` work chunks committed (all by default); ``token_rows``: rows per object of the
    token arrays (C: as an hsx before token objects wrote them)."""
    plan = make_plan(token_rows=token_rows)
    config = json.loads((model / "config.json").read_text())
    meta = {
        "model": {
            "path": str(model),
            "architectures": config["architectures"],
            "num_hidden_layers": LAYERS,
            "hidden_size": H,
            "config_hash": config_hash(config),
        },
        "layer_ids": list(LAYER_IDS),
        "num_layers_captured": len(LAYER_IDS),
        "hidden_size": H,
        "logical_dtype": "float32",
        "state_encoding": encoding,
        "dataset": str(dataset),
    }
    store = ExtractionStore.open_or_create(url, plan, meta)
    engine = GreedyEngine(model)
    for chunk in plan.chunks[:chunks]:
        extract_chunk(host, store, chunk, engine, 64, RunContext("audit-test"))  # type: ignore[arg-type]
    return url
