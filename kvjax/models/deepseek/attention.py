"""DeepSeek-V3.2 attention: MLA with the DSA lightning indexer (HF ``DeepseekV32Attention``), whole sequences
(the oracle, with the cache's rounding :class:`CacheRounding`) and one cached ragged step over the paged latent +
indexer caches; :class:`StepMeta` is the step's per-token metadata. Semantics: :mod:`kvjax.models.deepseek.model`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.base.ragged import token_rows
from kvjax.base.softmax import masked_softmax
from kvjax.models.common.layers import Linear, RMSNorm
from kvjax.models.common.rope import apply_rope
from kvjax.models.deepseek.config import DeepseekConfig
from kvjax.ops.dsa import index_topk, indexer_scores, sparse_mla_decode, sparse_mla_decode_fp8
from kvjax.ops.mla import absorb_output, absorb_query, split_kv_b_proj
from kvjax.state.dsa_cache import (
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    write_dsa_indexer,
    write_dsa_key,
)
from kvjax.state.kv_cache import scatter_tokens
from kvjax.state.latent_cache import write_latent_cache

_HI = jax.lax.Precision.HIGHEST


def fp8_roundtrip(x: jax.Array, block: int) -> jax.Array:  # f32[..., N] -> f32[..., N]
    """``x`` as the DSA cache stores and reads it back: blockwise fp8 e4m3 (one f32 scale per ``block``)."""
    return dequantize_fp8_blockwise(*quantize_fp8_blockwise(x, block))


@dataclasses.dataclass(frozen=True)
class CacheRounding:
    """Which DSA cache roundings the full-sequence oracle applies, so that it computes what a cached step over
    caches of the same kind computes; built once by :meth:`~kvjax.models.deepseek.model.DeepseekV32.logits` and
    handed unchanged to every layer (a static, hashable value). The default rounds nothing (HF's computation)."""

    indexer_fp8: bool = False  # indexer keys through the fp8 quantisation of the ``indexer`` role
    latent_fp8: bool = False  # ``kv_c`` through fp8 and ``k_rope`` through bf16 (the DSA ``key`` roles)


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


# ------------------------------------------------------------------------------------------ step metadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMeta:
    """Per-step metadata every layer's cached attention reads (built once per step by :meth:`from_inputs`)."""

    slots: jax.Array  # i32[T]: flat cache slot (page * page_size + offset) of each token's new row; -1 = padding
    block_tables: jax.Array  # i32[B, 1, max_blocks]: pages of each row (one latent head); -1 = hole
    seq_lens: jax.Array  # i32[B]: context length of each row including this step's tokens
    cu_seqlens: jax.Array  # i32[B+1]: token start offsets of each row
    token_tables: jax.Array  # i32[T, 1, max_blocks]: the block table of each token's row
    token_lens: jax.Array  # i32[T]: keys each token may see (its position + 1; 0 for padding tokens)
    impl: str = dataclasses.field(default="auto", metadata=dict(static=True))  # sparse MLA decode backend

    @classmethod
    def from_inputs(cls, inputs, impl: str = "auto") -> "StepMeta":
        """From a :class:`kvjax.inputs.StepInputs` (``slot_mapping i32[T, 1]``, one latent head)."""
        t = inputs.token_ids.shape[0]
        valid = jnp.arange(t) < inputs.cu_seqlens[-1]
        return cls(
            slots=jnp.where(valid, inputs.slot_mapping[:, 0], -1),
            block_tables=inputs.block_tables,
            seq_lens=inputs.seq_lens,
            cu_seqlens=inputs.cu_seqlens,
            token_tables=inputs.block_tables[token_rows(inputs.cu_seqlens, t)],
            token_lens=jnp.where(valid, inputs.positions + 1, 0).astype(jnp.int32),
            impl=impl,
        )


# ------------------------------------------------------------------------------------------------ attention


class Attention(nnx.Module):
    """MLA with the DSA indexer (HF ``DeepseekV32Attention``)."""

    def __init__(self, c: DeepseekConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.c = c
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias, rngs=rngs, dtype=dtype)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6, dtype=dtype)
        self.q_b_proj = Linear(c.q_lora_rank, c.num_attention_heads * c.mla.qk_head_dim, rngs=rngs, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.mla.latent_dim, bias=c.attention_bias, rngs=rngs, dtype=dtype)
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
        q = self.q_b_proj(q_resid).reshape(*x.shape[:-1], c.num_attention_heads, c.mla.qk_head_dim)
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
        rounding: CacheRounding = CacheRounding(),
    ) -> jax.Array:  # [B, T, D]
        """Full causal sequence ``x: [B, T, D]`` (cos/sin ``f32[B, T, r/2]``) -> ``[B, T, D]``."""
        c = self.c
        b, t, _ = x.shape
        q_resid, q_nope, q_rope, kv_c, k_rope = self._project(x, cos, sin)
        if rounding.latent_fp8:
            kv_c = fp8_roundtrip(kv_c, c.quant_block).astype(x.dtype)
            k_rope = k_rope.astype(jnp.bfloat16).astype(x.dtype)
        kv = self.kv_b_proj(kv_c).reshape(b, t, c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        s = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, precision=_HI)
             + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope, precision=_HI)).astype(jnp.float32) * c.softmax_scale

        iq, ik, iw = self.indexer.project(x, q_resid, cos, sin)
        if rounding.indexer_fp8:
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
        cache: dict[str, jax.Array],  # this layer's roles {role: [P, page_size, ...]} (key, indexer, ...)
        meta: StepMeta,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:  # ([T, D], new cache)
        """Cached step over ``x: [T, D]``: writes this step's latents / indexer keys, attends over the cache.

        Returns ``([T, D], new cache)``; see :meth:`~kvjax.models.deepseek.model.DeepseekV32.forward_step`.
        """
        c = self.c
        q_resid, q_nope, q_rope, kv_c, k_rope = self._project(x, cos, sin)
        iq, ik, iw = self.indexer.project(x, q_resid, cos, sin)
        slots = meta.slots  # i32[T]; -1 for padding tokens
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
        dsa_impl = "reference" if meta.impl == "reference" else "auto"
        scores = indexer_scores(iq, iw, cache["indexer"], index_scale, meta.block_tables, meta.seq_lens,
                                cu_seqlens=meta.cu_seqlens, scale=c.index_head_dim ** -0.5,
                                impl=dsa_impl)  # f32[T, L]
        topk = index_topk(scores, c.index_topk)  # i32[T, index_topk]; -1 = none

        # Every token is one absorbed sparse-decode query over its own row's pages, causal through its length.
        w_uk, w_uv = split_kv_b_proj(self.kv_b_proj.kernel[...].T, c.num_attention_heads,
                                     c.qk_nope_head_dim, c.v_head_dim)
        q_lat = absorb_query(q_nope.astype(jnp.float32), w_uk)  # f32[T, H, R]
        q_rope = q_rope.astype(jnp.float32)
        tables, lens = meta.token_tables, meta.token_lens  # i32[T, 1, max_blocks], i32[T]
        if fp8_latent:
            o_lat = sparse_mla_decode_fp8(q_lat, q_rope, cache["key"], cache["key_scale"], cache["key_rope"],
                                          tables, lens, topk, scale=c.softmax_scale, impl=dsa_impl)
        else:
            o_lat = sparse_mla_decode(q_lat, q_rope, cache["key"], tables, lens, topk, scale=c.softmax_scale,
                                      impl=meta.impl)
        o = absorb_output(o_lat, w_uv).astype(x.dtype).reshape(x.shape[0], -1)
        return self.o_proj(o), cache
