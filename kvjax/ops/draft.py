"""A draft layer's one-token steps on its paged K/V: the ``K - 1`` chained steps of an MTP drafter, as one op.

After an MTP catch-up (:func:`kvjax.models.qwen3_5.mtp.mtp_propose`) each row has its first draft ``tok`` and the
MTP hidden state ``g`` it came from, at position ``p`` (the row's last accepted token). Step ``k = 1 .. S`` then runs
the layer on one token per row at position ``p + k`` (the published Qwen3.5 / Qwen3-Next MTP layer)::

    u = fc([rms(embed[tok]; norm_embed) | rms(g; norm_hidden)])
    x = rms(u; input_norm);  q | gate = x @ q_proj (per head);  k = x @ k_proj;  v = x @ v_proj
    q, k = rope(rms(q; q_norm)), rope(rms(k; k_norm))       # k, v written at position p + k of the row's pages
    u = u + (attn(q; pages) * sigmoid(gate)) @ o_proj
    y = rms(u; post_norm);  u = u + (silu(y @ gate_proj) * (y @ up_proj)) @ down_proj
    g = rms(u; final_norm);  tok = argmax(g @ lm_head)     # draft k + 1 of the row

Every ``rms`` is the zero-centred RMSNorm (scale ``1 + w``, float32 inside). The step writes its K/V (where the
row's table has a page there and the position fits the table) before attending, and attends with the main model's
masks (causal, per-KV-head window and sinks, ``-1`` holes never read); a row that is not live, or whose position is
past its table, attends to nothing (output 0) and writes nothing: its drafts are the caller's to discard.

Normalised call: :class:`DraftStepsCall` (its static :class:`DraftShape` and ``steps``). Reference = float32
pure jnp, the layer's step as above with :func:`kvjax.ops.attention.paged_attention_reference` for ``attn`` and
full-precision products: what the model's own layer loop computes on a CPU (``tests/test_mtp.py`` checks them
against each other; ``tests/test_draft_steps.py`` the kernel against the reference). Backend ``"pallas"`` = :func:`kvjax.pallas.draft.steps.draft_steps_pallas`, one
Triton-lowered program per row running every step with the layer's weights read from L2 and its own positions'
K/V kept in registers: for draft layers small enough that a row's matrices fit a program (the toy models').
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvjax.base.checks import check_array
from kvjax.base.norms import rms_norm
from kvjax.base.rotary import apply_rope, rope_cos_sin
from kvjax.ops.attention import PagedAttentionCall, paged_attention_reference
from kvjax.ops.backends import Backend, BackendTable
from kvjax.pallas.draft import steps as draft_kernel

DRAFT_OP = "draft_steps"


class DraftLayer(NamedTuple):
    """The weights one draft step reads (a pytree): the layer's and the main model's embedding and LM head.
    Norm weights are zero-centred (scale ``1 + w``)."""

    embed: jax.Array  # [V, H]: the main model's token embedding
    lm_head: jax.Array  # [H, V]: the main model's LM head (a tied model: embed.T)
    fc: jax.Array  # [2H, H]: [normed embedding | normed hidden] -> H
    norm_embed: jax.Array  # [H]
    norm_hidden: jax.Array  # [H]
    input_norm: jax.Array  # [H]
    q_proj: jax.Array  # [H, Hq * 2D]: each head's query then its output gate
    k_proj: jax.Array  # [H, Hkv * D]
    v_proj: jax.Array  # [H, Hkv * D]
    q_norm: jax.Array  # [D]
    k_norm: jax.Array  # [D]
    o_proj: jax.Array  # [Hq * D, H]
    post_norm: jax.Array  # [H]
    gate_proj: jax.Array  # [H, I]
    up_proj: jax.Array  # [H, I]
    down_proj: jax.Array  # [I, H]
    final_norm: jax.Array  # [H]


@dataclasses.dataclass(frozen=True)
class DraftShape:
    """The static layout of a draft layer's attention: heads, head size, RMSNorm epsilon, the softmax scale and the
    rotary inverse frequencies (``R / 2`` of them: the first ``R <= D`` dims of a head rotate, NeoX layout)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    inv_freq: tuple[float, ...]

    def __post_init__(self):
        for name in ("num_q_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DraftShape.{name} must be a positive int, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"DraftShape: {self.num_q_heads} query heads are not a multiple of "
                             f"{self.num_kv_heads} KV heads")
        if not (isinstance(self.eps, float) and self.eps > 0) or not (isinstance(self.scale, float) and self.scale > 0):
            raise ValueError(f"DraftShape eps and scale must be positive floats, got {self.eps!r}, {self.scale!r}")
        if not isinstance(self.inv_freq, tuple) or not 0 < 2 * len(self.inv_freq) <= self.head_dim:
            raise ValueError(f"DraftShape.inv_freq must be a tuple of 1 .. head_dim / 2 = {self.head_dim // 2} "
                             f"floats, got {self.inv_freq!r}")


