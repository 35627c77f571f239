"""DeepSeek multi-head latent attention (MLA): absorbed decode over a paged latent cache, its float32
reference, an un-absorbed reference for ragged causal batches (prefill), and the weight-absorption helpers.

Layout (DESIGN.md, "MLA"). The latent cache holds one ``R + r`` wide row per token (``R = kv_lora_rank``,
512 in DeepSeek; ``r = qk_rope_head_dim``, 64): ``[kv_c ‖ k_pe]``, where ``kv_c`` is the normalised compressed
KV and ``k_pe`` the roped shared key. Position ``p`` of sequence ``b`` lives in page
``block_tables[b, 0, p // page_size]`` at offset ``p % page_size``.

Absorption. ``kv_b_proj`` expands ``kv_c`` per head into ``k_nope = W_UK[h] @ kv_c`` and ``v = W_UV[h] @ kv_c``
(``W_UK[h]: [nope, R]``, ``W_UV[h]: [v, R]``). Then ``q_nope · k_nope = (q_nope @ W_UK[h]) · kv_c``, so decode
folds ``W_UK`` into the query (``q_latent = q_nope @ W_UK[h]``, :func:`absorb_query`) and attends with every
head over the single latent head (an MQA with K = the whole 576-wide row and V = its first ``R`` values);
``W_UV`` is applied to the ``R``-wide output afterwards (:func:`absorb_output`).

Kernel contract. :func:`mla_decode` builds one :class:`MLADecodeCall` from its arguments, checks it once
(:func:`check_call`) and runs the implementation that :data:`TABLE` (its backend table) chooses for ``impl``,
with exactly ``fn(call, latent_pages[, interpret=...]) -> o: [B, H, R]`` in ``q_latent``'s dtype
(``interpret``: kernels only, bound by the table). The DSA ops of :mod:`kvjax.ops.dsa` hand down the same call
with ``topk_indices`` set.

Backends (``impl="auto"`` takes the first that accepts, else the reference): ``"mosaic"``
(:mod:`kvjax.pallas.mla.decode_mgpu`, Hopper, R = 512, r = 64, pages of 64k tokens, a 16-bit cache, more than
16 heads: faster than the Triton-lowered kernels at many heads, slower at 16; RESULTS.md, "MLA decode"), ``"pallas"``
(:mod:`kvjax.pallas.mla.decode`, the Pallas Triton lowering, any GPU; ``R``, ``r`` and the page size powers of two
>= 16, else ``auto`` runs the reference) and ``"triton"``
(:mod:`kvjax.triton.mla_decode`, a jax-triton baseline below ``"pallas"``: ``auto`` never takes it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.base.checks import INT32_MAX, check_cu_seqlens, check_float, check_int32, check_seq_lens
from kvjax.base.ragged import token_rows
from kvjax.base.softmax import masked_softmax
from kvjax.ops.backends import Backend, BackendTable, lazy, on_gpu, on_hopper
from kvjax.pallas.mla import decode as mla_pallas
from kvjax.pallas.mla import decode_mgpu as mla_mosaic
from kvjax.triton import mla_decode_unsupported as triton_unsupported


def check_scale(scale) -> float:
    """A softmax scale: a positive Python number (not a bool), returned as a float; ``ValueError`` otherwise."""
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive Python float, got {scale!r}")
    return float(scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLADecodeCall:
    """One absorbed MLA decode call, dense or DSA-sparse: built once by the public op (:func:`mla_decode`,
    :func:`kvjax.ops.dsa.sparse_mla_decode`, :func:`~kvjax.ops.dsa.sparse_mla_decode_fp8`) and handed unchanged to
    :func:`check_call`, the op's backend table and the chosen kernel; the latent cache goes beside it
    (``latent_pages``, or the fp8 DSA ``key`` roles). A pytree: the arrays are leaves (``topk_indices`` ``None``
    for a dense call), ``scale`` and ``num_kv_splits`` static, checked here."""

    q_latent: jax.Array  # [B, H, R]  absorbed query (q_nope @ W_UK), bf16 / f16 / f32
    q_rope: jax.Array  # [B, H, r]  roped query, q_latent's dtype
    block_tables: jax.Array  # i32[B, 1, max_blocks]; -1 = no page (positions not attendable, never read)
    seq_lens: jax.Array  # i32[B]; 0 = padding row (output 0)
    scale: float = dataclasses.field(metadata=dict(static=True))  # softmax scale, a positive Python float
    topk_indices: jax.Array | None = None  # i32[B, K] DSA: the positions attended, -1 = none; None = all (dense)
    num_kv_splits: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # None: the kernel's

    def __post_init__(self):
        object.__setattr__(self, "scale", check_scale(self.scale))
        n = self.num_kv_splits
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= INT32_MAX):
            raise ValueError(f"num_kv_splits must be None or an int >= 1 and <= {INT32_MAX}, got {n!r}")


def check_call(call: MLADecodeCall) -> None:
    """Host-side check of a call's arrays (``ValueError`` naming the argument): ``q_latent [B, H, R]`` and
    ``q_rope [B, H, r]`` of one float dtype, ``block_tables i32[B, 1, max_blocks]``, ``seq_lens i32[B]`` and
    ``topk_indices i32[B, K]``. The op then checks its cache (rows ``R + r`` wide, or the fp8 roles) and the
    host values of ``seq_lens`` against the positions the table covers (``check_seq_lens``)."""
    check_float("q_latent", call.q_latent, rank=3)
    b, h, _ = call.q_latent.shape
    check_float("q_rope", call.q_rope, rank=3)
    if call.q_rope.shape[:2] != (b, h):
        raise ValueError(f"q_rope must have shape ({b}, {h}, rope_dim) like q_latent, got {tuple(call.q_rope.shape)}")
    if call.q_rope.dtype != call.q_latent.dtype:
        raise ValueError(f"q_rope dtype {call.q_rope.dtype} differs from q_latent dtype {call.q_latent.dtype}")
    check_int32("block_tables", call.block_tables, rank=3)
    if call.block_tables.shape[:2] != (b, 1):
        raise ValueError(f"block_tables must have shape ({b}, 1, max_blocks) (one latent head), got "
                         f"{tuple(call.block_tables.shape)}")
    check_int32("seq_lens", call.seq_lens, shape=(b,))
    if call.topk_indices is not None:
        check_int32("topk_indices", call.topk_indices, rank=2)
        if call.topk_indices.shape[0] != b:
            raise ValueError(f"topk_indices must have shape ({b}, topk), got {tuple(call.topk_indices.shape)}")


def page_of(
    block_tables: jax.Array,  # i32[B, 1, max_blocks]
    positions: jax.Array,  # i32[B, K]; < 0 = none
    page_size: int,
) -> tuple[jax.Array, jax.Array]:  # (page i32[B, K], -1 where none; offset i32[B, K])
    """Where positions live in the paged cache: their page (``-1`` for a hole, a negative position or one past
    the table) and their row within it."""
    mb = block_tables.shape[-1]
    blk = positions // page_size
    ok = (positions >= 0) & (blk < mb)
    page = jnp.take_along_axis(block_tables[:, 0, :], jnp.clip(blk, 0, mb - 1), axis=1)
    return jnp.where(ok, page, -1), positions % page_size


def _gather_latent(latent_pages, block_tables):
    """f32[B, L, R+r] rows of every position the table covers (``L = max_blocks * page_size``) and bool[B, L]
    page-present mask."""
    b, page_size = block_tables.shape[0], latent_pages.shape[1]
    length = block_tables.shape[-1] * page_size
    page, off = page_of(block_tables, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length)), page_size)
    return latent_pages[jnp.maximum(page, 0), off].astype(jnp.float32), page >= 0


def mla_decode_reference(
    call: MLADecodeCall,  # dense: topk_indices None
    latent_pages: jax.Array,  # [P, page_size, R + r]
    *,
    return_lse: bool = False,
):
    """Float32 oracle of :func:`mla_decode` (``call.num_kv_splits`` is ignored).

    Returns ``o: [B, H, R]`` in ``q_latent``'s dtype, or ``(o, lse f32[B, H])`` with ``return_lse``.
    """
    rank = call.q_latent.shape[-1]
    rows, present = _gather_latent(latent_pages, call.block_tables)  # f32[B, L, R+r], bool[B, L]
    q = jnp.concatenate([call.q_latent, call.q_rope], axis=-1).astype(jnp.float32)  # [B, H, R+r]
    visible = present & (jnp.arange(rows.shape[1])[None, :] < call.seq_lens[:, None])  # bool[B, L]
    rows = jnp.where(visible[..., None], rows, 0.0)  # garbage past the length cannot leak
    s = jnp.einsum("bhd,bld->bhl", q, rows) * call.scale
    p, lse = masked_softmax(s, visible[:, None, :])
    o = jnp.einsum("bhl,bld->bhd", p, rows[..., :rank]).astype(call.q_latent.dtype)
    return (o, lse) if return_lse else o


def mla_decode(
    q_latent: jax.Array,  # [B, H, R]
    q_rope: jax.Array,  # [B, H, r]
    latent_pages: jax.Array,  # [P, page_size, R + r]
    block_tables: jax.Array,  # i32[B, 1, max_blocks]
    seq_lens: jax.Array,  # i32[B]
    *,
    scale: float,
    num_kv_splits: int | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Absorbed MLA decode: every query head attends over the paged latent cache (one token per sequence).

    Logit of position ``p``: ``scale * (q_latent · kv_c[p] + q_rope · k_pe[p])``; value: ``kv_c[p]``.
    ``seq_lens[b]`` positions (including the token written this step) are attended; rows with
    ``seq_lens == 0`` give 0. Returns ``o: [B, H, R]`` in ``q_latent``'s dtype; changes nothing.
    ``num_kv_splits`` (kernels) fixes the split-KV factor; ``None`` lets the kernel choose from static shapes.
    ``impl``: ``"auto"``, ``"reference"``, ``"mosaic"``, ``"pallas"``, ``"triton"``, ``"interpret"`` or
    ``"NAME:interpret"`` (:mod:`kvjax.ops.backends`); a named kernel that cannot take the call raises
    :class:`~kvjax.errors.UnknownImplError` with the reason.
    """
    call = MLADecodeCall(q_latent, q_rope, block_tables, seq_lens, scale=scale, num_kv_splits=num_kv_splits)
    check_call(call)
    check_float("latent_pages", latent_pages, rank=3, shape=(None, None, q_latent.shape[-1] + q_rope.shape[-1]))
    check_seq_lens(seq_lens, block_tables.shape[-1] * latent_pages.shape[1], device=True)
    return TABLE.choose(impl, (call, latent_pages), {})[1](call, latent_pages)


