"""RMSNorm as Hugging Face computes it (float32 inside), shared by the models (:mod:`kvjax.models.common.layers`)
and the op references that run a model layer (:mod:`kvjax.ops.draft`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(
    x: jax.Array,  # [..., D]
    weight: jax.Array,  # [D]
    eps: float,
    *,
    zero_centered: bool = False,
) -> jax.Array:  # [..., D] in x's dtype
    """RMSNorm in float32. ``zero_centered``: scale by ``1 + weight`` (Qwen3.5), else by ``weight``.

    Matches HF rounding: Qwen3.5's zero-centred norm multiplies in f32 then casts; the Llama-style norm casts
    the normalised activations to the input dtype before multiplying by the weight.
    """
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)
