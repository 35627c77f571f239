"""What the paged-attention kernels share: launch metadata computed on device in jnp (static shapes: token
positions, the query tile map of the prefill kernels, the head-wise page walk), the operands every kernel takes
in one order (:func:`operands`), the scale vectors of fp8 pages and the shape check of the two Pallas Triton
kernels. Every kernel entry takes the op's call (``kvjax.ops.attention.PagedAttentionCall``, checked by the op:
``q [T, Hq, D]``, ``k_pages`` / ``v_pages [P, page_size, D]``, ``block_tables i32[B, Hkv, max_blocks]``,
``seq_lens i32[B]``, ``cu_seqlens i32[B+1]``, ``window`` / ``sinks i32[Hkv]``, ``k_scale`` / ``v_scale f32[P]`` or
``None``, static ``scale``) and hands it to these helpers unchanged.

Head-wise page walk. For a query span ``[i0, i1]`` (absolute positions) and KV head ``h`` the pages that can
hold a visible key are the *sink pages* ``[0, n_sink)`` and the *window pages* ``[lo, hi)``, with

- ``hi = i1 // page_size + 1`` (clamped to ``max_blocks``),
- ``lo = max(0, i0 - window + 1) // page_size`` for a SWA head, ``0`` for a full head (``window == 0``),
- ``n_sink = min(ceil(sinks / page_size), lo)`` for a SWA head (sinks below ``lo`` only), else ``0``.

Kernels walk the *virtual page list* ``v = 0 .. n_sink + hi - lo - 1`` mapped to table column
``v if v < n_sink else lo + v - n_sink``, so every page they touch can hold an attendable key, and each
page is visited once. Nothing here reads the block table: holes are masked by the kernels themselves.

fp8 pages (:func:`page_scales`): the Triton kernels load the float8_e4m3fn page bytes and convert them to q's
dtype (exact: every e4m3 value is a bf16 / f16 / f32 value), multiply each ``q . k`` logit by its page's key
scale and each probability by its page's value scale before the ``P V`` product (the softmax sums take the
unscaled probabilities); the scales are powers of two (:mod:`kvjax.state.kv_cache`), so both products are exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.base.device import is_pow2
from kvjax.base.ragged import count_le

SMEM_BUDGET = 224 * 1024  # bytes of shared memory a kernel may plan for (an H100 / H200 block has 227 KiB)


def token_positions(
    cu_seqlens: jnp.ndarray,  # i32[B+1]
    seq_lens: jnp.ndarray,  # i32[B]
    num_tokens: int,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Row, absolute position and realness of every query token.

    Returns ``row: i32[T]`` (clipped to ``[0, B)``), ``pos: i32[T]`` (``seq_lens[row] - n_new + offset``) and
    ``real: bool[T]`` (the token belongs to a row and has a non-negative position).
    """
    num_rows = seq_lens.shape[0]
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    row = count_le(cu_seqlens, tok) - 1
    row = jnp.clip(row, 0, num_rows - 1)
    n_new = cu_seqlens[row + 1] - cu_seqlens[row]
    pos = seq_lens[row] - n_new + (tok - cu_seqlens[row])
    real = (tok >= cu_seqlens[0]) & (tok < cu_seqlens[num_rows]) & (pos >= 0)
    return row, pos, real


