"""Chunked gated delta rule (prefill / extend): Pallas kernels (Triton lowering) for the sequential part.

The token stream is cut into global chunks of ``C`` tokens (``C = 64``; 32 for float32 inputs) *without*
repacking the ragged batch: a chunk may hold the tail of one sequence and the head of the next, and every
intra-chunk quantity is masked to pairs of tokens of the same sequence ("segments"). Two stages:

1. :func:`kvjax.pallas.gdn.prep.prepare` (parallel over all chunks and heads; the state-independent
   part, fla's "WY" form, from the raw q / k): per segment cumulative log-decay ``gc``,
   ``T = (I + tril(beta k k^T decay, -1))^-1``, ``w = T (beta exp(gc) k)``, ``u = T (beta v)``, the causal
   intra-chunk scores ``A = (q k^T) * decay`` and per-token row factors ``qf = |q|^-1 scale exp(gc)``,
   ``kf = |k|^-1 exp(g_last - gc)`` (the l2norm folded in: no normalised copy of q / k exists).
2. ``_chunk_kernel`` (one program per (sequence row, value head, block of value columns)): walks
   the row's chunks in order with the state slice ``S: f32[K, block_v]`` in registers::

       v_new = u - w S;   o = (qf * q) S + A v_new;   S = exp(g_last) S + (kf * k)^T v_new

   reading the initial state from, and writing the final state to, a pool ``f32[R, Hv, K, V]`` at the row's
   index (aliased input -> output: in place under jit with a donated pool), with the ``rows`` / ``flags``
   convention of :mod:`kvjax.pallas.gdn.common`. Each program writes the outputs of its own sequence's
   tokens (masked stores); the first and last rows also zero the tokens outside every sequence.

Chunk parallelism (few long sequences: ``long_rows * Hv <= CP_MAX_HEAD_ROWS``, :func:`auto_segment_chunks`). The
sequential kernel then has too few programs for the GPU, so the stream is cut into segments of ``L`` chunks
(:func:`segment_layout`). Per chunk the state map is affine, ``S' = (exp(g_last) I - (kf k)^T w) S + (kf k)^T u``,
so per segment ``S_end = M S_start + B``. ``_transition_kernel`` computes ``[M | B]`` for every segment in parallel
(the same chunk recurrence on ``K + V`` columns from ``[I | 0]``, ``u = 0`` for the ``M`` columns),
``_scan_kernel`` chains the segments of each sequence into their start states, and the sequential kernel walks
all segments at once from those states (the benchmark's table "GDN chunked prefill, FlashQLA recipe" in
benchmarks/RESULTS.md says where it pays). The warm-up (``decay_floor``, default :data:`DECAY_FLOOR`): a token
maps a state by ``exp(g) (I - beta k k^T)``, of 2-norm at most ``exp(g) max(1, |1 - beta |k|^2|)``, so walking a
segment back from its end, once the chunks behind bound ``||M||`` below ``exp(decay_floor)`` the rest of the segment
cannot reach the next segment's start by more than that factor of a state: the transition kernel walks ``B`` from
zeros over those last chunks only and stores ``M = 0`` (FlashQLA's ``auto_cp`` skips such transitions too, at
``exp(-10)``). A gated head stops after a few chunks; an ungated one walks its whole segment, as before.

This fused sequential kernel replaced a two-pass form (fla's structure: a sequential state pass, then a fully
parallel output pass), which tied at one long sequence and lost at four (RESULTS.md, "GDN chunked prefill").
Loading chunk ``c + 1``'s operands before chunk ``c``'s update (a register prefetch) runs this kernel out of
registers, so it loads at the start of each step.

Any K and V: q / k / w rows are loaded as ``next_pow2(K)`` lanes, value blocks may overrun V, with masked loads
and stores (:mod:`kvjax.pallas.gdn.common`); at powers of two the code has no mask.

Matmul operands are in the input dtype (bf16 in serving: like fla, states are rounded to bf16 for the
tensor-core products and accumulate in f32); for float32 inputs every product takes three TF32 passes (about
f32 accuracy; full f32 in interpret mode: :func:`kvjax.pallas.gdn.common.f32_precision`), in chunks of 32 tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.base.device import is_pow2, next_pow2
from kvjax.base.ragged import count_le
from kvjax.pallas.gdn.common import (FLAG_HAS_INITIAL, FLAG_LIVE, col_block, dot, f32_precision,
                                     head_cols, load, on_initial_state, on_slot_pool, store, tile_mask)
from kvjax.pallas.gdn.prep import PrepConfig, padded_operands, prepare
from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call
from kvjax.pallas.gdn.prep_mgpu import shape_reason as prep_mgpu_shape_reason
from kvjax.pallas.gdn.seq_mgpu import seq_mgpu_fused_call

CHUNK = 64
MANY_PROGRAMS = 256  # block_v=None: the widest value block that still gives this many sequential programs
FLAG_MORE = 4  # segment flag (chunk parallelism): the segment is not its sequence's last
CP_MAX_HEAD_ROWS = 16  # segment_chunks=None: chunk parallelism when long rows * Hv is at most this ...
CP_MIN_SEGMENTS = 4  # ... and the padded stream holds at least this many segments
DECAY_FLOOR = -16.0  # the transition kernel's warm-up: drop M below exp(-16) = 1.1e-7 (float32's rounding)
# The scan kernel holds one segment's M (next_pow2(K)^2 values in the input dtype) in shared memory: Triton 3.6 for
# sm_90 gives it 262144 B at float32 K = 192, past a Hopper CTA's 227 KB (a GPU test failed there), 147456 B at bfloat16
# K = 192 and 65536 B at float32 K = 96. Chunk parallelism needs M within this many bytes.
CP_MAX_M_BYTES = 128 << 10


def cp_unsupported(kd: int, dtype) -> str | None:
    """Why chunk parallelism cannot run at key dim ``kd`` and input ``dtype`` (``None``: it can): the scan
    kernel's ``M`` tile, ``next_pow2(kd)^2`` values of ``dtype``, must fit :data:`CP_MAX_M_BYTES`."""
    nbytes = next_pow2(kd) ** 2 * jnp.dtype(dtype).itemsize
    if nbytes > CP_MAX_M_BYTES:
        return (f"K={kd} in {jnp.dtype(dtype).name}: the scan kernel's M tile would take {nbytes} bytes of shared "
                f"memory (> {CP_MAX_M_BYTES})")
    return None


