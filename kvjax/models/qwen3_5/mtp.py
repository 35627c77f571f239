"""Multi-token prediction (MTP) layers of Qwen3.5 / Qwen3-Next checkpoints and the greedy MTP drafter.

The published architecture (vLLM's ``qwen3_next_mtp`` / ``qwen3_5_mtp``; checkpoint keys ``mtp.*``). For a
position ``t`` with the main model's final-normed hidden state ``h_t`` (the LM head's input) and the token
``x_{t+1}`` that follows it::

    u = fc([pre_fc_norm_embedding(embed(x_{t+1})) | pre_fc_norm_hidden(h_t)])   # Linear 2H -> H, no bias
    u = u + attn(input_layernorm(u))              # one gated full-attention decoder layer of the main
    u = u + mlp(post_attention_layernorm(u))      # model's kind, at RoPE position t, over its own K/V
    g_t = norm(u)                                 # the MTP hidden state, fed back by the next draft step
    logits = lm_head(g_t)                         # the main model's head (shared): predicts x_{t+2}

Every norm is the zero-centred RMSNorm of the main model (scale ``1 + weight``); ``embed`` and ``lm_head`` are the
main model's (the checkpoint has no MTP copy of either). The MTP layer's attention has the main model's
attention layout (its KV heads, ``window`` / ``sinks``), so it is addressed by the same head-wise block tables.

**The MTP cache.** The MTP layer keeps K/V of its own (the seed's ``initialize_mtp_kv_cache``): one GQA page pool
per MTP layer, made by :func:`init_mtp_caches` through :mod:`kvjax.state.registry` like the main model's and
named ``<role>_caches_<L + i>`` (``L`` = the main model's layer count: the MTP layers come after its layers, as
vLLM numbers them). It has as many pages as the main model's pools and is addressed by the *same* block tables and
slot mappings: position ``t`` of a row holds, in the MTP pool, the MTP layer's K/V of the pair ``(h_t, x_{t+1})``
in the page where the main pool holds the main layers' K/V of ``x_t``. So the scheduler's pages, recycling (SWA
heads: the MTP layer has the same windows) and prefix caching serve both without anything of their own.

**Drafting** (:func:`mtp_propose`, vLLM's one-MTP-layer loop). After a main-model step (a prefill chunk, a
decode token, or a verification of ``x_n, d_1 .. d_K`` whose first ``a`` drafts were accepted) the MTP layer
runs once over the step's tokens (a ragged *catch-up* step: ``(h_t, x_{t+1})`` at every position, writing their
K/V), then the output at each row's last accepted position ``p`` gives the first draft (for position
``p + 2``); each further draft step ``k`` runs one token per row at position ``p + k``: the previous draft and the
previous MTP hidden state ``g``: the ``K - 1`` steps are one op, :func:`kvjax.ops.draft.draft_steps`
(:func:`draft_op`; a kernel with one program per row for small float32 layers), or the layer's own ragged steps
(:func:`draft_loop`) on a mesh shard, over fp8 pages or with biases. Every pass writes its K/V before attending, a
query attends positions up to its own, and the catch-ups tile every position with the true pairs, so keys left by
rejected drafts or by draft steps are always overwritten before a later query can read them.

**On a mesh** (:meth:`kvjax.models.sharding.ShardedModel.local_head`): each device runs a local module of the
local config, its attention heads and MLP columns split over ``"model"`` like the model's layers (the model's KV-head
placement), the embedding lookup and LM head through the local model's ``tp`` (vocabulary-sharded), the attention
masks of its own KV heads; its pools hold those heads' pages.

Full-sequence forward without a cache: :meth:`Qwen3_5MTP.dense` (training, and the oracle of the paged step).
Loading: :func:`kvjax.models.qwen3_5.loading.load` reads the ``mtp.*`` tensors when the checkpoint has them and
keeps the module beside (not inside) the model's parameters: :func:`mtp_of`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.base.fp8 import FP8_DTYPE
from kvjax.config import check_kv_cache_dtype
from kvjax.inputs import StepInputs
from kvjax.models.common.checkpoint import abstract_model, assign_params, check_param_dtype
from kvjax.models.common.layers import Linear, RMSNorm
from kvjax.models.common.parallel import embed
from kvjax.models.common.rope import rope_cos_sin, rope_inv_freq
from kvjax.models.qwen3_5.config import Qwen3_5Config
from kvjax.models.qwen3_5.layers import DecoderLayer
from kvjax.models.qwen3_5.model import Qwen3_5ForCausalLM
from kvjax.ops.draft import DraftLayer, DraftShape, draft_slots, draft_steps
from kvjax.state.kv_cache import FP8_ROLES
from kvjax.state.registry import GQACacheSpec, cache_name, create_caches


class Qwen3_5MTP(nnx.Module):
    """The MTP layers of a Qwen3.5 model (parameter paths mirror the checkpoint's ``mtp.*`` names:
    ``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers.<i>.*``, ``norm``)."""

    def __init__(self, config: Qwen3_5Config, *, num_layers: int = 1, rngs: nnx.Rngs, dtype=jnp.float32):
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"Qwen3_5MTP num_layers must be an int >= 1, got {num_layers!r}")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.fc = Linear(2 * h, h, rngs=rngs, dtype=dtype)  # kernel [2H, H]: [embedding | hidden] -> H
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zero_centered=True, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zero_centered=True, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(config, "full_attention", rngs=rngs, dtype=dtype)
                                for _ in range(num_layers)])
        self.norm = RMSNorm(h, eps, zero_centered=True, dtype=dtype)
        inv_freq, _ = rope_inv_freq(
            config.attention.head_dim,
            {"rope_theta": config.rope_theta, "partial_rotary_factor": config.partial_rotary_factor},
        )
        self._inv_freq = tuple(float(f) for f in inv_freq)  # static, f32-exact (the main model's RoPE)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def first_layer(self) -> int:
        """Layer index of MTP layer 0 in cache names: the main model's layer count."""
        return self.config.num_layers

    def combine(self, model: Qwen3_5ForCausalLM, next_ids: jax.Array, hidden: jax.Array) -> jax.Array:
        """``fc([norm_e(embed(next_ids)) | norm_h(hidden)])``: i32[...], [..., H] -> [..., H]."""
        _check_model(model, self)
        emb = embed(model.model.embed_tokens[...], next_ids, model.tp)  # [..., H]
        e = self.pre_fc_norm_embedding(emb)
        g = self.pre_fc_norm_hidden(hidden.astype(emb.dtype))
        return self.fc(jnp.concatenate([e, g], axis=-1))

    def logits(self, model: Qwen3_5ForCausalLM, g: jax.Array) -> jax.Array:  # [..., H] -> f32[..., vocab]
        """The main model's LM head on MTP hidden states (already normed by ``self.norm``)."""
        return model.project_vocab(g)

    def _cos_sin(self, positions: jax.Array):
        return rope_cos_sin(positions, jnp.asarray(self._inv_freq, jnp.float32))

    def dense(self, model: Qwen3_5ForCausalLM, hidden: jax.Array, next_ids: jax.Array, *,
              layer: int = 0) -> jax.Array:
        """Full sequences without a cache: ``hidden [B, T, H]`` (the main model's hidden states at positions
        ``0..T-1``) and ``next_ids i32[B, T]`` (the token after each position) -> MTP hidden states ``[B, T, H]``
        (after ``norm``; :meth:`logits` of position ``t`` predicts the token at ``t + 2``)."""
        if hidden.ndim != 3 or next_ids.shape != hidden.shape[:2]:
            raise ValueError(f"dense needs hidden [B, T, H] and next_ids i32[B, T], got {tuple(hidden.shape)} and "
                             f"{tuple(next_ids.shape)}")
        lay = self.layers[layer]
        u = self.combine(model, next_ids, hidden)
        cos, sin = self._cos_sin(jnp.arange(hidden.shape[1], dtype=jnp.int32))
        u = lay.mlp_block(u + lay.self_attn.full(lay.input_layernorm(u), cos, sin))
        return self.norm(u)

    def step(
        self,
        model: Qwen3_5ForCausalLM,
        pages: dict[str, jax.Array],  # the MTP caches: {<role>_caches_<first_layer + i>: [P, page_size, ...]}
        hidden: jax.Array,  # [T, H]: hidden state of each token (main model's or the previous MTP step's)
        next_ids: jax.Array,  # i32[T]: token following each position
        positions: jax.Array,  # i32[T]
        *,
        cu_seqlens: jax.Array,  # i32[B+1]
        seq_lens: jax.Array,  # i32[B]: context length of each row including these tokens
        block_tables: jax.Array,  # i32[B, Hkv, max_blocks]: the main model's tables
        slot_mapping: jax.Array,  # i32[T, Hkv]; -1 = skip
        layer: int = 0,
        max_query_len: int | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:  # (MTP hidden states [T, H], new pages)
        """One ragged step of MTP layer ``layer`` on its paged K/V: writes these tokens' K/V by
        ``slot_mapping``, attends through ``block_tables`` with the main model's per-KV-head window / sinks
        (the same semantics as the main model's attention layers: :func:`kvjax.ops.attention.paged_attention`;
        ``max_query_len``: its static bound on every row's tokens, as the main model passes a verification step's)."""
        from kvjax.ops.attention import paged_attention
        from kvjax.state.kv_cache import write_kv_cache

        _check_model(model, self)
        a = self.config.attention
        lay = self.layers[layer]
        li = self.first_layer + layer
        names = {r: cache_name(r, li) for r in FP8_ROLES if cache_name(r, li) in pages}
        if "key" not in names:
            raise ValueError(f"MTP layer {layer} needs caches {cache_name('key', li)!r} / {cache_name('value', li)!r} "
                             f"(init_mtp_caches); got {sorted(pages)}")
        u = self.combine(model, next_ids, hidden)  # [T, H]
        cos, sin = self._cos_sin(positions)
        q, gate, k, v = lay.self_attn.project(lay.input_layernorm(u), cos, sin)
        own = write_kv_cache({r: pages[n] for r, n in names.items()}, k, v, slot_mapping, cu_seqlens=cu_seqlens)
        window, sinks = jnp.asarray(a.window, jnp.int32), jnp.asarray(a.sinks, jnp.int32)  # i32[Hkv] each
        if model.tp is not None:  # this device's KV heads of the global masks (as the model's own layers)
            window = model.tp.local(jnp.asarray(model.tp.kv_window or (0,) * model.tp.size, jnp.int32))
            sinks = model.tp.local(jnp.asarray(model.tp.kv_sinks or (0,) * model.tp.size, jnp.int32))
        o = paged_attention(
            q, own["key"], own["value"], block_tables, seq_lens, cu_seqlens=cu_seqlens, scale=a.head_dim ** -0.5,
            window=window, sinks=sinks,
            k_scale=own.get("key_scale"), v_scale=own.get("value_scale"), max_query_len=max_query_len,
        )
        u = lay.mlp_block(u + lay.self_attn.finish(o, gate))
        return self.norm(u), {**pages, **{n: own[r] for r, n in names.items()}}

    # ------------------------------------------------ the draft steps as one op (kvjax.ops.draft)

    @property
    def draft_shape(self) -> DraftShape:
        """The static layout :func:`kvjax.ops.draft.draft_steps` takes (:class:`kvjax.ops.draft.DraftShape`)."""
        a = self.config.attention
        return DraftShape(a.num_q_heads, a.num_kv_heads, a.head_dim, float(self.config.rms_norm_eps),
                          float(a.head_dim ** -0.5), self._inv_freq)

    def draft_layer(self, model: Qwen3_5ForCausalLM, layer: int = 0) -> DraftLayer:
        """MTP layer ``layer``'s weights with the model's embedding and LM head, as
        :class:`kvjax.ops.draft.DraftLayer` (a tied model's head: the embedding transposed)."""
        _check_model(model, self)
        lay = self.layers[layer]
        att, mlp = lay.self_attn, lay.mlp
        embed = model.model.embed_tokens[...]
        head = embed.T if model.lm_head is None else model.lm_head.kernel[...]
        return DraftLayer(
            embed, head, self.fc.kernel[...], self.pre_fc_norm_embedding.weight[...],
            self.pre_fc_norm_hidden.weight[...], lay.input_layernorm.weight[...], att.q_proj.kernel[...],
            att.k_proj.kernel[...], att.v_proj.kernel[...], att.q_norm.weight[...], att.k_norm.weight[...],
            att.o_proj.kernel[...], lay.post_attention_layernorm.weight[...], mlp.gate_proj.kernel[...],
            mlp.up_proj.kernel[...], mlp.down_proj.kernel[...], self.norm.weight[...])

    def draft_op_reason(self, model: Qwen3_5ForCausalLM, pages: dict[str, jax.Array]) -> str | None:
        """Why the one-token draft steps cannot run as the op :func:`kvjax.ops.draft.draft_steps` (then they run as
        the layer's own steps, :func:`draft_loop`), or ``None``: on a mesh shard (the op has no collectives), over
        fp8 pages (the op writes float pages), with projection or LM-head biases (the op has none)."""
        if model.tp is not None:
            return "a mesh shard"
        if cache_name("key_scale", self.first_layer) in pages:
            return "fp8 pages"
        att = self.layers[0].self_attn
        linears = (self.fc, att.q_proj, att.k_proj, att.v_proj, att.o_proj, model.lm_head)  # lm_head None: tied
        if any(x is not None and x.bias is not None for x in linears):
            return "biases"
        return None

    # ------------------------------------------------ the engine's drafter (kvjax.models.interface.DraftHead)

    def init_caches(self, *, num_pages: int, page_size: int, dtype=jnp.float32, kv_cache_dtype: str = "auto"
                    ) -> dict[str, jax.Array]:
        """:func:`init_mtp_caches` of these layers."""
        return init_mtp_caches(self, num_pages=num_pages, page_size=page_size, dtype=dtype,
                               kv_cache_dtype=kv_cache_dtype)

    def propose(self, model: Qwen3_5ForCausalLM, pages: dict[str, jax.Array], hidden: jax.Array,
                inputs: StepInputs, sampled: jax.Array, *, num_draft: int
                ) -> tuple[jax.Array, dict[str, jax.Array]]:  # (drafts i32[B, K], new pages)
        """:func:`mtp_propose` with these layers (``pages`` may hold the model's pools too: only this module's are
        read and replaced)."""
        return mtp_propose(model, self, pages, hidden, inputs, sampled, num_draft=num_draft)


def _check_model(model, mtp: Qwen3_5MTP) -> None:
    c, m = model.config, mtp.config  # a device-local shard's: both local configs (kvjax.models.sharding.shard_head)
    if (c.hidden_size, c.vocab_size, c.attention) != (m.hidden_size, m.vocab_size, m.attention):
        raise ValueError(f"MTP layers built for hidden {m.hidden_size}, vocab {m.vocab_size}, attention {m.attention}; "
                         f"the model has {c.hidden_size}, {c.vocab_size}, {c.attention}")


def init(config: Qwen3_5Config, *, num_layers: int = 1, seed: int = 0, dtype=jnp.float32) -> Qwen3_5MTP:
    """Random MTP layers for a toy model, drawn on the host with numpy: projections ``N(0, 1/fan_in)``, biases and
    the zero-centred norm scales 0 (the Hugging Face init of the main model's layers)."""
    dtype = check_param_dtype(dtype)
    mtp = abstract_model(lambda: Qwen3_5MTP(config, num_layers=num_layers, rngs=nnx.Rngs(0), dtype=dtype))
    rng = np.random.default_rng(seed)
    values = {}
    for path, var in nnx.to_flat_state(nnx.state(mtp, nnx.Param)):
        shape = tuple(var.get_value().shape)
        values[path] = (rng.normal(0.0, 1.0 / np.sqrt(shape[0]), shape) if str(path[-1]) == "kernel"
                        else np.zeros(shape))
    return assign_params(mtp, values)


def init_mtp_caches(mtp: Qwen3_5MTP, *, num_pages: int, page_size: int, dtype=jnp.float32,
                    kv_cache_dtype: str = "auto") -> dict[str, jax.Array]:
    """Zeroed MTP caches: ``key_caches_<l>`` / ``value_caches_<l>`` ``[P, page_size, D]`` for each MTP layer
    ``l = first_layer + i`` (``num_pages`` = the main model's page count: the same block tables address both);
    ``kv_cache_dtype="fp8"``: float8_e4m3fn pages plus ``key_scale_caches_<l>`` / ``value_scale_caches_<l>``
    ``f32[P]``, as :meth:`Qwen3_5ForCausalLM.init_caches`."""
    a = mtp.config.attention
    page_dtype = FP8_DTYPE if check_kv_cache_dtype(kv_cache_dtype) == "fp8" else dtype
    specs = [GQACacheSpec(layer=mtp.first_layer + i, num_kv_heads=a.num_kv_heads, page_size=page_size,
                          head_dim=a.head_dim, dtype=page_dtype) for i in range(mtp.num_layers)]
    return create_caches(specs, num_pages)


def mtp_propose(
    model: Qwen3_5ForCausalLM,
    mtp: Qwen3_5MTP,
    pages: dict[str, jax.Array],  # the MTP caches (init_mtp_caches)
    hidden: jax.Array,  # [T, H]: the main model's final-normed hidden state of each step token
    inputs: StepInputs,  # that main-model step's inputs; logits_indices = each row's last accepted token
    sampled: jax.Array,  # i32[B]: the token at position (last accepted + 1) of each row
    *,
    num_draft: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:  # (drafts i32[B, K], new MTP pages)
    """Greedy drafts of ``num_draft`` tokens per row from the MTP layer (see the module docstring).

    ``hidden`` and ``inputs`` are a main-model step's (:meth:`Qwen3_5ForCausalLM.forward_step_hidden`): a
    prefill chunk, decode tokens or a verification of ``K + 1`` tokens per row, with ``inputs.logits_indices``
    pointing at each row's last *accepted* token (position ``p``) and ``sampled[b]`` the token that follows it:
    the token the main model sampled there (the bonus token after a verification), or, for a prefill chunk that
    does not end its prompt, the prompt's next token. The catch-up step pairs every step token with the step's
    next token (``sampled`` at the last accepted one); the tokens after it in a row pair with rejected drafts
    and their K/V is overwritten before anything reads it. ``drafts[b, k]`` is the draft for position
    ``p + 2 + k``; rows without tokens get ``-1``. Draft step ``k`` writes the K/V of position ``p + k``
    (``k = 1 .. K-1``): the caller's block tables must have those pages (vLLM's lookahead slots), else the write
    is skipped and the draft attends without it (a worse draft, never a wrong output: drafts are verified).
    """
    if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
        raise ValueError(f"num_draft must be an int >= 1, got {num_draft!r}")
    if mtp.num_layers != 1:
        raise NotImplementedError(f"mtp_propose drafts with one MTP layer (Qwen3.5, Qwen3-Next); this one has "
                                  f"{mtp.num_layers}")
    t, b = hidden.shape[0], inputs.seq_lens.shape[0]
    if inputs.token_ids.shape != (t,):
        raise ValueError(f"hidden has {t} tokens, inputs.token_ids shape {tuple(inputs.token_ids.shape)}")
    if sampled.shape != (b,):
        raise ValueError(f"sampled must be i32[B={b}], got shape {tuple(sampled.shape)}")
    cu, last = inputs.cu_seqlens, inputs.logits_indices
    live = cu[1:] > cu[:-1]  # bool[B]
    ids = inputs.token_ids
    nxt = jnp.concatenate([ids[1:], ids[-1:]])  # i32[T]: the step's next token
    nxt = nxt.at[jnp.where(live, last, t)].set(sampled.astype(nxt.dtype), mode="drop")
    g, pages = mtp.step(model, pages, hidden, nxt, inputs.positions, cu_seqlens=cu, seq_lens=inputs.seq_lens,
                        block_tables=inputs.block_tables, slot_mapping=inputs.slot_mapping,
                        max_query_len=inputs.max_query_len or None)
    g = g[last]  # [B, H]
    tok = jnp.argmax(mtp.logits(model, g), axis=-1).astype(jnp.int32)  # i32[B]
    drafts = [tok[:, None]]
    p0 = inputs.positions[last]  # i32[B]
    if num_draft > 1:
        rest, pages = (draft_loop if mtp.draft_op_reason(model, pages) else draft_op)(
            model, mtp, pages, g, tok, p0, live, inputs.block_tables, num_draft - 1)
        drafts.append(rest)
    return jnp.where(live[:, None], jnp.concatenate(drafts, axis=1), -1), pages


def draft_op(model: Qwen3_5ForCausalLM, mtp: Qwen3_5MTP, pages: dict[str, jax.Array], g: jax.Array, tok: jax.Array,
             p0: jax.Array, live: jax.Array, block_tables: jax.Array, steps: int
             ) -> tuple[jax.Array, dict[str, jax.Array]]:  # (drafts i32[B, steps], new pages)
    """The one-token draft steps as the op :func:`kvjax.ops.draft.draft_steps` (its backend table chooses the
    kernel): ``g`` [B, H] and ``tok`` i32[B] each row's MTP hidden state and first draft, ``p0`` i32[B] its last
    accepted position, ``live`` bool[B]. The pages of MTP layer 0 are read and replaced."""
    a = model.config.attention
    k_name, v_name = cache_name("key", mtp.first_layer), cache_name("value", mtp.first_layer)
    rest, k_pages, v_pages = draft_steps(
        mtp.draft_layer(model), mtp.draft_shape, pages[k_name], pages[v_name], g, tok, p0, live, block_tables,
        jnp.asarray(a.window, jnp.int32), jnp.asarray(a.sinks, jnp.int32), steps=steps)
    return rest, {**pages, k_name: k_pages, v_name: v_pages}


def draft_loop(model: Qwen3_5ForCausalLM, mtp: Qwen3_5MTP, pages: dict[str, jax.Array], g: jax.Array, tok: jax.Array,
               p0: jax.Array, live: jax.Array, block_tables: jax.Array, steps: int
               ) -> tuple[jax.Array, dict[str, jax.Array]]:  # (drafts i32[B, steps], new pages)
    """The one-token draft steps through the layer's own :meth:`Qwen3_5MTP.step` (ragged steps of one token per
    row): what runs where :func:`draft_op` cannot (:meth:`Qwen3_5MTP.draft_op_reason`: a mesh shard, fp8 pages,
    projection biases). Same arguments and result as :func:`draft_op`."""
    b = g.shape[0]
    page_size = pages[cache_name("key", mtp.first_layer)].shape[1]
    room = block_tables.shape[2] * page_size
    one = jnp.arange(b + 1, dtype=jnp.int32)  # one token per row
    drafts = []
    for k in range(1, steps + 1):
        pos = p0 + k
        ok = live & (pos < room)
        g, pages = mtp.step(
            model, pages, g, tok, pos, cu_seqlens=one, seq_lens=jnp.where(ok, pos + 1, 0),
            block_tables=block_tables, slot_mapping=draft_slots(block_tables, pos, ok, page_size),
        )
        tok = jnp.argmax(mtp.logits(model, g), axis=-1).astype(jnp.int32)
        drafts.append(tok)
    return jnp.stack(drafts, axis=1), pages


@dataclasses.dataclass(frozen=True, eq=False)
class AttachedMTP:
    """A loaded model's MTP layers, held beside its parameters (a static attribute: not part of the model's
    parameter tree, so its sharding plan, ``with_swa`` and the engine's step are unchanged). Read it with
    :func:`mtp_of`; split it (``nnx.split``) to pass its parameters into a jitted step."""

    module: Qwen3_5MTP


def attach(model, mtp: Qwen3_5MTP | None):
    """Keep ``mtp`` beside ``model`` (``model.mtp``); returns ``model``."""
    model.mtp = None if mtp is None else AttachedMTP(mtp)
    return model


def mtp_of(model) -> Qwen3_5MTP | None:
    """The MTP layers loaded with ``model`` (:func:`kvjax.models.load_pretrained` of a checkpoint with ``mtp.*``
    tensors), else ``None``."""
    held = getattr(model, "mtp", None)
    return None if held is None else held.module
