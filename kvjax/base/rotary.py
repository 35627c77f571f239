"""Rotary position embeddings as Hugging Face applies them: cos/sin tables in float32 and the NeoX
(``rotate_half``) or DeepSeek interleaved rotation with partial rotary dims. Shared by the models
(:mod:`kvjax.models.common.rope` computes the inverse frequencies from a checkpoint's config) and the op references
that run a model layer (:mod:`kvjax.ops.draft`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
