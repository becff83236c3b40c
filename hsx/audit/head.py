"""The target's own output head: its final norm and LM head, read from the model's safetensors
(those two tensors only), applied to stored final pre-norm states.

The stored final state at position t, through the norm and the head, must predict token t+1 as
the target did. ``OutputHead.score`` gives, per position, the top-5 ids, the top logit, the
log-sum-exp over the vocabulary and the logits of the data's tokens at a few shifts; the
vocabulary is walked in blocks (a 129k x 7168 head is 3.7 GB in float32: on the CPU it stays in
its stored dtype and each block is converted as it is used).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hsx.errors import ConfigError
from hsx.model.config import text_config
from hsx.model.families import logit_softcap
from hsx.trainers.final_norm import FinalNorm, load_final_norm, weight_files

# "lm_head.weight", nested under a multimodal wrapper ("language_model.lm_head.weight"); never a
# multi-token-prediction layer's own head ("model.layers.61.shared_head.head.weight").
_LM_HEAD = re.compile(r"^(?:[\w.]*\.)?lm_head\.weight$")
_EMBEDDINGS = re.compile(r"^(?:[\w.]*\.)?(?:model|language_model)\.embed_tokens\.weight$")
_HEAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOP_K = 5
_BLOCK_ELEMENTS = 1 << 24  # head rows converted at once: 64 MiB of float32
_POSITIONS_PER_STEP = 1024  # logits [1024, block rows] at a time
# Relative error of a logit computed from bf16 operands (the head's own rounding on a GPU).
_BF16_EPS = 2.0**-8


@dataclass(frozen=True)
class HeadScores:
    """What the head says of n positions (CPU tensors)."""

    top: torch.Tensor  # [n, 5] int64: the top-5 ids, best first
    top_logit: torch.Tensor  # [n] float32
    log_norm: torch.Tensor  # [n] float32: log-sum-exp of the logits (log-probs are logit - this)
    target_logit: torch.Tensor  # [n, S] float32: logits of the targets (NaN where none)


@dataclass(frozen=True)
class HeadSource:
    """Where the head came from, for the report."""

    tensor: str  # "<file>:<tensor name>"
    tied: bool  # the input embeddings (tie_word_embeddings)
    norm: str  # the final norm's "<file>:<tensor name>"
    vocab_size: int
    device: str
    compute_dtype: str


def find_head(model_dir: Path, config: dict[str, Any]) -> tuple[str, str, bool]:
    """(file, tensor name, tied) of the LM head in the model's safetensors, without reading it;
    ConfigError naming what was looked for when there is none."""
    files = weight_files(model_dir)
    if not files:
        raise ConfigError(
            f"{model_dir}: no LM head weights found: expected safetensors holding the final "
            "norm and LM head, found no safetensors files (a dummy-weight model?)"
        )
    heads = sorted(n for n in files if _LM_HEAD.match(n) and "layers." not in n)
    if len(heads) > 1:
        raise ConfigError(f"{model_dir}: expected one LM head weight, found {heads}")
    if heads:
        return files[heads[0]], heads[0], False
    text = text_config(config)
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    embeddings = sorted(n for n in files if _EMBEDDINGS.match(n) and "layers." not in n)
    if tied is False or len(embeddings) != 1:
        why = "tie_word_embeddings is false" if tied is False else f"embeddings {embeddings}"
        raise ConfigError(
            f"{model_dir}: no LM head weights found: expected 'lm_head.weight' (or, for tied "
            f"embeddings, one 'model.embed_tokens.weight'), found neither among {len(files)} "
            f"tensors ({why})"
        )
    return files[embeddings[0]], embeddings[0], True  # tied, said so or unsaid


def _read_tensor(model_dir: Path, file: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(model_dir / file), framework="pt") as handle:
        return handle.get_tensor(name)


def choose_device(requested: str, head_bytes: int) -> torch.device:
    """``cpu``, ``cuda`` (refused where there is none) or ``auto``: a GPU when one is present
    with room for the head twice over (an engine may hold most of its memory), else the CPU."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"audit device: expected auto, cpu or cuda, found {requested!r}")
    if requested == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise ConfigError("audit device: expected a CUDA device (--device cuda), found none")
    if available:
        free, _ = torch.cuda.mem_get_info()
        if requested == "cuda" or free > 2 * head_bytes + (1 << 30):
            return torch.device("cuda")
    return torch.device("cpu")


