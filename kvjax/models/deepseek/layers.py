"""DeepSeek-V3.2 blocks: the MoE (HF ``DeepseekV32MoE``: sigmoid group-limited router, routed and shared
experts) and the decoder layer (MLA + DSA attention, dense MLP or MoE). Semantics: :mod:`kvjax.models.deepseek.model`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.models.common.layers import MLP, RMSNorm
from kvjax.models.deepseek.attention import Attention, CacheRounding, StepMeta
from kvjax.models.deepseek.config import DeepseekConfig
from kvjax.ops.collective import all_reduce

_HI = jax.lax.Precision.HIGHEST


class Router(nnx.Module):
    """HF ``DeepseekV32TopkRouter``: sigmoid scores, group-limited top-k (groups ranked by their best two
    ``score + e_score_correction_bias``), weights = unbiased scores, renormalised, times the scaling factor."""

    def __init__(self, c: DeepseekConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.c = c
        e = c.n_routed_experts
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (e, c.hidden_size), dtype) * c.hidden_size ** -0.5)
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))  # f32[E] (a buffer in HF)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:  # [N, D] -> (i32[N, K], f32[N, K])
        c = self.c
        n, e, g = x.shape[0], c.n_routed_experts, c.n_group
        logits = jnp.matmul(x.astype(jnp.float32), self.weight[...].astype(jnp.float32).T, precision=_HI)
        scores = jax.nn.sigmoid(logits)  # f32[N, E]
        choice = scores + self.e_score_correction_bias[...]
        group_scores = jnp.sum(jax.lax.top_k(choice.reshape(n, g, e // g), 2)[0], axis=-1)  # [N, G]
        _, groups = jax.lax.top_k(group_scores, c.topk_group)
        keep = jnp.any(jax.nn.one_hot(groups, g, dtype=jnp.bool_), axis=-2)  # bool[N, G]
        choice = jnp.where(jnp.repeat(keep, e // g, axis=-1), choice, -jnp.inf)
        _, idx = jax.lax.top_k(choice, c.num_experts_per_tok)  # i32[N, K]
        w = jnp.take_along_axis(scores, idx, axis=-1)
        if c.norm_topk_prob:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return idx, w * c.routed_scaling_factor


class Experts(nnx.Module):
    """Routed expert weights in HF layout: ``gate_up_proj [E, 2I, D]`` (gate rows first), ``down_proj [E, D, I]``."""

    def __init__(self, e: int, d: int, i: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_up_proj = nnx.Param(jax.random.normal(rngs.params(), (e, 2 * i, d), dtype) * d ** -0.5)
        self.down_proj = nnx.Param(jax.random.normal(rngs.params(), (e, d, i), dtype) * i ** -0.5)


class MoE(nnx.Module):
    """HF ``DeepseekV32MoE``: routed experts (``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]``) weighted by
    the router, plus shared experts (an MLP of width ``moe_intermediate_size * n_shared_experts``).

    Reference formulation: every expert runs on every token, unselected experts get weight 0.
    """

    def __init__(self, c: DeepseekConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        e, d, i = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.gate = Router(c, rngs=rngs, dtype=dtype)
        self.experts = Experts(e, d, i, rngs=rngs, dtype=dtype)
        self.shared_experts = MLP(d, i * c.n_shared_experts, rngs=rngs, dtype=dtype)
        self.reduce_axis: str | None = None  # static: sum the routed partial products over this mesh axis
        self.reduce_impl: str = "auto"  # static: the all-reduce implementation of that sum

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        flat = x.reshape(-1, x.shape[-1])
        idx, w = self.gate(flat)
        combine = jnp.einsum("nke,nk->ne", jax.nn.one_hot(idx, self.experts.down_proj.shape[0], dtype=w.dtype), w)
        gate_up = jnp.einsum("nd,efd->nef", flat, self.experts.gate_up_proj[...], precision=_HI)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        y = jnp.einsum("nei,edi->ned", jax.nn.silu(gate) * up, self.experts.down_proj[...], precision=_HI)
        routed = jnp.einsum("ne,ned->nd", combine.astype(y.dtype), y, precision=_HI).reshape(x.shape)
        routed = all_reduce(routed, self.reduce_axis, impl=self.reduce_impl)
        return routed + self.shared_experts(x)


class DecoderLayer(nnx.Module):
    def __init__(self, c: DeepseekConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.self_attn = Attention(c, rngs=rngs, dtype=dtype)
        sparse = c.mlp_layer_types[layer] == "sparse"
        self.mlp = MoE(c, rngs=rngs, dtype=dtype) if sparse else MLP(
            c.hidden_size, c.intermediate_size, rngs=rngs, dtype=dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, rounding: CacheRounding) -> jax.Array:
        """Pre-norm residual block over a full causal sequence (HF ``DeepseekV32DecoderLayer``): ``x [B, T, D]``,
        ``cos`` / ``sin`` ``f32[B, T, r/2]`` -> ``[B, T, D]`` (see :meth:`Attention.__call__`)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, rounding)
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(
        self,
        x: jax.Array,  # [T, D]
        cos: jax.Array,  # f32[T, r/2]
        sin: jax.Array,  # f32[T, r/2]
        cache: dict[str, jax.Array],  # this layer's roles {role: [P, page_size, ...]}
        meta: StepMeta,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:  # ([T, D], new cache)
        """Cached step of the block (see :meth:`Attention.step`)."""
        a, cache = self.self_attn.step(self.input_layernorm(x), cos, sin, cache, meta)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache
