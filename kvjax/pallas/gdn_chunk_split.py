"""Two-pass ("split") form of the chunked gated delta rule (fla's structure): a sequential state pass, then a
fully parallel output pass over every (sequence, chunk) pair. ``chunk_gated_delta_rule_pool(form="split")``;
on an H200 it tied with the fused kernel of :mod:`kvjax.pallas.gdn_chunk` at one long prompt and was slower at
four (benchmarks/RESULTS.md), so the fused form is the default. The shared helpers of both forms live here.

Pair ``p = c + n`` is chunk ``c`` of sequence row ``n`` (unique: a row's chunks are consecutive, and row
``n + 1`` starts at most at row ``n``'s last chunk); ``_pair_table`` gives the row of each pair (-1 unused).
The state pass stores the state before every pair (``h: [NC+N, Hv, K, V]``, in the input dtype) and
``v_new = u - w S`` per token, and updates ``S <- exp(g_last) S + (kf k)^T v_new``; with ``prefetch`` the
next chunk's operands are loaded before the current update. The output pass computes
``o = (qf q) h + A v_new``.

Both read the initial state from, and write the final state to, the pool at the row's index, like
:mod:`kvjax.pallas.gdn_chunk` (same ``rows`` / ``flags`` convention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.base.ragged import count_le
from kvjax.pallas.gdn_chunk_prep import _dot
from kvjax.pallas.gdn_recurrent import FLAG_HAS_INITIAL, FLAG_LIVE


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


def _chunk_decay(gl_ref, c, h, start, end, live, chunk: int):
    """Scalar state decay of chunk ``c`` for the row owning tokens ``[start, end)``: ``exp(gl)`` at any of
    its tokens in the chunk (one value per segment), or 1 when the row has no token there."""
    c0 = c * chunk
    any_in = live & (start < end) & (c0 < end) & (c0 + chunk > start)
    first = jnp.clip(jnp.maximum(start, c0) - c0, 0, chunk - 1)
    return jnp.where(any_in, jnp.exp(gl_ref[c, h, first]), 1.0)


def _walk_chunks(c_lo, c_hi, num_chunks: int, load, step, s0, prefetch: bool):
    """``s = step(c, s, load(c))`` for the chunks ``c`` in ``[c_lo, c_hi)``. With ``prefetch`` the loads of
    chunk ``c + 1`` are issued before chunk ``c``'s update and carried in registers, so their latency overlaps
    the update instead of adding to every sequential step."""
    if not prefetch:
        return lax.fori_loop(c_lo, c_hi, lambda c, s: step(c, s, load(c)), s0)
    last = jnp.clip(c_hi - 1, 0, num_chunks - 1)

    def body(c, carry):
        s, cur = carry
        nxt = load(jnp.minimum(c + 1, last))
        return step(c, s, cur), nxt

    return lax.fori_loop(c_lo, c_hi, body, (s0, load(jnp.minimum(c_lo, last))))[0]



def _chunk_state_kernel(
    cu_ref,  # i32[N+1]
    rows_ref,  # i32[N]
    flags_ref,  # i32[N]
    k_ref,  # [Tp, Hk, K]  raw k
    w_ref,  # [NC, Hv, C, K]
    u_ref,  # [NC, Hv, C, V]
    kf_ref,  # f32[NC, Hv, C]  k row factor
    gl_ref,  # f32[NC, Hv, C]
    pool_in_ref,  # f32[R, Hv, K, V]  (aliased with pool_ref)
    h_ref,  # [NC+N, Hv, K, V]  state before chunk c of sequence n, at pair index c + n
    vn_ref,  # [Tp, Hv, V]  v_new per token
    pool_ref,  # f32[R, Hv, K, V]
    *,
    group: int,
    chunk: int,
    block_v: int,
    precision,
    prefetch: bool,
):
    """Split form, pass 1 (sequential): the state recurrence and ``v_new``; outputs come from pass 2."""
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    vs = pl.ds(pl.multiple_of(vb * block_v, block_v), block_v)
    start, end, lo, hi, live, read = _row_range(cu_ref, flags_ref, n, pl.num_programs(0), vn_ref.shape[0])
    row = rows_ref[n]
    kd = pool_in_ref.shape[2]
    s0 = plt.load(pool_in_ref.at[row, h, :, vs], mask=jnp.full((kd, block_v), read), other=0.0)
    dt = w_ref.dtype
    dot = functools.partial(_dot, precision=precision)
    idx = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    def load(c):
        rs = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        return (u_ref[c, h, :, vs], w_ref[c, h, :, :], k_ref[rs, hk, :], kf_ref[c, h, :],
                _chunk_decay(gl_ref, c, h, start, end, live, chunk))

    def step(c, s, loaded):  # s: f32[K, block_v]
        u, w, k, kf, decay = loaded
        r = c * chunk + idx
        in_seq = (r >= start) & (r < end) & live
        own = (r >= lo) & (r < hi)
        rs = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        sb = s.astype(dt)
        h_ref[c + n, h, :, vs] = sb
        v_new = u.astype(jnp.float32) - dot(w, sb)
        vb_ = jnp.where(in_seq[:, None], v_new, 0.0).astype(dt)
        plt.store(vn_ref.at[rs, h, vs], vb_, mask=own[:, None])
        kg = (k.astype(jnp.float32) * jnp.where(in_seq, kf, 0.0)[:, None]).astype(dt)
        return s * decay + dot(kg, vb_, contract_a=0)

    s = _walk_chunks(lo // chunk, (hi + chunk - 1) // chunk, u_ref.shape[0], load, step, s0, prefetch)

    @pl.when(live)
    def _():
        pool_ref[row, h, :, vs] = s


def _pair_rows(cu_ref, flags_ref, n, c, chunk: int, num_seqs: int, num_rows: int):
    """Tokens of chunk ``c`` that belong to row ``n`` (``in_seq``) and that it writes (``own``): bool[C]."""
    start, end, lo, hi, live, _ = _row_range(cu_ref, flags_ref, n, num_seqs, num_rows)
    r = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    return (r >= start) & (r < end) & live, (r >= lo) & (r < hi)


def _chunk_out_kernel(
    cu_ref,  # i32[N+1]
    flags_ref,  # i32[N]
    pair_ref,  # i32[NC+N]  sequence of each (sequence, chunk) pair, -1 = unused
    q_ref,  # [Tp, Hk, K]  raw q
    a_ref,  # [NC, Hv, C, C]
    qf_ref,  # f32[NC, Hv, C]  q row factor
    h_ref,  # [NC+N, Hv, K, V]
    vn_ref,  # [Tp, Hv, V]
    o_ref,  # [Tp, Hv, V]
    *,
    group: int,
    chunk: int,
    block_v: int,
    precision,
):
    """Pass 2 (parallel over pairs): ``o = (qf q) h + A v_new`` for the pair's own rows."""
    p, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n = pair_ref[p]

    @pl.when(n >= 0)
    def _():
        c = p - n
        hk = h // group
        vs = pl.ds(pl.multiple_of(vb * block_v, block_v), block_v)
        in_seq, own = _pair_rows(cu_ref, flags_ref, n, c, chunk, flags_ref.shape[0], o_ref.shape[0])
        rs = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        dt = a_ref.dtype
        hs = h_ref[p, h, :, vs]
        vn = vn_ref[rs, h, vs]
        qg = (q_ref[rs, hk, :].astype(jnp.float32) * qf_ref[c, h, :][:, None]).astype(dt)
        o = _dot(qg, hs, precision=precision) + _dot(a_ref[c, h, :, :], vn, precision=precision)
        o = jnp.where(in_seq[:, None], o, 0.0)
        plt.store(o_ref.at[rs, h, vs], o.astype(o_ref.dtype), mask=own[:, None])


