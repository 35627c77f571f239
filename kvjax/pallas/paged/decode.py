"""Head-wise paged attention, split-KV flash-decoding over single-head pages (Pallas, Triton lowering).

One program per (query token, KV head, split). It holds the whole GQA group of query heads of that KV head
(padded to >= 16 rows for the tensor cores), so each K/V page is read once per token. It walks only the
virtual page list of :mod:`kvjax.pallas.paged.common` (sink pages + window pages of *its* KV head), cut into
``num_splits`` equal parts; a ``-1`` table entry is masked at the load, so a hole is never read. Every split
writes an f32 partial output and its log-sum-exp, merged by :func:`kvjax.pallas.split_kv.merge_splits` (an
empty split, or a padding token, weighs 0, never NaN).

fp8 pages (float8_e4m3fn with ``k_scale`` / ``v_scale`` ``f32[P]``): the kernel loads the page bytes (1 byte a
value; no dequantised copy of the cache exists anywhere), multiplies each logit of a key by its page's key scale
(folded with the softmax scale into one per-key factor) and weighs each value by its page's value scale through
the probabilities of the ``P V`` product; accumulation stays f32. A key's two scales are loaded with it, per key
like its page id, so a hole's or a masked key's scale is never read. Where the products run is ``fp8_dot``
(:data:`FP8_DOTS`):

- ``"q"``: K and V converted to q's dtype (bf16: on sm_90 Triton converts e4m3 -> f16 -> bf16, three
  instructions per two values); the value scale multiplies the probabilities before their cast.
- ``"f16"``: K, V and q in f16 (e4m3 -> f16 is one ``cvt.rn.f16x2.e4m3x2`` per two values; every e4m3 value and
  every normal bf16 q value is exact in f16).
- ``"e4m3"``: tensor-core products on the e4m3 bytes themselves: q quantised to e4m3 per query row (outside the
  kernel, one power-of-two scale per row, :func:`quantize_q`), the probabilities quantised to e4m3 (times 256,
  so that only ``p < 2**-14`` leaves e4m3's normal range) before ``P V``.
- ``"e4m3_qk"``: ``q K^T`` on e4m3 as ``"e4m3"``, ``P V`` in f16 as ``"f16"``.

For every variant but ``"q"`` the value scales reach the probabilities relative to a running reference scale
(the largest value scale of the walk so far, a power of two like them), so a probability is never multiplied by
a tiny page scale before its 16- or 8-bit cast: the accumulator is kept in units of that reference and rescaled
when it grows (exactly: powers of two), like the running max of the softmax.

The kernel is exact for *any* ragged batch (it re-reads a row's pages once per query token), so it is the
``"pallas"`` backend of ``kvjax.ops.paged_attention``: the fallback on every GPU and what ``impl="interpret"``
runs; for prefill-shaped batches the table prefers the prefill kernels (:mod:`kvjax.pallas.paged.prefill`,
:mod:`kvjax.pallas.paged.prefill_mgpu`).
Measured and not kept: fixed-size splits (``balanced``), tied on full heads and never ahead on SWA heads; a
manual register prefetch of the next block, block_k 32, 8 warps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.base.device import next_pow2
from kvjax.base.fp8 import FP8_DTYPE, pow2_scale
from kvjax.pallas.paged import common
from kvjax.pallas.split_kv import merge_splits

_NEG_INF = float("-inf")
_TARGET_PROGRAMS = 1024  # split the KV walk until about this many programs run (132 SMs on H100/H200)
FP8_DOTS = ("q", "f16", "e4m3", "e4m3_qk")  # where the products over fp8 pages run (module doc)
_P_E4M3 = 256.0  # probabilities (<= 1) times this before their e4m3 cast ("e4m3"): normal down to p = 2**-14


def _decode_kernel(
    q_ref,  # [T*Hq, D]
    k_ref,  # [P*page_size, D] (float or float8_e4m3fn)
    v_ref,  # [P*page_size, D]
    ks_ref,  # f32[P]: key scale per page (fp8 pages; else f32[1], never read)
    vs_ref,  # f32[P]: value scale per page
    qs_ref,  # f32[T*Hq]: q's scale per row (fp8_dot "e4m3" / "e4m3_qk"; else f32[1], never read)
    bt_ref,  # i32[B*Hkv*max_blocks]
    row_ref,  # i32[T]
    pos_ref,  # i32[T]
    lo_ref,  # i32[T*Hkv]
    nsink_ref,  # i32[T*Hkv]
    npages_ref,  # i32[T*Hkv]
    win_ref,  # i32[Hkv]
    sink_ref,  # i32[Hkv]
    o_ref,  # num_splits == 1: [T*Hq, D] (q dtype); else f32[T*Hkv*S*Gp, D]
    *lse_refs,  # num_splits > 1: f32[T*Hkv*S*Gp]
    scale: float,
    group: int,
    rows: int,
    page_size: int,
    block_k: int,
    max_blocks: int,
    num_kv_heads: int,
    num_splits: int,
    fp8: bool,
    fp8_dot: str,
):
    t = pl.program_id(0)
    h = pl.program_id(1)
    s = pl.program_id(2)
    th = t * num_kv_heads + h
    b = row_ref[t]
    i = pos_ref[t]
    lo = lo_ref[th]
    n_sink = nsink_ref[th]
    n_pages = npages_ref[th]
    w = win_ref[h]
    sk = sink_ref[h]
    pages_per_block = block_k // page_size

    per_split = pl.cdiv(n_pages, num_splits)  # every walk cut into num_splits equal parts
    start = s * per_split
    end = jnp.minimum(n_pages, start + per_split)
    n_iter = pl.cdiv(jnp.maximum(end - start, 0), pages_per_block)

    cols = jnp.arange(q_ref.shape[1], dtype=jnp.int32)
    g = jnp.arange(rows, dtype=jnp.int32)
    q_rows = (t * num_kv_heads + h) * group + g
    q_ok = g < group
    q = plgpu.load(q_ref.at[jnp.where(q_ok, q_rows, 0)[:, None], cols[None, :]], mask=q_ok[:, None], other=0.0)
    relative_v = fp8 and fp8_dot != "q"  # value scales relative to a running reference (module doc)
    k_dtype = v_dtype = q.dtype
    qk_scale = scale
    if relative_v:
        k_dtype = FP8_DTYPE if fp8_dot.startswith("e4m3") else jnp.float16
        v_dtype = FP8_DTYPE if fp8_dot == "e4m3" else jnp.float16
        if k_dtype == jnp.float16:
            q = q.astype(jnp.float16)
        else:  # q arrives quantised: its row scales join the softmax scale
            q_sc = plgpu.load(qs_ref.at[jnp.where(q_ok, q_rows, 0)], mask=q_ok, other=0.0)
            qk_scale = (scale * q_sc)[:, None]

    j = jnp.arange(block_k, dtype=jnp.int32)
    j_page = j // page_size
    j_off = j % page_size
    bt_base = (b * num_kv_heads + h) * max_blocks

    def load_block(c):
        vp = start + c * pages_per_block + j_page
        in_range = vp < end
        col = jnp.where(vp < n_sink, vp, lo + vp - n_sink)
        page = plgpu.load(bt_ref.at[jnp.where(in_range, bt_base + col, 0)], mask=in_range, other=-1)
        kpos = col * page_size + j_off
        visible = (kpos <= i) & ((w == 0) | (i - kpos < w) | (kpos < sk))
        ok = in_range & (page >= 0) & visible
        kv_rows = jnp.where(ok, page, 0) * page_size + j_off
        k = plgpu.load(k_ref.at[kv_rows[:, None], cols[None, :]], mask=ok[:, None], other=0.0)
        v = plgpu.load(v_ref.at[kv_rows[:, None], cols[None, :]], mask=ok[:, None], other=0.0)
        if not fp8:
            return k, v, ok, scale, None
        safe = jnp.where(ok, page, 0)
        k_sc = plgpu.load(ks_ref.at[safe], mask=ok, other=0.0)  # f32[block_k]: each key's page scale
        v_sc = plgpu.load(vs_ref.at[safe], mask=ok, other=0.0)
        return k.astype(k_dtype), v.astype(v_dtype), ok, qk_scale * k_sc[None, :], v_sc

    def update(k, v, ok, k_factor, v_sc, acc, m, l, v_ref=None):
        sc = plgpu.dot(q, k, trans_b=True) * k_factor  # f32[rows, block_k]
        sc = jnp.where(ok[None, :], sc, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(sc - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        if not relative_v:  # float pages, or fp8 with the value scale on the probabilities (l unscaled)
            pv = p if v_sc is None else p * v_sc[None, :]
            return acc * alpha[:, None] + plgpu.dot(pv.astype(v.dtype), v), m_new, l
        ref_new = jnp.maximum(v_ref, jnp.max(v_sc))  # powers of two: the ratios below are exact
        ref_safe = jnp.where(ref_new > 0, ref_new, 1.0)
        pv = p * (v_sc / ref_safe)[None, :]  # <= p: a probability is never scaled up past 1
        if v.dtype == FP8_DTYPE:
            pv = pv * _P_E4M3
        acc = acc * (alpha * (v_ref / ref_safe))[:, None] + plgpu.dot(pv.astype(v.dtype), v)
        return acc, m_new, l, ref_new

    def body(c, carry):
        return update(*load_block(c), *carry)

    head_dim = q.shape[-1]
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), _NEG_INF, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    if relative_v:  # the accumulator in units of the reference value scale (and of the probabilities' e4m3 factor)
        acc, m, l, v_ref = jax.lax.fori_loop(0, n_iter, body, (acc, m, l, jnp.float32(0.0)))
        acc = acc * (v_ref / _P_E4M3 if v_dtype == FP8_DTYPE else v_ref)
    else:
        acc, m, l = jax.lax.fori_loop(0, n_iter, body, (acc, m, l))
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    if num_splits == 1:
        plgpu.store(o_ref.at[q_rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=q_ok[:, None])
    else:
        (lse_ref,) = lse_refs
        part_rows = ((t * num_kv_heads + h) * num_splits + s) * group + g  # the G real rows only
        plgpu.store(o_ref.at[part_rows[:, None], cols[None, :]], out, mask=q_ok[:, None])
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), _NEG_INF)
        plgpu.store(lse_ref.at[part_rows], lse, mask=q_ok)


def _decode_call(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, D] (float or float8_e4m3fn)
    v_pages: jax.Array,  # [P, page_size, D]
    k_scale: jax.Array,  # f32[P] (fp8 pages) or f32[1] (float pages: unread)
    v_scale: jax.Array,  # f32[P] or f32[1]
    q_scale: jax.Array,  # f32[T, Hq] (fp8_dot "e4m3" / "e4m3_qk": q is e4m3) or f32[1] (unread)
    block_tables: jax.Array,  # i32[B, Hkv, max_blocks]
    row: jax.Array,  # i32[T]
    pos: jax.Array,  # i32[T]
    lo: jax.Array,  # i32[T, Hkv]
    n_sink: jax.Array,  # i32[T, Hkv]
    n_pages: jax.Array,  # i32[T, Hkv]
    window: jax.Array,  # i32[Hkv]
    sinks: jax.Array,  # i32[Hkv]
    *,
    scale: float,
    num_splits: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    fp8: bool,
    fp8_dot: str,
    out_dtype,
    interpret: bool,
) -> jax.Array:  # [T, Hq, D] (out_dtype)
    t_total, hq, d = q.shape
    num_pages, page_size, _ = k_pages.shape
    hkv, max_blocks = block_tables.shape[1:]
    group = hq // hkv
    rows = max(16, next_pow2(group))
    kernel = functools.partial(
        _decode_kernel, scale=scale, group=group, rows=rows, page_size=page_size, block_k=block_k,
        max_blocks=max_blocks, num_kv_heads=hkv, num_splits=num_splits, fp8=fp8, fp8_dot=fp8_dot,
    )
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((t_total * hq, d), out_dtype)
    else:
        n_part = t_total * hkv * num_splits * group
        out_shape = (jax.ShapeDtypeStruct((n_part, d), jnp.float32), jax.ShapeDtypeStruct((n_part,), jnp.float32))
    res = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(t_total, hkv, num_splits),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"kvjax_paged_decode{_variant_name(fp8, fp8_dot)}_s{num_splits}_bk{block_k}",
    )(
        q.reshape(t_total * hq, d),
        k_pages.reshape(num_pages * page_size, d),
        v_pages.reshape(num_pages * page_size, d),
        k_scale, v_scale, q_scale.reshape(-1),
        block_tables.reshape(-1),
        row, pos, lo.reshape(-1), n_sink.reshape(-1), n_pages.reshape(-1), window, sinks,
    )
    if num_splits == 1:
        return res.reshape(t_total, hq, d)
    o_part, lse = res
    o_part = o_part.reshape(t_total, hkv, num_splits, group, d)
    lse = lse.reshape(t_total, hkv, num_splits, group)
    return merge_splits(o_part, lse, axis=2).reshape(t_total, hq, d).astype(out_dtype)


def _variant_name(fp8: bool, fp8_dot: str) -> str:
    if not fp8:
        return ""
    return "_fp8" if fp8_dot == "q" else f"_fp8_{fp8_dot}"


def quantize_q(
    q: jax.Array,  # [T, Hq, D] float
) -> tuple[jax.Array, jax.Array]:  # (f8e4m3[T, Hq, D], f32[T, Hq])
    """q quantised to e4m3 per (token, head) row with a power-of-two scale (:func:`kvjax.base.fp8.pow2_scale` of
    the row's max, so ``|q| / scale <= 448``; an all-zero row gets scale 0 and quantises to 0): what the
    ``"e4m3"`` and ``"e4m3_qk"`` variants feed their ``q K^T`` products."""
    x = q.astype(jnp.float32)
    s = pow2_scale(jnp.max(jnp.abs(x), axis=-1))
    return (x / jnp.where(s > 0, s, 1.0)[..., None]).astype(FP8_DTYPE), s


def unsupported(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, D]
    v_pages: jax.Array,  # [P, page_size, D]
    block_tables: jax.Array,  # i32[B, Hkv, max_blocks]
    seq_lens: jax.Array,  # i32[B]
    **static,  # cu_seqlens, scale, window, sinks: any value is fine
) -> str | None:
    """Why :func:`paged_decode` cannot take this normalised call (shapes only), or None: it takes any batch
    with a power-of-two ``head_dim >= 16`` and a power-of-two ``page_size``, float or fp8 pages (``k_scale`` /
    ``v_scale`` in ``static``)."""
    return common.triton_shape_reason(q, k_pages)


def default_num_splits(num_tokens: int, num_kv_heads: int, max_blocks: int, pages_per_block: int) -> int:
    """Static split count: enough programs to fill the GPU, never more splits than KV blocks."""
    splits = next_pow2(pl.cdiv(_TARGET_PROGRAMS, max(1, num_tokens * num_kv_heads)))
    return int(max(1, min(splits, pl.cdiv(max_blocks, pages_per_block), 64)))


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "num_splits", "block_k", "num_warps", "num_stages", "fp8_dot"),
)
def paged_decode(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, D]
    v_pages: jax.Array,  # [P, page_size, D]
    block_tables: jax.Array,  # i32[B, Hkv, max_blocks], -1 = hole
    seq_lens: jax.Array,  # i32[B]
    *,
    cu_seqlens: jax.Array,  # i32[B+1]
    scale: float,
    window: jax.Array,  # i32[Hkv]
    sinks: jax.Array,  # i32[Hkv]
    k_scale: jax.Array | None = None,  # f32[P]: fp8 (float8_e4m3fn) pages only
    v_scale: jax.Array | None = None,  # f32[P]
    interpret: bool = False,
    num_splits: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_dot: str = "q",
) -> jax.Array:  # [T, Hq, D]
    """Split-KV paged attention of every query token (normalised ``kvjax.ops.paged_attention`` call).

    Tuning knobs, defaults the fastest measured (RESULTS.md, "Paged attention decode"): ``num_splits`` (default:
    :func:`default_num_splits`), ``block_k`` keys per step (64, at least one page), ``num_warps`` 4,
    ``num_stages`` 4 (fp8 pages: 2, RESULTS.md "Paged attention decode"). ``ValueError`` for shapes
    :func:`unsupported` rejects and for fp8 pages without their scales
    (:func:`kvjax.pallas.paged.common.page_scales`). fp8 pages read as ``page * scale`` (module doc); ``fp8_dot``
    (fp8 pages only, one of :data:`FP8_DOTS`) picks where their products run, default ``"q"`` (q's dtype). Reads
    only; tokens that belong to no row get output 0 (in q's dtype).
    """
    t_total = q.shape[0]
    hkv, max_blocks = block_tables.shape[1:]
    page_size = k_pages.shape[1]
    block_k = max(block_k or 64, page_size)
    reason = unsupported(q, k_pages, v_pages, block_tables, seq_lens)
    if reason:
        raise ValueError(f"pallas paged_decode {reason}")
    fp8, k_scale, v_scale = common.page_scales(k_pages, v_pages, k_scale, v_scale, kernel="pallas paged_decode")
    if fp8_dot not in FP8_DOTS:
        raise ValueError(f"pallas paged_decode: fp8_dot must be one of {FP8_DOTS}, got {fp8_dot!r}")
    if fp8_dot != "q" and not fp8:
        raise ValueError(f"pallas paged_decode: fp8_dot={fp8_dot!r} goes with float8_e4m3fn pages, got "
                         f"{k_pages.dtype} pages")
    q_in, q_scale = q, jnp.ones((1,), jnp.float32)
    if fp8_dot.startswith("e4m3"):
        q_in, q_scale = quantize_q(q)
    if block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two, got {block_k}")
    if num_splits is None:
        num_splits = default_num_splits(t_total, hkv, max_blocks, block_k // page_size)
    row, pos, real = common.token_positions(cu_seqlens, seq_lens, t_total)
    lo, n_sink, n_pages = common.page_ranges(pos, pos, real, window, sinks, page_size=page_size,
                                             max_blocks=max_blocks)
    return _decode_call(
        q_in, k_pages, v_pages, k_scale, v_scale, q_scale, block_tables, row, pos, lo, n_sink, n_pages, window,
        sinks, scale=scale, num_splits=num_splits, block_k=block_k, num_warps=num_warps or 4,
        num_stages=num_stages or (2 if fp8 else 4), fp8=fp8, fp8_dot=fp8_dot, out_dtype=q.dtype,
        interpret=interpret,
    )
