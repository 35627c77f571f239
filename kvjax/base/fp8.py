"""Blockwise fp8 e4m3 quantisation: DSA cache writes (``kvjax.state.dsa_cache``) and reads (``kvjax.ops.dsa``).

``scale = amax(|x|) / 448`` over each ``block`` consecutive values, ``q = x / scale`` rounded to e4m3 (a block of
zeros gets scale 0 and quantises to 0, never NaN); dequantise ``q * scale``. Lives in :mod:`kvjax.base`, below both.
The GQA fp8 pages (:mod:`kvjax.state.kv_cache`) take power-of-two page scales instead (:func:`pow2_scale`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.base.checks import check_float

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def quantize_fp8_blockwise(
    x: jax.Array,  # f32 / bf16 / f16 [..., N]
    block: int = 128,
) -> tuple[jax.Array, jax.Array]:  # (f8e4m3[..., N], f32[..., N // block])
    """Blockwise fp8 e4m3 quantisation: one f32 scale ``amax / 448`` per ``block`` consecutive values."""
    check_float("x", x)
    n = x.shape[-1]
    if block < 1 or n % block:
        raise ValueError(f"last dim of x ({n}) must be a multiple of block={block}")
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], n // block, block)
    scale = jnp.max(jnp.abs(xb), axis=-1) / FP8_MAX  # f32[..., N // block]
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(xb / safe[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(x.shape), scale


def dequantize_fp8_blockwise(
    q: jax.Array,  # f8e4m3[..., N] (any dtype castable to f32)
    scale: jax.Array,  # f32[..., N // block]
) -> jax.Array:  # f32[..., N]
    """Inverse of :func:`quantize_fp8_blockwise` (up to e4m3 rounding): ``q * scale`` broadcast over each block."""
    n, nb = q.shape[-1], scale.shape[-1]
    if nb < 1 or n % nb or tuple(scale.shape[:-1]) != tuple(q.shape[:-1]):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match q shape {tuple(q.shape)}")
    qb = q.astype(jnp.float32).reshape(*q.shape[:-1], nb, n // nb)
    return (qb * scale[..., None].astype(jnp.float32)).reshape(q.shape)


def pow2_scale(
    amax: jax.Array,  # f32[...] >= 0: the largest magnitude a scale must cover
) -> jax.Array:  # f32[...]: 2**e, the smallest power of two with amax <= 448 * 2**e; 0 where amax == 0
    """Power-of-two fp8 scale (the GQA fp8 pages, :mod:`kvjax.state.kv_fp8`): ``amax / scale`` lies in ``(224, 448]``.

    Exact (``frexp``, no division): ``amax = m 2**k`` with ``m`` in ``[0.5, 1)`` gives ``2**(k - 9)`` when
    ``512 m <= 448`` (``m <= 0.875``), else ``2**(k - 8)``. Rescaling e4m3 values between two such scales is a
    shift of their exponents, exact for every value that stays in e4m3's normal range.
    """
    amax = jnp.asarray(amax, jnp.float32)
    m, k = jnp.frexp(amax)
    e = jnp.where(m <= FP8_MAX / 512.0, k - 9, k - 8)
    return jnp.where(amax > 0, jnp.ldexp(jnp.ones_like(amax), e), 0.0)