def page_ranges(
    first_pos: jnp.ndarray,  # i32[N]: first query position of the span
    last_pos: jnp.ndarray,  # i32[N]: last query position of the span
    live: jnp.ndarray,  # bool[N]: spans that attend at all
    window: jnp.ndarray,  # i32[Hkv]
    sinks: jnp.ndarray,  # i32[Hkv]
    *,
    page_size: int,
    max_blocks: int,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Virtual page list of every (span, KV head): ``lo, n_sink, n_pages: i32[N, Hkv]`` (see module doc)."""
    w = window[None, :]
    sk = sinks[None, :]
    i0 = first_pos[:, None]
    i1 = last_pos[:, None]
    swa = w > 0
    hi = jnp.minimum(i1 // page_size + 1, max_blocks)
    lo = jnp.where(swa, jnp.maximum(i0 - w + 1, 0) // page_size, 0)
    lo = jnp.minimum(lo, hi)
    n_sink = jnp.where(swa, jnp.minimum((sk + page_size - 1) // page_size, lo), 0)
    n_pages = jnp.where(live[:, None], n_sink + hi - lo, 0)
    return lo.astype(jnp.int32), n_sink.astype(jnp.int32), n_pages.astype(jnp.int32)


def tile_map(cu_seqlens, seq_lens, num_tokens: int, block_q: int):
    """Tiles of <= block_q consecutive tokens of one span, covering all ``num_tokens`` tokens.

    The spans are ``[0, cu[0])``, the rows ``[cu[b], cu[b+1])`` and ``[cu[B], T)``: tiles of the two padding spans
    attend to nothing, so the kernel writes their tokens' zeros itself (no select over the output afterwards).
    Returns (row, first token, length, first position, attends)[NT].
    """
    num_rows = seq_lens.shape[0]
    bounds = jnp.clip(jnp.concatenate([jnp.zeros((1,), jnp.int32), cu_seqlens.astype(jnp.int32),
                                       jnp.full((1,), num_tokens, jnp.int32)]), 0, num_tokens)  # i32[B+3]
    n_span = jnp.maximum(bounds[1:] - bounds[:-1], 0)  # i32[B+2]
    num_tiles = -(-num_tokens // block_q) + num_rows + 2
    tiles = (n_span + block_q - 1) // block_q
    ends = jnp.cumsum(tiles)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    span = count_le(ends, tile)  # first span whose tiles end after `tile`
    live = span < num_rows + 2
    span = jnp.minimum(span, num_rows + 1)
    attends = live & (span >= 1) & (span <= num_rows)
    row = jnp.clip(span - 1, 0, num_rows - 1)
    local = tile - (ends[span] - tiles[span])
    tok0 = bounds[span] + local * block_q
    length = jnp.where(live, jnp.clip(n_span[span] - local * block_q, 0, block_q), 0)
    pos0 = seq_lens[row] - n_span[span] + local * block_q
    return row, tok0.astype(jnp.int32), length.astype(jnp.int32), pos0.astype(jnp.int32), attends


def tile_walks(
    call,  # kvjax.ops.attention.PagedAttentionCall: cu_seqlens, seq_lens, window, sinks, pages, block_tables
    tokens_per_tile: int,
) -> tuple[tuple[jnp.ndarray, ...], tuple[jnp.ndarray, ...]]:
    """Launch metadata of the prefill kernels: the :func:`tile_map` and each (tile, KV head)'s page walk.

    Returns the spans ``(row, first token, length, first position): i32[NT]`` each and the walks
    ``(lo, n_sink, n_pages): i32[NT, Hkv]`` each (:func:`operands` takes both).
    """
    t_row, t_tok, t_len, t_pos, t_attends = tile_map(call.cu_seqlens, call.seq_lens, call.q.shape[0], tokens_per_tile)
    walks = page_ranges(t_pos, t_pos + t_len - 1, t_attends & (t_len > 0), call.window, call.sinks,
                        page_size=call.page_size, max_blocks=call.max_blocks)
    return (t_row, t_tok, t_len, t_pos), walks


def operands(
    call,  # kvjax.ops.attention.PagedAttentionCall
    kv: tuple[jax.Array, ...],  # (q, k, v, k_scale, v_scale) in the kernel's layout
    spans: tuple[jnp.ndarray, ...],  # i32[N] each: the metadata of the kernel's query spans (tokens or tiles)
    walks: tuple[jnp.ndarray, ...],  # (lo, n_sink, n_pages): i32[N, Hkv] each
) -> tuple[jax.Array, ...]:
    """The operands of every paged kernel, in their one order: ``kv``, the flat block table
    ``i32[B*Hkv*max_blocks]``, ``spans``, the flat walks ``i32[N*Hkv]``, ``window``, ``sinks``."""
    return (*kv, call.block_tables.reshape(-1), *spans, *(x.reshape(-1) for x in walks), call.window, call.sinks)


def kernel_refs(refs: tuple, num_spans: int) -> tuple[tuple, tuple, tuple, tuple]:
    """Inside a kernel: its refs, :func:`operands` in order then the kernel's outputs and scratch, split into
    ``(q, k, v, k_scale, v_scale, block_tables)``, the ``num_spans`` span refs, the walk refs
    ``(lo, n_sink, n_pages, window, sinks)`` (read with :func:`walk_at`) and the rest.

    Refs: ``q [T*Hq, D]`` (Mosaic GPU: ``[T, Hq, D]``), ``k`` / ``v [P*page_size, D]`` (Mosaic GPU:
    ``[P, page_size, D]``), float or float8_e4m3fn; ``k_scale`` / ``v_scale f32[P]`` (fp8 pages; else ``f32[1]``,
    never read); ``block_tables i32[B*Hkv*max_blocks]``; spans ``i32[N]`` each; ``lo`` / ``n_sink`` / ``n_pages
    i32[N*Hkv]``; ``window`` / ``sinks i32[Hkv]``."""
    head, spans, walk = refs[:6], refs[6:6 + num_spans], refs[6 + num_spans:11 + num_spans]
    return head, spans, walk, refs[11 + num_spans:]


def walk_at(walk_refs: tuple, th: jax.Array, h: jax.Array) -> tuple[jax.Array, ...]:
    """``(lo, n_sink, n_pages, window, sinks)``, i32[] each: the page walk of (span, KV head) ``th = span * Hkv +
    h`` and KV head ``h``'s mask, read from the walk refs of :func:`kernel_refs`."""
    lo_ref, nsink_ref, npages_ref, win_ref, sink_ref = walk_refs
    return lo_ref[th], nsink_ref[th], npages_ref[th], win_ref[h], sink_ref[h]


def triton_shape_reason(call) -> str | None:  # kvjax.ops.attention.PagedAttentionCall
    """What the Pallas Triton paged kernels (decode and prefill) cannot take: they need a power-of-two
    ``head_dim >= 16`` and a power-of-two ``page_size`` (``"needs ..., got ..."``), else None."""
    d, page_size = call.q.shape[-1], call.page_size
    if d < 16 or not is_pow2(d):
        return f"needs a power-of-two head_dim >= 16, got {d}"
    if not is_pow2(page_size):
        return f"needs a power-of-two page_size, got {page_size}"
    return None


def fit_shared_memory(*, head_dim: int, kv_itemsize: int, q_itemsize: int, block_k: int, num_stages: int,
                      rows: int, min_block_k: int, min_rows: int, fixed: tuple[str, ...] = (),
                      convert_itemsize: int = 0) -> tuple[int, int, int]:
    """``(block_k, num_stages, rows)`` of a Triton paged kernel shrunk until its planned shared memory fits
    :data:`SMEM_BUDGET`: up to ``num_stages`` K and V blocks of ``block_k x head_dim`` in the software pipeline,
    beside a ``rows x head_dim`` query tile, and ``block_k x head_dim`` elements of ``convert_itemsize`` bytes: the
    prefill kernel over fp8 pages passes 2, the tile of their bf16 conversion that Triton 3.6 keeps beside the
    pipeline's buffers (sm_90, compiled on a CPU: at ``head_dim`` 256 it took 263680 B with 2 stages of 128 keys
    where the pipeline and q planned 196608, past a Hopper CTA's 227 KB; the decode kernel's fp8 configurations
    compiled within the plan without it, so it passes 0). Stages go first (down to 2), then ``block_k`` (down to
    ``min_block_k``), then the last stage (no pipelining), then ``rows`` (down to ``min_rows``); a knob named in
    ``fixed`` (set by the caller) is left as it is. The tuned bf16 and fp8 defaults at ``head_dim`` 128 fit
    unchanged; float32 pages or ``head_dim`` 256 take fewer stages or smaller blocks instead of failing to
    launch."""
    def planned(bk: int, st: int, r: int) -> int:
        return st * 2 * bk * head_dim * kv_itemsize + r * head_dim * q_itemsize + bk * head_dim * convert_itemsize

    while planned(block_k, num_stages, rows) > SMEM_BUDGET:
        if num_stages > 2 and "num_stages" not in fixed:
            num_stages -= 1
        elif block_k > min_block_k and "block_k" not in fixed:
            block_k //= 2
        elif num_stages > 1 and "num_stages" not in fixed:
            num_stages -= 1
        elif rows > min_rows and "rows" not in fixed:
            rows //= 2
        else:
            break
    return block_k, num_stages, rows


def page_scales(call) -> tuple[bool, jax.Array, jax.Array]:  # (fp8, f32[P] or f32[1], f32[P] or f32[1])
    """Whether a kernel reads fp8 pages (the call carries ``k_scale`` / ``v_scale`` ``f32[P]``, one scale per
    single-head page), and the two scale arrays it is handed: float pages take no scales and are handed an unread
    ``f32[1]`` each, so the kernel's operands do not change. The op checked the pages against their scales."""
    if call.k_scale is None:
        one = jnp.ones((1,), jnp.float32)
        return False, one, one
    return True, call.k_scale, call.v_scale