def _row_range(cu_ref, flags_ref, n, num_seqs, num_rows: int):
    """Row n's tokens [start, end), the rows it writes [lo, hi) (the first/last rows also own the tokens
    outside every sequence, up to the padded length), whether it is live and whether it reads a state."""
    start, end = cu_ref[n], cu_ref[n + 1]
    flags = flags_ref[n]
    live = (flags & FLAG_LIVE) != 0
    read = live & ((flags & FLAG_HAS_INITIAL) != 0)
    lo = jnp.where(n == 0, 0, start)
    hi = jnp.where(n == num_seqs - 1, num_rows, end)
    return start, end, lo, hi, live, read


def _chunk_log_decay(gl_ref, c, h, start, end, live, chunk: int):
    """Scalar log state decay of chunk ``c`` for the row owning tokens ``[start, end)``: ``gl`` at any of its
    tokens in the chunk (one value per segment), or 0 when the row has no token there."""
    c0 = c * chunk
    any_in = live & (start < end) & (c0 < end) & (c0 + chunk > start)
    first = jnp.clip(jnp.maximum(start, c0) - c0, 0, chunk - 1)
    return jnp.where(any_in, gl_ref[c, h, first], 0.0)


def _chunk_decay(gl_ref, c, h, start, end, live, chunk: int):
    """Scalar state decay ``exp(gl)`` of chunk ``c`` for the row owning tokens ``[start, end)`` (1 when the row
    has no token there)."""
    return jnp.exp(_chunk_log_decay(gl_ref, c, h, start, end, live, chunk))