class DraftStepsCall(NamedTuple):
    """A checked call of :func:`draft_steps` (what the backend table's functions take)."""

    layer: DraftLayer
    k_pages: jax.Array  # [P, page_size, D]: the draft layer's keys
    v_pages: jax.Array  # [P, page_size, D]
    hidden: jax.Array  # [B, H]: each row's draft hidden state after its first draft (already final-normed)
    tokens: jax.Array  # i32[B]: each row's first draft
    positions: jax.Array  # i32[B]: each row's last accepted position p (step k runs at p + k)
    live: jax.Array  # bool[B]: rows that draft
    block_tables: jax.Array  # i32[B, Hkv, max_blocks]: the rows' pages per KV head, -1 = hole
    window: jax.Array  # i32[Hkv]: 0 = full attention
    sinks: jax.Array  # i32[Hkv]
    shape: DraftShape
    steps: int

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]


def draft_slots(
    block_tables: jax.Array,  # i32[B, Hkv, max_blocks]
    positions: jax.Array,  # i32[B]
    ok: jax.Array,  # bool[B]: rows that write
    page_size: int,
) -> jax.Array:  # i32[B, Hkv]: page * page_size + offset of each row's position per KV head; -1 = skip
    """Slot mapping of one token per row at ``positions``; ``-1`` where the row does not write, the position lies
    past the table or its block is a hole."""
    max_blocks = block_tables.shape[2]
    blk = positions // page_size
    inside = ok & (positions >= 0) & (blk < max_blocks)
    page = jnp.take_along_axis(block_tables, jnp.clip(blk, 0, max_blocks - 1)[:, None, None], axis=2)[..., 0]
    return jnp.where(inside[:, None] & (page >= 0), page * page_size + (positions % page_size)[:, None], -1)


