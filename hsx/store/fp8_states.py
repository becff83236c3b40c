"""fp8 (e4m3) hidden states with one float32 scale per token and layer.

A state vector ``x [H]`` is stored as ``q = fp8(x * (448 / max|x|))`` and its scale
``s = max|x| / 448`` (448 is e4m3's largest finite value; ``x = q * s`` reads it back), so each vector uses the whole fp8 range whatever its norm: the
residual stream's norm grows by orders of magnitude from the first captured layer to the last,
and a per-tensor or per-layer scale would leave the early layers in e4m3's subnormals. The
scale costs 4 bytes per H (0.06% at H = 7168); float32 rather than bf16 so that the scale adds
no rounding of its own.

Rounding is torch's cast (round to nearest even). The documented bound, per element:
``|x - dequantize(quantize(x))| <= max(|x| * 2**-4, s * 2**-10) + |x| * 2**-20`` (3 mantissa
bits: half a unit in the last place is 2**-4 of the value for normal numbers; e4m3's subnormal
step is 2**-9 of the scale, so half of it is 2**-10 * s; the last term covers the float32
arithmetic around the cast).

Scales keep what the captured-state checks look for: a vector with inf/NaN has a non-finite
scale, an all-zero vector a zero scale.
"""

from __future__ import annotations

import torch

ENCODING = "fp8_e4m3"
FP8_MAX = 448.0
SCALES_ARRAY = "hidden_scales"  # float32 [T, K], beside hidden_states uint8 [T, K, H]
_BLOCK_TOKENS = 256  # tokens quantized at a time: the float32 temporaries stay small


def quantize(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``states [tokens, K, H]`` (any float dtype, any device) -> ``(q [tokens, K, H] uint8,
    scales [tokens, K] float32)`` on the same device. Two passes over the states: the max
    magnitude (exact in any dtype: no arithmetic), then one multiply into float32 and the
    cast (on the CPU, the float32 temporaries of a division and a clamp cost two more passes
    at GPU rates of states)."""
    tokens = states.shape[0]
    q = torch.empty(states.shape, dtype=torch.uint8, device=states.device)
    scales = torch.empty(states.shape[:-1], dtype=torch.float32, device=states.device)
    scaled: torch.Tensor | None = None
    for first in range(0, tokens, _BLOCK_TOKENS):
        block = states[first : first + _BLOCK_TOKENS]  # [n, K, H]
        amax = block.abs().amax(dim=-1).to(torch.float32)  # [n, K]: 4x vector_norm's speed here
        scale = amax / FP8_MAX  # [n, K]; NaN/inf where the vector has one, 0 where all zero
        usable = torch.isfinite(scale) & (scale > 0)
        inverse = torch.where(usable, FP8_MAX / amax, torch.ones_like(amax))
        if scaled is None or scaled.shape != block.shape:
            scaled = torch.empty(block.shape, dtype=torch.float32, device=states.device)
        # |block * inverse| <= 448 * (1 + 2**-22): below 464, where e4m3 would overflow.
        torch.mul(block, inverse.unsqueeze(-1), out=scaled)
        q[first : first + _BLOCK_TOKENS] = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        scales[first : first + _BLOCK_TOKENS] = scale
    return q, scales


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``q [tokens, K, H] uint8`` and ``scales [tokens, K] float32`` -> states ``[tokens, K,
    H]`` in ``dtype``. A zero scale gives zeros; a non-finite one gives NaN (as stored)."""
    if q.shape[:-1] != scales.shape:
        raise ValueError(
            f"fp8 states: expected scales of shape {tuple(q.shape[:-1])}, found "
            f"{tuple(scales.shape)}"
        )
    values = q.view(torch.float8_e4m3fn).to(torch.float32)
    return (values * scales.to(torch.float32).unsqueeze(-1)).to(dtype)


def error_bound(states: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The documented per-element bound of the round trip, ``[tokens, K, H]`` float32."""
    x = states.to(torch.float32).abs()
    fp8 = torch.maximum(x * 2.0**-4, scales.to(torch.float32).unsqueeze(-1) * 2.0**-10)
    return fp8 + x * 2.0**-20
