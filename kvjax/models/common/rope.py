"""Rotary position embeddings as Hugging Face computes them: inverse frequencies (default and YaRN), cos/sin
tables in float32, and the NeoX (``rotate_half``) or DeepSeek interleaved rotation with partial rotary dims.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import CheckpointError


def rope_inv_freq(head_dim: int, rope_parameters: Mapping[str, Any], *,
                  max_position_embeddings: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``f32[rotary_dim // 2]`` and the cos/sin scaling (``attention_factor``).

    ``rope_parameters`` is HF's dict: ``rope_theta``, optional ``partial_rotary_factor`` (rotary_dim =
    ``int(head_dim * factor)``) and ``rope_type`` ``"default"`` or ``"yarn"`` (``factor``,
    ``original_max_position_embeddings``, ``beta_fast``/``beta_slow``, ``mscale``/``mscale_all_dim``,
    ``attention_factor``, ``truncate``) with HF's formulas. Other rope types raise :class:`CheckpointError`.
    """
    rp = dict(rope_parameters)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if "rope_theta" not in rp:
        raise CheckpointError(f"rope_parameters has no 'rope_theta': {rp!r}")
    base = float(rp["rope_theta"])
    dim = int(head_dim * float(rp.get("partial_rotary_factor", 1.0) or 1.0))
    if dim < 2 or dim % 2:
        raise CheckpointError(f"rotary dim {dim} (head_dim={head_dim}, rope_parameters={rp!r}) must be even >= 2")
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(base) ** exponents
    if rope_type == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    if rope_type != "yarn":
        raise CheckpointError(f"unsupported rope_type {rope_type!r} (supported: 'default', 'yarn')")
    orig = rp.get("original_max_position_embeddings")
    if orig is None:
        raise CheckpointError(f"yarn rope_parameters need 'original_max_position_embeddings': {rp!r}")
    factor = rp.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise CheckpointError("yarn rope without 'factor' needs max_position_embeddings")
        factor = max_position_embeddings / orig
    factor = float(factor)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(
    positions: jax.Array,  # i32[...]
    inv_freq: jax.Array,  # f32[R/2]
    attention_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:  # f32[..., R/2] each
    """cos/sin of ``position * inv_freq`` in float32, times ``attention_factor``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(
    x: jax.Array,  # [..., H, D]
    cos: jax.Array,  # f32[..., R/2] (broadcast over H)
    sin: jax.Array,  # f32[..., R/2]
    *,
    interleaved: bool = False,
) -> jax.Array:  # [..., H, D] in x's dtype
    """Rotate the first ``R`` dims of each head (partial rotary: dims ``R..D`` pass through unchanged).

    ``interleaved=False``: NeoX / HF ``rotate_half`` layout (pairs ``(i, i + R/2)``). ``interleaved=True``:
    DeepSeek layout (pairs ``(2i, 2i+1)``), output de-interleaved ``[even', odd']`` exactly as HF's
    ``apply_rotary_pos_emb_interleave`` (q and k get the same permutation, so ``q.k`` is unchanged).
    cos/sin are cast to ``x.dtype`` first, as HF does.
    """
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half:]
    c = cos[..., None, :].astype(x.dtype)
    s = sin[..., None, :].astype(x.dtype)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
