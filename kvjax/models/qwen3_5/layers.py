"""Layers of the toy Qwen3.5 text model (flax NNX); see :mod:`kvjax.models.qwen3_5.model` for the semantics.

- :class:`GatedDeltaNet`: ``in_proj_qkv`` -> causal depthwise conv1d + SiLU -> gated delta rule (q/k l2-norm,
  ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``) -> gated RMSNorm with ``z`` -> ``out_proj``;
  whole sequences (``__call__``) or one ragged step on the slot-addressed GDN pool (``step``).
- :class:`GatedAttention`: output-gated q, zero-centred q/k RMSNorm, partial RoPE, GQA; whole sequences with
  :func:`dense_masked_attention` (per-KV-head window/sinks) — the paged path lives in the model's step.
- :class:`DecoderLayer` (pre-norm residual, shared SwiGLU :class:`~kvjax.models.common.layers.MLP`),
  :class:`TextModel` (embeddings, layers, norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.base.ragged import token_rows
from kvjax.config import AttentionConfig, GDNConfig
from kvjax.models.common.layers import MLP, GatedRMSNorm, Linear, RMSNorm, TorchLinear
from kvjax.models.common.rope import apply_rope
from kvjax.models.qwen3_5.config import Qwen3_5Config
from kvjax.state.gdn_pool import GDNStatePool


class GatedDeltaNet(nnx.Module):
    """Qwen3.5 linear-attention token mixer over a ragged token-major batch."""

    def __init__(self, hidden: int, cfg: GDNConfig, eps: float, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        hk, hv, kd, vd = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        self.in_proj_qkv = Linear(hidden, cfg.conv_dim, rngs=rngs, dtype=dtype)
        self.in_proj_z = Linear(hidden, hv * vd, rngs=rngs, dtype=dtype)
        self.in_proj_b = TorchLinear(hidden, hv, rngs=rngs, dtype=dtype)  # weight [Hv, H]: rows read by the kernel
        self.in_proj_a = TorchLinear(hidden, hv, rngs=rngs, dtype=dtype)
        w = cfg.conv_kernel_size
        self.conv_weight = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.conv_dim, w), dtype) / np.sqrt(w)
        )  # [conv_dim, W]
        self.dt_bias = nnx.Param(jnp.ones((hv,), dtype))  # [Hv]
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), dtype, 0.01, 16.0)))  # [Hv]
        self.norm = GatedRMSNorm(vd, eps, dtype=dtype)
        self.out_proj = Linear(hv * vd, hidden, rngs=rngs, dtype=dtype)
        del hk, kd

    def _conv(self, x: jax.Array, cu_seqlens: jax.Array, conv_state: jax.Array | None):
        """x [T, H] -> conv(in_proj_qkv(x)) [T, conv_dim] (SiLU) and the final conv states [N, conv_dim, W-1]."""
        from kvjax.ops.conv import causal_conv1d

        return causal_conv1d(
            self.in_proj_qkv(x), self.conv_weight[...], None,
            cu_seqlens=cu_seqlens, initial_state=conv_state, activation="silu",
        )

    def _split(self, x: jax.Array, mixed: jax.Array):
        """x [T, H], conv output [T, conv_dim] -> q, k [T, Hk, K], v [T, Hv, V], g f32[T, Hv], beta [T, Hv], z."""
        from kvjax.ops.gdn_on_pool import qwen_gates, split_packed

        c = self.cfg
        q, k, v = split_packed(mixed, c.num_v_heads, c.head_k_dim, c.head_v_dim)
        g, beta = qwen_gates(self.in_proj_a(x), self.in_proj_b(x), self.A_log[...], self.dt_bias[...], v.dtype)
        return q, k, v, g, beta, self._z(x)

    def _z(self, x: jax.Array) -> jax.Array:  # [T, H] -> [T, Hv, V]
        c = self.cfg
        return self.in_proj_z(x).reshape(x.shape[0], c.num_v_heads, c.head_v_dim)

    def _out(self, o: jax.Array, z: jax.Array) -> jax.Array:  # [T, Hv, V], [T, Hv, V] -> [T, H]
        c = self.cfg
        return self.out_proj(self.norm(o, z).reshape(o.shape[0], c.num_v_heads * c.head_v_dim))

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array) -> jax.Array:  # [T, H], i32[N+1] -> [T, H]
        """Whole sequences from zero state (no cache)."""
        from kvjax.ops.gdn import chunk_gated_delta_rule

        qkv, _ = self._conv(x, cu_seqlens, None)
        q, k, v, g, beta, z = self._split(x, qkv)
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm=True)
        return self._out(o, z)

    def step(
        self,
        x: jax.Array,  # [T, H]
        inputs,  # StepInputs
        pool: GDNStatePool,  # conv [L_gdn, S+1, conv_dim, W-1], ssm f32[L_gdn, S+1, Hv, K, V]
        layer: int,  # index of this layer in the pool
        decode_only: bool,  # static: every live row has exactly one token (recurrent + conv-update path)
    ) -> tuple[jax.Array, GDNStatePool]:  # y [T, H], pool updated at the live rows' slots
        """Ragged step on the slot-addressed pool (slot 0 = PAD: never read as state, never written).

        ``decode_only``: each row's single token is gathered to a row-major ``[B, H]`` batch (no gather when
        ``T == B``: live rows come first, so token ``b`` is row ``b``'s) and the decode kernels run by slot id,
        each live row continuing its state (a ``decode_only`` step has no fresh row): the conv update, then
        :func:`~kvjax.state.gdn_pool.gated_delta_decode` of one :class:`~kvjax.ops.gdn_on_pool.GatedDecodeCall`
        (the packed conv output; the kernel projects the gates from ``x`` itself); outputs are scattered back
        to token order. A verification step (speculative decoding: ``pool.spec`` set, never ``decode_only``) also
        records each verification row's states after every position (:func:`kvjax.state.gdn_spec.record`); with
        ``inputs.max_query_len`` (every row continues its state with a few tokens) one call does the recurrence and
        the recording instead of the chunked kernel (:func:`kvjax.state.gdn_spec.verify`).
        """
        from kvjax.ops.gdn_on_pool import GatedDecodeCall
        from kvjax.state import gdn_spec
        from kvjax.state.gdn_pool import conv_decode, conv_prefill, gated_delta_decode, gather, gdn_prefill

        slots, has_init, cu = inputs.gdn_slots, inputs.has_initial_state, inputs.cu_seqlens
        weight = self.conv_weight[...]
        if decode_only:
            assert pool.spec is None, "a verification step has rows of several tokens: not decode_only"
            t = x.shape[0]
            rows_are_tokens = t == cu.shape[0] - 1  # live rows first, one token each: token b is row b's
            xr = x if rows_are_tokens else x[jnp.clip(cu[:-1], 0, t - 1)]  # [B, H] (padding rows: ignored)
            mixed, pool = conv_decode(self.in_proj_qkv(xr), weight, None, pool, layer=layer, slot_ids=slots)
            call = GatedDecodeCall(mixed, xr, self.in_proj_a.weight[...], self.in_proj_b.weight[...],
                                   self.A_log[...], self.dt_bias[...], slots, layer=layer,
                                   scale=self.cfg.head_k_dim ** -0.5, use_qk_l2norm=True)
            o, pool = gated_delta_decode(call, pool)
            y = self._out(o, self._z(xr))  # [B, H]
            return (y if rows_are_tokens else y[token_rows(cu, t)]), pool
        conv_in = self.in_proj_qkv(x)  # [T, conv_dim]
        before = None if pool.spec is None else gather(pool, layer, slots, has_init)  # a verification step's rows
        mixed, pool = conv_prefill(
            conv_in, weight, None, pool, layer=layer, slot_ids=slots, has_initial_state=has_init, cu_seqlens=cu,
        )
        q, k, v, g, beta, z = self._split(x, mixed)
        if before is not None and inputs.max_query_len:  # every row continues its state with a few tokens
            o, pool = gdn_spec.verify(pool, layer, conv_in, before[0], q, k, v, g, beta, slots, cu,
                                      scale=self.cfg.head_k_dim ** -0.5, use_qk_l2norm=True)
            return self._out(o, z), pool
        o, pool = gdn_prefill(
            q, k, v, g, beta, pool, layer=layer, slot_ids=slots, has_initial_state=has_init, cu_seqlens=cu,
            use_qk_l2norm=True,
        )
        if before is not None:  # the states after each verification position (speculative decoding's rollback)
            pool = gdn_spec.record(pool, layer, conv_in, before[0], k, v, g, beta, before[1], use_qk_l2norm=True)
        return self._out(o, z), pool


def dense_masked_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, T, Hkv, D]
    v: jax.Array,  # [B, T, Hkv, D]
    window: jax.Array,  # i32[Hkv], 0 = full
    sinks: jax.Array,  # i32[Hkv]
    scale: float,
) -> jax.Array:  # [B, T, Hq, D]
    """Softmax attention of whole sequences (positions ``0..T-1``) with the per-KV-head window/sink mask."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("bihgd,bjhd->bhgij", qg, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) * scale
    i = jnp.arange(t)[:, None]
    j = jnp.arange(t)[None, :]
    w = window[:, None, None]
    mask = (j <= i)[None] & ((w == 0) | (i - j < w) | (j < sinks[:, None, None]))  # [Hkv, T, T]
    s = jnp.where(mask[None, :, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgij,bjhd->bihgd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return o.reshape(b, t, hq, d).astype(q.dtype)


class GatedAttention(nnx.Module):
    """Qwen3.5 full attention: output-gated q, q/k RMSNorm, partial RoPE, GQA, optional SWA heads."""

    def __init__(self, hidden: int, cfg: AttentionConfig, eps: float, *, bias: bool, rngs: nnx.Rngs,
                 dtype=jnp.float32):
        self.cfg = cfg
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(hidden, hq * d * 2, bias=bias, rngs=rngs, dtype=dtype)
        self.k_proj = Linear(hidden, hkv * d, bias=bias, rngs=rngs, dtype=dtype)
        self.v_proj = Linear(hidden, hkv * d, bias=bias, rngs=rngs, dtype=dtype)
        self.o_proj = Linear(hq * d, hidden, bias=bias, rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(d, eps, zero_centered=True, dtype=dtype)
        self.k_norm = RMSNorm(d, eps, zero_centered=True, dtype=dtype)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """x [..., H] -> q [..., Hq, D], gate [..., Hq*D], k, v [..., Hkv, D] (q, k normed and rotated)."""
        c = self.cfg
        lead = x.shape[:-1]
        qg = self.q_proj(x).reshape(*lead, c.num_q_heads, 2 * c.head_dim)
        q, gate = qg[..., : c.head_dim], qg[..., c.head_dim:]
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(*lead, c.num_kv_heads, c.head_dim)), cos, sin)
        v = self.v_proj(x).reshape(*lead, c.num_kv_heads, c.head_dim)
        return q, gate.reshape(*lead, c.num_q_heads * c.head_dim), k, v

    def finish(self, o: jax.Array, gate: jax.Array) -> jax.Array:  # [..., Hq, D], [..., Hq*D] -> [..., H]
        o = o.reshape(*o.shape[:-2], -1)
        return self.o_proj(o * jax.nn.sigmoid(gate))

    def full(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:  # [B, T, H] -> [B, T, H]
        q, gate, k, v = self.project(x, cos, sin)
        window = jnp.asarray(self.cfg.window, jnp.int32)
        sinks = jnp.asarray(self.cfg.sinks, jnp.int32)
        o = dense_masked_attention(q, k, v, window, sinks, self.cfg.head_dim ** -0.5)
        return self.finish(o, gate)


class DecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3_5Config, layer_type: str, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.layer_type = layer_type
        h, eps = config.hidden_size, config.rms_norm_eps
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(h, config.gdn, eps, rngs=rngs, dtype=dtype)
        else:
            self.self_attn = GatedAttention(h, config.attention, eps, bias=config.attention_bias, rngs=rngs,
                                            dtype=dtype)
        self.mlp = MLP(h, config.intermediate_size, rngs=rngs, dtype=dtype)
        self.input_layernorm = RMSNorm(h, eps, zero_centered=True, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, zero_centered=True, dtype=dtype)

    def mlp_block(self, x: jax.Array) -> jax.Array:
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nnx.Module):
    def __init__(self, config: Qwen3_5Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.embed_tokens = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size), dtype)
        )  # [vocab, H]
        self.layers = nnx.List([DecoderLayer(config, t, rngs=rngs, dtype=dtype) for t in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True, dtype=dtype)