# ----------------------------------------------------------------------------------------------------------
# Un-absorbed attention (prefill / chunked prefill / decode) and absorption helpers.


def split_kv_b_proj(
    kv_b_weight: jax.Array,  # [H * (nope + v), R] (torch ``nn.Linear.weight`` layout: [out, in])
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
) -> tuple[jax.Array, jax.Array]:
    """Split ``kv_b_proj``'s weight into per-head ``W_UK: [H, nope, R]`` and ``W_UV: [H, v, R]``.

    (A flax ``Dense`` kernel is the transpose, ``[R, H * (nope + v)]``: pass ``kernel.T``.)
    """
    check_float("kv_b_weight", kv_b_weight, rank=2)
    want = num_heads * (qk_nope_head_dim + v_head_dim)
    if kv_b_weight.shape[0] != want:
        raise ValueError(
            f"kv_b_weight must have {num_heads} * ({qk_nope_head_dim} + {v_head_dim}) = {want} rows, "
            f"got shape {tuple(kv_b_weight.shape)}"
        )
    w = kv_b_weight.reshape(num_heads, qk_nope_head_dim + v_head_dim, kv_b_weight.shape[1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def absorb_query(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """``q_latent[..., h, :] = q_nope[..., h, :] @ W_UK[h]``: ``[..., H, nope] x [H, nope, R] -> [..., H, R]``."""
    if q_nope.shape[-2:] != w_uk.shape[:2]:
        raise ValueError(f"q_nope [..., H, nope] {tuple(q_nope.shape)} does not match w_uk {tuple(w_uk.shape)}")
    out = jnp.einsum("...hn,hnr->...hr", q_nope.astype(jnp.float32), w_uk.astype(jnp.float32))
    return out.astype(q_nope.dtype)


def absorb_output(o_latent: jax.Array, w_uv: jax.Array) -> jax.Array:
    """``o[..., h, :] = W_UV[h] @ o_latent[..., h, :]``: ``[..., H, R] x [H, v, R] -> [..., H, v]``."""
    if o_latent.shape[-2] != w_uv.shape[0] or o_latent.shape[-1] != w_uv.shape[2]:
        raise ValueError(f"o_latent [..., H, R] {tuple(o_latent.shape)} does not match w_uv {tuple(w_uv.shape)}")
    out = jnp.einsum("...hr,hvr->...hv", o_latent.astype(jnp.float32), w_uv.astype(jnp.float32))
    return out.astype(o_latent.dtype)


def mla_prefill_reference(
    q_nope: jax.Array,  # [T, H, nope]
    q_pe: jax.Array,  # [T, H, r] (roped)
    latent_pages: jax.Array,  # [P, page_size, R + r] (this step's tokens already written)
    block_tables: jax.Array,  # i32[B, 1, max_blocks]
    seq_lens: jax.Array,  # i32[B], context length including this step's tokens
    w_uk: jax.Array,  # [H, nope, R]
    w_uv: jax.Array,  # [H, v, R]
    *,
    cu_seqlens: jax.Array,  # i32[B+1]
    scale: float,
) -> jax.Array:
    """Un-absorbed MLA over a ragged causal batch, float32 inside: the oracle for prefill and the decode check.

    Keys and values are expanded per head from the cached latent: ``k = [W_UK[h] kv_c ‖ k_pe]``,
    ``v = W_UV[h] kv_c``. Row ``b``'s ``n = cu[b+1] - cu[b]`` new tokens sit at positions
    ``seq_lens[b] - n .. seq_lens[b] - 1`` and are causal among themselves (prefill, chunked prefill and decode
    are one case). Tokens past ``cu_seqlens[-1]`` get 0. Returns ``o: [T, H, v]`` in ``q_nope``'s dtype.
    """
    check_float("q_nope", q_nope, rank=3)
    check_float("q_pe", q_pe, rank=3)
    check_int32("cu_seqlens", cu_seqlens, shape=(block_tables.shape[0] + 1,))
    t = q_nope.shape[0]
    check_cu_seqlens(cu_seqlens, t)
    check_seq_lens(seq_lens, block_tables.shape[-1] * latent_pages.shape[1])
    rank = w_uk.shape[-1]
    length = block_tables.shape[-1] * latent_pages.shape[1]
    rows, present = _gather_latent(latent_pages, block_tables)  # [B, L, R+r]
    rows = jnp.where((present & (jnp.arange(length)[None, :] < seq_lens[:, None]))[..., None], rows, 0.0)
    kv_c, k_pe = rows[..., :rank], rows[..., rank:]
    k_nope = jnp.einsum("hnr,blr->bhln", w_uk.astype(jnp.float32), kv_c)  # [B, H, L, nope]
    v = jnp.einsum("hvr,blr->bhlv", w_uv.astype(jnp.float32), kv_c)  # [B, H, L, v]

    tok = jnp.arange(t)
    row = token_rows(cu_seqlens, t)
    valid = tok < cu_seqlens[-1]
    pos = seq_lens[row] - (cu_seqlens[row + 1] - tok)  # absolute position of each new token

    def one(qn, qp, b, p, ok):
        s = (jnp.einsum("hn,hln->hl", qn.astype(jnp.float32), k_nope[b])
             + jnp.einsum("hr,lr->hl", qp.astype(jnp.float32), k_pe[b])) * scale
        key = jnp.arange(length)
        mask = (present[b] & (key <= p) & ok)[None, :]
        p, _ = masked_softmax(s, mask)
        return jnp.einsum("hl,hlv->hv", p, v[b])

    o = jax.lax.map(lambda a: one(*a), (q_nope, q_pe, row, pos, valid))
    return o.astype(q_nope.dtype)


def example_call(b: int, h: int, context: int, *, page_size: int = 64, dtype=jnp.bfloat16, rank: int = 512,
                 rope: int = 64, topk: int | None = None) -> tuple[tuple, dict]:
    """A representative call ``((call, latent_pages), {})`` of ``b`` rows of ``context`` positions, ``h`` heads
    (DSA-sparse over ``topk`` listed positions when given)."""
    sds = jax.ShapeDtypeStruct
    blocks = context // page_size
    call = MLADecodeCall(sds((b, h, rank), dtype), sds((b, h, rope), dtype), sds((b, 1, blocks), jnp.int32),
                         sds((b,), jnp.int32), scale=(128 + rope) ** -0.5,
                         topk_indices=None if topk is None else sds((b, topk), jnp.int32))
    return (call, sds((b * blocks, page_size, rank + rope), dtype)), {}


TABLE = BackendTable(
    "mla_decode",
    mla_decode_reference,
    (
        Backend("mosaic", mla_mosaic.mla_decode_mgpu, priority=30, device=on_hopper,
                unsupported=mla_mosaic.unsupported,
                note="ahead at many heads (H=128), behind the Triton lowering at H=16 (RESULTS.md, MLA decode)"),
        Backend("pallas", mla_pallas.mla_decode_pallas, priority=20, device=on_gpu,
                unsupported=mla_pallas.unsupported,
                note="the fastest at few heads (H=16) (RESULTS.md, MLA decode)"),
        Backend("triton", lazy("kvjax.triton.mla_decode:mla_decode_triton"), priority=10, device=on_gpu,
                unsupported=triton_unsupported, interpretable=False,
                note="jax-triton baseline, never ahead of the best Hopper kernel (RESULTS.md, MLA decode)"),
    ),
    examples={
        "decode B=128 L=4096 H=16 page 64 bf16": lambda: example_call(128, 16, 4096),
        "decode B=128 L=4096 H=128 page 64 bf16": lambda: example_call(128, 128, 4096),
        "decode B=8 L=1024 H=128 page 16 f32": lambda: example_call(8, 128, 1024, page_size=16, dtype=jnp.float32),
        "decode B=8 L=1024 H=16 R=96 page 16 bf16 (not a Triton tile)": lambda: example_call(8, 16, 1024,
                                                                                             page_size=16, rank=96),
    },
)
