"""Toy DeepSeek-V3.2 (MLA + DSA lightning indexer) in flax NNX, with Hugging Face parity.

Computes exactly what ``transformers``' ``DeepseekV32ForCausalLM`` computes (dense MLP and MoE layers, the
MoE in a dense every-expert reference formulation):

- **MLA**: ``q = q_b_proj(rmsnorm(q_a_proj(x)))`` split ``[nope | rope]``; ``kv_a_proj_with_mqa(x)`` split into
  the latent ``kv_c = rmsnorm(.)`` (``kv_lora_rank``) and one shared ``k_rope``; DeepSeek's *interleaved* RoPE
  on ``q_rope``/``k_rope`` (output de-interleaved, as HF); ``kv_b_proj`` expands ``kv_c`` into per-head
  ``k_nope``/``v``. Softmax scale ``qk_head_dim**-0.5``, times ``yarn_mscale(factor, mscale_all_dim)**2`` when
  YaRN is configured (HF ``yarn_apply_mscale``); YaRN's ``attention_factor`` scales cos/sin.
- **DSA indexer** (HF ``DeepseekV32Indexer``): ``q_i = wq_b(q_resid)`` (``[Hi, Di]``), ``k_i = LayerNorm(wk(x))``
  (one ``Di`` key per token), *non-interleaved* (``rotate_half``) RoPE on the first ``qk_rope_head_dim`` dims of
  both; ``score[t, s] = sum_h w[t, h] * relu(q_i[t, h] . k_i[s] / sqrt(Di))`` with
  ``w = weights_proj(x) / sqrt(Hi)``; causal mask; the top ``min(index_topk, S)`` keys per query are the only
  keys the MLA attends to. HF skips the reference implementation's Hadamard rotation and fp8 scoring (it
  scores in f32), and so does :meth:`DeepseekV32.logits` by default.

- **MoE** (``mlp_layer_types == "sparse"``, HF ``DeepseekV32MoE``): sigmoid router, groups ranked by their
  best two ``score + e_score_correction_bias``, top ``num_experts_per_tok`` experts of the kept groups weighted
  by their unbiased scores (renormalised, times ``routed_scaling_factor``), plus shared experts.

**Quantised caches and the top-k.** The DSA cache stores indexer keys as fp8 e4m3 with one f32 scale per
``quant_block`` values (:mod:`kvjax.state.dsa_cache`), and in its full layout (``init_caches(kind="dsa")``) also
the latent ``kv_c`` as fp8 and ``k_rope`` as bf16. HF scores the indexer in f32 (it skips the reference
implementation's Hadamard rotation and fp8 scoring), so where ``index_topk`` < context length an fp8 indexer
cache can select other keys than HF does. Choice: ``logits()`` is exactly HF by default, and
``logits(indexer_fp8=True, latent_fp8=True)`` applies the cache's quantise/dequantise round trips to the same
tensors of the full-sequence forward: the exact oracle of a step over such caches (tested). A step over
``init_caches(kind="mla", indexer_fp8=False)`` (f32 indexer keys) reproduces HF's own selection.

**Step** (:meth:`DeepseekV32.forward_step`, driven by :func:`kvjax.engine.step.make_step`): a ragged token-major
batch (:class:`kvjax.engine.inputs.StepInputs`) writes each new token's latent row ``[kv_c | k_rope]`` and
indexer key by ``slot_mapping``, scores the cached indexer keys (:func:`kvjax.ops.dsa.indexer_scores`), takes
the causal top-k (:func:`kvjax.ops.dsa.index_topk`) and runs every token (prefill chunk or decode) as one
absorbed sparse-MLA decode query over its row's pages (:func:`kvjax.ops.dsa.sparse_mla_decode`: ``W_UK``
folded into q, ``W_UV`` applied to the latent output), causal through its own position.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.errors import CheckpointError
from kvjax.models.common import (
    Linear,
    RMSNorm,
    TensorSource,
    apply_rope,
    assign_params,
    load_safetensors,
    rope_cos_sin,
    rope_inv_freq,
)
from kvjax.models.deepseek_config import DeepseekConfig
from kvjax.ops.dsa import index_topk, indexer_scores, sparse_mla_decode, sparse_mla_decode_fp8
from kvjax.ops.mla import absorb_output, absorb_query, split_kv_b_proj
from kvjax.base.ragged import token_rows
from kvjax.base.softmax import masked_softmax
from kvjax.state.dsa_cache import (
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    write_dsa_indexer,
    write_dsa_key,
)
from kvjax.state.kv_cache import scatter_tokens
from kvjax.state.latent_cache import write_latent_cache
from kvjax.state.registry import (
    ROLE_PRIORITY,
    DSACacheSpec,
    MLACacheSpec,
    cache_layout,
    cache_name,
    create_kv_cache,
)

ARCHITECTURES = ("DeepseekV32ForCausalLM",)
_HI = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------- fp8 indexer keys


def fp8_roundtrip(x: jax.Array, block: int) -> jax.Array:  # f32[..., N] -> f32[..., N]
    """``x`` as the DSA cache stores and reads it back: blockwise fp8 e4m3 (one f32 scale per ``block``)."""
    return dequantize_fp8_blockwise(*quantize_fp8_blockwise(x, block))


# ---------------------------------------------------------------------------------------------- modules


class LayerNorm(nnx.Module):
    """``torch.nn.LayerNorm`` (affine) in float32: ``weight: [D]`` (ones), ``bias: [D]`` (zeros)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32):
        self.eps = float(eps)
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [D]
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))  # [D]

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...] + self.bias[...]).astype(x.dtype)