def _chunk_kernel(
    cu_ref,  # i32[N+1]
    rows_ref,  # i32[N]
    flags_ref,  # i32[N]
    q_ref,  # [Tp, Hk, K]  raw q
    k_ref,  # [Tp, Hk, K]  raw k
    w_ref,  # [NC, Hv, C, K]
    u_ref,  # [NC, Hv, C, V]
    a_ref,  # [NC, Hv, C, C]
    qf_ref,  # f32[NC, Hv, C]  q row factor |q|^-1 scale exp(gc)
    kf_ref,  # f32[NC, Hv, C]  k row factor |k|^-1 exp(gl - gc)
    gl_ref,  # f32[NC, Hv, C]  gc at the segment's last token in the chunk
    pool_in_ref,  # f32[R, Hv, K, V]  (aliased with pool_ref)
    o_ref,  # [Tp, Hv, V]
    pool_ref,  # f32[R, Hv, K, V]
    *,
    group: int,
    chunk: int,
    block_v: int,
    precision,
):
    """Program ``(n, h, vb)``: sequence row ``n``, value head ``h``, value block ``vb``."""
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs = pl.num_programs(0)
    hk = h // group
    kd, vd = pool_in_ref.shape[2], pool_in_ref.shape[3]
    kc, kmask = head_cols(kd)
    vs, vmask = col_block(vb, block_v, vd)
    kp = next_pow2(kd)
    start, end, lo, hi, live, read = _row_range(cu_ref, flags_ref, n, num_seqs, o_ref.shape[0])
    row = rows_ref[n]
    state_mask = tile_mask((kp, block_v), kmask, vmask)
    s0 = plt.load(
        pool_in_ref.at[row, h, kc, vs], mask=tile_mask((kp, block_v), kmask, vmask, jnp.full((kp, block_v), read)),
        other=0.0,
    )
    dt = w_ref.dtype
    mm = functools.partial(dot, precision=precision)
    idx = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    k_lanes = tile_mask((chunk, kp), None, kmask)  # bool[C, Kp] | None
    v_lanes = tile_mask((chunk, block_v), None, vmask)  # bool[C, block_v] | None

    def step(c, s):  # s: f32[Kp, block_v]
        rs = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        u, w = load(u_ref, (c, h, slice(None), vs), v_lanes), load(w_ref, (c, h, slice(None), kc), k_lanes)
        q, qf, a = load(q_ref, (rs, hk, kc), k_lanes), qf_ref[c, h, :], a_ref[c, h, :, :]
        k, kf = load(k_ref, (rs, hk, kc), k_lanes), kf_ref[c, h, :]
        decay = _chunk_decay(gl_ref, c, h, start, end, live, chunk)
        r = c * chunk + idx
        in_seq = (r >= start) & (r < end) & live
        own = (r >= lo) & (r < hi)
        sb = s.astype(dt)
        v_new = u.astype(jnp.float32) - mm(w, sb)
        v_new = jnp.where(in_seq[:, None], v_new, 0.0)
        vb_ = v_new.astype(dt)
        qg = (q.astype(jnp.float32) * qf[:, None]).astype(dt)
        o = mm(qg, sb) + mm(a, vb_)
        o = jnp.where(in_seq[:, None], o, 0.0)
        plt.store(o_ref.at[rs, h, vs], o.astype(o_ref.dtype), mask=tile_mask((chunk, block_v), None, vmask,
                                                                              own[:, None]))
        kg = (k.astype(jnp.float32) * jnp.where(in_seq, kf, 0.0)[:, None]).astype(dt)
        return s * decay + mm(kg, vb_, contract_a=0)

    s = lax.fori_loop(lo // chunk, (hi + chunk - 1) // chunk, step, s0)

    @pl.when(live)
    def _():
        store(pool_ref, (row, h, kc, vs), s, state_mask)


def _chunk_call(q, k, w, u, a, qf, kf, gl, pool, cu_seqlens, rows, flags, *, out_dtype, block_v, num_warps,
                num_stages, interpret):
    tp, hk, kd = q.shape
    nc, hv, chunk, vd = u.shape
    precision = f32_precision(interpret) if w.dtype == jnp.float32 else None
    kernel = functools.partial(
        _chunk_kernel, group=hv // hk, chunk=chunk, block_v=block_v, precision=precision
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((tp, hv, vd), out_dtype),
            jax.ShapeDtypeStruct(pool.shape, jnp.float32),
        ),
        grid=(rows.shape[0], hv, pl.cdiv(vd, block_v)),
        input_output_aliases={11: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_chunk",
    )(cu_seqlens, rows, flags, q, k, w, u, a, qf, kf, gl, pool)


# ---------------------------------------------------------------------------------------------------------
# Chunk parallelism: a long sequence cut into segments whose states are computed in parallel.
# ---------------------------------------------------------------------------------------------------------


def segment_layout(
    cu_seqlens: jax.Array,  # i32[N+1]
    rows: jax.Array,  # i32[N]
    flags: jax.Array,  # i32[N]
    *,
    num_tokens: int,
    segment_tokens: int,
):
    """Cut every sequence at the stream positions that are multiples of ``segment_tokens`` (a multiple of the
    chunk): ``P = N + ceil(num_tokens / segment_tokens) - 1`` segments (a static bound), in token order, each
    sequence's pieces back to back, an empty sequence one empty piece, unused slots empty at ``cu_seqlens[N]``.

    Returns ``seg_cu: i32[P+1]`` (piece ``i`` holds tokens ``[seg_cu[i], seg_cu[i+1])``), ``seg_flags: i32[P]``
    (its sequence's ``FLAG_LIVE | FLAG_HAS_INITIAL``, 0 for unused slots, ``| FLAG_MORE`` when a piece of the
    same sequence follows), ``first: i32[N]`` (each sequence's first piece) and ``last: i32[N]`` (its last)."""
    num_seqs = cu_seqlens.shape[0] - 1
    num_blocks = -(-num_tokens // segment_tokens)
    num_segs = num_seqs + num_blocks - 1
    s, e = cu_seqlens[:-1], cu_seqlens[1:]
    b0 = s // segment_tokens
    b1 = jnp.where(e > s, (e - 1) // segment_tokens, b0)
    cnt = b1 - b0 + 1  # i32[N] pieces per sequence (>= 1)
    cend = jnp.cumsum(cnt).astype(jnp.int32)
    cbeg = cend - cnt
    i = jnp.arange(num_segs, dtype=jnp.int32)
    seq = count_le(cend, i)  # i32[P]; N: unused slot
    pad = seq >= num_seqs
    sc = jnp.minimum(seq, num_seqs - 1)
    j = i - cbeg[sc]
    blk = b0[sc] + j
    tail = cu_seqlens[num_seqs]
    start = jnp.where(pad, tail, jnp.maximum(s[sc], blk * segment_tokens))
    seg_cu = jnp.concatenate([start, tail[None]]).astype(jnp.int32)
    more = ~pad & (j < cnt[sc] - 1)
    seg_flags = jnp.where(pad, 0, flags[sc]) | jnp.where(more, FLAG_MORE, 0)
    return seg_cu, seg_flags.astype(jnp.int32), cbeg, cend - 1


def _transition_kernel(
    cu_ref,  # i32[P+1]  segment token ranges
    flags_ref,  # i32[P]  segment flags (FLAG_MORE: compute)
    k_ref,  # [Tp, Hk, K]  raw k
    w_ref,  # [NC, Hv, C, K]
    u_ref,  # [NC, Hv, C, V]
    kf_ref,  # f32[NC, Hv, C]
    gl_ref,  # f32[NC, Hv, C]
    growth_ref,  # f32[NC, Hv]  log bound of the chunk's growth of a state besides its decay (chunk_growth);
    #              f32[1, 1] unread without the warm-up
    m_ref,  # [P, Hv, K, K]  out: segment transition M (input dtype)
    b_ref,  # f32[P, Hv, K, V]  out: at slot i + 1, segment i's state from zeros (B)
    *,
    group: int,
    chunk: int,
    block: int,
    num_k_blocks: int,
    decay_floor: float | None,
    precision,
):
    """Segment ``i``'s affine state map ``S_end = M S_start + B`` (segments with a successor, live): the
    chunk recurrence run on ``X = [M | B]`` from ``[I | 0]``, ``u = 0`` for the ``M`` columns; program
    ``(i, h, j)`` takes column block ``j`` of ``X`` (the first ``ceil(K / block)`` blocks are ``M``'s).

    ``decay_floor`` (log units, or ``None``: exact): the warm-up. Walking back from the segment's end, the first
    chunk ``c*`` where the chunks ``c*..end`` bound ``||M||`` below ``exp(decay_floor)`` (their log decays plus
    ``growth_ref``) ends the walk: ``B`` is the state from zeros at ``c*`` and ``M`` is stored as 0, so the start
    state of the next segment is off by at most ``exp(decay_floor)`` times the state at ``c*``."""
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    kd, vd = k_ref.shape[2], u_ref.shape[3]
    kc, kmask = head_cols(kd)
    kp = next_pow2(kd)
    is_m = j < num_k_blocks
    mcols, mmask = col_block(jnp.minimum(j, num_k_blocks - 1), block, kd)
    bcols, bmask = col_block(jnp.maximum(j - num_k_blocks, 0), block, vd)
    start, end = cu_ref[n], cu_ref[n + 1]
    flags = flags_ref[n]
    live = (flags & FLAG_LIVE) != 0
    work = live & ((flags & FLAG_MORE) != 0)
    dt = w_ref.dtype
    mm = functools.partial(dot, precision=precision)
    idx = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    k_lanes = tile_mask((chunk, kp), None, kmask)  # bool[C, Kp] | None
    u_lanes = tile_mask((chunk, block), None, bmask)  # bool[C, block] | None
    col0 = jnp.minimum(j, num_k_blocks - 1) * block
    eye = lax.broadcasted_iota(jnp.int32, (kp, block), 0) == col0 + lax.broadcasted_iota(jnp.int32, (kp, block), 1)
    x0 = jnp.where(is_m & eye, 1.0, 0.0).astype(jnp.float32)  # f32[Kp, block]

    def step(c, x):  # x: f32[Kp, block]
        rs = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        u = load(u_ref, (c, h, slice(None), bcols), u_lanes).astype(jnp.float32)
        u = jnp.where(is_m, 0.0, u)
        w = load(w_ref, (c, h, slice(None), kc), k_lanes)
        k, kf = load(k_ref, (rs, hk, kc), k_lanes), kf_ref[c, h, :]
        decay = _chunk_decay(gl_ref, c, h, start, end, live, chunk)
        r = c * chunk + idx
        in_seq = (r >= start) & (r < end)
        v_new = jnp.where(in_seq[:, None], u - mm(w, x.astype(dt)), 0.0)
        kg = (k.astype(jnp.float32) * jnp.where(in_seq, kf, 0.0)[:, None]).astype(dt)
        return x * decay + mm(kg, v_new.astype(dt), contract_a=0)

    c_lo = jnp.where(work, start // chunk, 0)
    c_hi = jnp.where(work, (end + chunk - 1) // chunk, 0)
    if decay_floor is not None:  # the warm-up: the chunks whose bound on ||M|| stays above exp(decay_floor)
        def log_bound(c):
            return _chunk_log_decay(gl_ref, c, h, start, end, live, chunk) + growth_ref[c, h]

        c_star, acc = lax.while_loop(lambda ca: (ca[0] > c_lo) & (ca[1] >= decay_floor),
                                     lambda ca: (ca[0] - 1, ca[1] + log_bound(ca[0] - 1)),
                                     (c_hi, jnp.float32(0.0)))
        cut = acc < decay_floor  # M below the floor: stored as 0; B from zeros at c_star
        x0 = jnp.where(cut, 0.0, x0)
        c_lo = jnp.where(cut, jnp.where(is_m, c_hi, c_star), c_lo)
    x = lax.fori_loop(c_lo, c_hi, step, x0)

    @pl.when(work & is_m)
    def _():
        store(m_ref, (n, h, kc, mcols), x.astype(m_ref.dtype), tile_mask((kp, block), kmask, mmask))

    @pl.when(work & jnp.logical_not(is_m))
    def _():
        store(b_ref, (n + 1, h, kc, bcols), x, tile_mask((kp, block), kmask, bmask))


def _scan_kernel(
    first_ref,  # i32[N]  each sequence's first segment
    last_ref,  # i32[N]  its last segment
    rows_ref,  # i32[N]
    flags_ref,  # i32[N]
    m_ref,  # [P, Hv, K, K]
    pool_ref,  # f32[R, Hv, K, V]  read: initial states
    b_in_ref,  # f32[P, Hv, K, V]  (aliased with s_ref)
    s_ref,  # f32[P, Hv, K, V]  out: each segment's start state
    *,
    block_v: int,
    precision,
):
    """Start states of the segments, in order along each sequence: ``S_first = initial`` (or zeros) and
    ``S_{i+1} = M_i S_i + B_i``, in place over the ``B`` buffer (slot ``i + 1`` holds ``B_i``)."""
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kd, vd = pool_ref.shape[2], pool_ref.shape[3]
    kc, kmask = head_cols(kd)
    vs, vmask = col_block(vb, block_v, vd)
    kp = next_pow2(kd)
    flags = flags_ref[n]
    live = (flags & FLAG_LIVE) != 0
    read = live & ((flags & FLAG_HAS_INITIAL) != 0)
    first, last = first_ref[n], last_ref[n]
    state_mask = tile_mask((kp, block_v), kmask, vmask)
    s0 = plt.load(pool_ref.at[rows_ref[n], h, kc, vs],
                  mask=tile_mask((kp, block_v), kmask, vmask, jnp.full((kp, block_v), read)), other=0.0)
    m_mask = tile_mask((kp, kp), kmask, kmask)
    dt = m_ref.dtype
    mm = functools.partial(dot, precision=precision)

    @pl.when(live)
    def _():
        store(s_ref, (first, h, kc, vs), s0, state_mask)

    def step(i, s):  # s: f32[Kp, block_v]
        m = load(m_ref, (i, h, kc, kc), m_mask)
        s = mm(m, s.astype(dt)) + load(b_in_ref, (i + 1, h, kc, vs), state_mask)
        store(s_ref, (i + 1, h, kc, vs), s, state_mask)
        return s

    lax.fori_loop(first, jnp.where(live, last, first), step, s0)


def chunk_growth(
    k: jax.Array,  # [Tp, Hk, K]  raw k, padded to the chunks
    beta: jax.Array,  # [T, Hv]
    *,
    chunk: int,
    use_qk_l2norm: bool,
) -> jax.Array:  # f32[Tp / chunk, Hv]
    """Per chunk and value head, a log bound on how much the chunk's tokens can grow a state besides their decay:
    ``sum_t log max(1, |1 - beta_t |k_t|^2|)`` (the 2-norm of ``I - beta k k^T``), with ``|k|^2 <= 1`` taken as 1
    under ``use_qk_l2norm`` (then ``log max(1, |1 - beta|)``). 0 for ``beta`` in ``[0, 2]`` and unit keys (Qwen3.5:
    sigmoid ``beta``, l2-normalised keys). Tokens past ``beta``'s end count 0. The warm-up of
    :func:`_transition_kernel` adds it to the chunks' log decays."""
    tp, hk, _ = k.shape
    hv = beta.shape[1]
    b = jnp.pad(beta.astype(jnp.float32), ((0, tp - beta.shape[0]), (0, 0)))  # f32[Tp, Hv]
    if use_qk_l2norm:
        norm2 = jnp.ones((tp, hv), jnp.float32)
    else:
        norm2 = jnp.repeat(jnp.sum(jnp.square(k.astype(jnp.float32)), axis=-1), hv // hk, axis=1)  # f32[Tp, Hv]
    grow = jnp.log(jnp.maximum(1.0, jnp.abs(1.0 - b * norm2)))
    return jnp.sum(grow.reshape(tp // chunk, chunk, hv), axis=1)


def _cp_call(q, k, w, u, a, qf, kf, gl, growth, pool, cu_seqlens, rows, flags, *, segment_chunks, out_dtype,
             block_v, transition_block, scan_block, decay_floor, num_warps, num_stages, interpret):
    """The sequential part with chunk parallelism: transition kernel (every segment's ``M``, ``B``; the warm-up
    below ``decay_floor``), scan kernel (every segment's start state), the sequential kernel over segments, the
    final states to the pool."""
    tp, hk, kd = q.shape
    nc, hv, chunk, vd = u.shape
    num_seqs = rows.shape[0]
    dt = w.dtype
    precision = f32_precision(interpret) if dt == jnp.float32 else None
    seg_cu, seg_flags, first, last = segment_layout(cu_seqlens, rows, flags, num_tokens=tp,
                                                    segment_tokens=segment_chunks * chunk)
    num_segs = seg_flags.shape[0]
    if transition_block is None:
        transition_block = 64 if num_segs * hv * (pl.cdiv(kd, 64) + pl.cdiv(vd, 64)) >= 2 * MANY_PROGRAMS else 32
    tb = min(transition_block, next_pow2(max(kd, vd)))
    nbk = pl.cdiv(kd, tb)
    m, b = pl.pallas_call(
        functools.partial(_transition_kernel, group=hv // hk, chunk=chunk, block=tb, num_k_blocks=nbk,
                          decay_floor=decay_floor, precision=precision),
        out_shape=(jax.ShapeDtypeStruct((num_segs, hv, kd, kd), dt),
                   jax.ShapeDtypeStruct((num_segs, hv, kd, vd), jnp.float32)),
        grid=(num_segs, hv, nbk + pl.cdiv(vd, tb)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_chunk_transition",
    )(seg_cu, seg_flags, k, w, u, kf, gl, growth)
    sb = min(scan_block, next_pow2(vd))
    starts = pl.pallas_call(
        functools.partial(_scan_kernel, block_v=sb, precision=precision),
        out_shape=jax.ShapeDtypeStruct((num_segs, hv, kd, vd), jnp.float32),
        grid=(num_seqs, hv, pl.cdiv(vd, sb)),
        input_output_aliases={6: 0},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_scan",
    )(first, last, rows, flags, m, pool, b)
    seg_live = (seg_flags & FLAG_LIVE) != 0
    seg_flags = jnp.where(seg_live, FLAG_LIVE | FLAG_HAS_INITIAL, 0).astype(jnp.int32)
    o, ends = _chunk_call(q, k, w, u, a, qf, kf, gl, starts, seg_cu, jnp.arange(num_segs, dtype=jnp.int32),
                          seg_flags, out_dtype=out_dtype, block_v=block_v, num_warps=num_warps,
                          num_stages=num_stages, interpret=interpret)
    live = (flags & FLAG_LIVE) != 0
    pool = pool.at[jnp.where(live, rows, pool.shape[0])].set(ends[last], mode="drop")
    return o, pool


def _fused_call(q, k, v, g, beta, pool, cu_seqlens, rows, flags, *, scale, use_qk_l2norm, value_heads, block_v,
                interpret):
    """FlashQLA's layout (``seq="fused"``): ``prep_mgpu_call(outputs="inverse")`` (``Tb``, ``A``, row factors; no
    ``w`` / ``u``) and ``seq_mgpu_fused_call`` (``v_new = Tb (v - kr * (k S))`` from raw v); the padding and
    segment ids of :func:`kvjax.pallas.gdn.prep.padded_operands`."""
    seg, qp, kp, vp, gp, bp = padded_operands(q, k, v, g, beta, cu_seqlens, CHUNK)
    tb, a, rowf = prep_mgpu_call(seg, qp, kp, vp, gp, bp, chunk=CHUNK, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                 value_heads=value_heads, outputs="inverse", interpret=interpret)
    return seq_mgpu_fused_call(qp, kp, vp, tb, a, rowf, pool, cu_seqlens, rows, flags,
                               out_dtype=v.dtype, block_v=block_v, interpret=interpret)


def auto_segment_chunks(num_rows: int, hv: int, num_chunks: int) -> int:
    """``segment_chunks=None``: 0 (no chunk parallelism) unless the stream holds at least ``CP_MIN_SEGMENTS``
    segments and its long rows leave the sequential kernel few programs (``long_rows * Hv <= CP_MAX_HEAD_ROWS``);
    the segment length is the power of two near ``sqrt(2 * num_chunks)`` chunks (at least 8), which balances the
    two segment walks against the scan over segments.

    ``long_rows``: the most rows that can each hold ``CP_MIN_SEGMENTS`` segments, ``min(num_rows, num_chunks //
    (CP_MIN_SEGMENTS * L))`` (at least 1). The row count is a static bound (the engine pads its rows to a bucket)
    and says nothing of how the tokens are spread, so the rule takes the case that sets the walk's length: the
    stream in as few long rows as it can fill. The engine's chunked-prefill step is that case (one prompt chunk of
    ~2044 tokens beside decode rows in a bucket of 16 rows: chunk parallelism 1.45x the sequential pass at 4 / 8
    heads); where the rows really are short and even (16 rows of 128 tokens) it costs 1.7x (their states copied
    through the segment starts; an H200, benchmarks/RESULTS.md "GDN prefill in the engine's steps")."""
    seg = max(8, next_pow2(int((2 * num_chunks) ** 0.5 * 0.75)))
    long_rows = max(1, min(num_rows, num_chunks // (CP_MIN_SEGMENTS * seg)))
    if long_rows * hv > CP_MAX_HEAD_ROWS or num_chunks < CP_MIN_SEGMENTS * seg:
        return 0
    return seg


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm", "block_v", "num_warps", "num_stages", "prep", "segment_chunks",
                     "transition_block", "scan_block", "decay_floor", "seq", "interpret"),
    donate_argnames=("pool",),
)
def chunk_gated_delta_rule_pool(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    pool: jax.Array,  # f32[R, Hv, K, V]  donated, updated in place
    *,
    cu_seqlens: jax.Array,  # i32[N+1]
    rows: jax.Array,  # i32[N]
    flags: jax.Array,  # i32[N]  FLAG_HAS_INITIAL | FLAG_LIVE
    scale: float,
    use_qk_l2norm: bool = False,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    prep: PrepConfig = PrepConfig(),
    segment_chunks: int | None = None,
    transition_block: int | None = None,
    scan_block: int = 32,
    decay_floor: float | None = DECAY_FLOOR,
    seq: str = "triton",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V] in v's dtype, pool f32[R, Hv, K, V])
    """Chunked gated delta rule reading/writing states in ``pool`` at ``rows``; returns ``(o, pool)``.

    ``prep``: how the preparation kernel runs (:class:`kvjax.pallas.gdn.prep.PrepConfig`: warps, the inverse's
    operand dtype).

    ``block_v=None`` picks the widest value block (64, 32, 16) that still gives >= 256 programs: the
    sequential kernel has only ``N * Hv * V / block_v`` programs and is latency-bound when they are few.
    Any K and V: the kernels pad them to power-of-two blocks and mask (:mod:`kvjax.pallas.gdn.common`).
    Float32 inputs take 3xTF32 products (``common.f32_precision``), chunks of 32 tokens and ``num_stages=1``
    (``num_stages=None``: 1 for float32 inputs, 2 otherwise): 3xTF32 operands are staged in shared memory, and at
    K=192 64-token chunks with 2 stages would need more of it than a Hopper thread block has.

    ``segment_chunks`` (chunk parallelism, for few long sequences): cut the stream into segments of this many
    chunks; a transition kernel computes every segment's affine state map ``S_end = M S_start + B`` in
    parallel (``transition_block`` columns of ``[M | B]`` per program; ``None``: 64 where that still gives
    ``2 * MANY_PROGRAMS`` programs, else 32), a scan kernel chains them into each
    segment's start state (``scan_block`` value columns per program), and the sequential kernel walks all
    segments in parallel; the final states reach the pool by one scatter. ``None``: :func:`auto_segment_chunks`
    (0 where :func:`cp_unsupported`: float32 at K > 128; a positive count there is a ``ValueError``); 0: off (the
    sequential kernel walks each sequence whole, in place on the pool). ``decay_floor`` (log units; default
    :data:`DECAY_FLOOR`; ``None``: exact): the transition kernel's warm-up, which stops a segment's walk where the
    chunks after it bound ``||M||`` below ``exp(decay_floor)`` (their decays and :func:`chunk_growth`) and drops
    ``M``; each segment's start state is then off by at most that factor times a state inside the previous segment.

    ``seq``: the sequential kernel, ``"triton"`` (``_chunk_kernel``, after the preparation ``prep`` names) or
    ``"fused"`` (FlashQLA's layout: the Mosaic GPU preparation with ``outputs="inverse"`` and the fused Mosaic GPU
    pass of :mod:`kvjax.pallas.gdn.seq_mgpu`, :func:`_fused_call`; Hopper, bf16; ``block_v=None`` is that pass's own
    pick, ``num_warps`` and ``num_stages`` are the Triton kernels' only, ``prep`` gives only its ``value_heads``; no
    chunk parallelism: ``segment_chunks`` must be ``None`` or 0).
    """
    if seq not in ("triton", "fused"):
        raise ValueError(f"seq must be 'triton' or 'fused', got {seq!r}")
    if decay_floor is not None and (isinstance(decay_floor, bool) or not isinstance(decay_floor, (int, float))
                                    or not -math.inf < decay_floor < 0):
        raise ValueError(f"decay_floor must be None or a finite negative float (log units), got {decay_floor!r}")
    if seq == "fused":
        if segment_chunks:
            raise ValueError(f"seq='fused' has no chunk parallelism: segment_chunks must be None or 0, got "
                             f"{segment_chunks}")
        o, pool = _fused_call(q, k, v, g, beta, pool, cu_seqlens, rows, flags, scale=scale,
                              use_qk_l2norm=use_qk_l2norm, value_heads=prep.value_heads, block_v=block_v,
                              interpret=interpret)
        return o[:q.shape[0]], pool
    num_tokens, _, kd = q.shape
    no_cp = cp_unsupported(kd, q.dtype)
    if segment_chunks and no_cp:
        raise ValueError(f"segment_chunks={segment_chunks}: no chunk parallelism at {no_cp}")
    f32 = q.dtype == jnp.float32
    chunk = CHUNK // 2 if f32 else CHUNK
    if num_stages is None:
        num_stages = 1 if f32 else 2
    hv, vd = v.shape[1], v.shape[2]
    block_v_auto = block_v is None
    if block_v is None:
        block_v = next((b for b in (64, 32) if rows.shape[0] * hv * pl.cdiv(vd, b) >= MANY_PROGRAMS), 16)
    block_v = min(block_v, next_pow2(vd))
    if not is_pow2(block_v):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    qp, kp, w, u, a, qf, kf, gl = prepare(
        q, k, v, g, beta, cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk=chunk,
        config=prep, interpret=interpret,
    )
    if segment_chunks is None:
        segment_chunks = 0 if no_cp else auto_segment_chunks(rows.shape[0], hv, w.shape[0])
    if segment_chunks:
        if block_v_auto:
            num_segs = rows.shape[0] + pl.cdiv(w.shape[0], segment_chunks) - 1
            block_v = min(next((b for b in (64, 32) if num_segs * hv * pl.cdiv(vd, b) >= MANY_PROGRAMS), 16),
                          next_pow2(vd))
        growth = (jnp.zeros((1, 1), jnp.float32) if decay_floor is None  # unread without the warm-up
                  else chunk_growth(kp, beta, chunk=chunk, use_qk_l2norm=use_qk_l2norm))
        o, pool = _cp_call(
            qp, kp, w, u, a, qf, kf, gl, growth, pool, cu_seqlens, rows, flags, segment_chunks=segment_chunks,
            out_dtype=v.dtype, block_v=block_v, transition_block=transition_block, scan_block=scan_block,
            decay_floor=decay_floor, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        )
    else:
        o, pool = _chunk_call(
            qp, kp, w, u, a, qf, kf, gl, pool, cu_seqlens, rows, flags, out_dtype=v.dtype, block_v=block_v,
            num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        )
    return o[:num_tokens], pool


chunk_gated_delta_rule_pallas = on_initial_state(
    chunk_gated_delta_rule_pool,
    """Kernel of ``kvjax.ops.chunk_gated_delta_rule`` (backend ``"pallas"``): ``(o: [T, Hv, V], final: f32[N, Hv,
    K, V])``.""")

gdn_prefill_pool_pallas = on_slot_pool(
    chunk_gated_delta_rule_pool,
    """Backend ``"pallas"`` of ``gdn_prefill_pool``: the chunked kernels on the flattened slot pool.""")

_with_mosaic_prep = functools.partial(chunk_gated_delta_rule_pool, prep=PrepConfig(kernel="mosaic"))

chunk_gated_delta_rule_mosaic_prep = on_initial_state(
    _with_mosaic_prep,
    """Backend ``"mosaic"`` of ``kvjax.ops.chunk_gated_delta_rule``: the ``"pallas"`` kernels with the Mosaic GPU
    (wgmma) preparation kernel, :mod:`kvjax.pallas.gdn.prep_mgpu` (the calls :func:`mosaic_prep_unsupported`
    accepts).""")

gdn_prefill_pool_mosaic_prep = on_slot_pool(
    _with_mosaic_prep,
    """Backend ``"mosaic"`` of ``gdn_prefill_pool``: :data:`gdn_prefill_pool_pallas` with the Mosaic GPU preparation
    kernel.""")


_with_mosaic_fused = functools.partial(chunk_gated_delta_rule_pool, seq="fused")

chunk_gated_delta_rule_mosaic_fused = on_initial_state(
    _with_mosaic_fused,
    """Backend ``"mosaic-fused"`` of ``kvjax.ops.chunk_gated_delta_rule``: FlashQLA's layout, the Mosaic GPU
    preparation without ``w`` / ``u`` and the fused Mosaic GPU sequential pass (``seq="fused"``), for the calls
    :func:`mosaic_prep_unsupported` accepts (``auto``: those :func:`mosaic_fused_preferred` also accepts).""")

gdn_prefill_pool_mosaic_fused = on_slot_pool(
    _with_mosaic_fused,
    """Backend ``"mosaic-fused"`` of ``gdn_prefill_pool``: the pool kernel in FlashQLA's layout (``seq="fused"``).""")


def mosaic_prep_unsupported(call, state) -> str | None:  # a DeltaRuleCall and its initial state / pool's ssm
    """Why the ``"mosaic"`` and ``"mosaic-fused"`` backends cannot take a call, or ``None``: the shapes the Mosaic GPU
    preparation kernel takes (:func:`kvjax.pallas.gdn.prep_mgpu.shape_reason`: bf16 q / k / v, K and V of 64 or 128,
    few value heads per key head). Every call it accepts fits the fused Mosaic GPU sequential pass too (bf16, K and V
    of 64 or 128, chunks of 64): :func:`mosaic_fused_preferred` says where ``auto`` takes that one."""
    del state
    return prep_mgpu_shape_reason(call.q, call.k, call.v, chunk=CHUNK)


# "auto" takes the "mosaic-fused" backends (FlashQLA's layout; no chunk parallelism) wherever they were measured ahead
# of "mosaic" (the Mosaic preparation with the Triton pass, chunk-parallel where its own rule says): HISTORY run 248
# (H200, `benchmarks/gdn.py rule`, 29 shapes of 1 to 16 equal sequences of 512 to 32768 tokens and 8 to 32 value heads):
# 1.01-1.85x at every shape but one sequence of 8 value heads and 8192 tokens (0.81x: 0.2098 against 0.1703 ms), where
# eight (sequence, head) pairs leave most SMs to chunk parallelism. Hence: one sequence of at least
# MOSAIC_FUSED_NARROW_HEADS value heads or at most MOSAIC_FUSED_SHORT_TOKENS tokens; several sequences of at least
# MOSAIC_FUSED_MIN_TOKENS tokens on average (static shapes: T / N). Below that average are the engine's
# chunked-prefill steps (one long chunk among a bucket of short rows, or a bucket of short rows), which were measured
# either way ("mosaic" against "mosaic-fused", run 249, 2048 tokens: one chunk among padding rows 0.1117 against
# 0.1289 ms at 16 rows of 8 heads, 0.3151 against 0.3059 at 64 rows of 32; even rows 0.0704 against 0.0413 at 16 x
# 128, 0.2587 against 0.3342 at 64 x 32), so they keep "mosaic", as before. RESULTS.md, "GDN chunked prefill".
MOSAIC_FUSED_NARROW_HEADS = 16
MOSAIC_FUSED_SHORT_TOKENS = 2048
MOSAIC_FUSED_MIN_TOKENS = 512


def mosaic_fused_preferred(call, state) -> str | None:  # a DeltaRuleCall and its initial state / pool's ssm
    """The ``"mosaic-fused"`` backends' ``prefer`` rule (``auto`` only; by name they take every call
    :func:`mosaic_prep_unsupported` accepts): why ``auto`` passes them over, or ``None`` where they were measured
    fastest: one sequence (``cu_seqlens`` of two entries; ``None`` is one token per row) of at least
    :data:`MOSAIC_FUSED_NARROW_HEADS` value heads or at most :data:`MOSAIC_FUSED_SHORT_TOKENS` tokens, or several
    sequences of at least :data:`MOSAIC_FUSED_MIN_TOKENS` tokens a sequence on average (static shapes: ``T / N``)."""
    del state
    num_seqs = call.q.shape[0] if call.cu_seqlens is None else call.cu_seqlens.shape[0] - 1
    hv, tokens = call.v.shape[1], call.q.shape[0]
    if num_seqs == 1:
        if hv >= MOSAIC_FUSED_NARROW_HEADS or tokens <= MOSAIC_FUSED_SHORT_TOKENS:
            return None
        return (f"one sequence of fewer than {MOSAIC_FUSED_NARROW_HEADS} value heads and more than "
                f"{MOSAIC_FUSED_SHORT_TOKENS} tokens is faster chunk-parallel (measured), got {hv} value heads, "
                f"{tokens} tokens")
    if tokens >= MOSAIC_FUSED_MIN_TOKENS * num_seqs:
        return None
    return (f"several sequences need >= {MOSAIC_FUSED_MIN_TOKENS} tokens a sequence on average (the engine's "
            f"chunked-prefill buckets, measured either way, keep 'mosaic'), got {num_seqs} sequences, {tokens} tokens")
