"""Split-KV MLA decode over a paged latent cache (Pallas, Triton lowering), dense and DSA-sparse.

Stage 1: one program per (head group, KV split, sequence). It walks its split of the sequence in steps of
``block_n`` latent rows: contiguous rows of one page when ``block_n`` divides the page size (defaults: 32
rows at <= 16 heads, one 64-row page above), otherwise rows gathered through the block table; for DSA, the
listed top-k positions. Each row is read once as two tiles, ``kv_c [block_n, R]`` and ``k_pe [block_n, r]``;
logits are ``q_latent · kv_c + q_rope · k_pe`` and the same ``kv_c`` tile is the value (base-2 online
softmax). It writes the split's normalised f32 output and its log-sum-exp. A sequence is cut into
``num_kv_splits`` contiguous ranges of token blocks of its own length, so every split of a long sequence has work and
the splits of a short one may be empty (output 0, lse ``-inf``, no NaN). Holes (``-1``) and positions past
``seq_lens`` are masked: their bytes are never loaded.

Stage 2 merges the splits with their log-sum-exps (a small fused XLA reduction). With one split, stage 1
writes the final output directly in the query dtype and stage 2 is skipped.

On a Hopper GPU, :func:`mla_decode_pallas` sends batches of more than ``TRITON_MAX_HEADS`` heads to the Mosaic
GPU kernel of :mod:`kvjax.pallas.mla_decode_mgpu` (wgmma, warp-specialised; 1.7-2.0x this kernel at 32-128
heads, slower at 16 where its 64-head tile is mostly padding); ``kernel=`` pins either.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MAX_SPLITS = 64  # bounds the f32 split buffers
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_MASK_INIT = -1e30  # finite running-max start: a fully masked page keeps exp(...) at 0, never NaN


def _stage1_kernel(
    tables_ref,  # i32[B, max_blocks] (whole array)
    lens_ref,  # i32[B] (whole array)
    *refs,  # [topk_ref i32[B, K] (whole array; sparse only)], q_ref, qr_ref, latent_ref, o_ref, lse_ref
    scale: float,
    num_splits: int,
    block_n: int,
    sparse: bool,
):
    if sparse:
        topk_ref, q_ref, qr_ref, latent_ref, o_ref, lse_ref = refs
    else:
        q_ref, qr_ref, latent_ref, o_ref, lse_ref = refs
    # q_ref [block_h, R], qr_ref [block_h, r], latent_ref [P, page_size, R + r] (whole array),
    # o_ref [block_h, R] (f32 split output, or the final dtype with one split), lse_ref f32[block_h]
    split, b = pl.program_id(1), pl.program_id(2)
    page_size = latent_ref.shape[1]
    max_blocks = tables_ref.shape[1]
    block_h, rank = q_ref.shape
    rope = qr_ref.shape[1]

    seq_len = lens_ref[b]
    n_steps = topk_ref.shape[1] // block_n if sparse else pl.cdiv(seq_len, block_n)
    per_split = pl.cdiv(n_steps, num_splits)
    start = split * per_split
    end = jnp.minimum(start + per_split, n_steps)

    q = q_ref[...]
    qr = qr_ref[...]
    offs = jnp.arange(block_n, dtype=jnp.int32)
    cols = jnp.arange(rank, dtype=jnp.int32)
    rcols = rank + jnp.arange(rope, dtype=jnp.int32)

    def step(acc, m, l, kv, kr, valid):
        # base-2 online softmax: logits pre-scaled by log2(e) so exp2 (a single ex2 instruction) does the work
        s = plgpu.dot(q, kv, trans_b=True) + plgpu.dot(qr, kr, trans_b=True)  # f32[block_h, block_n]
        s = jnp.where(valid[None, :], s * (scale * _LOG2E), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(kv.dtype), kv)
        return acc, m_new, l

    def body_contiguous(j, carry):  # dense, block_n divides page_size: contiguous rows of one page per step
        first = j * block_n
        page = tables_ref[b, first // page_size]
        row0 = first % page_size
        valid = (first + offs < seq_len) & (page >= 0)  # bool[block_n]
        page = jnp.maximum(page, 0)
        rows = pl.ds(row0, block_n) if block_n < page_size else slice(None)
        kv = plgpu.load(latent_ref.at[page, rows, pl.ds(0, rank)], mask=valid[:, None], other=0.0)
        kr = plgpu.load(latent_ref.at[page, rows, pl.ds(rank, rope)], mask=valid[:, None], other=0.0)
        return step(*carry, kv, kr, valid)

    def body_gather(j, carry):  # block_n token rows gathered through the block table
        if sparse:
            pos = topk_ref[b, pl.ds(j * block_n, block_n)]
        else:
            pos = j * block_n + offs
        pos_ok = (pos >= 0) & (pos < seq_len)
        pos = jnp.where(pos_ok, pos, 0)
        page = tables_ref[b, jnp.minimum(pos // page_size, max_blocks - 1)]
        valid = pos_ok & (page >= 0)  # bool[block_n]
        page, off = jnp.maximum(page, 0)[:, None], (pos % page_size)[:, None]
        kv = plgpu.load(latent_ref.at[page, off, cols[None, :]],
                        mask=jnp.broadcast_to(valid[:, None], (block_n, rank)), other=0.0)
        kr = plgpu.load(latent_ref.at[page, off, rcols[None, :]],
                        mask=jnp.broadcast_to(valid[:, None], (block_n, rope)), other=0.0)
        return step(*carry, kv, kr, valid)

    init = (
        jnp.zeros((block_h, rank), jnp.float32),
        jnp.full((block_h,), _MASK_INIT, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    body = body_contiguous if (page_size % block_n == 0 and not sparse) else body_gather
    acc, m, l = jax.lax.fori_loop(start, end, body, init)
    has = l > 0.0
    safe_l = jnp.where(has, l, 1.0)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m + jnp.log2(safe_l)) * _LN2, -jnp.inf)  # natural-log lse


def _stage1_call(q, qr, latent, tables, lens, topk=None, *, scale, num_splits, block_h, num_warps, num_stages,
                 interpret, block_n=None):
    b, h, rank = q.shape
    rope = qr.shape[-1]
    groups = h // block_h
    block_n = block_n or latent.shape[1]
    sparse = topk is not None
    out_dtype = q.dtype if num_splits == 1 else jnp.float32
    kernel = functools.partial(_stage1_kernel, scale=scale, num_splits=num_splits, block_n=block_n,
                               sparse=sparse)
    whole = pl.no_block_spec  # the kernel indexes these itself
    in_specs = [whole, whole] + ([whole] if sparse else []) + [
        pl.BlockSpec((None, block_h, rank), lambda g, s, i: (i, g, 0)),
        pl.BlockSpec((None, block_h, rope), lambda g, s, i: (i, g, 0)),
        whole,
    ]
    args = (tables, lens) + ((topk,) if sparse else ()) + (q, qr, latent)
    return pl.pallas_call(
        kernel,
        grid=(groups, num_splits, b),  # head groups vary fastest: they share each page through L2
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_h, rank), lambda g, s, i: (i, s, g, 0)),
            pl.BlockSpec((None, None, block_h), lambda g, s, i: (i, s, g)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, num_splits, h, rank), out_dtype),
            jax.ShapeDtypeStruct((b, num_splits, h), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_sparse_decode_stage1" if sparse else "mla_decode_stage1",
    )(*args)


def merge_splits(o_parts: jax.Array, lse_parts: jax.Array) -> jax.Array:
    """Stage 2: f32[B, S, H, R] split outputs and f32[B, S, H] lse -> f32[B, H, R].

    ``o = Σ_s exp(lse_s - lse) o_s`` with ``lse = log Σ_s exp(lse_s)``; empty splits (lse ``-inf``) weigh 0 and
    an all-empty row gives 0.
    """
    m = jnp.max(lse_parts, axis=1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_parts - m)  # [B, S, H]
    denom = jnp.sum(w, axis=1)
    o = jnp.einsum("bsh,bshr->bhr", w, o_parts, precision=jax.lax.Precision.HIGHEST)
    return o / jnp.where(denom > 0, denom, 1.0)[..., None]


def choose_num_kv_splits(batch: int, head_groups: int, max_steps: int, num_sms: int) -> int:
    """Static split factor from shapes only (no host sync): about one program per SM and at least two splits
    (measured best at B=128 on an H200), at least 4 token blocks per split, at most 64."""
    programs = batch * head_groups
    want = max(2, math.ceil(num_sms / programs))
    return max(1, min(want, max_steps // 4, _MAX_SPLITS))


def _num_sms() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


def default_tiles(num_heads: int, page_size: int, sparse: bool = False) -> dict:
    """Tile defaults picked by measurement on an H200 (benchmarks/RESULTS.md, "MLA decode and DSA").

    Few heads (memory-bound): 16 heads x half a page per step, 4 warps, 3 stages. Many heads (the QK/PV
    products dominate): 64 heads x one page, 8 warps, 2 stages (3 stages exceed shared memory).
    """
    if num_heads <= 16:
        tiles = dict(block_h=16, block_n=32 if page_size % 32 == 0 else page_size, num_warps=4, num_stages=3)
    else:
        tiles = dict(block_h=64 if num_heads >= 64 else 32, block_n=page_size, num_warps=8, num_stages=2)
    if sparse:
        tiles["block_n"] = 64
    return tiles


def _decode(q_latent, q_rope, latent_pages, block_tables, seq_lens, topk, *, scale, num_kv_splits, block_h,
            block_n, num_warps, num_stages, interpret):
    b, h, _ = q_latent.shape
    page_size = latent_pages.shape[1]
    tiles = default_tiles(h, page_size, sparse=topk is not None)
    block_h = block_h or tiles["block_h"]
    block_n = block_n or tiles["block_n"]
    num_warps = num_warps or tiles["num_warps"]
    num_stages = num_stages or tiles["num_stages"]
    pad = -h % block_h
    q, qr = q_latent.astype(latent_pages.dtype), q_rope.astype(latent_pages.dtype)
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0)))
        qr = jnp.pad(qr, ((0, 0), (0, pad), (0, 0)))
    if topk is not None and topk.shape[1] % block_n:
        topk = jnp.pad(topk, ((0, 0), (0, -topk.shape[1] % block_n)), constant_values=-1)
    groups = (h + pad) // block_h
    if num_kv_splits is None:
        steps = (topk.shape[1] if topk is not None else block_tables.shape[-1] * page_size) // block_n
        num_kv_splits = choose_num_kv_splits(b, groups, steps, _num_sms())
    o, lse = _stage1_call(q, qr, latent_pages, block_tables[:, 0, :], seq_lens, topk, scale=scale,
                          num_splits=num_kv_splits, block_h=block_h, block_n=block_n, num_warps=num_warps,
                          num_stages=num_stages, interpret=interpret)
    if num_kv_splits == 1:
        out = o[:, 0].astype(q_latent.dtype)
    else:
        out = merge_splits(o, lse).astype(q_latent.dtype)
    return out[:, :h]


_STATIC = ("scale", "num_kv_splits", "block_h", "block_n", "num_warps", "num_stages", "interpret")
# "auto" keeps this kernel up to this many heads and takes the Mosaic GPU kernel above (H200, B=128 L=4096:
# Mosaic 0.203 vs 0.182-0.198 ms at 16 heads, where 48 of its 64 tile rows are padding; 0.210 vs 0.337-0.350 ms
# at 32)
TRITON_MAX_HEADS = 16


def _use_mosaic(q_latent, q_rope, latent_pages, kernel: str, tiles: tuple, interpret: bool) -> bool:
    if kernel not in ("auto", "mosaic", "triton"):
        raise ValueError(f"kernel must be 'auto', 'mosaic' or 'triton', got {kernel!r}")
    if kernel != "auto":
        return kernel == "mosaic"
    from kvjax.pallas import hopper_gpu, mla_decode_mgpu

    return (not interpret and hopper_gpu() and q_latent.shape[1] > TRITON_MAX_HEADS and all(t is None for t in tiles)
            and mla_decode_mgpu.unsupported(q_latent, q_rope, latent_pages) is None)


@functools.partial(jax.jit, static_argnames=_STATIC + ("kernel",))
def mla_decode_pallas(
    q_latent: jax.Array,  # [B, H, R]
    q_rope: jax.Array,  # [B, H, r]
    latent_pages: jax.Array,  # [P, page_size, R + r]
    block_tables: jax.Array,  # i32[B, 1, max_blocks]
    seq_lens: jax.Array,  # i32[B]
    *,
    scale: float,
    num_kv_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    kernel: str = "auto",
) -> jax.Array:
    """Split-KV MLA decode (see module doc). Returns ``o: [B, H, R]`` in ``q_latent``'s dtype.

    ``kernel``: ``"triton"`` (this module's Pallas Triton kernel), ``"mosaic"``
    (:func:`kvjax.pallas.mla_decode_mgpu.mla_decode_mgpu`: Hopper only, reads whole 64-row tiles, so rows of a
    page past ``seq_lens`` must be finite), or ``"auto"``: Mosaic on a Hopper GPU above ``TRITON_MAX_HEADS``
    heads when no Triton tile option is given and the shapes fit (R = 512, r = 64, pages of 64k tokens, a
    16-bit cache), else Triton.

    Tuning of the Triton kernel (static, defaults from :func:`default_tiles`): ``block_h`` query heads per
    program, ``block_n`` tokens per step (a divisor of the page size reads contiguous rows; larger values
    gather rows through the block table), warps, pipeline stages.
    """
    if _use_mosaic(q_latent, q_rope, latent_pages, kernel, (block_h, block_n, num_warps, num_stages), interpret):
        from kvjax.pallas.mla_decode_mgpu import mla_decode_mgpu

        return mla_decode_mgpu(q_latent, q_rope, latent_pages, block_tables, seq_lens, scale=scale,
                               num_kv_splits=num_kv_splits, interpret=interpret)
    return _decode(q_latent, q_rope, latent_pages, block_tables, seq_lens, None, scale=scale,
                   num_kv_splits=num_kv_splits, block_h=block_h, block_n=block_n, num_warps=num_warps,
                   num_stages=num_stages, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def sparse_mla_decode_pallas(
    q_latent: jax.Array,  # [B, H, R]
    q_rope: jax.Array,  # [B, H, r]
    latent_pages: jax.Array,  # [P, page_size, R + r]
    block_tables: jax.Array,  # i32[B, 1, max_blocks]
    seq_lens: jax.Array,  # i32[B]
    topk_indices: jax.Array,  # i32[B, K]; -1 = none
    *,
    scale: float,
    num_kv_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """DSA sparse MLA decode: the same split-KV kernel over the ``K`` listed positions (``block_n`` per step).

    Positions ``< 0`` or ``>= seq_lens`` and holes are masked (never loaded). Returns ``o: [B, H, R]``.
    """
    return _decode(q_latent, q_rope, latent_pages, block_tables, seq_lens, topk_indices, scale=scale,
                   num_kv_splits=num_kv_splits, block_h=block_h, block_n=block_n, num_warps=num_warps,
                   num_stages=num_stages, interpret=interpret)
