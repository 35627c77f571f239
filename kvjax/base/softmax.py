"""Masked softmax shared by the MLA / DSA references and the DeepSeek model (never NaN on an empty row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_softmax(
    s: jax.Array,  # f32[..., L] logits
    mask: jax.Array,  # bool[..., L] (broadcast against s); True = visible
) -> tuple[jax.Array, jax.Array]:  # (weights f32[..., L], lse f32[...])
    """Normalised weights of logits ``s`` over the visible keys, and their log-sum-exp.

    Masked logits are replaced by ``-inf`` (not multiplied), so garbage (even NaN) there cannot leak. A row
    without any visible key gets all-zero weights and lse ``-inf`` (never NaN).
    """
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    safe = jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, m[..., 0] + jnp.log(safe[..., 0]), -jnp.inf)
    return p / safe, lse
