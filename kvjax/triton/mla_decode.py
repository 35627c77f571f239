"""Split-KV MLA decode as a hand-written Triton kernel, called from JAX through jax-triton.

The same algorithm as :mod:`kvjax.pallas.mla.decode` (one program per head group, KV split and sequence;
``block_n`` latent rows per step, contiguous within a page or gathered through the block table, each read
once; f32 split outputs + lse merged by the shared host side :func:`kvjax.pallas.split_kv.split_kv_inputs` /
:func:`~kvjax.pallas.split_kv.split_kv_output`), written directly in Triton so the benchmark can compare the
Pallas lowering against it on one GPU, with the same tile defaults. A registered backend of :func:`kvjax.ops.mla.mla_decode` (``impl="triton"``) that ``auto`` never
takes: on Hopper the Mosaic GPU kernel beats it above 16 heads and the Pallas kernel ties or beats it at 16
(RESULTS.md, "MLA decode"); elsewhere it was not measured.

``jax_triton`` and ``triton`` are optional dependencies (the ``triton`` extra): :func:`unsupported` names them
when they are missing; this module imports them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl

from kvjax.pallas.split_kv import STATIC_ARGNAMES, Tiles, default_tiles, split_kv_inputs, split_kv_output


@triton.jit
def _mla_stage1_kernel(
    q_ptr,  # [B, Hp, R]
    qr_ptr,  # [B, Hp, r]
    lat_ptr,  # [P, PS, R + r]
    bt_ptr,  # i32[B, 1, MAX_BLOCKS]
    lens_ptr,  # i32[B]
    o_ptr,  # [B, S, Hp, R]
    lse_ptr,  # f32[B, S, Hp]
    SCALE: tl.constexpr,
    HP: tl.constexpr,
    R: tl.constexpr,
    ROPE: tl.constexpr,
    PS: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    offs_h = g * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, R)
    offs_e = tl.arange(0, ROPE)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(q_ptr + (b * HP + offs_h)[:, None] * R + offs_r[None, :])
    qr = tl.load(qr_ptr + (b * HP + offs_h)[:, None] * ROPE + offs_e[None, :])
    seq_len = tl.load(lens_ptr + b)
    n_steps = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_steps, NUM_SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, n_steps)

    acc = tl.zeros((BLOCK_H, R), dtype=tl.float32)
    m = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(start, end):
        pos = j * BLOCK_N + offs_n
        in_seq = pos < seq_len
        if PS % BLOCK_N == 0:  # one page per step: a scalar page id, contiguous rows
            page = tl.load(bt_ptr + b * MAX_BLOCKS + (j * BLOCK_N) // PS)
            valid = in_seq & (page >= 0)
            row0 = (j * BLOCK_N) % PS
            row = lat_ptr + tl.maximum(page, 0).to(tl.int64) * (PS * (R + ROPE)) + (row0 + offs_n) * (R + ROPE)
        else:  # rows gathered across pages
            page = tl.load(bt_ptr + b * MAX_BLOCKS + tl.minimum(pos // PS, MAX_BLOCKS - 1), mask=in_seq, other=-1)
            valid = in_seq & (page >= 0)
            row = lat_ptr + tl.maximum(page, 0).to(tl.int64) * (PS * (R + ROPE)) + (pos % PS) * (R + ROPE)
        kv = tl.load(row[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
        kr = tl.load(row[:, None] + R + offs_e[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kv)) + tl.dot(qr, tl.trans(kr))
        s = tl.where(valid[None, :], s * (SCALE * 1.4426950408889634), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m = m_new

    has = l > 0.0
    safe_l = tl.where(has, l, 1.0)
    out_row = (b * NUM_SPLITS + split) * HP + offs_h
    tl.store(o_ptr + out_row[:, None] * R + offs_r[None, :], (acc / safe_l[:, None]).to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + out_row, tl.where(has, (m + tl.log2(safe_l)) * 0.6931471805599453, float("-inf")))


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
def mla_decode_triton(
    call,  # kvjax.ops.mla.MLADecodeCall (dense): q_latent [B, H, R], q_rope [B, H, r],
    #        block_tables i32[B, 1, max_blocks], seq_lens i32[B]; static scale, num_kv_splits
    latent_pages: jax.Array,  # [P, page_size, R + r]
    *,
    tiles: Tiles = Tiles(),
    interpret: bool = False,
) -> jax.Array:
    """Split-KV MLA decode in Triton (GPU only). Returns ``o: [B, H, R]`` in ``q_latent``'s dtype."""
    if interpret:
        raise ValueError("the Triton MLA kernel has no interpret mode; use impl='interpret' (Pallas)")
    b, h, rank = call.q_latent.shape
    _, page_size, _ = latent_pages.shape
    tiles = default_tiles(h, page_size, chosen=tiles)
    max_blocks = call.block_tables.shape[-1]

    def stage1(q, qr, num_splits, out_dtype):
        hp = q.shape[1]
        return jt.triton_call(
            q, qr, latent_pages, call.block_tables, call.seq_lens,
            kernel=_mla_stage1_kernel,
            out_shape=[
                jax.ShapeDtypeStruct((b, num_splits, hp, rank), out_dtype),
                jax.ShapeDtypeStruct((b, num_splits, hp), jnp.float32),
            ],
            grid=(hp // tiles.block_h, num_splits, b),
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            SCALE=call.scale, HP=hp, R=rank, ROPE=call.q_rope.shape[-1], PS=page_size, MAX_BLOCKS=max_blocks,
            NUM_SPLITS=num_splits, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
        )

    q, qr, splits, stage_dtype = split_kv_inputs(call, dtype=latent_pages.dtype, block_h=tiles.block_h,
                                                 max_steps=max_blocks * page_size // tiles.block_n)
    return split_kv_output(*stage1(q, qr, splits, stage_dtype), call)
