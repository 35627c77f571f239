"""Head-wise paged attention, prefill / extend path: ragged flash attention over single-head pages (Pallas, Triton
lowering).

The query tokens of a step are cut into *tiles*: consecutive tokens of one row, ``block_q`` tokens at most
(the tile map is built on device, with a static upper bound ``ceil(T / block_q) + B + 2`` on the tile count, so
nothing is synchronised with the host; tiles of the padding before and after the rows attend to nothing and
write zeros). One program per (tile, KV head) holds the tile's tokens for every
query head of the GQA group (``block_q * G`` rows), and walks the virtual page list of
:mod:`kvjax.pallas.paged.common` for the tile's position span and *its* KV head — sink pages plus the window
pages — with the causal / window / sink mask per (row, key). Cached prefix and new tokens are the same pages
(the new K/V are written to the cache before the call). ``-1`` entries are masked at the load, never read.
Rows with one token (decode rows of a mixed batch) are tiles of one token.

K/V come either one page at a time (``kv_load="page"``: a contiguous ``[page_size, D]`` load at a scalar page
id, one QK^T sub-product per page) or as a gathered key block (``"gather"``: per-key row offsets). The key
loop skips the per-element mask on blocks every row of the tile sees fully (split loops, or one loop that picks
the mask per block); the softmax scale is applied after the row max, so each score costs one FMA before exp2.

fp8 pages (float8_e4m3fn with ``k_scale`` / ``v_scale`` ``f32[P]``): K/V are loaded as page bytes (1 byte a
value, no dequantised copy of the cache) and converted to q's dtype; the raw ``q . k`` scores of a key are
multiplied by its page's key scale, and the probabilities by its page's value scale before the ``P V`` product
(the softmax sums take the unscaled probabilities); f32 accumulation. The scales come as a vector over the
block's keys (one per key, the same for the keys of one page), loaded under the keys' mask, so the scale of a
hole or a masked key is never read.

It is the ``"prefill"`` backend of ``kvjax.ops.paged_attention``: any GPU, batches with more tokens than rows
(:func:`unsupported`); on Hopper the table prefers the Mosaic GPU kernel of :mod:`kvjax.pallas.paged.prefill_mgpu`
where that one fits. The kernel itself is exact for any batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.base.device import next_pow2
from kvjax.pallas.paged import common

_NEG_INF = float("-inf")
_LOG2E = 1.4426950408889634


def _online_update(carry, scores, values, biases, qk_scale: float, v_scales=None):
    """One online-softmax step over key sub-blocks (same rows, one running max for all of them).

    ``scores``: raw ``q . k`` f32[rows, n_i] with masked keys at -inf; ``biases``: f32[rows] 0 / -inf per
    sub-block (-inf: a hole page) or None. The scale is applied after the row max (one FMA per score), softmax
    in base 2. ``v_scales`` (fp8 pages): per sub-block f32[n_i], each key's value scale, applied to the
    probabilities of the ``P V`` product only (``l`` sums the unscaled ones).
    """
    acc, m, l = carry
    blk = None
    for s, bias in zip(scores, biases):
        mx = jnp.max(s, axis=1) * qk_scale
        if bias is not None:
            mx = mx + bias
        blk = mx if blk is None else jnp.maximum(blk, mx)
    m_new = jnp.maximum(m, blk)
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    acc = acc * alpha[:, None]
    l = l * alpha
    for s, v, bias, v_sc in zip(scores, values, biases, v_scales or [None] * len(values)):
        shift = m_safe if bias is None else m_safe - bias  # +inf for a hole: every p is 0
        p = jnp.exp2(s * qk_scale - shift[:, None])
        l = l + jnp.sum(p, axis=1)
        pv = p if v_sc is None else p * v_sc[None, :]
        acc = acc + plgpu.dot(pv.astype(v.dtype), v)
    return acc, m_new, l


def _prefill_kernel(
    *refs,  # common.operands (spans: row, first token, length (0 = empty tile), first position: i32[NT] per
    #         tile), then o_ref [T*Hq, D]
    scale: float,
    group: int,
    rows: int,
    page_size: int,
    block_k: int,
    max_blocks: int,
    num_kv_heads: int,
    loop: str,
    kv_load: str,
    page_ids: str,
    fp8: bool,
):
    (q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref), tile_refs, walk, (o_ref,) = common.kernel_refs(refs, num_spans=4)
    tile_row_ref, tile_tok_ref, tile_len_ref, tile_pos_ref = tile_refs
    h = pl.program_id(0)
    tile = pl.num_programs(1) - 1 - pl.program_id(1)  # the last (longest-walk) tiles of every head launch first
    th = tile * num_kv_heads + h
    b = tile_row_ref[tile]
    tok0 = tile_tok_ref[tile]
    n_tok = tile_len_ref[tile]
    i0 = tile_pos_ref[tile]
    i_last = i0 + n_tok - 1
    lo, n_sink, n_pages, w, sk = common.walk_at(walk, th, h)
    pages_per_block = block_k // page_size
    hq = num_kv_heads * group

    cols = jnp.arange(q_ref.shape[1], dtype=jnp.int32)
    r = jnp.arange(rows, dtype=jnp.int32)
    r_tok = r // group
    r_ok = (r_tok < n_tok) & (r < (rows // group) * group)
    q_rows = (tok0 + r_tok) * hq + h * group + r % group  # unique per r; masked rows are never touched
    qpos = i0 + r_tok
    q = plgpu.load(q_ref.at[jnp.where(r_ok, q_rows, 0)[:, None], cols[None, :]], mask=r_ok[:, None], other=0.0)
    bt_base = (b * num_kv_heads + h) * max_blocks
    qk_scale = scale * _LOG2E  # softmax in base 2

    def visible(kpos):  # bool[rows, n]: causal + window/sink mask of absolute key positions kpos: i32[n]
        diff = qpos[:, None] - kpos[None, :]
        return (diff >= 0) & ((w == 0) | (diff < w) | (kpos[None, :] < sk))

    def column(vp):  # table column of virtual page vp (sink pages first, then the window pages)
        return jnp.where(vp < n_sink, vp, lo + vp - n_sink)

    # Blocks [a, b) hold only window pages whose keys every row of the tile sees (all <= i0, all inside the
    # window of the last row): no per-element mask there. Sink pages and the window's edges are masked.
    n_blocks = pl.cdiv(n_pages, pages_per_block)
    col_a = jnp.where(w > 0, pl.cdiv(jnp.maximum(i_last - w + 1, 0), page_size), 0)
    col_b = (i0 + 1) // page_size - 1
    blk_a = jnp.minimum(pl.cdiv(n_sink + jnp.maximum(col_a - lo, 0), pages_per_block), n_blocks)
    blk_b = jnp.minimum(jnp.maximum((n_sink + col_b + 1 - lo) // pages_per_block, blk_a), n_blocks)

    def mask_scores(c, s, kpos, k_ok, mode: str, key_bias: bool):
        # "masked": causal/window/sink/hole mask per element; "unmasked": every key of the block is visible to
        # every row, only holes are masked (per key if key_bias, else by the caller); "fused": one of the two,
        # chosen per block at run time.
        def full(s_):
            return jnp.where(visible(kpos) & k_ok[None, :], s_, _NEG_INF)

        def light(s_):
            return s_ + jnp.where(k_ok, 0.0, _NEG_INF)[None, :] if key_bias else s_

        if mode == "masked":
            return full(s)
        if mode == "unmasked":
            return light(s)
        return jax.lax.cond((c < blk_a) | (c >= blk_b), full, light, s)

    def load_page_id(vp, mode: str):  # physical page of virtual page vp (scalar load), -1 past the walk
        col = column(vp)
        if mode == "unmasked":  # inside the walk
            return bt_ref[bt_base + col]
        in_range = vp < n_pages
        return jnp.where(in_range, bt_ref[bt_base + jnp.where(in_range, col, 0)], -1)

    def dequant(k, v, page, ok):  # fp8 pages: K, V in q's dtype and their keys' scales (f32[n] each)
        safe = jnp.where(ok, page, 0)
        k_sc = plgpu.load(ks_ref.at[safe], mask=ok, other=0.0)
        v_sc = plgpu.load(vs_ref.at[safe], mask=ok, other=0.0)
        return k.astype(q.dtype), v.astype(q.dtype), k_sc, v_sc

    def page_block(c, carry, mode: str, pages):
        # one contiguous [page_size, D] load per page at a scalar page id: no per-key address math
        scores, values, biases, v_scales = [], [], [], []
        for i, page in enumerate(pages):
            col = column(c * pages_per_block + i)
            ok = page >= 0  # a hole is never read: uniform mask on the load
            start = jnp.where(ok, page, 0) * page_size
            if mode != "unmasked":  # keys past the tile's last position (a page's unwritten tail) are not read
                kpos = col * page_size + jnp.arange(page_size, dtype=jnp.int32)
                k_ok = ok & (kpos <= i_last)
                k = plgpu.load(k_ref.at[pl.ds(start, page_size), :], mask=k_ok[:, None], other=0.0)
                v = plgpu.load(v_ref.at[pl.ds(start, page_size), :], mask=k_ok[:, None], other=0.0)
            else:
                k = plgpu.load(k_ref.at[pl.ds(start, page_size), :], mask=ok, other=0.0)
                v = plgpu.load(v_ref.at[pl.ds(start, page_size), :], mask=ok, other=0.0)
            v_sc = None
            if fp8:  # the page's scales once per key (a vector load at one address, under the keys' mask)
                keys_ok = jnp.broadcast_to(ok, (page_size,)) if mode == "unmasked" else k_ok
                k, v, k_sc, v_sc = dequant(k, v, jnp.broadcast_to(page, (page_size,)), keys_ok)
            s = plgpu.dot(q, k, trans_b=True)  # f32[rows, page_size]
            if fp8:
                s = s * k_sc[None, :]
            if mode != "unmasked":
                s = mask_scores(c, s, kpos, k_ok, mode, key_bias=False)
            # a hole page: p = 0 (a per-row vector: the Triton lowering rejects a scalar select of -inf)
            biases.append(None if mode == "masked" else jnp.where(jnp.broadcast_to(ok, (rows,)), 0.0, _NEG_INF))
            scores.append(s)
            values.append(v)
            v_scales.append(v_sc)
        return _online_update(carry, scores, values, biases, qk_scale, v_scales)

    def page_step(c, carry, mode: str):  # page ids loaded in the step that uses them
        pages = [load_page_id(c * pages_per_block + i, mode) for i in range(pages_per_block)]
        return page_block(c, carry, mode, pages)

    def page_step_carry(c, carry, mode: str):  # page ids loaded one step early, passed in the loop carry
        nxt = tuple(load_page_id((c + 1) * pages_per_block + i, "masked") for i in range(pages_per_block))
        return (*page_block(c, carry[:3], mode, carry[3]), nxt)

    j = jnp.arange(block_k, dtype=jnp.int32)
    j_page = j // page_size
    j_off = j % page_size

    def gather_step(c, carry, mode: str):
        # per-key row offsets from a vector load of the block table (one load of block_k keys)
        vp = c * pages_per_block + j_page
        col = column(vp)
        kpos = col * page_size + j_off
        if mode != "unmasked":
            in_range = vp < n_pages
            page = plgpu.load(bt_ref.at[jnp.where(in_range, bt_base + col, 0)], mask=in_range, other=-1)
            k_ok = (page >= 0) & (kpos <= i_last)
        else:
            page = plgpu.load(bt_ref.at[bt_base + col])
            k_ok = page >= 0
        kv_rows = jnp.where(k_ok, page, 0) * page_size + j_off
        k = plgpu.load(k_ref.at[kv_rows[:, None], cols[None, :]], mask=k_ok[:, None], other=0.0)
        v = plgpu.load(v_ref.at[kv_rows[:, None], cols[None, :]], mask=k_ok[:, None], other=0.0)
        v_sc = None
        if fp8:
            k, v, k_sc, v_sc = dequant(k, v, page, k_ok)
        s = plgpu.dot(q, k, trans_b=True)
        if fp8:
            s = s * k_sc[None, :]
        s = mask_scores(c, s, kpos, k_ok, mode, key_bias=True)
        return _online_update(carry, [s], [v], [None], qk_scale, [v_sc])

    step = page_step if kv_load == "page" else gather_step
    head_dim = q.shape[-1]
    carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _NEG_INF, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    if page_ids == "carry":  # carry: (acc, m, l, page ids of step c)
        first = tuple(load_page_id(i, "masked") for i in range(pages_per_block))
        carry = jax.lax.fori_loop(0, n_blocks, functools.partial(page_step_carry, mode=loop), (*carry, first))[:3]
    elif loop == "split":  # three loops: masked head, unmasked middle, masked tail (the causal diagonal)
        carry = jax.lax.fori_loop(0, blk_a, functools.partial(step, mode="masked"), carry)
        carry = jax.lax.fori_loop(blk_a, blk_b, functools.partial(step, mode="unmasked"), carry)
        carry = jax.lax.fori_loop(blk_b, n_blocks, functools.partial(step, mode="masked"), carry)
    else:  # one loop: "fused" masks a block only outside [a, b)
        carry = jax.lax.fori_loop(0, n_blocks, functools.partial(step, mode=loop), carry)
    acc, m, l = carry
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(o_ref.at[q_rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=r_ok[:, None])


def unsupported(call) -> str | None:  # kvjax.ops.attention.PagedAttentionCall
    """Why the ``"prefill"`` backend declines this call, or None: the shapes of
    :func:`kvjax.pallas.paged.common.triton_shape_reason`, and more tokens than rows (``T <= B`` is a
    decode-shaped batch, served by :func:`kvjax.pallas.paged.decode.paged_decode`), and no static
    ``max_query_len`` (a verification step's bound on every row's tokens) of at most :data:`FEW_TOKENS`, nor one with
    at most :data:`FEW_TOTAL` tokens in all (those the split-KV decode kernel serves faster). Float or fp8 pages."""
    t_total, num_rows = call.q.shape[0], call.block_tables.shape[0]
    if t_total <= num_rows:
        return f"needs more tokens than rows, got a decode-shaped batch (T={t_total} <= B={num_rows})"
    if call.max_query_len and (call.max_query_len <= FEW_TOKENS or t_total <= FEW_TOTAL):
        return (f"rows of at most {call.max_query_len} tokens (max_query_len) with max_query_len <= {FEW_TOKENS} or "
                f"T={t_total} <= {FEW_TOTAL}: a decode-shaped batch")
    return common.triton_shape_reason(call)


# Calls with a static max_query_len (a verification step's rows) that the split-KV decode kernel takes: rows of at
# most FEW_TOKENS tokens, or at most FEW_TOTAL tokens in all. Measured (RESULTS.md, "Verification attention";
# benchmarks/verify_attn.py): the decode kernel's row mode reads a row's pages once for its J tokens and beat this
# kernel at every measured shape with J <= 5 (J = 2, 3, 5; B = 1, 16, 64; pages of 16 and 64; 0.12-0.65x its
# time), and the one-token programs at every one of them too. The decode kernel holds up to
# decode.MAX_TOKENS_PER_PROGRAM tokens of a row in one program, so FEW_TOKENS stays <= that bound; J = 6..8 is not
# measured. FEW_TOTAL: measured against the one-token programs before the row mode existed.
FEW_TOKENS = 5
FEW_TOTAL = 16

# Defaults per K/V load path, the fastest measured at T=4096, H=32, D=128 (RESULTS.md, "Paged attention prefill").
_PAGE_MODE_MIN_PAGE = 64  # "page" loads were slower than "gather" at page 16 (16-key sub-products)
_DEFAULTS = {
    "page": dict(block_k=64, num_warps=4, num_stages=3, fused_loop=True, page_ids="load"),
    "gather": dict(block_k=128, num_warps=8, num_stages=3, fused_loop=False, page_ids="load"),
}
# pages of >= 128 tokens (measured at 128 only; block_k = page_size): 8 warps, page ids one step ahead (4 warps, or
# ids loaded in the step that uses them, were slower for a [128, D] page per step).
_LARGE_PAGE = 128
_DEFAULTS_LARGE_PAGE = dict(block_k=128, num_warps=8, num_stages=3, fused_loop=True, page_ids="carry")


@functools.partial(
    jax.jit,
    static_argnames=("interpret", "block_q", "block_k", "num_warps", "num_stages", "kv_load", "fused_loop", "page_ids"),
)
def paged_prefill(
    call,  # kvjax.ops.attention.PagedAttentionCall (checked by the op)
    *,
    interpret: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_load: str = "auto",
    fused_loop: bool | None = None,
    page_ids: str | None = None,
) -> jax.Array:  # [T, Hq, D] in q's dtype
    """Ragged causal paged attention for any batch (prefill, chunked prefill, mixed prefill + decode).

    The contract of ``kvjax.ops.paged_attention``; tokens of no row get output 0. ``ValueError`` for shapes
    :func:`kvjax.pallas.paged.common.triton_shape_reason` rejects (the kernel takes decode-shaped batches too; only
    the backend table sends them elsewhere) and for bad knobs; fp8 pages read as ``page * scale`` (module doc).
    Tuning knobs: ``block_q`` counts query *rows* of a program (tokens x GQA group), default 128. ``kv_load``:
    ``"page"`` loads each page as one contiguous ``[page_size, D]`` block at a scalar page id (one QK^T sub-product
    per page of a key block), ``"gather"`` loads a key block through per-key row offsets; ``"auto"`` picks per page
    size. Unset knobs take the measured defaults of the chosen path (``_DEFAULTS``; ``"page"`` with pages of >= 128
    tokens: ``_DEFAULTS_LARGE_PAGE``), shrunk where float32 pages or a wide head would not fit shared memory
    (:func:`kvjax.pallas.paged.common.fit_shared_memory`). ``fused_loop``: one key loop that picks the mask per
    block at run time instead of separate loops for the masked and unmasked blocks. ``page_ids``
    (``kv_load="page"``; ``"carry"`` implies one loop): ``"load"`` (the default below 128-token pages) reads each
    page id in the step that uses it, ``"carry"`` one step ahead, passed in the loop carry. Measured slower and
    removed: page ids two steps ahead or from a register chunk of the table, a key block's pages joined into one
    operand, all tiles of one KV head launched together, masking every key block (``fast_path=False``).
    """
    q = call.q
    t_total, hq, d = q.shape
    num_pages, page_size, _ = call.k_pages.shape
    hkv = call.num_kv_heads
    group = hq // hkv
    if kv_load == "auto":
        kv_load = "page" if page_size >= _PAGE_MODE_MIN_PAGE else "gather"
    if kv_load not in _DEFAULTS:
        raise ValueError(f"kv_load must be 'auto', 'page' or 'gather', got {kv_load!r}")
    tuned = _DEFAULTS_LARGE_PAGE if kv_load == "page" and page_size >= _LARGE_PAGE else _DEFAULTS[kv_load]
    page_ids = page_ids or tuned["page_ids"]
    fixed = tuple(name for name, val in (("block_k", block_k), ("num_stages", num_stages), ("rows", block_q))
                  if val is not None)
    block_k = max(block_k or tuned["block_k"], page_size)
    num_warps = num_warps or tuned["num_warps"]
    num_stages = num_stages or tuned["num_stages"]
    fused_loop = tuned["fused_loop"] if fused_loop is None else fused_loop
    min_rows = max(16, next_pow2(group))
    rows = max(block_q or 128, min_rows)
    block_k, num_stages, rows = common.fit_shared_memory(
        head_dim=d, kv_itemsize=call.k_pages.dtype.itemsize, q_itemsize=q.dtype.itemsize, block_k=block_k,
        num_stages=num_stages, rows=rows, min_block_k=max(page_size, 16), min_rows=min_rows, fixed=fixed,
        convert_itemsize=2 if call.k_scale is not None else 0)
    reason = common.triton_shape_reason(call)
    if reason:
        raise ValueError(f"pallas paged_prefill {reason}")
    fp8, k_scale, v_scale = common.page_scales(call)
    for name, val in (("block_k", block_k), ("block_q", rows)):
        if val & (val - 1):
            raise ValueError(f"pallas paged_prefill needs a power-of-two {name}, got {val}")
    if page_ids not in ("load", "carry"):
        raise ValueError(f"page_ids must be 'load' or 'carry', got {page_ids!r}")
    if page_ids != "load" and kv_load != "page":
        raise ValueError(f"page_ids={page_ids!r} needs kv_load='page', got {kv_load!r}")
    if page_ids != "load":
        fused_loop = True
    spans, walks = common.tile_walks(call, rows // group)
    kernel = functools.partial(
        _prefill_kernel, scale=call.scale, group=group, rows=rows, page_size=page_size, block_k=block_k,
        max_blocks=call.max_blocks, num_kv_heads=hkv, kv_load=kv_load,
        loop="fused" if fused_loop else "split", page_ids=page_ids, fp8=fp8,
    )
    kv = (q.reshape(t_total * hq, d), call.k_pages.reshape(num_pages * page_size, d),
          call.v_pages.reshape(num_pages * page_size, d), k_scale, v_scale)
    o = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t_total * hq, d), q.dtype),
        grid=(hkv, spans[0].shape[0]),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"kvjax_paged_prefill{'_fp8' if fp8 else ''}_{kv_load}_bq{rows}_bk{block_k}",
    )(*common.operands(call, kv, spans, walks))
    return o.reshape(t_total, hq, d)  # every token is written: padding tokens and negative positions as 0
