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
batch (:class:`kvjax.inputs.StepInputs`, condensed once into the typed
:class:`~kvjax.models.deepseek.attention.StepMeta`) writes each new token's latent row ``[kv_c | k_rope]`` and
indexer key by ``slot_mapping``, scores the cached indexer keys (:func:`kvjax.ops.dsa.indexer_scores`), takes
the causal top-k (:func:`kvjax.ops.dsa.index_topk`) and runs every token (prefill chunk or decode) as one
absorbed sparse-MLA decode query over its row's pages (:func:`kvjax.ops.dsa.sparse_mla_decode`: ``W_UK``
folded into q, ``W_UV`` applied to the latent output), causal through its own position.

The model satisfies :class:`kvjax.models.interface.CausalLM`. Config: :mod:`kvjax.models.deepseek.config`;
attention: :mod:`kvjax.models.deepseek.attention`; MoE and decoder layer: :mod:`kvjax.models.deepseek.layers`;
checkpoints: :mod:`kvjax.models.deepseek.loading`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.config import AttentionConfig
from kvjax.models.common.layers import Linear, RMSNorm
from kvjax.models.common.parallel import ShardPlan, TensorParallel, check_divisible, embed, gather_vocab
from kvjax.models.common.rope import rope_cos_sin, rope_inv_freq
from kvjax.models.deepseek.attention import CacheRounding, StepMeta
from kvjax.models.deepseek.config import DeepseekConfig
from kvjax.models.deepseek.layers import DecoderLayer
from kvjax.models.interface import ModelCaches
from kvjax.state.registry import (
    ROLE_PRIORITY,
    DSACacheSpec,
    MLACacheSpec,
    cache_layout,
    cache_name,
    create_kv_cache,
)

_HI = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------------------ model


