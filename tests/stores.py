"""Comparing two extraction stores as a trainer sees them: through the reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hsx.store.reader import HiddenStatesReader


@dataclass
class StoreDifference:
    samples: int
    tokens: int
    # Largest |a - b| over every hidden-state value (the engine's run-to-run spread: batches
    # of other composition reorder fp32 sums).
    max_abs_hidden: float


def compare_stores(url_a: str, url_b: str) -> StoreDifference:
    """Every sample of both stores: the same sample index (offsets and lengths), token ids and
    loss masks exactly, and the largest hidden-state difference. Raises AssertionError naming
    the first sample that differs."""
    a, b = HiddenStatesReader(url_a), HiddenStatesReader(url_b)
    assert a.num_samples == b.num_samples, f"samples: {a.num_samples} vs {b.num_samples}"
    assert a.available_samples.tolist() == b.available_samples.tolist()
    starts_a, lengths_a = a.store.sample_rows(0, a.num_samples)
    starts_b, lengths_b = b.store.sample_rows(0, b.num_samples)
    assert np.array_equal(starts_a, starts_b) and np.array_equal(lengths_a, lengths_b)
    worst, tokens = 0.0, 0
    for index in a.available_samples.tolist():
        left, right = a.sample(index), b.sample(index)
        assert left.input_ids.equal(right.input_ids), f"sample {index}: token ids differ"
        assert left.loss_mask.equal(right.loss_mask), f"sample {index}: loss masks differ"
        assert left.hidden_states.shape == right.hidden_states.shape, f"sample {index}: shape"
        diff = (left.hidden_states.float() - right.hidden_states.float()).abs().max()
        worst = max(worst, float(diff))
        tokens += int(left.input_ids.shape[0])
    return StoreDifference(len(a.available_samples), tokens, worst)


def max_difference_from_hf(model_dir: Path, url: str) -> tuple[int, float]:
    """Every sample of the store against HF transformers' fp32 states of its token ids:
    (samples compared, the largest |store - HF| over every captured layer and token)."""
    rows = row_differences_from_hf(model_dir, url)
    return len(rows), max((float(r.max()) for r in rows), default=0.0)


def row_differences_from_hf(model_dir: Path, url: str) -> list[Any]:
    """Per sample, the largest |store - HF| of each token over its captured layers: ``[tokens]``
    float32 tensors (where one token is off and why: an MoE router's near-tie, a shift)."""
    import torch

    from hsx.preflight.hf_reference import hf_hidden_states, load_hf_model

    reader = HiddenStatesReader(url)
    hf = load_hf_model(model_dir)
    rows: list[torch.Tensor] = []
    for index in reader.available_samples.tolist():
        sample = reader.sample(index)
        (reference,) = hf_hidden_states(hf, [sample.input_ids.numpy()], reader.layer_ids)
        assert sample.hidden_states.shape == reference.shape, f"sample {index}: shape"
        assert sample.hidden_states.dtype == torch.float32
        # [tokens, K, H] -> [tokens]
        rows.append((sample.hidden_states - reference).abs().amax(dim=(1, 2)))
    return rows
