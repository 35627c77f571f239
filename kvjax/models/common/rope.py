"""Rotary position embeddings as Hugging Face computes them: inverse frequencies (default and YaRN) from a
checkpoint's config; the cos/sin tables and the rotation itself are :mod:`kvjax.base.rotary`'s (re-exported here).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from kvjax.base.rotary import apply_rope, rope_cos_sin
from kvjax.errors import CheckpointError

__all__ = ["apply_rope", "rope_cos_sin", "rope_inv_freq"]


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