def _pair_table(cu_seqlens, num_chunks: int, chunk: int):
    """i32[NC+N]: the sequence of (sequence n, chunk c) pair ``c + n`` (unique, see _chunk_state_kernel), -1 unused."""
    num_seqs = cu_seqlens.shape[0] - 1
    tp = num_chunks * chunk
    lo = cu_seqlens[:-1].at[0].set(0)
    hi = cu_seqlens[1:].at[-1].set(tp)
    seq = jnp.arange(num_seqs, dtype=jnp.int32)
    first, stop = lo // chunk + seq, (hi + chunk - 1) // chunk + seq
    pair = jnp.arange(num_chunks + num_seqs, dtype=jnp.int32)
    n = count_le(first, pair) - 1
    ok = (n >= 0) & (pair < stop[jnp.clip(n, 0, num_seqs - 1)])
    return jnp.where(ok, n, -1)


def _chunk_call_split(q, k, w, u, a, qf, kf, gl, pool, cu_seqlens, rows, flags, *, out_dtype, block_v,
                      out_block_v, num_warps, num_stages, prefetch, interpret):
    tp, hk, kd = q.shape
    nc, hv, chunk, vd = u.shape
    num_seqs = rows.shape[0]
    dt = w.dtype
    precision = lax.Precision.HIGHEST if dt == jnp.float32 else None
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    pairs = _pair_table(cu_seqlens, nc, chunk)
    group = hv // hk
    h_shape = jax.ShapeDtypeStruct((nc + num_seqs, hv, kd, vd), dt)
    pool_shape = jax.ShapeDtypeStruct(pool.shape, jnp.float32)
    h, vn, pool = pl.pallas_call(
        functools.partial(_chunk_state_kernel, group=group, chunk=chunk, block_v=block_v, precision=precision,
                          prefetch=prefetch),
        out_shape=(h_shape, jax.ShapeDtypeStruct((tp, hv, vd), dt), pool_shape),
        grid=(num_seqs, hv, vd // block_v),
        input_output_aliases={8: 2},
        compiler_params=params,
        interpret=interpret,
        name="gdn_chunk_state",
    )(cu_seqlens, rows, flags, k, w, u, kf, gl, pool)
    o = pl.pallas_call(
        functools.partial(_chunk_out_kernel, group=group, chunk=chunk, block_v=out_block_v, precision=precision),
        out_shape=jax.ShapeDtypeStruct((tp, hv, vd), out_dtype),
        grid=(nc + num_seqs, hv, vd // out_block_v),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_out",
    )(cu_seqlens, flags, pairs, q, a, qf, h, vn)
    return o, pool
