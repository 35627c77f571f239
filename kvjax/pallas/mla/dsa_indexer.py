"""DSA lightning-indexer scores over the paged fp8 indexer cache (Pallas, Triton lowering).

Computes ``score[t, j] = scale · Σ_h w[t, h] · relu(q[t, h] · k[j])`` for every key position ``j`` of token
``t``'s sequence, ``-inf`` where ``j`` is past the token's position, its page is a hole (``-1``), or ``t`` is a
padding token. Same result as :func:`kvjax.ops.dsa.indexer_scores_reference`.

Tiling: one program per (query token, chunk of ``pages_per_program`` pages). The program loads the token's
queries ``[Hi, Di]`` once, then for each page of the chunk reads the page's fp8 keys ``[page_size, Di]``
(contiguous) and their scales, decodes the fp8 bytes to bf16 in registers (exact: e4m3 has 3 mantissa bits,
bf16 has 7), and computes ``q · kᵀ`` as one ``[Hi, page_size]`` tensor-core product per 128-value scale group
(**bf16 operands, f32 accumulation**; the reference is f32, so the only rounding is of ``q`` to bf16). The
group's scale multiplies the product's columns (``Σ_g s_g · (q_g · k_g)``), then relu, the weighted sum over
heads, and ``scale``. Pages that are holes, past the token's position, or belong to a padding token are
never loaded (the program writes ``-inf``).

Bytes: ``T · L · (Di + 4 · Di/128)`` key bytes (a decode batch reads each key once; several tokens of one
sequence re-read its pages, mostly from L2). FLOPs: ``2 · T · L · Hi · Di``.

fp8 decoding: the keys are loaded as uint8 (a free bitcast view outside the kernel) and each value is rebuilt
as ``f16(((x & 0x7f) << 7) | ((x & 0x80) << 8)) · 256`` (exact for every finite e4m3fn value, subnormals
included). Loading float8_e4m3fn directly and casting in-kernel fails to lower with jax 0.11.2 (Pallas
Triton casts the masked load's integer fill value to fp8: ``cannot cast ... i32 to f8E4M3FN``). Non-fp8 float
keys are cast to bf16 (f32 keys then lose precision): :func:`unsupported`, the backend table's check, declines
them, so ``impl="auto"`` keeps the f32 reference for them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.base.device import is_pow2, num_sms
from kvjax.base.ragged import token_rows


def decode_e4m3_bits(x: jax.Array) -> jax.Array:  # u8[...] -> f32[...]
    """uint8 e4m3fn bit patterns -> f32 values (exact; NaN patterns are never written by the quantiser)."""
    x16 = x.astype(jnp.uint16)
    bits = ((x16 & 0x7F) << 7) | ((x16 & 0x80) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32) * 256.0


def _indexer_kernel(
    rows_ref,  # i32[T] batch row of each token (whole array)
    pos_ref,  # i32[T] position of each token; -1 for padding tokens (whole array)
    tables_ref,  # i32[B, max_blocks] (whole array)
    q_ref,  # bf16[Hp, Di] this token's queries
    w_ref,  # f32[Hp] this token's head weights (0 on padded heads)
    k_ref,  # u8 / f8e4m3 / float [P, page_size, Di] (whole array)
    s_ref,  # f32[P, page_size, G] (whole array)
    o_ref,  # f32[pages_per_program * page_size] this chunk's scores
    *,
    scale: float,
    pages_per_program: int,
    fp8_bits: bool,  # k_ref holds e4m3fn bit patterns as uint8
):
    c, t = pl.program_id(0), pl.program_id(1)
    page_size, di = k_ref.shape[1], k_ref.shape[2]
    groups = s_ref.shape[2]
    width = di // groups
    max_blocks = tables_ref.shape[1]
    hp = q_ref.shape[0]
    row, pos = rows_ref[t], pos_ref[t]
    offs = jnp.arange(page_size, dtype=jnp.int32)
    w = w_ref[...]

    for j in range(pages_per_program):
        blk = c * pages_per_program + j
        first = blk * page_size
        page = tables_ref[row, jnp.minimum(blk, max_blocks - 1)]
        live = (blk < max_blocks) & (page >= 0) & (first <= pos)
        out = pl.ds(j * page_size, page_size)

        @pl.when(live)
        def _(first=first, page=page, out=out):
            visible = first + offs <= pos  # bool[page_size]
            kmask = jnp.broadcast_to(visible[:, None], (page_size, width))
            acc = jnp.zeros((hp, page_size), jnp.float32)
            for g in range(groups):
                kg = plgpu.load(k_ref.at[page, :, pl.ds(g * width, width)], mask=kmask, other=0)
                kg = (decode_e4m3_bits(kg) if fp8_bits else kg).astype(jnp.bfloat16)
                sg = plgpu.load(s_ref.at[page, :, jnp.int32(g)], mask=visible, other=0.0)  # f32[page_size]
                qg = q_ref[:, pl.ds(g * width, width)] if groups > 1 else q_ref[...]
                acc += plgpu.dot(qg, kg, trans_b=True) * sg[None, :]
            score = jnp.sum(w[:, None] * jnp.maximum(acc, 0.0), axis=0) * scale
            o_ref[out] = jnp.where(visible, score, -jnp.inf)

        @pl.when(jnp.logical_not(live))
        def _(out=out):
            o_ref[out] = jnp.full((page_size,), -jnp.inf, jnp.float32)


def _indexer_call(rows, pos, tables, q, w, keys, scales, *, scale, pages_per_program, fp8_bits, num_warps,
                  num_stages, interpret):
    t, hp, di = q.shape
    page_size = keys.shape[1]
    chunks = pl.cdiv(tables.shape[1], pages_per_program)
    width = pages_per_program * page_size
    kernel = functools.partial(_indexer_kernel, scale=scale, pages_per_program=pages_per_program,
                               fp8_bits=fp8_bits)
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=(chunks, t),
        in_specs=[
            whole, whole, whole,
            pl.BlockSpec((None, hp, di), lambda c, i: (i, 0, 0)),
            pl.BlockSpec((None, hp), lambda c, i: (i, 0)),
            whole, whole,
        ],
        out_specs=pl.BlockSpec((None, width), lambda c, i: (i, c)),
        out_shape=jax.ShapeDtypeStruct((t, chunks * width), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="dsa_indexer_scores",
    )(rows, pos, tables, q, w, keys, scales)


def default_pages_per_program(num_tokens: int, max_blocks: int, num_sms: int = 132) -> int:
    """Pages per program: up to 8 (queries loaded once per 8 pages) while keeping >= 2 programs per SM."""
    ppp = 8
    while ppp > 1 and num_tokens * -(-max_blocks // ppp) < 2 * num_sms:
        ppp //= 2
    return ppp


def _tile_limits(index_k, index_scale) -> str | None:
    """Why the Triton tiles cannot take these keys (page size and scale-group width powers of two >= 16)."""
    page_size, di = index_k.shape[1], index_k.shape[-1]
    groups = 1 if index_scale is None else index_scale.shape[-1]
    if not is_pow2(page_size) or page_size < 16:
        return f"a power-of-two page_size >= 16, got {page_size}"
    if not is_pow2(di // groups) or di // groups < 16:
        return f"Di // scales = {di} // {groups} to be a power of two >= 16"
    return None


def unsupported(
    call,  # kvjax.ops.dsa.IndexerCall: q [T, Hi, Di], weights f32[T, Hi], ...
    index_k: jax.Array,  # [P, page_size, Di]
    index_scale: jax.Array | None,  # f32[P, page_size, G] | None
) -> str | None:
    """The backend table's check of :func:`kvjax.ops.dsa.indexer_scores`'s call: fp8 keys (other float keys
    would be rounded to bf16; the reference keeps them in f32) and :func:`_tile_limits`."""
    del call
    if index_k.dtype != jnp.float8_e4m3fn:
        return f"float8_e4m3fn keys (it rounds other keys to bf16), got {index_k.dtype}"
    why = _tile_limits(index_k, index_scale)
    return None if why is None else f"needs {why}"


@functools.partial(jax.jit, static_argnames=("pages_per_program", "num_warps", "num_stages", "interpret"))
def indexer_scores_pallas(
    call,  # kvjax.ops.dsa.IndexerCall: q [T, Hi, Di] roped indexer queries, weights f32[T, Hi],
    #        block_tables i32[B, 1, max_blocks], seq_lens i32[B], cu_seqlens i32[B+1]; static scale
    index_k: jax.Array,  # f8e4m3 (or float) [P, page_size, Di]
    index_scale: jax.Array | None,  # f32[P, page_size, Di // block] | None
    *,
    pages_per_program: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Indexer scores ``f32[T, max_blocks * page_size]`` (see module doc); ``-inf`` where not visible.

    Needs ``page_size`` and ``Di // G`` (``G`` scales per token) to be powers of two >= 16; raises
    ``ValueError`` otherwise. ``pages_per_program`` defaults to :func:`default_pages_per_program`.
    """
    t, hi, di = call.q.shape
    page_size = index_k.shape[1]
    why = _tile_limits(index_k, index_scale)
    if why:
        raise ValueError(f"indexer kernel needs {why}")
    if index_scale is None:
        index_scale = jnp.ones(index_k.shape[:2] + (1,), jnp.float32)
    tables = call.block_tables[:, 0, :]
    max_blocks = tables.shape[1]
    ppp = pages_per_program or default_pages_per_program(t, max_blocks, num_sms())

    cu_seqlens = call.cu_seqlens
    tok = jnp.arange(t, dtype=jnp.int32)
    rows = token_rows(cu_seqlens, t)
    pos = call.seq_lens[rows] - (cu_seqlens[rows + 1] - tok)
    pos = jnp.where(tok < cu_seqlens[-1], pos, -1).astype(jnp.int32)

    hp = max(16, 1 << (hi - 1).bit_length())
    qb = jnp.pad(call.q.astype(jnp.bfloat16), ((0, 0), (0, hp - hi), (0, 0)))
    w = jnp.pad(call.weights.astype(jnp.float32), ((0, 0), (0, hp - hi)))
    fp8_bits = index_k.dtype == jnp.float8_e4m3fn
    keys = jax.lax.bitcast_convert_type(index_k, jnp.uint8) if fp8_bits else index_k
    out = _indexer_call(rows.astype(jnp.int32), pos, tables, qb, w, keys, index_scale.astype(jnp.float32),
                        scale=call.scale, pages_per_program=ppp, fp8_bits=fp8_bits, num_warps=num_warps,
                        num_stages=num_stages, interpret=interpret)
    length = max_blocks * page_size
    return out if out.shape[1] == length else out[:, :length]
