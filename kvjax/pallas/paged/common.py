"""Launch metadata shared by the paged-attention kernels, computed on device in jnp (static shapes): token
positions, the query tile map of the prefill kernels, and the head-wise page walk; and the shape check of the
two Pallas Triton kernels.

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
from kvjax.base.fp8 import FP8_DTYPE
from kvjax.base.ragged import count_le


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
    cu_seqlens: jnp.ndarray,  # i32[B+1]
    seq_lens: jnp.ndarray,  # i32[B]
    window: jnp.ndarray,  # i32[Hkv]
    sinks: jnp.ndarray,  # i32[Hkv]
    *,
    num_tokens: int,
    tokens_per_tile: int,
    page_size: int,
    max_blocks: int,
) -> tuple[jnp.ndarray, ...]:
    """Launch metadata of the prefill kernels: the :func:`tile_map` and each (tile, KV head)'s page walk.

    Returns ``(row, first token, length, first position): i32[NT]`` and ``(lo, n_sink, n_pages): i32[NT, Hkv]``.
    """
    t_row, t_tok, t_len, t_pos, t_attends = tile_map(cu_seqlens, seq_lens, num_tokens, tokens_per_tile)
    lo, n_sink, n_pages = page_ranges(t_pos, t_pos + t_len - 1, t_attends & (t_len > 0), window, sinks,
                                      page_size=page_size, max_blocks=max_blocks)
    return t_row, t_tok, t_len, t_pos, lo, n_sink, n_pages


def triton_shape_reason(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, D]
) -> str | None:
    """What the Pallas Triton paged kernels (decode and prefill) cannot take: they need a power-of-two
    ``head_dim >= 16`` and a power-of-two ``page_size`` (``"needs ..., got ..."``), else None."""
    d, page_size = q.shape[-1], k_pages.shape[1]
    if d < 16 or not is_pow2(d):
        return f"needs a power-of-two head_dim >= 16, got {d}"
    if not is_pow2(page_size):
        return f"needs a power-of-two page_size, got {page_size}"
    return None


def page_scales(
    k_pages: jax.Array,  # [P, page_size, D]: float, or float8_e4m3fn
    v_pages: jax.Array,  # [P, page_size, D]
    k_scale: jax.Array | None,  # f32[P] for fp8 pages, else None
    v_scale: jax.Array | None,  # f32[P] for fp8 pages, else None
    *,
    kernel: str,
) -> tuple[bool, jax.Array, jax.Array]:  # (fp8, f32[P] or f32[1], f32[P] or f32[1])
    """Whether a Triton paged kernel reads fp8 pages, and the two scale arrays it is handed.

    fp8 pages are float8_e4m3fn ``k_pages`` / ``v_pages`` with ``k_scale`` / ``v_scale`` ``f32[P]`` (one scale per
    single-head page); float pages take no scales and are handed an unread ``f32[1]`` each, so the kernel's
    signature does not change. ``ValueError`` naming ``kernel`` and the argument otherwise (the op checks the
    same first; this guards direct kernel calls).
    """
    fp8 = [jnp.dtype(x.dtype) == FP8_DTYPE for x in (k_pages, v_pages)]
    if fp8[0] != fp8[1]:
        raise ValueError(f"{kernel}: k_pages and v_pages must both be float8_e4m3fn or both float, got "
                         f"{k_pages.dtype} and {v_pages.dtype}")
    if not fp8[0]:
        given = [n for n, x in (("k_scale", k_scale), ("v_scale", v_scale)) if x is not None]
        if given:
            raise ValueError(f"{kernel}: {' and '.join(given)} go with float8_e4m3fn pages, got {k_pages.dtype} pages")
        one = jnp.ones((1,), jnp.float32)
        return False, one, one
    num_pages = k_pages.shape[0]
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            raise ValueError(f"{kernel}: fp8 pages need {name} (f32[P] per-page scales, P={num_pages}), got None")
        if tuple(x.shape) != (num_pages,) or x.dtype != jnp.float32:
            raise ValueError(f"{kernel}: {name} must be f32[{num_pages}] (one scale per page), got "
                             f"{x.dtype}{list(x.shape)}")
    return True, k_scale, v_scale