class Indexer(nnx.Module):
    """DSA lightning indexer: per-token query heads ``[Hi, Di]``, one key ``[Di]`` and head weights ``[Hi]``."""

    def __init__(self, c: DeepseekConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.n_heads, self.head_dim = c.index_n_heads, c.index_head_dim
        self.wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, rngs=rngs, dtype=dtype)
        self.wk = Linear(c.hidden_size, c.index_head_dim, rngs=rngs, dtype=dtype)
        self.k_norm = LayerNorm(c.index_head_dim, 1e-6, dtype=dtype)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads, rngs=rngs, dtype=dtype)

    def project(
        self,
        x: jax.Array,  # [..., D] hidden
        q_resid: jax.Array,  # [..., q_lora_rank] q_a_layernorm(q_a_proj(x))
        cos: jax.Array,  # f32[..., r/2]
        sin: jax.Array,  # f32[..., r/2]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(q f32[..., Hi, Di], k f32[..., Di], w f32[..., Hi])`` for hidden ``x`` and ``q_resid`` ``[..., *]``."""
        q = self.wq_b(q_resid).reshape(*q_resid.shape[:-1], self.n_heads, self.head_dim)
        q = apply_rope(q, cos, sin, interleaved=False)
        k = apply_rope(self.k_norm(self.wk(x))[..., None, :], cos, sin, interleaved=False)[..., 0, :]
        w = self.weights_proj(x).astype(jnp.float32) * (self.n_heads ** -0.5)
        return q.astype(jnp.float32), k.astype(jnp.float32), w

    def scores(
        self,
        q: jax.Array,  # f32[..., Hi, Di]
        k: jax.Array,  # f32[..., S, Di]
        w: jax.Array,  # f32[..., Hi]
    ) -> jax.Array:  # f32[..., S]
        """Index scores ``f32[..., S]`` of queries ``q [..., Hi, Di]`` (weights ``w [..., Hi]``) over keys
        ``k [..., S, Di]``: ``sum_h w_h * relu(q_h . k / sqrt(Di))``."""
        s = jnp.einsum("...hd,...sd->...hs", q, k, precision=_HI) * (self.head_dim ** -0.5)
        return jnp.einsum("...h,...hs->...s", w, jax.nn.relu(s), precision=_HI)


def topk_mask(scores: jax.Array, allowed: jax.Array, topk: int) -> jax.Array:
    """bool[..., S]: the ``min(topk, S)`` best ``scores`` per row among ``allowed`` keys (HF's top-k after the
    causal mask; disallowed keys can fill the top-k only when fewer than ``topk`` are allowed, and they stay
    masked)."""
    s = scores.shape[-1]
    k = min(topk, s)
    masked = jnp.where(allowed, scores, -jnp.inf)
    if k == s:
        return jnp.broadcast_to(allowed, scores.shape)
    _, idx = jax.lax.top_k(masked, k)
    return jnp.any(jax.nn.one_hot(idx, s, dtype=jnp.bool_), axis=-2) & allowed


class Attention(nnx.Module):
    """MLA with the DSA indexer (HF ``DeepseekV32Attention``)."""

    def __init__(self, c: DeepseekConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.c = c
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias, rngs=rngs, dtype=dtype)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6, dtype=dtype)
        self.q_b_proj = Linear(c.q_lora_rank, c.num_attention_heads * c.qk_head_dim, rngs=rngs, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.latent_dim, bias=c.attention_bias, rngs=rngs, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6, dtype=dtype)
        self.kv_b_proj = Linear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                rngs=rngs, dtype=dtype)
        self.o_proj = Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias,
                             rngs=rngs, dtype=dtype)
        self.indexer = Indexer(c, rngs=rngs, dtype=dtype)

    def _project(self, x, cos, sin):
        """Per token: ``q_resid [..., qr]``, ``q_nope [..., H, nope]``, roped ``q_rope [..., H, r]``,
        latent ``kv_c [..., R]`` and roped shared ``k_rope [..., r]``."""
        c = self.c
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).reshape(*x.shape[:-1], c.num_attention_heads, c.qk_head_dim)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        q_rope = apply_rope(q_rope, cos, sin, interleaved=True)
        ckv = self.kv_a_proj_with_mqa(x)
        kv_c = self.kv_a_layernorm(ckv[..., : c.kv_lora_rank])
        k_rope = apply_rope(ckv[..., None, c.kv_lora_rank:], cos, sin, interleaved=True)[..., 0, :]
        return q_resid, q_nope, q_rope, kv_c, k_rope

    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        cos: jax.Array,  # f32[B, T, r/2]
        sin: jax.Array,  # f32[B, T, r/2]
        *,
        indexer_fp8: bool = False,
        latent_fp8: bool = False,
    ) -> jax.Array:  # [B, T, D]
        """Full causal sequence ``x: [B, T, D]`` (cos/sin ``f32[B, T, r/2]``) -> ``[B, T, D]``."""
        c = self.c
        b, t, _ = x.shape
        q_resid, q_nope, q_rope, kv_c, k_rope = self._project(x, cos, sin)
        if latent_fp8:
            kv_c = fp8_roundtrip(kv_c, c.quant_block).astype(x.dtype)
            k_rope = k_rope.astype(jnp.bfloat16).astype(x.dtype)
        kv = self.kv_b_proj(kv_c).reshape(b, t, c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        s = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, precision=_HI)
             + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope, precision=_HI)).astype(jnp.float32) * c.softmax_scale

        iq, ik, iw = self.indexer.project(x, q_resid, cos, sin)
        if indexer_fp8:
            ik = fp8_roundtrip(ik, c.quant_block)
        causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
        iscores = self.indexer.scores(iq, ik[:, None], iw)  # [B, T, S]
        mask = topk_mask(iscores, causal, c.index_topk)  # [B, T, S]
        p = masked_softmax(s, mask[:, None])[0].astype(v.dtype)
        o = jnp.einsum("bhts,bshv->bthv", p, v, precision=_HI).reshape(b, t, -1)
        return self.o_proj(o)

    def step(
        self,
        x: jax.Array,  # [T, D]
        cos: jax.Array,  # f32[T, r/2]
        sin: jax.Array,  # f32[T, r/2]
        cache: dict[str, jax.Array],  # this layer's roles (see DeepseekV32.forward_step)
        meta: dict[str, Any],  # step metadata built by DeepseekV32.forward_step
    ) -> tuple[jax.Array, dict[str, jax.Array]]:  # ([T, D], new cache)
        """Cached step over ``x: [T, D]``: writes this step's latents / indexer keys, attends over the cache.

        Returns ``([T, D], new cache)``; see :meth:`DeepseekV32.forward_step` for ``cache`` and ``meta``.
        """
        c = self.c
        q_resid, q_nope, q_rope, kv_c, k_rope = self._project(x, cos, sin)
        iq, ik, iw = self.indexer.project(x, q_resid, cos, sin)
        slots = meta["slots"]  # i32[T]; -1 for padding tokens
        fp8_latent = "key_scale" in cache
        cache = write_dsa_key(cache, kv_c, k_rope, slots) if fp8_latent else write_latent_cache(
            cache, kv_c, k_rope, slots)
        if cache["indexer"].dtype == jnp.float32:  # unquantised indexer keys (HF's selection)
            cache = {**cache, "indexer": scatter_tokens(cache["indexer"], ik, slots)}
            index_scale = None
        else:
            cache = write_dsa_indexer(cache, ik, slots)
            index_scale = cache["indexer_scale"]
        # the DSA kernels take fewer shapes than the attention kernels (fp8 keys, power-of-two tiles): they follow
        # ``impl`` only as far as "reference" (a pure-reference step) vs "auto" (kernel where it applies)
        dsa_impl = "reference" if meta["impl"] == "reference" else "auto"
        scores = indexer_scores(iq, iw, cache["indexer"], index_scale, meta["block_tables"], meta["seq_lens"],
                                cu_seqlens=meta["cu_seqlens"], scale=c.index_head_dim ** -0.5,
                                impl=dsa_impl)  # f32[T, L]
        topk = index_topk(scores, c.index_topk)  # i32[T, index_topk]; -1 = none

        # Every token is one absorbed sparse-decode query over its own row's pages, causal through its length.
        w_uk, w_uv = split_kv_b_proj(self.kv_b_proj.kernel[...].T, c.num_attention_heads,
                                     c.qk_nope_head_dim, c.v_head_dim)
        q_lat = absorb_query(q_nope.astype(jnp.float32), w_uk)  # f32[T, H, R]
        q_rope = q_rope.astype(jnp.float32)
        tables, lens = meta["token_tables"], meta["token_lens"]  # i32[T, 1, max_blocks], i32[T]
        if fp8_latent:
            o_lat = sparse_mla_decode_fp8(q_lat, q_rope, cache["key"], cache["key_scale"], cache["key_rope"],
                                          tables, lens, topk, scale=c.softmax_scale, impl=dsa_impl)
        else:
            o_lat = sparse_mla_decode(q_lat, q_rope, cache["key"], tables, lens, topk, scale=c.softmax_scale,
                                      impl=meta["impl"])
        o = absorb_output(o_lat, w_uv).astype(x.dtype).reshape(x.shape[0], -1)
        return self.o_proj(o), cache


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int, inter: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_proj = Linear(d, inter, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(d, inter, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(inter, d, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        flat = x.reshape(-1, x.shape[-1])
        idx, w = self.gate(flat)
        combine = jnp.einsum("nke,nk->ne", jax.nn.one_hot(idx, self.experts.down_proj.shape[0], dtype=w.dtype), w)
        gate_up = jnp.einsum("nd,efd->nef", flat, self.experts.gate_up_proj[...], precision=_HI)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        y = jnp.einsum("nei,edi->ned", jax.nn.silu(gate) * up, self.experts.down_proj[...], precision=_HI)
        routed = jnp.einsum("ne,ned->nd", combine.astype(y.dtype), y, precision=_HI).reshape(x.shape)
        return routed + self.shared_experts(x)


class DecoderLayer(nnx.Module):
    def __init__(self, c: DeepseekConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.self_attn = Attention(c, rngs=rngs, dtype=dtype)
        sparse = c.mlp_layer_types[layer] == "sparse"
        self.mlp = MoE(c, rngs=rngs, dtype=dtype) if sparse else MLP(
            c.hidden_size, c.intermediate_size, rngs=rngs, dtype=dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)

    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        cos: jax.Array,  # f32[B, T, r/2]
        sin: jax.Array,  # f32[B, T, r/2]
        *,
        indexer_fp8: bool = False,
        latent_fp8: bool = False,
    ) -> jax.Array:  # [B, T, D]
        """Pre-norm residual block over a full causal sequence (HF ``DeepseekV32DecoderLayer``)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, indexer_fp8=indexer_fp8, latent_fp8=latent_fp8)
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(
        self,
        x: jax.Array,  # [T, D]
        cos: jax.Array,  # f32[T, r/2]
        sin: jax.Array,  # f32[T, r/2]
        cache: dict[str, jax.Array],  # this layer's roles (see DeepseekV32.forward_step)
        meta: dict[str, Any],  # step metadata built by DeepseekV32.forward_step
    ) -> tuple[jax.Array, dict[str, jax.Array]]:  # ([T, D], new cache)
        """Cached step of the block (see :meth:`Attention.step`)."""
        a, cache = self.self_attn.step(self.input_layernorm(x), cos, sin, cache, meta)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache


# ------------------------------------------------------------------------------------------------ model


@functools.lru_cache(maxsize=32)
def _rope_table(c: DeepseekConfig) -> tuple[np.ndarray, float]:
    """HF rotary inverse frequencies ``f32[r/2]`` (default or YaRN) and the cos/sin ``attention_factor``."""
    return rope_inv_freq(c.qk_rope_head_dim, c.rope, max_position_embeddings=c.max_position_embeddings)


class DeepseekV32(nnx.Module):
    """DeepSeek-V3.2 causal LM. Parameter paths mirror HF names without the ``model.`` prefix."""

    def __init__(self, config: DeepseekConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        c = config
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(c, i, rngs=rngs, dtype=dtype) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size, rngs=rngs, dtype=dtype)

    def _cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:  # f32[..., r/2] each
        inv_freq, factor = _rope_table(self.config)
        return rope_cos_sin(positions, inv_freq, factor)

    def _head(self, h: jax.Array) -> jax.Array:
        h = self.norm(h)
        if self.lm_head is None:
            return jnp.einsum("...d,vd->...v", h, self.embed_tokens[...], precision=_HI).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    @nnx.jit(static_argnames=("indexer_fp8", "latent_fp8"))
    def logits(self, input_ids: jax.Array, *, indexer_fp8: bool = False, latent_fp8: bool = False) -> jax.Array:
        """Full-sequence forward, no cache: ``input_ids i32[B, T]`` -> ``f32[B, T, vocab]`` (positions 0..T-1).

        Jit-compiled (once per shape and flags). The defaults compute exactly what HF computes.
        ``indexer_fp8=True`` rounds the indexer keys through the DSA cache's fp8 quantisation and
        ``latent_fp8=True`` rounds ``kv_c`` through fp8 and ``k_rope`` through bf16 (the DSA ``key`` roles):
        the oracles of :meth:`forward_step` over caches made with the same options.
        """
        b, t = input_ids.shape
        x = self.embed_tokens[...][input_ids]
        cos, sin = self._cos_sin(jnp.broadcast_to(jnp.arange(t), (b, t)))
        for layer in self.layers:
            x = layer(x, cos, sin, indexer_fp8=indexer_fp8, latent_fp8=latent_fp8)
        return self._head(x)

    def init_caches(self, *, num_pages: int, page_size: int, kind: str = "mla", dtype=jnp.float32,
                    indexer_fp8: bool = True, max_seqs: int | None = None) -> dict[str, jax.Array]:
        """Zeroed caches ``{<role>_caches_<layer>: array}`` ordered by (layer, role priority), as
        :func:`kvjax.state.registry.create_caches` names them.

        ``kind="mla"``: the MLA latent cache ``key [P, page_size, R + r]`` in ``dtype`` plus the DSA indexer roles
        ``indexer f8e4m3[P, page_size, Di]`` + ``indexer_scale f32[P, page_size, Di // quant_block]``
        (``indexer_fp8=False``: ``indexer`` in f32, unquantised). ``kind="dsa"``: the full DSA layout (fp8 latent
        ``key`` + ``key_scale`` + bf16 ``key_rope`` + fp8 indexer), as the seed allocates it.
        ``max_seqs`` is accepted for a uniform model interface and unused (no per-sequence state).
        """
        del max_seqs
        c = self.config
        if kind not in ("mla", "dsa"):
            raise ValueError(f"init_caches kind must be 'mla' or 'dsa', got {kind!r}")
        if kind == "dsa" and not indexer_fp8:
            raise ValueError("kind='dsa' caches always hold fp8 indexer keys; got indexer_fp8=False")
        out: dict[str, jax.Array] = {}
        for layer in range(c.num_hidden_layers):
            dsa = DSACacheSpec(layer, page_size, c.kv_lora_rank, c.qk_rope_head_dim, c.index_head_dim,
                               c.quant_block)
            if kind == "dsa":
                cache = create_kv_cache(dsa, num_pages)
            else:
                cache = create_kv_cache(MLACacheSpec(layer, page_size, c.kv_lora_rank, c.qk_rope_head_dim, dtype),
                                        num_pages)
                for role in ("indexer", "indexer_scale"):
                    sds = cache_layout(dsa, num_pages)[role]
                    fp32 = not indexer_fp8 and role == "indexer"
                    cache[role] = jnp.zeros(sds.shape, jnp.float32 if fp32 else sds.dtype)
            out.update({cache_name(role, layer): cache[role] for role in ROLE_PRIORITY if role in cache})
        return out

    def forward_step(self, caches: dict[str, jax.Array], inputs, *,
                     impl: str = "auto") -> tuple[jax.Array, dict[str, jax.Array]]:
        """One ragged step over the paged caches (pure: returns new caches; jit with caches donated).

        ``caches``: from :meth:`init_caches` (``<role>_caches_<layer>``). ``inputs``: a :class:`kvjax.engine.inputs.StepInputs` (reads
        ``token_ids``, ``positions``, ``cu_seqlens``, ``seq_lens``, ``block_tables i32[B, 1, max_blocks]``,
        ``slot_mapping i32[T, 1]``, ``logits_indices i32[N]`` (``N = B`` in the StepInputs contract; any ``N``
        works); GDN fields are unused). This step's latents and indexer keys are written first; token ``t`` of
        row ``b`` then attends to the positions ``<= positions[t]`` of row ``b`` that its indexer selects
        (:func:`kvjax.ops.dsa.indexer_scores`, :func:`~kvjax.ops.dsa.index_topk`, absorbed
        :func:`~kvjax.ops.dsa.sparse_mla_decode` with ``impl``; the indexer and ``sparse_mla_decode_fp8`` with
        ``"reference"`` when ``impl="reference"``, else ``"auto"``). Returns ``(logits f32[N, vocab], caches)``.
        """
        t = inputs.token_ids.shape[0]
        tok = jnp.arange(t)
        row = token_rows(inputs.cu_seqlens, t)
        valid = tok < inputs.cu_seqlens[-1]
        meta = {
            "slots": jnp.where(valid, inputs.slot_mapping[:, 0], -1),
            "block_tables": inputs.block_tables,
            "seq_lens": inputs.seq_lens,
            "cu_seqlens": inputs.cu_seqlens,
            "token_tables": inputs.block_tables[row],  # i32[T, 1, max_blocks]
            "token_lens": jnp.where(valid, inputs.positions + 1, 0).astype(jnp.int32),  # i32[T]
            "impl": impl,
        }
        x = self.embed_tokens[...][inputs.token_ids]
        cos, sin = self._cos_sin(inputs.positions)
        new = dict(caches)
        for li, layer in enumerate(self.layers):
            names = {role: cache_name(role, li) for role in ROLE_PRIORITY if cache_name(role, li) in caches}
            x, cache = layer.step(x, cos, sin, {role: caches[name] for role, name in names.items()}, meta)
            new.update({name: cache[role] for role, name in names.items()})
        return self._head(x[inputs.logits_indices]), new

    step = forward_step


# ---------------------------------------------------------------------------------------------- loading


def _param_values(config: DeepseekConfig, src: TensorSource) -> dict[tuple, np.ndarray]:
    """Every parameter path of :class:`DeepseekV32` -> its checked value from the checkpoint."""
    c = config
    vals: dict[tuple, np.ndarray] = {}

    def linear(path: tuple, name: str, d_in: int, d_out: int, bias: bool = False) -> None:
        vals[(*path, "kernel")] = src.take(f"{name}.weight", (d_out, d_in)).T
        if bias:
            vals[(*path, "bias")] = src.take(f"{name}.bias", (d_out,))

    def vector(path: tuple, name: str, dim: int) -> None:
        vals[path] = src.take(name, (dim,))

    vals[("embed_tokens",)] = src.take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    for i in range(c.num_hidden_layers):
        p, n = ("layers", i), f"model.layers.{i}"
        a, an = (*p, "self_attn"), f"{n}.self_attn"
        linear((*a, "q_a_proj"), f"{an}.q_a_proj", c.hidden_size, c.q_lora_rank, c.attention_bias)
        vector((*a, "q_a_layernorm", "weight"), f"{an}.q_a_layernorm.weight", c.q_lora_rank)
        linear((*a, "q_b_proj"), f"{an}.q_b_proj", c.q_lora_rank, c.num_attention_heads * c.qk_head_dim)
        linear((*a, "kv_a_proj_with_mqa"), f"{an}.kv_a_proj_with_mqa", c.hidden_size, c.latent_dim,
               c.attention_bias)
        vector((*a, "kv_a_layernorm", "weight"), f"{an}.kv_a_layernorm.weight", c.kv_lora_rank)
        linear((*a, "kv_b_proj"), f"{an}.kv_b_proj", c.kv_lora_rank,
               c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim))
        linear((*a, "o_proj"), f"{an}.o_proj", c.num_attention_heads * c.v_head_dim, c.hidden_size,
               c.attention_bias)
        ix, ixn = (*a, "indexer"), f"{an}.indexer"
        linear((*ix, "wq_b"), f"{ixn}.wq_b", c.q_lora_rank, c.index_n_heads * c.index_head_dim)
        linear((*ix, "wk"), f"{ixn}.wk", c.hidden_size, c.index_head_dim)
        vector((*ix, "k_norm", "weight"), f"{ixn}.k_norm.weight", c.index_head_dim)
        vector((*ix, "k_norm", "bias"), f"{ixn}.k_norm.bias", c.index_head_dim)
        linear((*ix, "weights_proj"), f"{ixn}.weights_proj", c.hidden_size, c.index_n_heads)
        if c.mlp_layer_types[i] == "sparse":
            e, inter = c.n_routed_experts, c.moe_intermediate_size
            vals[(*p, "mlp", "gate", "weight")] = src.take(f"{n}.mlp.gate.weight", (e, c.hidden_size))
            vector((*p, "mlp", "gate", "e_score_correction_bias"), f"{n}.mlp.gate.e_score_correction_bias", e)
            ex = f"{n}.mlp.experts"
            if src.has(f"{ex}.gate_up_proj"):  # fused in-memory layout
                gate_up = src.take(f"{ex}.gate_up_proj", (e, 2 * inter, c.hidden_size))
                down = src.take(f"{ex}.down_proj", (e, c.hidden_size, inter))
            else:  # per-expert layout, as save_pretrained writes it
                gate_up = np.stack([np.concatenate(
                    [src.take(f"{ex}.{j}.gate_proj.weight", (inter, c.hidden_size)),
                     src.take(f"{ex}.{j}.up_proj.weight", (inter, c.hidden_size))]) for j in range(e)])
                down = np.stack([src.take(f"{ex}.{j}.down_proj.weight", (c.hidden_size, inter)) for j in range(e)])
            vals[(*p, "mlp", "experts", "gate_up_proj")] = gate_up
            vals[(*p, "mlp", "experts", "down_proj")] = down
            mlp_path, mlp_name, width = (*p, "mlp", "shared_experts"), f"{n}.mlp.shared_experts", \
                inter * c.n_shared_experts
        else:
            mlp_path, mlp_name, width = (*p, "mlp"), f"{n}.mlp", c.intermediate_size
        for proj, d_in, d_out in (("gate_proj", c.hidden_size, width), ("up_proj", c.hidden_size, width),
                                  ("down_proj", width, c.hidden_size)):
            linear((*mlp_path, proj), f"{mlp_name}.{proj}", d_in, d_out)
        vector((*p, "input_layernorm", "weight"), f"{n}.input_layernorm.weight", c.hidden_size)
        vector((*p, "post_attention_layernorm", "weight"), f"{n}.post_attention_layernorm.weight", c.hidden_size)
    vector(("norm", "weight"), "model.norm.weight", c.hidden_size)
    if not c.tie_word_embeddings:
        linear(("lm_head",), "lm_head", c.hidden_size, c.vocab_size)
    return vals


def from_hf(config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *, dtype=jnp.float32) -> DeepseekV32:
    """Build a :class:`DeepseekV32` from a HF config dict and its named tensors; all checks happen first.

    Raises :class:`CheckpointError` naming a bad config key, a missing / mis-shaped / non-float tensor or an
    unexpected tensor (e.g. layers beyond ``num_hidden_layers``, or MoE weights for a layer the config makes
    dense).
    """
    cfg = DeepseekConfig.from_hf(config)
    for name, value in tensors.items():
        if not np.issubdtype(np.asarray(value).dtype, np.floating) and str(value.dtype) != "bfloat16":
            raise CheckpointError(f"tensor {name!r} has non-float dtype {value.dtype}")
    src = TensorSource(tensors)
    values = _param_values(cfg, src)
    ignore = ("lm_head.",) if cfg.tie_word_embeddings else ()
    extra = src.unused(ignore)
    if extra:
        raise CheckpointError(f"checkpoint has tensors the config does not describe: {extra[:8]}")
    model = DeepseekV32(cfg, rngs=nnx.Rngs(0), dtype=dtype)
    return assign_params(model, values)


def load(path: str, config: Mapping[str, Any] | None = None, *, dtype=jnp.float32) -> DeepseekV32:
    """Loader for :func:`kvjax.models.load_pretrained`: ``config.json`` + safetensors at ``path``."""
    if config is None:
        from kvjax.models.common import read_config

        config = read_config(path)
    DeepseekConfig.from_hf(config)  # config errors before reading any tensor
    return from_hf(config, load_safetensors(path), dtype=dtype)