class DeepseekV32(nnx.Module):
    """DeepSeek-V3.2 causal LM. Parameter paths mirror HF names without the ``model.`` prefix."""

    def __init__(self, config: DeepseekConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        c = config
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(c, i, rngs=rngs, dtype=dtype) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size, rngs=rngs, dtype=dtype)
        # HF rotary inverse frequencies f32[r/2] (default or YaRN) and the cos/sin attention_factor; static
        inv_freq, factor = rope_inv_freq(c.qk_rope_head_dim, c.rope, max_position_embeddings=c.max_position_embeddings)
        self._inv_freq = tuple(float(f) for f in inv_freq)  # f32-exact
        self._rope_factor = float(factor)
        self.tp: TensorParallel | None = None  # set on a device-local shard (kvjax.models.sharding)

    def _cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:  # f32[..., r/2] each
        return rope_cos_sin(positions, jnp.asarray(self._inv_freq, jnp.float32), self._rope_factor)

    def _head(self, h: jax.Array) -> jax.Array:
        h = self.norm(h)
        if self.lm_head is None:
            out = jnp.einsum("...d,vd->...v", h, self.embed_tokens[...], precision=_HI)
        else:
            out = self.lm_head(h)
        return gather_vocab(out.astype(jnp.float32), self.tp)

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
        rounding = CacheRounding(indexer_fp8=indexer_fp8, latent_fp8=latent_fp8)
        for layer in self.layers:
            x = layer(x, cos, sin, rounding)
        return self._head(x)

    # ----------------------------------------------------- serving (kvjax.models.interface.CausalLM)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def shard_plan(self, axis: str, size: int) -> ShardPlan:
        """How :func:`kvjax.models.sharding.shard_model` splits this model over a mesh axis of ``size`` devices.

        The MLA latent cache has one head, so it cannot be split by head: its pages are split over the data axis
        only (each data shard's rows keep their own pages) and replicated over this axis (``pages_over_model``
        False), as vLLM's tensor-parallel MLA does. Over the axis: the query heads of the absorbed attention
        (``q_b_proj``, ``kv_b_proj`` columns, ``o_proj`` rows: each device attends its heads over the shared
        latent pages), MLP and expert columns (the router and the DSA indexer stay whole: top-k selection must
        not depend on a cross-device sum order) and the padded vocabulary. ``ValueError`` names a count that
        ``size`` does not divide."""
        c = self.config
        counts = {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size}
        if "sparse" in c.mlp_layer_types:
            counts["moe_intermediate_size"] = c.moe_intermediate_size
        check_divisible(counts, size, axis)
        vpad = -(-c.vocab_size // size) * size
        local = dataclasses.replace(
            c, vocab_size=vpad // size, num_attention_heads=c.num_attention_heads // size,
            intermediate_size=c.intermediate_size // size,
            moe_intermediate_size=max(c.moe_intermediate_size // size, 1),
        )
        i = c.moe_intermediate_size
        perm = np.concatenate([np.arange(o + k * i // size, o + (k + 1) * i // size)
                               for k in range(size) for o in (0, i)])  # [gate | up] rows: a share of each
        return ShardPlan(local_config=local, vocab_padded=vpad, pages_over_model=False,
                         perms={("experts", "gate_up_proj"): (1, perm)},
                         tp=TensorParallel(axis, size, c.vocab_size))

    def attention_layout(self) -> AttentionConfig:
        """One latent head of width ``kv_lora_rank + qk_rope_head_dim``: one block table per row (MLA)."""
        return AttentionConfig(1, 1, self.config.mla.latent_dim)

    def init_caches(self, *, num_pages: int, page_size: int, kind: str = "mla", dtype=jnp.float32,
                    indexer_fp8: bool = True, max_seqs: int | None = None) -> ModelCaches:
        """Zeroed caches: ``pages`` ``{<role>_caches_<layer>: array}`` ordered by (layer, role priority), as
        :func:`kvjax.state.registry.create_caches` names them; no GDN pool (``gdn=None``).

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
        return ModelCaches(pages=out)

    def forward_step(self, caches: ModelCaches, inputs, *, impl: str = "auto") -> tuple[jax.Array, ModelCaches]:
        """One ragged step over the paged caches (pure: returns new caches; jit with caches donated).

        ``caches``: from :meth:`init_caches` (``pages``: ``<role>_caches_<layer>``). ``inputs``: a
        :class:`kvjax.inputs.StepInputs` (reads ``token_ids``, ``positions``, ``cu_seqlens``, ``seq_lens``,
        ``block_tables i32[B, 1, max_blocks]``, ``slot_mapping i32[T, 1]``, ``logits_indices i32[N]`` (``N = B`` in the StepInputs contract; any ``N``
        works); GDN fields are unused). This step's latents and indexer keys are written first; token ``t`` of
        row ``b`` then attends to the positions ``<= positions[t]`` of row ``b`` that its indexer selects
        (:func:`kvjax.ops.dsa.indexer_scores`, :func:`~kvjax.ops.dsa.index_topk`, absorbed
        :func:`~kvjax.ops.dsa.sparse_mla_decode` with ``impl``; the indexer and ``sparse_mla_decode_fp8`` with
        ``"reference"`` when ``impl="reference"``, else ``"auto"``). Returns ``(logits f32[N, vocab], caches)``.
        """
        meta = StepMeta.from_inputs(inputs, impl)
        x = embed(self.embed_tokens[...], inputs.token_ids, self.tp)
        cos, sin = self._cos_sin(inputs.positions)
        pages = caches.pages
        new = dict(pages)
        for li, layer in enumerate(self.layers):
            names = {role: cache_name(role, li) for role in ROLE_PRIORITY if cache_name(role, li) in pages}
            x, cache = layer.step(x, cos, sin, {role: pages[name] for role, name in names.items()}, meta)
            new.update({name: cache[role] for role, name in names.items()})
        return self._head(x[inputs.logits_indices]), ModelCaches(pages=new, gdn=caches.gdn)
