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

Kernel contract. :func:`mla_decode` validates on the host and runs the implementation that :data:`TABLE` (its
backend table) chooses for ``impl``, with exactly::

    fn(q_latent,       # [B, H, R]   (bf16 / f16 / f32)
       q_rope,         # [B, H, r]
       latent_pages,   # [P, page_size, R + r]
       block_tables,   # i32[B, 1, max_blocks]; -1 = no page (positions not attendable, never read)
       seq_lens,       # i32[B]; 0 = padding row (output 0)
       scale=...,          # Python float
       num_kv_splits=...,  # int | None (None: the implementation chooses)
       [interpret=...])    # bool, kernels only (added by the table)
    -> o: [B, H, R] in q_latent's dtype

Backends (``impl="auto"`` takes the first that accepts, else the reference): ``"mosaic"``
(:mod:`kvjax.pallas.mla.decode_mgpu`, Hopper, R = 512, r = 64, pages of 64k tokens, a 16-bit cache, more than
16 heads: faster than the Triton-lowered kernels at many heads, slower at 16; RESULTS.md, "MLA decode"), ``"pallas"``
(:mod:`kvjax.pallas.mla.decode`, the Pallas Triton lowering, any GPU; ``R``, ``r`` and the page size powers of two
>= 16, else ``auto`` runs the reference) and ``"triton"``
(:mod:`kvjax.triton.mla_decode`, a jax-triton baseline below ``"pallas"``: ``auto`` never takes it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.base.checks import INT32_MAX, check_cu_seqlens, check_float, check_int32, check_seq_lens
from kvjax.base.ragged import token_rows
from kvjax.base.softmax import masked_softmax
from kvjax.ops.backends import Backend, BackendTable, lazy, on_gpu, on_hopper
from kvjax.pallas.mla import decode as mla_pallas
from kvjax.pallas.mla import decode_mgpu as mla_mosaic
from kvjax.triton import mla_decode_unsupported as triton_unsupported


def _gather_latent(latent_pages, block_tables, length):
    """f32[B, length, R+r] rows of positions 0..length-1 and bool[B, length] page-present mask."""
    page_size = latent_pages.shape[1]
    pos = jnp.arange(length)
    page = block_tables[:, 0, pos // page_size]  # i32[B, length]
    present = page >= 0
    rows = latent_pages[jnp.maximum(page, 0), pos % page_size]  # [B, length, R+r]
    return rows.astype(jnp.float32), present


def mla_decode_reference(
    q_latent: jax.Array,  # [B, H, R]
    q_rope: jax.Array,  # [B, H, r]
    latent_pages: jax.Array,  # [P, page_size, R + r]
    block_tables: jax.Array,  # i32[B, 1, max_blocks]
    seq_lens: jax.Array,  # i32[B]
    *,
    scale: float,
    num_kv_splits: int | None = None,
    return_lse: bool = False,
):
    """Float32 oracle of :func:`mla_decode` (``num_kv_splits`` is accepted and ignored).

    Returns ``o: [B, H, R]`` in ``q_latent``'s dtype, or ``(o, lse f32[B, H])`` with ``return_lse``.
    """
    del num_kv_splits
    rank = q_latent.shape[-1]
    length = block_tables.shape[-1] * latent_pages.shape[1]
    rows, present = _gather_latent(latent_pages, block_tables, length)
    q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32)  # [B, H, R+r]
    visible = present & (jnp.arange(length)[None, :] < seq_lens[:, None])  # bool[B, L]
    rows = jnp.where(visible[..., None], rows, 0.0)  # garbage past the length cannot leak
    s = jnp.einsum("bhd,bld->bhl", q, rows) * scale
    mask = visible[:, None, :]  # [B, 1, L]
    p, lse = masked_softmax(s, mask)
    o = jnp.einsum("bhl,bld->bhd", p, rows[..., :rank]).astype(q_latent.dtype)
    return (o, lse) if return_lse else o


def _validate_decode(q_latent, q_rope, latent_pages, block_tables, seq_lens, scale, num_kv_splits) -> None:
    check_float("q_latent", q_latent, rank=3)
    b, h, rank = q_latent.shape
    check_float("q_rope", q_rope, rank=3)
    if q_rope.shape[:2] != (b, h):
        raise ValueError(f"q_rope must have shape ({b}, {h}, rope_dim) like q_latent, got {tuple(q_rope.shape)}")
    if q_rope.dtype != q_latent.dtype:
        raise ValueError(f"q_rope dtype {q_rope.dtype} differs from q_latent dtype {q_latent.dtype}")
    check_float("latent_pages", latent_pages, rank=3)
    width = rank + q_rope.shape[-1]
    if latent_pages.shape[-1] != width:
        raise ValueError(
            f"latent_pages last dim must be kv_lora_rank + rope_dim = {rank} + {q_rope.shape[-1]} = {width}, "
            f"got shape {tuple(latent_pages.shape)}"
        )
    check_int32("block_tables", block_tables, rank=3)
    if block_tables.shape[:2] != (b, 1):
        raise ValueError(
            f"block_tables must have shape ({b}, 1, max_blocks) (one latent head), got {tuple(block_tables.shape)}"
        )
    check_int32("seq_lens", seq_lens, shape=(b,))
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive Python float, got {scale!r}")
    if num_kv_splits is not None and (
        isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= INT32_MAX
    ):
        raise ValueError(f"num_kv_splits must be None or an int >= 1 and <= {INT32_MAX}, got {num_kv_splits!r}")
    check_seq_lens(seq_lens, block_tables.shape[-1] * latent_pages.shape[1], device=True)


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
    _validate_decode(q_latent, q_rope, latent_pages, block_tables, seq_lens, scale, num_kv_splits)
    args = (q_latent, q_rope, latent_pages, block_tables, seq_lens)
    kwargs = dict(scale=float(scale), num_kv_splits=num_kv_splits)
    return TABLE.choose(impl, args, kwargs)[1](*args, **kwargs)


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
    rows, present = _gather_latent(latent_pages, block_tables, length)  # [B, L, R+r]
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


def _example(b: int, h: int, context: int, page_size: int = 64, dtype=jnp.bfloat16,
             rank: int = 512, rope: int = 64) -> tuple[tuple, dict]:
    sds = jax.ShapeDtypeStruct
    blocks = context // page_size
    args = (sds((b, h, rank), dtype), sds((b, h, rope), dtype), sds((b * blocks, page_size, rank + rope), dtype),
            sds((b, 1, blocks), jnp.int32), sds((b,), jnp.int32))
    return args, dict(scale=(128 + rope) ** -0.5, num_kv_splits=None)


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
        "decode B=128 L=4096 H=16 page 64 bf16": lambda: _example(128, 16, 4096),
        "decode B=128 L=4096 H=128 page 64 bf16": lambda: _example(128, 128, 4096),
        "decode B=8 L=1024 H=128 page 16 f32": lambda: _example(8, 128, 1024, page_size=16, dtype=jnp.float32),
        "decode B=8 L=1024 H=16 R=96 page 16 bf16 (not a Triton tile)": lambda: _example(8, 16, 1024, page_size=16,
                                                                                         rank=96),
    },
)
