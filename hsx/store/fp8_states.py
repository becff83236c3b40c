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
# Tokens quantized at a time: on the CPU the float32 temporaries stay in cache; on a GPU, fewer
# and larger kernels (8192 x K x H float32 at H = 7168, K = 4 is 0.9 GiB).
_CPU_BLOCK_TOKENS = 256
_DEVICE_BLOCK_TOKENS = 8192
# Packed rows (pack/unpack): each vector's H fp8 bytes, then its float32 scale's 4 bytes.
PACKED_SCALE_BYTES = 4


def quantize(
    states: torch.Tensor, into: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``states [tokens, K, H]`` (any float dtype, any device) -> ``(q [tokens, K, H] uint8,
    scales [tokens, K] float32)`` on the same device. Two passes over the states: the max
    magnitude (exact in any dtype: no arithmetic), then one multiply into float32 and the
    cast (on the CPU, the float32 temporaries of a division and a clamp cost two more passes
    at GPU rates of states)."""
    tokens = states.shape[0]
    step = _CPU_BLOCK_TOKENS if states.device.type == "cpu" else _DEVICE_BLOCK_TOKENS
    q = torch.empty(states.shape, dtype=torch.uint8, device=states.device) if into is None else into
    scales = torch.empty(states.shape[:-1], dtype=torch.float32, device=states.device)
    scaled: torch.Tensor | None = None
    for first in range(0, tokens, step):
        block = states[first : first + step]  # [n, K, H]
        amax = block.abs().amax(dim=-1).to(torch.float32)  # [n, K]: 4x vector_norm's speed here
        # Tensor by tensor: IEEE division on every device (CUDA divides a tensor by a Python
        # scalar through its reciprocal, one ulp away at times: a GPU's bytes would differ).
        limit = torch.full_like(amax, FP8_MAX)
        scale = amax / limit  # [n, K]; NaN/inf where the vector has one, 0 where all zero
        usable = torch.isfinite(scale) & (scale > 0)
        inverse = torch.where(usable, limit / amax, torch.ones_like(amax))
        if scaled is None or scaled.shape != block.shape:
            scaled = torch.empty(block.shape, dtype=torch.float32, device=states.device)
        # |block * inverse| <= 448 * (1 + 2**-22): below 464, where e4m3 would overflow.
        torch.mul(block, inverse.unsqueeze(-1), out=scaled)
        q[first : first + step] = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        scales[first : first + step] = scale
    return q, scales


def pack(states: torch.Tensor) -> torch.Tensor:
    """``states [tokens, K, H]`` -> packed rows ``[tokens, K, H + 4]`` uint8 on the same device:
    each vector's fp8 bytes then its float32 scale's bytes. One tensor, so the engine's copy to
    the host, its result ring and spool files move fp8 states as they move plain ones, at
    about half the bytes of bf16; ``quantize`` makes the bytes (bit-equal on every device)."""
    tokens, layers, hidden = states.shape
    packed = torch.empty(
        (tokens, layers, hidden + PACKED_SCALE_BYTES), dtype=torch.uint8, device=states.device
    )
    _, scales = quantize(states, into=packed[..., :hidden])
    packed[..., hidden:] = scales.contiguous().view(torch.uint8).view(tokens, layers, -1)
    return packed


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows ``[tokens, K, H + 4]`` uint8 -> ``(q [tokens, K, H] uint8, scales [tokens, K]
    float32)``; ``q`` is a view of ``packed``."""
    if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[-1] <= PACKED_SCALE_BYTES:
        raise ValueError(
            f"packed fp8 rows: expected uint8 [tokens, K, H + {PACKED_SCALE_BYTES}], found "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    hidden = packed.shape[-1] - PACKED_SCALE_BYTES
    scales = packed[..., hidden:].contiguous().view(torch.float32).squeeze(-1)  # [tokens, K]
    return packed[..., :hidden], scales


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
