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

Stage 2 and the host side (head padding, split choice, merge) are :func:`kvjax.pallas.split_kv.split_kv_inputs` /
:func:`~kvjax.pallas.split_kv.split_kv_output`; tile defaults are :func:`kvjax.pallas.split_kv.default_tiles`; the
pieces of stage 1 shared with the fp8 DSA kernel are :mod:`kvjax.pallas.mla.common`. One entry,
:func:`mla_decode_pallas`, takes the dense and the sparse call (``call.topk_indices``). Its tiles are Triton
blocks, powers of two >= 16: :func:`unsupported` declines other ``R``, ``r`` and page sizes (``impl="auto"`` then
runs the reference; a named ``impl`` raises with the reason). On a Hopper GPU above 16 heads the backend table
of :func:`kvjax.ops.mla.mla_decode` takes the Mosaic GPU kernel instead (:mod:`kvjax.pallas.mla.decode_mgpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.pallas.mla.common import gather_rows, softmax_step, split_steps, stage1_layout
from kvjax.pallas.split_kv import (LN2, MASK_INIT, STATIC_ARGNAMES, Tiles, default_tiles, pad_positions,
                                   split_kv_inputs, split_kv_output, tile_reason)


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
    block_h, rank = q_ref.shape
    rope = qr_ref.shape[1]

    seq_len = lens_ref[b]
    start, end = split_steps(topk_ref.shape[1] // block_n if sparse else pl.cdiv(seq_len, block_n), split,
                             num_splits)

    q = q_ref[...]
    qr = qr_ref[...]
    offs = jnp.arange(block_n, dtype=jnp.int32)
    cols = jnp.arange(rank, dtype=jnp.int32)
    rcols = rank + jnp.arange(rope, dtype=jnp.int32)

    def step(acc, m, l, kv, kr, valid):
        s = plgpu.dot(q, kv, trans_b=True) + plgpu.dot(qr, kr, trans_b=True)  # f32[block_h, block_n]
        p, alpha, m_new, l = softmax_step(s, valid, m, l, scale)
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
        page, off, valid = gather_rows(tables_ref, b, pos, seq_len, page_size)
        kv = plgpu.load(latent_ref.at[page, off, cols[None, :]],
                        mask=jnp.broadcast_to(valid[:, None], (block_n, rank)), other=0.0)
        kr = plgpu.load(latent_ref.at[page, off, rcols[None, :]],
                        mask=jnp.broadcast_to(valid[:, None], (block_n, rope)), other=0.0)
        return step(*carry, kv, kr, valid)

    init = (
        jnp.zeros((block_h, rank), jnp.float32),
        jnp.full((block_h,), MASK_INIT, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    body = body_contiguous if (page_size % block_n == 0 and not sparse) else body_gather
    acc, m, l = jax.lax.fori_loop(start, end, body, init)
    has = l > 0.0
    safe_l = jnp.where(has, l, 1.0)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)  # natural-log lse


def _stage1_call(q, qr, latent, tables, lens, topk=None, *, scale, num_splits, block_h, num_warps, num_stages,
                 interpret, block_n=None, out_dtype=None):
    """Stage 1 over ``q [B, Hp, R]``, ``qr [B, Hp, r]`` (heads padded to whole groups of ``block_h``): split outputs
    ``[B, S, Hp, R]`` (``out_dtype``; default q's dtype with one split, f32 with several) and f32 lse ``[B, S, Hp]``."""
    b, h, rank = q.shape
    block_n = block_n or latent.shape[1]
    sparse = topk is not None
    out_dtype = out_dtype or (q.dtype if num_splits == 1 else jnp.float32)
    kernel = functools.partial(_stage1_kernel, scale=scale, num_splits=num_splits, block_n=block_n,
                               sparse=sparse)
    grid, query_specs, out_specs, out_shape = stage1_layout(b, h, rank, qr.shape[-1], block_h=block_h,
                                                            num_splits=num_splits, out_dtype=out_dtype)
    whole = pl.no_block_spec  # the kernel indexes these itself
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole, whole] + ([whole] if sparse else []) + query_specs + [whole],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_sparse_decode_stage1" if sparse else "mla_decode_stage1",
    )(*(tables, lens) + ((topk,) if sparse else ()) + (q, qr, latent))


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
def mla_decode_pallas(
    call,  # kvjax.ops.mla.MLADecodeCall: q_latent [B, H, R], q_rope [B, H, r], block_tables i32[B, 1, max_blocks],
    #        seq_lens i32[B], topk_indices i32[B, K] (sparse) or None (dense); static scale, num_kv_splits
    latent_pages: jax.Array,  # [P, page_size, R + r]
    *,
    tiles: Tiles = Tiles(),
    interpret: bool = False,
) -> jax.Array:  # [B, H, R] in q_latent's dtype
    """Split-KV MLA decode (see module doc), dense or DSA-sparse over the ``K`` listed positions (``block_n`` per
    step; positions ``< 0`` or ``>= seq_lens`` and holes are masked, never loaded): the contract of
    :func:`kvjax.ops.mla.mla_decode` / :func:`kvjax.ops.dsa.sparse_mla_decode`. Reads only.

    ``tiles`` (static, defaults from :func:`kvjax.pallas.split_kv.default_tiles`): ``block_h`` query heads per
    program, ``block_n`` tokens per step (a dense walk reads contiguous rows when it divides the page size and
    gathers rows through the block table otherwise), warps, pipeline stages.
    """
    page_size = latent_pages.shape[1]
    topk = call.topk_indices
    tiles = default_tiles(call.q_latent.shape[1], page_size, topk is not None, tiles)
    if topk is not None:
        topk = pad_positions(topk, tiles.block_n)
    steps = (topk.shape[1] if topk is not None else call.block_tables.shape[-1] * page_size) // tiles.block_n
    q, qr, splits, stage_dtype = split_kv_inputs(call, dtype=latent_pages.dtype, block_h=tiles.block_h,
                                                 max_steps=steps)
    o, lse = _stage1_call(q, qr, latent_pages, call.block_tables[:, 0, :], call.seq_lens, topk, scale=call.scale,
                          num_splits=splits, block_h=tiles.block_h, block_n=tiles.block_n,
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages, interpret=interpret,
                          out_dtype=stage_dtype)
    return split_kv_output(o, lse, call)


def unsupported(
    call,  # kvjax.ops.mla.MLADecodeCall (dense or sparse)
    latent_pages: jax.Array,  # [P, page_size, R + r]
) -> str | None:
    """Backend-table check of :func:`mla_decode_pallas` (the call of ``mla_decode`` / ``sparse_mla_decode``):
    ``R`` and ``r`` powers of two >= 16, and the default step (:func:`kvjax.pallas.split_kv.default_tiles`: 32
    rows or a whole page; a sparse step gathers 64 listed rows, whatever the page size) a power of two >= 16;
    else the reason."""
    return tile_reason(call, latent_pages)