def draft_steps_reference(call: DraftStepsCall) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Float32 pure-jnp oracle: ``(drafts i32[B, S], k_pages, v_pages)`` (see the module docstring)."""
    lay, sh = call.layer, call.shape
    hi = jax.lax.Precision.HIGHEST
    b, hq, hkv, d = call.hidden.shape[0], sh.num_q_heads, sh.num_kv_heads, sh.head_dim
    page_size, max_blocks = call.page_size, call.block_tables.shape[2]
    num_pages = call.k_pages.shape[0]
    k_flat = call.k_pages.reshape(num_pages * page_size, d)
    v_flat = call.v_pages.reshape(num_pages * page_size, d)
    inv_freq = jnp.asarray(sh.inv_freq, jnp.float32)
    rows = jnp.arange(b + 1, dtype=jnp.int32)  # one token per row
    g, tok = call.hidden, call.tokens
    drafts = []
    for k in range(1, call.steps + 1):
        pos = call.positions + k  # i32[B]
        ok = call.live & (pos >= 0) & (pos < max_blocks * page_size)
        e = lay.embed[jnp.clip(tok, 0, lay.embed.shape[0] - 1)]
        u = jnp.matmul(jnp.concatenate([rms_norm(e, lay.norm_embed, sh.eps, zero_centered=True),
                                        rms_norm(g, lay.norm_hidden, sh.eps, zero_centered=True)], axis=-1),
                       lay.fc, precision=hi)
        x = rms_norm(u, lay.input_norm, sh.eps, zero_centered=True)
        qg = jnp.matmul(x, lay.q_proj, precision=hi).reshape(b, hq, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        kk = jnp.matmul(x, lay.k_proj, precision=hi).reshape(b, hkv, d)
        vv = jnp.matmul(x, lay.v_proj, precision=hi).reshape(b, hkv, d)
        cos, sin = rope_cos_sin(pos, inv_freq)
        q = apply_rope(rms_norm(q, lay.q_norm, sh.eps, zero_centered=True), cos, sin)
        kk = apply_rope(rms_norm(kk, lay.k_norm, sh.eps, zero_centered=True), cos, sin)
        slot = draft_slots(call.block_tables, pos, ok, page_size)
        slot = jnp.where(slot >= 0, slot, k_flat.shape[0])  # out of range: dropped
        k_flat = k_flat.at[slot.reshape(-1)].set(kk.reshape(-1, d).astype(k_flat.dtype), mode="drop")
        v_flat = v_flat.at[slot.reshape(-1)].set(vv.reshape(-1, d).astype(v_flat.dtype), mode="drop")
        o = paged_attention_reference(PagedAttentionCall(
            q, k_flat.reshape(call.k_pages.shape), v_flat.reshape(call.v_pages.shape), call.block_tables,
            jnp.where(ok, pos + 1, 0), rows, call.window, call.sinks, None, None, scale=sh.scale))
        u = u + jnp.matmul((o * jax.nn.sigmoid(gate)).reshape(b, hq * d), lay.o_proj, precision=hi)
        y = rms_norm(u, lay.post_norm, sh.eps, zero_centered=True)
        u = u + jnp.matmul(jax.nn.silu(jnp.matmul(y, lay.gate_proj, precision=hi))
                           * jnp.matmul(y, lay.up_proj, precision=hi), lay.down_proj, precision=hi)
        g = rms_norm(u, lay.final_norm, sh.eps, zero_centered=True)
        tok = jnp.argmax(jnp.matmul(g, lay.lm_head, precision=hi).astype(jnp.float32), axis=-1).astype(jnp.int32)
        drafts.append(tok)
    return (jnp.stack(drafts, axis=1), k_flat.reshape(call.k_pages.shape), v_flat.reshape(call.v_pages.shape))


def check_call(call: DraftStepsCall) -> DraftStepsCall:
    """Shapes and dtypes of every argument against the layer's (``ValueError`` naming the argument), ``steps`` a
    positive int; returns ``call``."""
    lay, sh = call.layer, call.shape
    if not isinstance(sh, DraftShape):
        raise ValueError(f"shape must be a DraftShape, got {sh!r}")
    if isinstance(call.steps, bool) or not isinstance(call.steps, int) or call.steps < 1:
        raise ValueError(f"steps must be a positive int, got {call.steps!r}")
    hq, hkv, d = sh.num_q_heads, sh.num_kv_heads, sh.head_dim
    check_array("embed", lay.embed, rank=2)
    v, h = lay.embed.shape
    inter = lay.gate_proj.shape[-1] if getattr(lay.gate_proj, "ndim", 0) == 2 else None
    floats = [jnp.float32, jnp.bfloat16, jnp.float16]
    for name, shape in (("lm_head", (h, v)), ("fc", (2 * h, h)), ("norm_embed", (h,)), ("norm_hidden", (h,)),
                        ("input_norm", (h,)), ("q_proj", (h, hq * 2 * d)), ("k_proj", (h, hkv * d)),
                        ("v_proj", (h, hkv * d)), ("q_norm", (d,)), ("k_norm", (d,)), ("o_proj", (hq * d, h)),
                        ("post_norm", (h,)), ("gate_proj", (h, inter)), ("up_proj", (h, inter)),
                        ("down_proj", (inter, h)), ("final_norm", (h,))):
        check_array(f"layer.{name}", getattr(lay, name), shape=shape, dtypes=floats)
    check_array("k_pages", call.k_pages, rank=3, shape=(None, None, d), dtypes=floats)
    check_array("v_pages", call.v_pages, shape=tuple(call.k_pages.shape), dtypes=[call.k_pages.dtype])
    check_array("hidden", call.hidden, rank=2, shape=(None, h), dtypes=floats)
    b = call.hidden.shape[0]
    check_array("tokens", call.tokens, shape=(b,), dtypes=[jnp.int32])
    check_array("positions", call.positions, shape=(b,), dtypes=[jnp.int32])
    check_array("live", call.live, shape=(b,), dtypes=[jnp.bool_])
    check_array("block_tables", call.block_tables, rank=3, shape=(b, hkv, None), dtypes=[jnp.int32])
    check_array("window", call.window, shape=(hkv,), dtypes=[jnp.int32])
    check_array("sinks", call.sinks, shape=(hkv,), dtypes=[jnp.int32])
    return call


def draft_steps(
    layer: DraftLayer,
    shape: DraftShape,
    k_pages: jax.Array,  # [P, page_size, D]
    v_pages: jax.Array,  # [P, page_size, D]
    hidden: jax.Array,  # [B, H]
    tokens: jax.Array,  # i32[B]
    positions: jax.Array,  # i32[B]
    live: jax.Array,  # bool[B]
    block_tables: jax.Array,  # i32[B, Hkv, max_blocks]
    window: jax.Array,  # i32[Hkv]
    sinks: jax.Array,  # i32[Hkv]
    *,
    steps: int,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (drafts i32[B, steps], k_pages, v_pages)
    """``steps`` chained one-token steps of a draft layer from each row's first draft (module docstring): each row's
    next ``steps`` drafts and the pages with every step's K/V written (the inputs are not changed; jit with the
    pages donated to update them in place). ``ValueError`` naming a bad argument (:func:`check_call`);
    ``UnknownImplError`` for an ``impl`` that cannot run here. Jittable."""
    call = check_call(DraftStepsCall(layer, k_pages, v_pages, hidden, tokens, positions, live, block_tables, window,
                                     sinks, shape, steps))
    return DRAFT_TABLE.choose(impl, (call,), {})[1](call)


def _example(rows: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int,
             pages: int = 449, page_size: int = 16, max_blocks: int = 14, steps: int = 3, dtype=jnp.float32):
    sds = jax.ShapeDtypeStruct
    h, d = hidden, head_dim
    lay = DraftLayer(sds((vocab, h), dtype), sds((h, vocab), dtype), sds((2 * h, h), dtype), sds((h,), dtype),
                     sds((h,), dtype), sds((h,), dtype), sds((h, heads * 2 * d), dtype), sds((h, kv_heads * d), dtype),
                     sds((h, kv_heads * d), dtype), sds((d,), dtype), sds((d,), dtype), sds((heads * d, h), dtype),
                     sds((h,), dtype), sds((h, inter), dtype), sds((h, inter), dtype), sds((inter, h), dtype),
                     sds((h,), dtype))
    i32 = jnp.int32
    shape = DraftShape(heads, kv_heads, head_dim, 1e-6, head_dim ** -0.5, tuple(1.0 / 2 ** i for i in range(d // 2)))
    call = DraftStepsCall(lay, sds((pages, page_size, d), dtype), sds((pages, page_size, d), dtype),
                          sds((rows, h), dtype), sds((rows,), i32), sds((rows,), i32), sds((rows,), jnp.bool_),
                          sds((rows, kv_heads, max_blocks), i32), sds((kv_heads,), i32), sds((kv_heads,), i32), shape,
                          steps)
    return (call,), {}


DRAFT_TABLE = BackendTable(
    DRAFT_OP,
    draft_steps_reference,
    (
        Backend("pallas", draft_kernel.draft_steps_pallas, priority=10, unsupported=draft_kernel.unsupported,
                note="one program per row, every step in it: small float32 draft layers (RESULTS.md, Speculative "
                     "decoding)"),
    ),
    examples={
        "copy toy MTP B=16 H=64 Hq=4 Hkv=2 D=16 I=128 V=128, 3 steps": lambda: _example(16, 64, 4, 2, 16, 128, 128),
        "B=16 H=2048 Hq=16 Hkv=2 D=256 I=6144 V=4096": lambda: _example(16, 2048, 16, 2, 256, 6144, 4096),
    },
)
