"""DSA sparse MLA decode over the fp8 ``key`` cache roles (Pallas, Triton lowering).

The split-KV sparse path of :mod:`kvjax.pallas.mla.decode`, reading the DSA roles directly instead of a bf16
latent: ``key f8e4m3[P, page_size, R]``, ``key_scale f32[P, page_size, R // w]`` (one scale per ``w``
consecutive values, ``w = 128``) and ``key_rope bf16[P, page_size, r]``. One program per (head group, KV
split, sequence) walks its share of the ``K`` listed positions ``block_n`` at a time, gathering those rows
through the block table. The fp8 bytes are decoded to bf16 exactly (see :mod:`kvjax.pallas.mla.dsa_indexer`) and
the scales are applied outside the products, so the dequantisation adds no rounding:

- logits ``= Σ_g s_g · (q_g · k_gᵀ) + q_rope · k_ropeᵀ`` (bf16 operands, f32 accumulation);
- output group ``g`` accumulates ``(p · s_g) · k_g`` with ``p`` the base-2 online-softmax weights rounded to
  bf16 (as the bf16 kernel does), one ``[block_h, w]`` f32 accumulator per group.

Positions ``< 0`` or ``>= seq_lens`` and holes are masked (their bytes are never loaded). The host side (head
padding, split choice, merge) is :func:`kvjax.pallas.split_kv.split_kv_inputs` /
:func:`~kvjax.pallas.split_kv.split_kv_output`; the split's steps, the row gather, the online-softmax step and the
``pallas_call`` layout are those of the bf16 kernel (:mod:`kvjax.pallas.mla.common`).

Against the jnp reference path of :func:`kvjax.ops.dsa.sparse_mla_decode_fp8` it is faster at 16 heads and ties
or trails at 128 (RESULTS.md, "DSA sparse decode"): :func:`unsupported`, the backend table's check, therefore
declines more than 16 heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.base.device import is_pow2
from kvjax.pallas.mla.dsa_indexer import decode_e4m3_bits
from kvjax.pallas.mla.common import gather_rows, softmax_step, split_steps, stage1_layout
from kvjax.pallas.split_kv import (LN2, MASK_INIT, STATIC_ARGNAMES, Tiles, default_tiles, pad_positions,
                                   split_kv_inputs, split_kv_output)

MAX_HEADS = 16  # more heads: not faster than the jnp path (module doc)


def _sparse_fp8_kernel(
    tables_ref,  # i32[B, max_blocks] (whole array)
    lens_ref,  # i32[B] (whole array)
    topk_ref,  # i32[B, K] (whole array)
    q_ref,  # bf16[block_h, R]
    qr_ref,  # bf16[block_h, r]
    key_ref,  # u8[P, page_size, R] e4m3fn bit patterns (whole array)
    kscale_ref,  # f32[P, page_size, G] (whole array)
    rope_ref,  # bf16[P, page_size, r] (whole array)
    o_ref,  # [block_h, R] split output (f32, or the final dtype with one split)
    lse_ref,  # f32[block_h]
    *,
    scale: float,
    num_splits: int,
    block_n: int,
):
    split, b = pl.program_id(1), pl.program_id(2)
    page_size, rank = key_ref.shape[1], key_ref.shape[2]
    groups = kscale_ref.shape[2]
    width = rank // groups
    block_h, rope = qr_ref.shape

    seq_len = lens_ref[b]
    start, end = split_steps(topk_ref.shape[1] // block_n, split, num_splits)

    qs = [q_ref[:, pl.ds(g * width, width)] for g in range(groups)]
    qr = qr_ref[...]
    cols = jnp.arange(width, dtype=jnp.int32)
    rcols = jnp.arange(rope, dtype=jnp.int32)
    gcols = jnp.arange(groups, dtype=jnp.int32)

    def body(j, carry):
        accs, m, l = carry[:groups], carry[groups], carry[groups + 1]
        pos = topk_ref[b, pl.ds(j * block_n, block_n)]
        page, off, valid = gather_rows(tables_ref, b, pos, seq_len, page_size)
        kr = plgpu.load(rope_ref.at[page, off, rcols[None, :]],
                        mask=jnp.broadcast_to(valid[:, None], (block_n, rope)), other=0.0)
        sc = plgpu.load(kscale_ref.at[page, off, gcols[None, :]],
                        mask=jnp.broadcast_to(valid[:, None], (block_n, groups)), other=0.0)  # f32[block_n, G]
        s = plgpu.dot(qr, kr.astype(jnp.bfloat16), trans_b=True)  # f32[block_h, block_n]
        kmask = jnp.broadcast_to(valid[:, None], (block_n, width))
        tiles = []
        for g in range(groups):
            kg = plgpu.load(key_ref.at[page, off, (g * width + cols)[None, :]], mask=kmask, other=0)
            kg = decode_e4m3_bits(kg).astype(jnp.bfloat16)  # exact
            sg = jnp.sum(jnp.where(gcols[None, :] == g, sc, 0.0), axis=1)  # f32[block_n]
            s += plgpu.dot(qs[g], kg, trans_b=True) * sg[None, :]
            tiles.append((kg, sg))
        p, alpha, m_new, l = softmax_step(s, valid, m, l, scale)
        accs = tuple(acc * alpha[:, None] + plgpu.dot((p * sg[None, :]).astype(jnp.bfloat16), kg)
                     for acc, (kg, sg) in zip(accs, tiles))
        return (*accs, m_new, l)

    init = tuple(jnp.zeros((block_h, width), jnp.float32) for _ in range(groups)) + (
        jnp.full((block_h,), MASK_INIT, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    out = jax.lax.fori_loop(start, end, body, init)
    m, l = out[groups], out[groups + 1]
    has = l > 0.0
    safe_l = jnp.where(has, l, 1.0)
    for g in range(groups):
        o_ref[:, pl.ds(g * width, width)] = (out[g] / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)  # natural-log lse


def _sparse_fp8_call(q, qr, key, kscale, krope, tables, lens, topk, *, scale, num_splits, block_h, block_n,
                     num_warps, num_stages, out_dtype, interpret):
    b, h, rank = q.shape
    kernel = functools.partial(_sparse_fp8_kernel, scale=scale, num_splits=num_splits, block_n=block_n)
    grid, query_specs, out_specs, out_shape = stage1_layout(b, h, rank, qr.shape[-1], block_h=block_h,
                                                            num_splits=num_splits, out_dtype=out_dtype)
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole, whole, whole] + query_specs + [whole, whole, whole],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="dsa_sparse_decode_fp8_stage1",
    )(tables, lens, topk, q, qr, key, kscale, krope)


def _tile_limits(key, key_scale, q_rope) -> str | None:
    """Why the kernel cannot take these roles (fp8 keys, scale-group and rope widths powers of two >= 16)."""
    if key.dtype != jnp.float8_e4m3fn:
        return f"key must be float8_e4m3fn, got {key.dtype}"
    width, rope = key.shape[-1] // key_scale.shape[-1], q_rope.shape[-1]
    if not (is_pow2(width) and width >= 16 and is_pow2(rope) and rope >= 16):
        return (f"R // scales = {key.shape[-1]} // {key_scale.shape[-1]} and rope width {rope} must be powers of "
                f"two >= 16")
    return None


def unsupported(
    call,  # kvjax.ops.mla.MLADecodeCall (sparse): q_latent [B, H, R], q_rope [B, H, r], ...
    key: jax.Array,  # [P, page_size, R]
    key_scale: jax.Array,  # f32[P, page_size, R // w]
    key_rope: jax.Array,  # bf16[P, page_size, r]
) -> str | None:
    """The backend table's check of :func:`kvjax.ops.dsa.sparse_mla_decode_fp8`'s call: :func:`_tile_limits`,
    and more than ``MAX_HEADS`` heads declined (not faster than the jnp path there)."""
    del key_rope
    why = _tile_limits(key, key_scale, call.q_rope)
    if why:
        return why
    if call.q_latent.shape[1] > MAX_HEADS:
        return (f"H = {call.q_latent.shape[1]} > {MAX_HEADS} heads: not faster than the jnp path there "
                f"(RESULTS.md, DSA sparse decode)")
    return None


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
def sparse_mla_decode_fp8_pallas(
    call,  # kvjax.ops.mla.MLADecodeCall: q_latent [B, H, R], q_rope [B, H, r], block_tables i32[B, 1, max_blocks],
    #        seq_lens i32[B], topk_indices i32[B, K] (-1 = none); static scale, num_kv_splits
    key: jax.Array,  # f8e4m3[P, page_size, R]
    key_scale: jax.Array,  # f32[P, page_size, R // w]
    key_rope: jax.Array,  # bf16[P, page_size, r]
    *,
    tiles: Tiles = Tiles(),
    interpret: bool = False,
) -> jax.Array:
    """Sparse MLA decode over the DSA fp8 key roles (see module doc). Returns ``o: [B, H, R]`` in
    ``q_latent``'s dtype; a row with no selected position gives 0.

    ``tiles`` default to :func:`kvjax.pallas.split_kv.default_tiles` (sparse). Needs fp8 ``key``, a scale-group
    width ``R // G`` and a rope width that are powers of two >= 16; raises ``ValueError`` otherwise.
    """
    why = _tile_limits(key, key_scale, call.q_rope)
    if why:
        raise ValueError(f"sparse_mla_decode_fp8_pallas: {why}")
    tiles = default_tiles(call.q_latent.shape[1], key.shape[1], True, tiles)
    topk = pad_positions(call.topk_indices, tiles.block_n)
    keys = jax.lax.bitcast_convert_type(key, jnp.uint8)  # decoded in-kernel (see dsa_indexer)
    q, qr, splits, stage_dtype = split_kv_inputs(call, dtype=jnp.bfloat16, block_h=tiles.block_h,
                                                 max_steps=topk.shape[1] // tiles.block_n,
                                                 out_dtype=call.q_latent.dtype)
    o, lse = _sparse_fp8_call(q, qr, keys, key_scale.astype(jnp.float32), key_rope, call.block_tables[:, 0, :],
                              call.seq_lens, topk, scale=call.scale, num_splits=splits, block_h=tiles.block_h,
                              block_n=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                              out_dtype=stage_dtype, interpret=interpret)
    return split_kv_output(o, lse, call)
