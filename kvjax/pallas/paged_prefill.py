"""Head-wise paged attention, prefill / extend path: ragged flash attention over single-head pages (Pallas Triton).

The query tokens of a step are cut into *tiles*: consecutive tokens of one row, ``block_q`` tokens at most
(the tile map is built on device, with a static upper bound ``ceil(T / block_q) + B`` on the tile count, so
nothing is synchronised with the host). One program per (tile, KV head) holds the tile's tokens for every
query head of the GQA group (``block_q * G`` rows), and walks the virtual page list of
:mod:`kvjax.pallas.paged_common` for the tile's position span and *its* KV head — sink pages plus the window
pages — with the causal / window / sink mask per (row, key). Cached prefix and new tokens are the same pages
(the new K/V are written to the cache before the call). ``-1`` entries are masked at the load, never read.
Rows with one token (decode rows of a mixed batch) are tiles of one token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.pallas import paged_common

_NEG_INF = float("-inf")
_LOG2E = 1.4426950408889634


def _prefill_kernel(
    q_ref,  # [T*Hq, D]
    k_ref,  # [P*page_size, D]
    v_ref,  # [P*page_size, D]
    bt_ref,  # i32[B*Hkv*max_blocks]
    tile_row_ref,  # i32[NT]
    tile_tok_ref,  # i32[NT]: first token of the tile
    tile_len_ref,  # i32[NT]: tokens in the tile (0 = empty tile)
    tile_pos_ref,  # i32[NT]: position of the first token
    lo_ref,  # i32[NT*Hkv]
    nsink_ref,  # i32[NT*Hkv]
    npages_ref,  # i32[NT*Hkv]
    win_ref,  # i32[Hkv]
    sink_ref,  # i32[Hkv]
    o_ref,  # [T*Hq, D]
    *,
    scale: float,
    group: int,
    rows: int,
    page_size: int,
    block_k: int,
    max_blocks: int,
    num_kv_heads: int,
    unmasked_fast_path: bool,
):
    h = pl.program_id(0)
    tile = pl.num_programs(1) - 1 - pl.program_id(1)  # last (longest-walk) tiles of every head launch first
    th = tile * num_kv_heads + h
    b = tile_row_ref[tile]
    tok0 = tile_tok_ref[tile]
    n_tok = tile_len_ref[tile]
    i0 = tile_pos_ref[tile]
    i_last = i0 + n_tok - 1
    lo = lo_ref[th]
    n_sink = nsink_ref[th]
    n_pages = npages_ref[th]
    w = win_ref[h]
    sk = sink_ref[h]
    pages_per_block = block_k // page_size
    hq = num_kv_heads * group

    cols = jnp.arange(q_ref.shape[1], dtype=jnp.int32)
    r = jnp.arange(rows, dtype=jnp.int32)
    r_tok = r // group
    r_ok = (r_tok < n_tok) & (r < (rows // group) * group)
    q_rows = (tok0 + r_tok) * hq + h * group + r % group  # unique per r; masked rows are never touched
    qpos = i0 + r_tok
    q = plgpu.load(q_ref.at[jnp.where(r_ok, q_rows, 0)[:, None], cols[None, :]], mask=r_ok[:, None], other=0.0)

    j = jnp.arange(block_k, dtype=jnp.int32)
    j_page = j // page_size
    j_off = j % page_size
    bt_base = (b * num_kv_heads + h) * max_blocks

    qk_scale = scale * _LOG2E  # softmax in base 2

    def step(c, carry, masked: bool):
        acc, m, l = carry
        vp = c * pages_per_block + j_page
        in_range = vp < n_pages
        col = jnp.where(vp < n_sink, vp, lo + vp - n_sink)
        page = plgpu.load(bt_ref.at[jnp.where(in_range, bt_base + col, 0)], mask=in_range, other=-1)
        kpos = col * page_size + j_off
        k_ok = in_range & (page >= 0)
        if masked:
            k_ok = k_ok & (kpos <= i_last) & ((w == 0) | (kpos > i0 - w) | (kpos < sk))
        kv_rows = jnp.where(k_ok, page, 0) * page_size + j_off
        k = plgpu.load(k_ref.at[kv_rows[:, None], cols[None, :]], mask=k_ok[:, None], other=0.0)
        v = plgpu.load(v_ref.at[kv_rows[:, None], cols[None, :]], mask=k_ok[:, None], other=0.0)
        sc = plgpu.dot(q, k, trans_b=True) * qk_scale  # f32[rows, block_k], log2 units
        if masked:
            diff = qpos[:, None] - kpos[None, :]
            ok = k_ok[None, :] & (diff >= 0) & ((w == 0) | (diff < w) | (kpos[None, :] < sk))
            sc = jnp.where(ok, sc, _NEG_INF)
        else:  # every key of the block is visible to every row; only holes are masked
            sc = sc + jnp.where(k_ok, 0.0, _NEG_INF)[None, :]
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(sc - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, l

    # Blocks [a, b) hold only window pages whose keys every row of the tile sees (all <= i0, all inside the
    # window of the last row): no per-element mask there. Sink pages and the window's edges are masked.
    n_blocks = pl.cdiv(n_pages, pages_per_block)
    col_a = jnp.where(w > 0, pl.cdiv(jnp.maximum(i_last - w + 1, 0), page_size), 0)
    col_b = (i0 + 1) // page_size - 1
    blk_a = jnp.minimum(pl.cdiv(n_sink + jnp.maximum(col_a - lo, 0), pages_per_block), n_blocks)
    blk_b = jnp.minimum(jnp.maximum((n_sink + col_b + 1 - lo) // pages_per_block, blk_a), n_blocks)

    head_dim = q.shape[-1]
    carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _NEG_INF, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    if unmasked_fast_path:
        carry = jax.lax.fori_loop(0, blk_a, functools.partial(step, masked=True), carry)
        carry = jax.lax.fori_loop(blk_a, blk_b, functools.partial(step, masked=False), carry)
        carry = jax.lax.fori_loop(blk_b, n_blocks, functools.partial(step, masked=True), carry)
    else:
        carry = jax.lax.fori_loop(0, n_blocks, functools.partial(step, masked=True), carry)
    acc, m, l = carry
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(o_ref.at[q_rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=r_ok[:, None])


def _tile_map(cu_seqlens, seq_lens, num_tokens: int, block_q: int):
    """Tiles of <= block_q consecutive tokens of one row: (row, first token, length, first position)[NT]."""
    num_rows = seq_lens.shape[0]
    num_tiles = pl.cdiv(num_tokens, block_q) + num_rows
    n_new = jnp.clip(cu_seqlens[1:] - cu_seqlens[:-1], 0, None)  # i32[B]
    tiles = (n_new + block_q - 1) // block_q
    ends = jnp.cumsum(tiles)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    row = paged_common.count_le(ends, tile)  # first row whose tiles end after `tile`
    live = row < num_rows
    row = jnp.minimum(row, num_rows - 1)
    local = tile - (ends[row] - tiles[row])
    tok0 = cu_seqlens[row] + local * block_q
    length = jnp.where(live, jnp.clip(n_new[row] - local * block_q, 0, block_q), 0)
    pos0 = seq_lens[row] - n_new[row] + local * block_q
    return row, tok0.astype(jnp.int32), length.astype(jnp.int32), pos0.astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("scale", "interpret", "block_q", "block_k", "num_warps", "num_stages", "fast_path")
)
def paged_prefill(
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
    interpret: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fast_path: bool = True,
) -> jax.Array:  # [T, Hq, D]
    """Ragged causal paged attention for any batch (prefill, chunked prefill, mixed prefill + decode).

    Same contract as :func:`kvjax.pallas.paged_attention.paged_attention`; tokens of no row get output 0.
    ``block_q`` counts query *rows* of a program (tokens x GQA group), default 128. ``fast_path=False`` masks
    every key block (kept to measure what the unmasked middle blocks save).
    """
    t_total, hq, d = q.shape
    num_pages, page_size, _ = k_pages.shape
    num_rows, hkv, max_blocks = block_tables.shape
    group = hq // hkv
    block_k = max(block_k or 64, page_size)
    rows = max(block_q or 128, 16, paged_common.next_pow2(group))
    for name, val in (("head_dim", d), ("page_size", page_size), ("block_k", block_k), ("block_q", rows)):
        if val & (val - 1):
            raise ValueError(f"pallas paged_prefill needs a power-of-two {name}, got {val}")
    if d < 16:
        raise ValueError(f"pallas paged_prefill needs head_dim >= 16, got {d}")
    tokens_per_tile = rows // group
    t_row, t_tok, t_len, t_pos = _tile_map(cu_seqlens, seq_lens, t_total, tokens_per_tile)
    lo, n_sink, n_pages = paged_common.page_ranges(
        t_pos, t_pos + t_len - 1, t_len > 0, window, sinks, page_size=page_size, max_blocks=max_blocks
    )
    kernel = functools.partial(
        _prefill_kernel, scale=scale, group=group, rows=rows, page_size=page_size, block_k=block_k,
        max_blocks=max_blocks, num_kv_heads=hkv, unmasked_fast_path=fast_path,
    )
    o = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t_total * hq, d), q.dtype),
        grid=(hkv, t_row.shape[0]),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages or 3),
        interpret=interpret,
        name=f"kvjax_paged_prefill_bq{rows}_bk{block_k}",
    )(
        q.reshape(t_total * hq, d),
        k_pages.reshape(num_pages * page_size, d),
        v_pages.reshape(num_pages * page_size, d),
        block_tables.reshape(-1),
        t_row, t_tok, t_len, t_pos,
        lo.reshape(-1), n_sink.reshape(-1), n_pages.reshape(-1), window, sinks,
    )
    _, _, real = paged_common.token_positions(cu_seqlens, seq_lens, t_total)
    return jnp.where(real[:, None, None], o.reshape(t_total, hq, d), 0).astype(q.dtype)
