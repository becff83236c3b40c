"""fp8 (e4m3) states with per-token, per-layer scales: the round trip within its documented
bound over the residual stream's dynamic range, zeros and non-finite values kept where the
captured-state checks look for them, and the checks themselves on the scales."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hsx.engine.capture_checks import SampleScan
from hsx.store.fp8_states import (
    FP8_MAX,
    PACKED_SCALE_BYTES,
    dequantize,
    error_bound,
    pack,
    quantize,
    unpack,
)

pytestmark = pytest.mark.timeout(60)


def _residual_like(tokens: int = 300, k: int = 4, h: int = 512) -> torch.Tensor:
    """States whose norm grows by orders of magnitude from layer to layer (as the residual
    stream does), with a few outlier channels and some values in e4m3's subnormal range."""
    generator = torch.Generator().manual_seed(7)
    states = torch.randn(tokens, k, h, generator=generator)
    states *= torch.tensor([0.05, 1.0, 30.0, 900.0]).view(1, k, 1)
    states[:, :, 7] *= 40.0  # an outlier channel: the rest of the vector goes small
    return states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_within_the_documented_bound(dtype: torch.dtype) -> None:
    states = _residual_like().to(dtype)  # [tokens, K, H]
    q, scales = quantize(states)
    assert q.dtype == torch.uint8 and q.shape == states.shape
    assert scales.dtype == torch.float32 and scales.shape == states.shape[:-1]
    back = dequantize(q, scales, torch.float32)
    error = (back - states.float()).abs()
    bound = error_bound(states, scales)
    # bf16 output adds its own rounding; float32 here isolates fp8's.
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max())}"
    # Each vector uses the whole fp8 range: its largest element is exactly +-448 * scale.
    largest = q.view(torch.float8_e4m3fn).float().abs().amax(dim=-1)
    assert torch.equal(largest, torch.full_like(largest, FP8_MAX))
    # And the bound is not loose: the worst relative error of normal values is near 2**-4.
    normal = states.float().abs() > scales.unsqueeze(-1) * 2.0**-6
    relative = (error[normal] / states.float().abs()[normal]).max()
    assert 2.0**-5 < float(relative) <= 2.0**-4


def test_zero_and_non_finite_vectors_keep_their_marks() -> None:
    states = torch.ones(3, 2, 16)
    states[0, 1] = 0.0
    states[1, 0, 5] = float("nan")
    states[2, 1, 3] = float("inf")
    q, scales = quantize(states)
    assert float(scales[0, 1]) == 0.0
    assert torch.isnan(scales[1, 0]) and torch.isinf(scales[2, 1])
    back = dequantize(q, scales, torch.float32)
    assert torch.equal(back[0, 1], torch.zeros(16))
    assert torch.equal(back[0, 0], torch.ones(16)) and torch.equal(back[2, 0], torch.ones(16))


def test_dequantize_refuses_scales_of_another_shape() -> None:
    q, _ = quantize(torch.randn(4, 2, 8))
    with pytest.raises(ValueError, match=r"expected scales of shape \(4, 2\), found \(4, 3\)"):
        dequantize(q, torch.ones(4, 3))


def test_the_checks_read_fp8_scales_as_they_read_states() -> None:
    """SampleScan on an fp8 store's scales names the same positions as on the states."""
    states = torch.randn(6, 3, 32)
    states[2, 1] = 0.0
    states[4, 2, 9] = float("nan")
    states[:, 0] = 0.0  # a dead layer
    _, scales = quantize(states)
    from_states = SampleScan((2, 5, 8), 6)
    from_states.add(states.numpy(), 0)
    from_scales = SampleScan((2, 5, 8), 6)
    from_scales.add(scales.numpy()[:3], 0)  # two blocks, as the writer scans them
    from_scales.add(scales.numpy()[3:], 3)
    assert from_scales.problem() == from_states.problem()
    problem = from_scales.problem() or ""
    assert "non-finite values (inf/NaN) at 1 of 18" in problem
    assert "first at token 4, layer id 8" in problem
    assert "all-zero states at every token of layer id(s) [2]" in problem
    assert from_scales.zero == from_states.zero == 7


def test_blocks_of_a_long_sample_quantize_as_one() -> None:
    """Quantizing in token blocks (bounded temporaries) changes nothing."""
    states = _residual_like(tokens=700)
    q, scales = quantize(states)
    q_rows, scales_rows = zip(
        *(quantize(states[i : i + 1]) for i in range(0, 700, 97)), strict=True
    )
    assert scales[::97].shape[0] == len(scales_rows)
    assert torch.equal(torch.cat(q_rows), q[::97]) and torch.equal(
        torch.cat(scales_rows), scales[::97]
    )
    assert np.isfinite(scales.numpy()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_hold_the_same_bytes_as_quantize(dtype: torch.dtype) -> None:
    """What a GPU engine delivers for an fp8 store (pack: each vector's fp8 bytes, then its
    float32 scale's 4 bytes) unpacks to exactly quantize's bytes and scales."""
    states = _residual_like(tokens=700).to(dtype)  # [tokens, K, H]; more than one block
    states[5, 2] = 0.0
    states[9, 1, 3] = float("nan")
    q, scales = quantize(states)
    packed = pack(states)
    assert packed.dtype == torch.uint8 and packed.shape == (700, 4, 512 + PACKED_SCALE_BYTES)
    q2, scales2 = unpack(packed)
    assert torch.equal(q2, q)
    assert torch.equal(scales2.view(torch.int32), scales.view(torch.int32))  # NaN bits too


def test_unpack_names_what_it_expected() -> None:
    with pytest.raises(
        ValueError, match=r"expected uint8 \[tokens, K, H \+ 4\], found torch.bfloat16"
    ):
        unpack(torch.zeros(3, 2, 8, dtype=torch.bfloat16))


def test_a_store_written_from_packed_rows_equals_one_written_from_states(
    host: Any, tmp_path: Path
) -> None:
    """The writer takes packed rows (quantized by a GPU engine) or plain states (quantized on
    the host) for an fp8 store: the stored objects and the commit's digests are the same."""
    from hsx.extraction.chunk_extraction import RunContext, extract_chunk
    from hsx.store.reader import HiddenStatesReader
    from hsx.store.verify import verify_store
    from hsx.store.zarr_store import ExtractionStore
    from tests.unit.test_plan_store import StatesEngine, make_plan, meta

    class PackingEngine(StatesEngine):
        def extract(self, prompts: list[np.ndarray]) -> list[torch.Tensor]:
            return [pack(states) for states in super().extract(prompts)]

    records = {}
    for name, engine in (("host", StatesEngine()), ("packed", PackingEngine())):
        url = str(tmp_path / name)
        plan = make_plan([30, 70, 5], work=64)
        store = ExtractionStore.open_or_create(url, plan, {**meta(), "state_encoding": "fp8_e4m3"})
        records[name] = [
            extract_chunk(host, store, chunk, engine, 100, RunContext(name)).checksums
            for chunk in plan.chunks
        ]
        assert verify_store(ExtractionStore.open(url)).ok
    assert records["host"] == records["packed"]
    host_reader = HiddenStatesReader(str(tmp_path / "host"))
    packed_reader = HiddenStatesReader(str(tmp_path / "packed"))
    for index in range(3):
        assert torch.equal(
            host_reader.sample(index).hidden_states, packed_reader.sample(index).hidden_states
        )
