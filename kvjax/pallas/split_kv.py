"""Split-KV decoding shared by every split-KV kernel: stage 2 (the f32 log-sum-exp merge).

Stage 1 (a kernel) cuts each row's key walk into splits and writes, per split, an f32 partial output normalised
over that split and its log-sum-exp (``-inf`` for a split that saw no key). Stage 2 weighs the parts by
``exp(lse_s - lse)``: an empty split weighs 0, and a row where every split is empty gets 0, never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_splits(
    o_parts: jax.Array,  # f32[..., S, ..., R]: split outputs, split axis ``axis``
    lse_parts: jax.Array,  # f32[..., S, ...]: o_parts without its last dimension
    axis: int,
) -> jax.Array:  # f32[..., ..., R]: o_parts with the split axis summed out
    """``o = Σ_s exp(lse_s - lse) o_s / Σ_s exp(lse_s - lse)`` over the split axis ``axis`` of ``lse_parts``."""
    m = jnp.max(lse_parts, axis=axis, keepdims=True)
    w = jnp.exp(lse_parts - jnp.where(jnp.isfinite(m), m, 0.0))  # -inf -> weight 0
    den = jnp.sum(w, axis=axis)
    o = jnp.sum(w[..., None] * o_parts, axis=axis)
    return o / jnp.where(den > 0, den, 1.0)[..., None]
