"""Toy Qwen3.5 text model (flax NNX): Gated DeltaNet layers and gated full-attention layers.

Computes exactly what Hugging Face ``Qwen3_5ForCausalLM`` computes (transformers >= 5):

- ``linear_attention`` layers (:class:`~kvjax.models.qwen3_5.layers.GatedDeltaNet`): ``in_proj_qkv`` -> causal
  depthwise conv1d + SiLU over the concatenated ``[q | k | v]`` -> gated delta rule with q/k l2-norm,
  ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` -> per-head gated RMSNorm with ``z`` ->
  ``out_proj``;
- ``full_attention`` layers (:class:`~kvjax.models.qwen3_5.layers.GatedAttention`): ``q_proj`` gives per head
  ``[q | gate]``; zero-centred RMSNorm on q and k per head; partial NeoX RoPE; GQA softmax attention; output
  ``* sigmoid(gate)``; ``o_proj``;
- every layer: pre-norm residual token mixer and SwiGLU MLP; zero-centred RMSNorms (``1 + weight``).

Two forward paths share the same parameters:

- :meth:`Qwen3_5ForCausalLM.logits` — full sequences ``i32[B, T]``, no cache: the oracle for everything cached;
- :meth:`Qwen3_5ForCausalLM.forward_step` — one ragged step (:class:`kvjax.inputs.StepInputs`) on the
  caches (:class:`~kvjax.models.interface.ModelCaches`): GDN states by slot id, K/V in head-wise paged pools
  (jitted by :func:`kvjax.engine.step.make_step`).

The model satisfies :class:`kvjax.models.interface.CausalLM`. Config: :mod:`kvjax.models.qwen3_5.config`;
layers: :mod:`kvjax.models.qwen3_5.layers`; build: :func:`kvjax.models.load_pretrained` (HF checkpoint),
:func:`kvjax.models.qwen3_5.loading.init_random` (toy weights), and :meth:`Qwen3_5ForCausalLM.with_swa`
(same weights, SWA heads).

Research option (off by default): ``Qwen3_5Config.attention.window/sinks`` make some KV heads of every
full-attention layer sliding-window heads (mask: ``j <= i`` and (``i - j < window`` or ``j < sinks``)); both
paths apply the same mask. HF has no such heads, so parity with HF holds only with the option off.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.base.fp8 import FP8_DTYPE
from kvjax.config import AttentionConfig, GDNConfig, check_kv_cache_dtype
from kvjax.models.common.checkpoint import abstract_model
from kvjax.models.common.layers import Linear
from kvjax.models.common.parallel import ShardPlan, TensorParallel, check_divisible, embed, gather_vocab
from kvjax.models.common.rope import rope_cos_sin, rope_inv_freq
from kvjax.models.interface import ModelCaches
from kvjax.models.qwen3_5.config import Qwen3_5Config
from kvjax.models.qwen3_5.layers import TextModel
from kvjax.sched.blocks import placed_layout
from kvjax.state import gdn_pool
from kvjax.state.kv_cache import FP8_ROLES
from kvjax.state.registry import GQACacheSpec, cache_name, create_caches


def _kv_head_perms(order: np.ndarray, group: int, head_dim: int) -> dict[tuple[str, ...], tuple[int, np.ndarray]]:
    """Parameter permutations that make KV head ``j`` of the attention layers the model's head ``order[j]``
    (``order``: i64[Hkv]) with its GQA group of ``group`` query heads: path suffix -> (axis, index)."""
    q_heads = (order[:, None] * group + np.arange(group)).ravel()  # i64[Hq]: query heads in the new order

    def cols(heads: np.ndarray, width: int) -> np.ndarray:  # i64[len(heads) * width]: each head's block
        return (heads[:, None] * width + np.arange(width)).ravel()

    q, kv, o = cols(q_heads, 2 * head_dim), cols(order, head_dim), cols(q_heads, head_dim)  # q_proj: [q | gate]
    out = {}
    for name, index in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out[("self_attn", name, "kernel")] = (1, index)  # Linear kernel [in, out]
        out[("self_attn", name, "bias")] = (0, index)
    out[("self_attn", "o_proj", "kernel")] = (0, o)  # rows: the query heads' outputs (its bias is not per head)
    return out


class Qwen3_5ForCausalLM(nnx.Module):
    """Toy Qwen3.5 text model. Parameter paths mirror HF names (``kernel`` = transposed ``weight``)."""

    def __init__(self, config: Qwen3_5Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.model = TextModel(config, rngs=rngs, dtype=dtype)
        self.lm_head = (
            None if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, rngs=rngs, dtype=dtype)
        )
        inv_freq, _ = rope_inv_freq(
            config.attention.head_dim,
            {"rope_theta": config.rope_theta, "partial_rotary_factor": config.partial_rotary_factor},
        )
        self._inv_freq = tuple(float(f) for f in inv_freq)  # static, f32-exact
        self.tp: TensorParallel | None = None  # set on a device-local shard (kvjax.models.sharding)

    def with_swa(self, window: tuple[int, ...], sinks: tuple[int, ...] = ()) -> "Qwen3_5ForCausalLM":
        """A model with the same parameters whose full-attention layers have per-KV-head ``window``/``sinks``
        (research option: SWA heads). Both :meth:`logits` and :meth:`forward_step` apply the new masks."""
        config = self.config.with_swa(tuple(window), tuple(sinks))
        graphdef, _ = nnx.split(abstract_model(lambda: Qwen3_5ForCausalLM(config, rngs=nnx.Rngs(0))))
        return nnx.merge(graphdef, nnx.state(self))

    def _head(self, h: jax.Array) -> jax.Array:  # [..., H] -> f32[..., vocab]
        return self.project_vocab(self.model.norm(h))

    def project_vocab(self, h: jax.Array) -> jax.Array:  # [..., H] final-normed -> f32[..., vocab]
        """The LM head alone (tied to the embeddings or not), on final-normed hidden states; the MTP layers
        (:mod:`kvjax.models.qwen3_5.mtp`) share it."""
        if self.lm_head is None:
            out = jnp.matmul(h, self.model.embed_tokens[...].T, precision=jax.lax.Precision.HIGHEST)
        else:
            out = self.lm_head(h)
        return gather_vocab(out.astype(jnp.float32), self.tp)

    def _cos_sin(self, positions: jax.Array):
        return rope_cos_sin(positions, jnp.asarray(self._inv_freq, jnp.float32))

    def logits(self, input_ids: jax.Array) -> jax.Array:  # i32[B, T] -> f32[B, T, vocab]
        """Full-sequence forward without a cache (positions ``0..T-1``): the oracle for the cached step."""
        return self.project_vocab(self.hidden_states(input_ids))

    def hidden_states(self, input_ids: jax.Array) -> jax.Array:  # i32[B, T] -> [B, T, H]
        """Final-normed hidden states of full sequences without a cache (the LM head's input; what the MTP
        layers take as the main model's hidden state)."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be i32[B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        x = self.model.embed_tokens[...][input_ids]  # [B, T, H]
        cos, sin = self._cos_sin(jnp.arange(t, dtype=jnp.int32))
        cu = jnp.arange(b + 1, dtype=jnp.int32) * t
        for layer in self.model.layers:
            h = layer.input_layernorm(x)
            if layer.layer_type == "linear_attention":
                y = layer.linear_attn(h.reshape(b * t, -1), cu)
                y = y.reshape(b, t, -1)
            else:
                y = layer.self_attn.full(h, cos, sin)
            x = layer.mlp_block(x + y)
        return self.model.norm(x)

    # ----------------------------------------------------- serving (kvjax.models.interface.CausalLM)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def shard_plan(self, axis: str, size: int) -> ShardPlan:
        """How :func:`kvjax.models.sharding.shard_model` splits this model over a mesh axis of ``size`` devices:
        attention query/KV heads, GDN key/value heads (and their conv channels), MLP columns and the padded
        vocabulary. ``ValueError`` names a head count or width that ``size`` does not divide.

        KV heads are *placed* before the contiguous split (:func:`kvjax.sched.blocks.head_placement`, the
        plan's ``kv_order``): each device gets the same mix of SWA and full heads where the counts allow, so no
        device's page pool fills first. A KV head moves with everything that belongs to it: its ``k_proj`` /
        ``v_proj`` columns, its GQA group's ``q_proj`` columns (``[q | gate]`` per query head) and ``o_proj``
        rows, and its window / sinks (``tp.kv_window``). Attention heads are independent, so the placed model
        computes the same function (the ``o_proj`` sum runs in another order: equal up to rounding)."""
        c, a, g = self.config, self.config.attention, self.config.gdn
        counts = {"num_attention_heads": a.num_q_heads, "num_key_value_heads": a.num_kv_heads,
                  "linear_num_key_heads": g.num_k_heads, "linear_num_value_heads": g.num_v_heads,
                  "intermediate_size": c.intermediate_size}
        check_divisible(counts, size, axis)
        vpad = -(-c.vocab_size // size) * size
        local = dataclasses.replace(
            c, vocab_size=vpad // size, intermediate_size=c.intermediate_size // size,
            attention=AttentionConfig(a.num_q_heads // size, a.num_kv_heads // size, a.head_dim),
            gdn=GDNConfig(g.num_k_heads // size, g.num_v_heads // size, g.head_k_dim, g.head_v_dim,
                          g.conv_kernel_size),
        )
        qk, v = g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim
        blocks = [(0, qk), (qk, qk), (2 * qk, v)]  # [q | k | v] conv channels: each device takes its share of each
        perm = np.concatenate([np.arange(o + i * n // size, o + (i + 1) * n // size)
                               for i in range(size) for o, n in blocks])
        perms = {("linear_attn", "in_proj_qkv", "kernel"): (1, perm), ("linear_attn", "conv_weight"): (0, perm)}
        _, order = placed_layout(a, size)  # i64[Hkv]: KV heads in device-major order
        if (order != np.arange(a.num_kv_heads)).any():
            perms.update(_kv_head_perms(order, a.group_size, a.head_dim))
        window, sinks = np.asarray(a.window)[order].tolist(), np.asarray(a.sinks)[order].tolist()
        return ShardPlan(
            local_config=local, vocab_padded=vpad, pages_over_model=True, perms=perms,
            kv_order=tuple(order.tolist()) if len(perms) > 2 else (),
            tp=TensorParallel(axis, size, c.vocab_size, tuple(window), tuple(sinks)),
        )

    def attention_layout(self) -> AttentionConfig:
        """The full-attention layers' KV heads with their per-head ``window``/``sinks`` (one block table each)."""
        return self.config.attention

    def init_caches(self, *, num_pages: int, page_size: int, max_seqs: int, dtype=jnp.float32,
                    kv_cache_dtype: str = "auto") -> ModelCaches:
        """Zeroed caches: ``gdn``, a GDN pool with ``max_seqs + 1`` slots (slot 0 = PAD; ``[0, S+1, ...]`` for
        an attention-only model); ``pages``, ``key_caches_<l>`` / ``value_caches_<l> [P, page_size, D]`` per
        KV-head page pool of each full-attention layer ``l`` (page/conv dtype ``dtype``; SSM state always f32).
        ``kv_cache_dtype="fp8"`` (vLLM's name; ``"fp8_e4m3"`` too): float8_e4m3fn pages plus ``key_scale_caches_<l>``
        / ``value_scale_caches_<l>`` ``f32[P]`` (one scale per page; :mod:`kvjax.state.kv_cache`); ``"auto"``:
        pages of ``dtype``."""
        c = self.config
        a = c.attention
        page_dtype = FP8_DTYPE if check_kv_cache_dtype(kv_cache_dtype) == "fp8" else dtype
        specs = [GQACacheSpec(layer=i, num_kv_heads=a.num_kv_heads, page_size=page_size, head_dim=a.head_dim,
                              dtype=page_dtype) for i in c.attention_layers]
        return ModelCaches(
            pages=create_caches(specs, num_pages),
            gdn=gdn_pool.create(c.gdn, len(c.gdn_layers), max_seqs, conv_dtype=dtype),
        )

    def forward_step(self, caches: ModelCaches, inputs) -> tuple[jax.Array, ModelCaches]:
        """One ragged step (prefill chunks and decode tokens mixed); returns ``(f32[B, vocab], new caches)``
        (see :meth:`_trunk`)."""
        x, caches = self._trunk(caches, inputs)
        return self._head(x[inputs.logits_indices]), caches

    def forward_step_hidden(self, caches: ModelCaches, inputs) -> tuple[jax.Array, jax.Array, ModelCaches]:
        """:meth:`forward_step` that also returns every step token's final-normed hidden state: ``(logits
        f32[B, vocab] at logits_indices, hidden [T, H], new caches)`` (the MTP drafter's input,
        :func:`kvjax.models.qwen3_5.mtp.mtp_propose`)."""
        x, caches = self._trunk(caches, inputs)
        h = self.model.norm(x)  # [T, H]
        return self.project_vocab(h[inputs.logits_indices]), h, caches

    def mtp_head(self):
        """The MTP layers loaded beside this model (:func:`kvjax.models.qwen3_5.mtp.attach`; a
        :class:`~kvjax.models.interface.DraftHead`), or ``None``."""
        held = getattr(self, "mtp", None)
        return None if held is None else held.module

    def _trunk(self, caches: ModelCaches, inputs) -> tuple[jax.Array, ModelCaches]:
        """The layers of one ragged step (prefill chunks and decode tokens mixed): ``(x [T, H] before the final
        norm, new caches)``.

        Reads and writes GDN states at ``inputs.gdn_slots`` (zeros where ``has_initial_state`` is false; slot 0
        never written), writes new K/V by ``inputs.slot_mapping`` and attends through ``inputs.block_tables``
        with the per-KV-head window/sinks. ``inputs.decode_only`` (static) selects the recurrent GDN kernel and
        the conv update, which continue every live row's state (a ``decode_only`` step has no fresh row:
        :func:`kvjax.engine.inputs.decode_only`); otherwise the chunked kernel serves every row (prefill chunks
        and decode tokens).
        """
        from kvjax.ops.attention import paged_attention
        from kvjax.state.kv_cache import write_kv_cache

        c = self.config
        x = embed(self.model.embed_tokens[...], inputs.token_ids, self.tp)  # [T, H]
        cos, sin = self._cos_sin(inputs.positions)
        window = jnp.asarray(c.attention.window, jnp.int32)  # i32[Hkv]
        sinks = jnp.asarray(c.attention.sinks, jnp.int32)  # i32[Hkv]
        if self.tp is not None:  # this device's KV heads of the global masks
            window = self.tp.local(jnp.asarray(self.tp.kv_window or (0,) * self.tp.size, jnp.int32))
            sinks = self.tp.local(jnp.asarray(self.tp.kv_sinks or (0,) * self.tp.size, jnp.int32))
        pool, kv = caches.gdn, dict(caches.pages)
        gi = 0
        for li, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            if layer.layer_type == "linear_attention":
                y, pool = layer.linear_attn.step(h, inputs, pool, gi, inputs.decode_only)
                gi += 1
            else:
                attn = layer.self_attn
                q, gate, k, v = attn.project(h, cos, sin)
                names = {r: cache_name(r, li) for r in FP8_ROLES if cache_name(r, li) in kv}
                pages = write_kv_cache({r: kv[n] for r, n in names.items()}, k, v, inputs.slot_mapping,
                                       cu_seqlens=inputs.cu_seqlens)
                kv.update({n: pages[r] for r, n in names.items()})
                o = paged_attention(
                    q, pages["key"], pages["value"], inputs.block_tables, inputs.seq_lens,
                    cu_seqlens=inputs.cu_seqlens, scale=c.attention.head_dim ** -0.5, window=window, sinks=sinks,
                    k_scale=pages.get("key_scale"), v_scale=pages.get("value_scale"),
                    max_query_len=inputs.max_query_len or None,
                )
                y = attn.finish(o, gate)
            x = layer.mlp_block(x + y)
        return x, ModelCaches(pages=kv, gdn=pool)