class OutputHead:
    """The final norm and LM head of one model, on one device."""

    def __init__(
        self,
        norm: FinalNorm,
        weight: torch.Tensor,
        source: HeadSource,
        softcap: float | None = None,
    ) -> None:
        self.norm = norm  # its weight on the head's device
        self.weight = weight  # [V, H]: float32 on the CPU, else as stored or float32
        self.source = source
        self.softcap = softcap  # logits -> softcap * tanh(logits / softcap) (Gemma), or None
        self.device = weight.device
        self.compute_dtype = torch.float32 if self.device.type == "cpu" else weight.dtype
        self.vocab_size = int(weight.shape[0])
        self.block_rows = max(256, _BLOCK_ELEMENTS // int(weight.shape[1]))

    @classmethod
    def load(cls, model_dir: Path, config: dict[str, Any], device: str = "auto") -> OutputHead:
        """Read the norm and head of ``model_dir`` (ConfigError before any state is read when
        either is missing or has the wrong shape)."""
        file, name, tied = find_head(model_dir, config)
        norm = load_final_norm(model_dir, config)
        weight = _read_tensor(model_dir, file, name)
        text = text_config(config)
        vocab, hidden = int(text.get("vocab_size") or weight.shape[0]), int(text["hidden_size"])
        if weight.dim() != 2 or weight.shape[1] != hidden or weight.shape[0] < vocab:
            raise ConfigError(
                f"{model_dir}/{file}:{name}: expected an LM head of shape "
                f"({vocab}, {hidden}), found {tuple(weight.shape)}"
            )
        if weight.dtype not in _HEAD_DTYPES:
            raise ConfigError(
                f"{model_dir}/{file}:{name}: expected a float32, bfloat16 or float16 "
                f"LM head, found {weight.dtype} (a quantized head is not read)"
            )
        weight = weight[:vocab]  # a padded head's extra rows are never sampled
        target = choose_device(device, weight.numel() * weight.element_size())
        if target.type == "cpu":
            small = weight.numel() <= 4 * _BLOCK_ELEMENTS
            weight = weight.float() if small or weight.dtype == torch.float32 else weight
        else:
            free, _ = torch.cuda.mem_get_info()
            wide = weight.dtype == torch.float32 or free > 3 * weight.numel() * 4 + (1 << 30)
            weight = weight.to(target, torch.float32 if wide else torch.bfloat16)
        norm = replace(norm, weight=norm.weight.to(target))
        compute = "float32" if target.type == "cpu" else str(weight.dtype).removeprefix("torch.")
        source = HeadSource(f"{file}:{name}", tied, norm.source, vocab, str(target), compute)
        return cls(norm, weight, source, logit_softcap(config))

    @property
    def compute_eps(self) -> float:
        """Relative error of this head's own logits (bf16 operands on a GPU)."""
        return 0.0 if self.compute_dtype == torch.float32 else _BF16_EPS

    def _block(self, first: int) -> torch.Tensor:
        block = self.weight[first : first + self.block_rows]  # [b, H]
        return block if block.dtype == self.compute_dtype else block.to(self.compute_dtype)

    def normed(self, states: torch.Tensor) -> torch.Tensor:
        """[n, H] pre-norm states (any float dtype) -> [n, H] float32 on the head's device."""
        return self.norm(states.to(self.device))

    def score(self, states: torch.Tensor, targets: torch.Tensor) -> HeadScores:
        """``states [n, H]`` final pre-norm states, ``targets [n, S]`` int64 token ids (-1: no
        target) -> the head's top-5, top logit, log-sum-exp and the targets' logits."""
        parts = [
            self._score_step(
                states[i : i + _POSITIONS_PER_STEP], targets[i : i + _POSITIONS_PER_STEP]
            )
            for i in range(0, states.shape[0], _POSITIONS_PER_STEP)
        ]
        if not parts:
            empty = torch.empty(0)
            shape = (0, TOP_K)
            return HeadScores(
                torch.empty(shape, dtype=torch.int64),
                empty,
                empty,
                torch.empty(0, targets.shape[1]),
            )
        return HeadScores(
            *(torch.cat([getattr(p, f) for p in parts]) for f in HeadScores.__dataclass_fields__)
        )

    def _score_step(self, states: torch.Tensor, targets: torch.Tensor) -> HeadScores:
        h = self.normed(states).to(self.compute_dtype)  # [m, H]
        m = h.shape[0]
        targets = targets.to(self.device)  # [m, S]
        best = torch.full((m,), -math.inf, device=self.device)  # running max
        total = torch.zeros(m, device=self.device)  # running sum of exp(logit - best)
        top_v = torch.empty((m, 0), device=self.device)
        top_i = torch.empty((m, 0), dtype=torch.int64, device=self.device)
        found = torch.full(targets.shape, math.nan, device=self.device)  # [m, S]
        for first in range(0, self.vocab_size, self.block_rows):
            logits = (h @ self._block(first).T).float()  # [m, b]
            if self.softcap is not None:  # what the target samples from; the order is kept
                logits = self.softcap * torch.tanh(logits / self.softcap)
            width = logits.shape[1]
            new_best = torch.maximum(best, logits.amax(dim=1))
            total = total * torch.exp(best - new_best) + torch.exp(logits - new_best[:, None]).sum(
                dim=1
            )
            best = new_best
            values, index = logits.topk(min(TOP_K, width), dim=1)
            top_v, order = torch.cat([top_v, values], dim=1).topk(
                min(TOP_K, top_v.shape[1] + values.shape[1]), dim=1
            )
            top_i = torch.cat([top_i, index + first], dim=1).gather(1, order)
            inside = (targets >= first) & (targets < first + width)
            picked = logits.gather(1, (targets - first).clamp(0, width - 1))  # [m, S]
            found = torch.where(inside, picked, found)
        return HeadScores(top_i.cpu(), top_v[:, 0].cpu(), (best + total.log()).cpu(), found.cpu())

    def tie_tolerance(
        self, states: torch.Tensor, top: torch.Tensor, data: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """[m] float32: how far the data's token's logit may fall below the top one and still
        be the target's own choice, for states whose elements carry a relative error ``eps``
        (the store's dtype) and this head's own rounding: six standard deviations of the
        margin's error for independent per-element errors, ``6 eps |W_a * h|, |W_d * h|``."""
        if top.numel() == 0:
            return torch.empty(0)
        h = self.normed(states).float()  # [m, H]
        spread = (self.weight[top.to(self.device)].float() * h).pow(2).sum(dim=1)
        spread = spread + (self.weight[data.to(self.device)].float() * h).pow(2).sum(dim=1)
        return (6.0 * max(eps, self.compute_eps) * spread.sqrt() + 1e-6).cpu()

    def post_norm_ratio(self, states: torch.Tensor) -> torch.Tensor:
        """[n] float32: RMS of ``state / norm weight`` per vector. A state the final norm was
        already applied to gives 1 (up to eps); the pre-norm residual stream has no such rule."""
        weight = self.norm.weight
        usable = weight.abs() > 1e-6
        x = states.to(self.device).float()[:, usable] / weight[usable]
        return x.pow(2).mean(dim=1).sqrt().cpu()
