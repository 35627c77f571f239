"""Layers shared by the toy models: RMSNorm variants, ``Linear`` and the SwiGLU ``MLP`` (flax NNX).

Numerics follow Hugging Face transformers exactly (norms in float32), so a model built from these pieces can
match its ``transformers`` counterpart to float32 round-off.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.base.norms import rms_norm
from kvjax.ops.collective import all_reduce
from kvjax.ops.linear import linear
from kvjax.ops.mlp import swiglu


def gated_rms_norm(
    x: jax.Array,  # [..., D]
    gate: jax.Array,  # [..., D]
    weight: jax.Array,  # [D]
    eps: float,
) -> jax.Array:  # [..., D] in x's dtype
    """``weight * rmsnorm(x) * silu(gate)`` (norm before gate), as Qwen3.5's ``RMSNormGated``."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    out = weight * normed.astype(x.dtype)
    return (out * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale ``weight: [D]`` (``zero_centered``: init 0, scale ``1 + weight``)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, zero_centered: bool = False, dtype=jnp.float32):
        self.eps = float(eps)
        self.zero_centered = bool(zero_centered)
        init = jnp.zeros if zero_centered else jnp.ones
        self.weight = nnx.Param(init((dim,), dtype))  # [D]

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        return rms_norm(x, self.weight[...], self.eps, zero_centered=self.zero_centered)


class GatedRMSNorm(nnx.Module):
    """``weight * rmsnorm(x) * silu(gate)`` with ``weight: [D]`` initialised to ones."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [D]

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:  # [..., D], [..., D] -> [..., D]
        return gated_rms_norm(x, gate, self.weight[...], self.eps)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` with ``kernel: [in, out]`` (the transpose of a torch ``Linear.weight``); the
    product is the op :func:`kvjax.ops.linear.linear` (a Pallas kernel for 16-bit decode rows on a GPU).

    ``reduce_axis`` (static, ``None`` by default): on a row-parallel shard inside ``shard_map`` the partial
    product is summed over that mesh axis before the bias is added (the op :func:`kvjax.ops.collective.all_reduce`,
    implementation ``reduce_impl``: static, ``"auto"``; :mod:`kvjax.models.common.parallel`).
    """

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, rngs: nnx.Rngs, dtype=jnp.float32):
        scale = 1.0 / math.sqrt(d_in)
        self.kernel = nnx.Param(scale * jax.random.normal(rngs.params(), (d_in, d_out), dtype))  # [in, out]
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None  # [out] | None
        self.reduce_axis: str | None = None
        self.reduce_impl: str = "auto"

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        y = all_reduce(linear(x, self.kernel[...]), self.reduce_axis, impl=self.reduce_impl)
        return y if self.bias is None else y + self.bias[...]


class TorchLinear(nnx.Module):
    """``y = x @ weight.T`` with ``weight: [out, in]`` (torch's layout, loaded as stored): for column-parallel
    projections a kernel reads by output row (the GDN gates, :func:`kvjax.ops.gdn_on_pool.gated_delta_decode_pool`).
    No bias; sharded on the output axis (axis 0)."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        scale = 1.0 / math.sqrt(d_in)
        self.weight = nnx.Param(scale * jax.random.normal(rngs.params(), (d_out, d_in), dtype))  # [out, in]

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        return jnp.matmul(x, self.weight[...].T, precision=jax.lax.Precision.HIGHEST)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Qwen3.5 ``MLP``, DeepSeek dense MLP and shared experts); the
    up-projection is the op :func:`kvjax.ops.mlp.swiglu` (a Pallas kernel for decode rows on a GPU)."""

    def __init__(self, hidden: int, inter: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_proj = Linear(hidden, inter, rngs=rngs, dtype=dtype)  # kernel [H, I]
        self.up_proj = Linear(hidden, inter, rngs=rngs, dtype=dtype)  # kernel [H, I]
        self.down_proj = Linear(inter, hidden, rngs=rngs, dtype=dtype)  # kernel [I, H]

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., H] -> [..., H]
        return self.down_proj(swiglu(x, self.gate_proj.kernel[...], self.up_proj.kernel[...]))
