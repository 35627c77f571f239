"""Chunked gated delta rule (prefill / extend) as a Pallas kernel (Triton lowering) plus a parallel XLA stage.

The token stream is cut into global chunks of ``C`` tokens (``C = 64``) *without* repacking the ragged batch:
a chunk may hold the tail of one sequence and the head of the next, and every intra-chunk quantity is masked
to pairs of tokens of the same sequence ("segments"). Two stages:

1. ``_prepare`` (XLA, parallel over all chunks and heads; the state-independent part, fla's "WY" form):
   per segment cumulative log-decay ``gc``, ``T = (I + tril(beta k k^T * decay, -1))^-1``,
   ``w = T (beta exp(gc) k)``, ``u = T (beta v)`` and the causal intra-chunk scores ``A = (q k^T) * decay``.
2. ``_chunk_kernel`` (Pallas, one program per (sequence row, value head, block of value columns)): walks the
   row's chunks in order with the state slice ``S: f32[K, block_v]`` in registers::

       v_new = u - w S;   o = (q * exp(gc)) S + A v_new;   S = exp(g_last) S + (k * exp(g_last - gc))^T v_new

   reading the initial state from, and writing the final state to, a pool ``f32[R, Hv, K, V]`` at the row's
   index (aliased input -> output: in place under jit with a donated pool), exactly like
   :mod:`kvjax.pallas.gdn_recurrent` (same ``rows`` / ``flags`` convention). Each program writes the outputs
   of its own sequence's tokens (masked stores); the first and last rows also zero the tokens outside every
   sequence.

Matmul operands are in the input dtype (bf16 in serving: like fla, states are rounded to bf16 for the
tensor-core products and accumulate in f32); for float32 inputs every product runs at full f32 precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.pallas.gdn_recurrent import FLAG_HAS_INITIAL, FLAG_LIVE, L2NORM_EPS, _check_pow2

CHUNK = 64


def _dot(a, b, *, precision, contract_a: int = 1):
    """``a @ b`` (or ``a.T @ b`` with ``contract_a=0``) with float32 accumulation (``pl.dot`` left jax 0.11)."""
    dims = (((contract_a,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _dot_t(a, b, *, precision):
    """``a @ b.T`` with float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)

SUB = 16  # diagonal block size of the in-kernel inverse


def _prep_kernel(
    seg_ref,  # i32[Tp]  sequence id per token, -1 outside every sequence
    q_ref,  # [Tp, Hk, K]  (l2-normed, scaled)
    k_ref,  # [Tp, Hk, K]  (l2-normed)
    v_ref,  # [Tp, Hv, V]
    gc_ref,  # f32[NC, Hv, C]
    b_ref,  # f32[NC, Hv, C]  beta (0 outside every sequence)
    w_ref,  # [NC, Hv, C, K]
    u_ref,  # [NC, Hv, C, V]
    a_ref,  # [NC, Hv, C, C]
    *,
    group: int,
    chunk: int,
    precision,
    inv_precision,
):
    """One (chunk, value head): ``L``, ``T = (I + L)^-1``, ``w``, ``u`` and ``A`` with whole-chunk matmuls.

    The inverse needs no row loop and no slicing: with ``D`` the 16x16 block diagonal of ``L`` and ``E`` the
    rest, ``I + L = (I + D)(I + F)`` with ``F = (I + D)^-1 E``; ``D`` is nilpotent of order 16 and ``F`` of
    order ``C / 16``, so both inverses are finite products ``(I - X)(I + X^2)(I + X^4)...`` (10 matmuls).
    """
    c, h = pl.program_id(0), pl.program_id(1)
    hk = h // group
    dt = w_ref.dtype
    dot = functools.partial(_dot, precision=precision)
    if inv_precision == "bf16":  # one bf16 pass per product of the inverse (bf16 operands, f32 accumulation)
        def mm(a, b):
            return _dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), precision=None)
    else:
        mm = functools.partial(_dot, precision=inv_precision)
    full = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    seg = seg_ref[full]
    gc = gc_ref[c, h, :]
    beta = b_ref[c, h, :]
    k = k_ref[full, hk, :]
    ri = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    ci = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    keep = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0) & (ri >= ci)
    decay = jnp.exp(jnp.where(keep, gc[:, None] - gc[None, :], -jnp.inf))  # f32[C, C]
    a_ref[c, h, :, :] = (_dot_t(q_ref[full, hk, :], k, precision=precision) * decay).astype(dt)
    lmat = jnp.where(ri > ci, _dot_t(k, k, precision=precision) * decay, 0.0) * beta[:, None]
    eye = (ri == ci).astype(jnp.float32)
    diag = (ri // SUB) == (ci // SUB)
    power = -jnp.where(diag, lmat, 0.0)
    inv_d = eye + power
    for _ in range(int(np.log2(SUB)) - 1):
        power = mm(power, power)
        inv_d = inv_d + mm(inv_d, power)
    power = -mm(inv_d, jnp.where(diag, 0.0, lmat))  # -F
    inv_f = eye + power
    for _ in range(int(np.log2(chunk // SUB)) - 1):
        power = mm(power, power)
        inv_f = inv_f + mm(inv_f, power)
    tinv = mm(inv_f, inv_d).astype(dt)
    kb = (k.astype(jnp.float32) * (beta * jnp.exp(gc))[:, None]).astype(dt)
    w_ref[c, h, :, :] = dot(tinv, kb).astype(dt)
    vb = (v_ref[full, h, :].astype(jnp.float32) * beta[:, None]).astype(dt)
    u_ref[c, h, :, :] = dot(tinv, vb).astype(dt)


def _prep_call(seg, qn, kn, v, gc, bch, *, num_warps, inverse_dtype, interpret):
    tp, hk, kd = qn.shape
    nc, hv, chunk = gc.shape
    vd = v.shape[2]
    dt = qn.dtype
    precision = lax.Precision.HIGHEST if dt == jnp.float32 else None
    # products of the inverse: full f32 for f32 inputs; for bf16 inputs one TF32 pass (full f32 in interpret
    # mode, where TF32 does not exist) or one bf16 pass (T is rounded to bf16 right after, as in fla)
    if dt == jnp.float32:
        inv_precision = lax.Precision.HIGHEST
    elif inverse_dtype == "bf16":
        inv_precision = "bf16"
    else:
        inv_precision = lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32
    kernel = functools.partial(_prep_kernel, group=hv // hk, chunk=chunk, precision=precision,
                               inv_precision=inv_precision)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((nc, hv, chunk, kd), dt),
            jax.ShapeDtypeStruct((nc, hv, chunk, vd), dt),
            jax.ShapeDtypeStruct((nc, hv, chunk, chunk), dt),
        ),
        grid=(nc, hv),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_prep",
    )(seg, qn, kn, v, gc, bch)


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


def _chunk_kernel(
    cu_ref,  # i32[N+1]
    rows_ref,  # i32[N]
    flags_ref,  # i32[N]
    q_ref,  # [Tp, Hk, K]  (l2-normed, scaled)
    k_ref,  # [Tp, Hk, K]  (l2-normed)
    w_ref,  # [NC, Hv, C, K]
    u_ref,  # [NC, Hv, C, V]
    a_ref,  # [NC, Hv, C, C]
    gc_ref,  # f32[NC, Hv, C]  per-segment cumulative log-decay
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
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs = pl.num_programs(0)
    hk = h // group
    vs = pl.ds(pl.multiple_of(vb * block_v, block_v), block_v)
    start, end, lo, hi, live, read = _row_range(cu_ref, flags_ref, n, num_seqs, o_ref.shape[0])
    row = rows_ref[n]
    kd = pool_in_ref.shape[2]
    s0 = plt.load(
        pool_in_ref.at[row, h, :, vs], mask=jnp.full((kd, block_v), read), other=0.0
    )
    dt = w_ref.dtype
    dot = functools.partial(_dot, precision=precision)
    idx = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    def body(c, s):  # s: f32[K, block_v]
        r = c * chunk + idx
        in_seq = (r >= start) & (r < end) & live
        own = (r >= lo) & (r < hi)
        rs = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        gc = gc_ref[c, h, :]
        gl = gl_ref[c, h, :]
        sb = s.astype(dt)
        v_new = u_ref[c, h, :, vs].astype(jnp.float32) - dot(w_ref[c, h, :, :], sb)
        v_new = jnp.where(in_seq[:, None], v_new, 0.0)
        vb_ = v_new.astype(dt)
        qg = (q_ref[rs, hk, :].astype(jnp.float32) * jnp.exp(gc)[:, None]).astype(dt)
        o = dot(qg, sb) + dot(a_ref[c, h, :, :], vb_)
        o = jnp.where(in_seq[:, None], o, 0.0)
        plt.store(o_ref.at[rs, h, vs], o.astype(o_ref.dtype), mask=own[:, None])
        any_in = jnp.sum(in_seq.astype(jnp.int32)) > 0
        g_last = jnp.max(jnp.where(in_seq, gl, -jnp.inf))
        d_last = jnp.where(any_in, jnp.exp(g_last), 1.0)
        kdec = jnp.exp(jnp.where(in_seq, gl - gc, -jnp.inf))
        kg = (k_ref[rs, hk, :].astype(jnp.float32) * kdec[:, None]).astype(dt)
        return s * d_last + dot(kg, vb_, contract_a=0)

    s = lax.fori_loop(lo // chunk, (hi + chunk - 1) // chunk, body, s0)

    @pl.when(live)
    def _():
        pool_ref[row, h, :, vs] = s


def _chunk_call(qn, kn, w, u, a, gc, gl, pool, cu_seqlens, rows, flags, *, out_dtype, block_v,
                num_warps, num_stages, interpret):
    tp, hk, kd = qn.shape
    nc, hv, chunk, vd = u.shape
    precision = lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    kernel = functools.partial(
        _chunk_kernel, group=hv // hk, chunk=chunk, block_v=block_v, precision=precision
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((tp, hv, vd), out_dtype),
            jax.ShapeDtypeStruct(pool.shape, jnp.float32),
        ),
        grid=(rows.shape[0], hv, vd // block_v),
        input_output_aliases={10: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_chunk",
    )(cu_seqlens, rows, flags, qn, kn, w, u, a, gc, gl, pool)


def _chunk_state_kernel(
    cu_ref,  # i32[N+1]
    rows_ref,  # i32[N]
    flags_ref,  # i32[N]
    k_ref,  # [Tp, Hk, K]  (l2-normed)
    w_ref,  # [NC, Hv, C, K]
    u_ref,  # [NC, Hv, C, V]
    gc_ref,  # f32[NC, Hv, C]
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
):
    """Split form, pass 1 (sequential): the state recurrence only; outputs come from :func:`_chunk_out_kernel`."""
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

    def body(c, s):  # s: f32[K, block_v]
        r = c * chunk + idx
        in_seq = (r >= start) & (r < end) & live
        own = (r >= lo) & (r < hi)
        rs = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        sb = s.astype(dt)
        h_ref[c + n, h, :, vs] = sb
        v_new = u_ref[c, h, :, vs].astype(jnp.float32) - dot(w_ref[c, h, :, :], sb)
        vb_ = jnp.where(in_seq[:, None], v_new, 0.0).astype(dt)
        plt.store(vn_ref.at[rs, h, vs], vb_, mask=own[:, None])
        gc = gc_ref[c, h, :]
        gl = gl_ref[c, h, :]
        any_in = jnp.sum(in_seq.astype(jnp.int32)) > 0
        d_last = jnp.where(any_in, jnp.exp(jnp.max(jnp.where(in_seq, gl, -jnp.inf))), 1.0)
        kdec = jnp.exp(jnp.where(in_seq, gl - gc, -jnp.inf))
        kg = (k_ref[rs, hk, :].astype(jnp.float32) * kdec[:, None]).astype(dt)
        return s * d_last + dot(kg, vb_, contract_a=0)

    s = lax.fori_loop(lo // chunk, (hi + chunk - 1) // chunk, body, s0)

    @pl.when(live)
    def _():
        pool_ref[row, h, :, vs] = s


def _chunk_out_kernel(
    cu_ref,  # i32[N+1]
    flags_ref,  # i32[N]
    pair_ref,  # i32[NC+N]  sequence of each (sequence, chunk) pair, -1 = unused
    q_ref,  # [Tp, Hk, K]  (l2-normed, scaled)
    a_ref,  # [NC, Hv, C, C]
    gc_ref,  # f32[NC, Hv, C]
    h_ref,  # [NC+N, Hv, K, V]
    vn_ref,  # [Tp, Hv, V]
    o_ref,  # [Tp, Hv, V]
    *,
    group: int,
    chunk: int,
    block_v: int,
    precision,
):
    """Split form, pass 2 (parallel over pairs): ``o = (q * exp(gc)) h + A v_new`` for the pair's own rows."""
    p, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n = pair_ref[p]
    num_seqs = flags_ref.shape[0]

    @pl.when(n >= 0)
    def _():
        c = p - n
        hk = h // group
        vs = pl.ds(pl.multiple_of(vb * block_v, block_v), block_v)
        start, end, lo, hi, live, _ = _row_range(cu_ref, flags_ref, n, num_seqs, o_ref.shape[0])
        r = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
        in_seq = (r >= start) & (r < end) & live
        own = (r >= lo) & (r < hi)
        rs = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        dt = a_ref.dtype
        qg = (q_ref[rs, hk, :].astype(jnp.float32) * jnp.exp(gc_ref[c, h, :])[:, None]).astype(dt)
        o = _dot(qg, h_ref[p, h, :, vs], precision=precision)
        o = o + _dot(a_ref[c, h, :, :], vn_ref[rs, h, vs], precision=precision)
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
    n = jnp.searchsorted(first, pair, side="right").astype(jnp.int32) - 1
    ok = (n >= 0) & (pair < stop[jnp.clip(n, 0, num_seqs - 1)])
    return jnp.where(ok, n, -1)


def _chunk_call_split(qn, kn, w, u, a, gc, gl, pool, cu_seqlens, rows, flags, *, out_dtype, block_v,
                      out_block_v, num_warps, num_stages, interpret):
    tp, hk, kd = qn.shape
    nc, hv, chunk, vd = u.shape
    num_seqs = rows.shape[0]
    dt = w.dtype
    precision = lax.Precision.HIGHEST if dt == jnp.float32 else None
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    h, vn, pool = pl.pallas_call(
        functools.partial(_chunk_state_kernel, group=hv // hk, chunk=chunk, block_v=block_v, precision=precision),
        out_shape=(
            jax.ShapeDtypeStruct((nc + num_seqs, hv, kd, vd), dt),
            jax.ShapeDtypeStruct((tp, hv, vd), dt),
            jax.ShapeDtypeStruct(pool.shape, jnp.float32),
        ),
        grid=(num_seqs, hv, vd // block_v),
        input_output_aliases={8: 2},
        compiler_params=params,
        interpret=interpret,
        name="gdn_chunk_state",
    )(cu_seqlens, rows, flags, kn, w, u, gc, gl, pool)
    o = pl.pallas_call(
        functools.partial(_chunk_out_kernel, group=hv // hk, chunk=chunk, block_v=out_block_v,
                          precision=precision),
        out_shape=jax.ShapeDtypeStruct((tp, hv, vd), out_dtype),
        grid=(nc + num_seqs, hv, vd // out_block_v),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_out",
    )(cu_seqlens, flags, _pair_table(cu_seqlens, nc, chunk), qn, a, gc, h, vn)
    return o, pool


def _l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _unit_lower_inverse(lmat, method: str):
    """``(I + L)^-1`` for strictly lower-triangular ``L: f32[..., C, C]``."""
    c = lmat.shape[-1]
    eye = jnp.eye(c, dtype=lmat.dtype)
    if method == "solve":
        eye_b = jnp.broadcast_to(eye, lmat.shape)
        return lax.linalg.triangular_solve(
            lmat + eye, eye_b, left_side=True, lower=True, unit_diagonal=True
        )
    # (I + L)^-1 = sum_k (-L)^k = (I - L)(I + L^2)(I + L^4)...: L is nilpotent (L^C = 0).
    mm = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)
    power = -lmat
    inv = eye + power
    for _ in range(int(np.log2(c)) - 1):
        power = mm(power, power)
        inv = inv + mm(inv, power)
    return inv


def _prepare(q, k, v, g, beta, cu_seqlens, *, scale, use_qk_l2norm, chunk, prep, prep_num_warps=4,
             inverse_dtype="bf16", interpret=False):
    """State-independent per-chunk quantities (see the module docstring); all chunks and heads in parallel.

    ``prep="pallas"``: ``w``, ``u``, ``A`` by :func:`_prep_kernel` (16x16 block inverse in registers);
    ``"solve"`` / ``"doubling"``: pure XLA (batched triangular solve / nilpotent doubling), kept as cross-checks.
    """
    num_tokens, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    group = hv // hk
    dt = q.dtype
    prec = lax.Precision.HIGHEST if dt == jnp.float32 else None
    num_chunks = -(-num_tokens // chunk)
    tp = num_chunks * chunk
    num_seqs = cu_seqlens.shape[0] - 1

    def pad(x):
        return jnp.pad(x, [(0, tp - num_tokens)] + [(0, 0)] * (x.ndim - 1))

    t = jnp.arange(tp, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1
    valid = (seq >= 0) & (seq < num_seqs) & (t < num_tokens)
    seg = jnp.where(valid, seq, -1).reshape(num_chunks, chunk)  # i32[NC, C]

    qf, kf = pad(q).astype(jnp.float32), pad(k).astype(jnp.float32)
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qn, kn = (qf * scale).astype(dt), kf.astype(dt)  # [Tp, Hk, K]

    def heads_first(x, h):  # [Tp, h, ...] -> [NC, h, C, ...]
        x = x.reshape(num_chunks, chunk, h, *x.shape[2:])
        return jnp.moveaxis(x, 2, 1)

    gch = heads_first(jnp.where(valid[:, None], pad(g).astype(jnp.float32), 0.0), hv)  # f32[NC, Hv, C]
    bch = heads_first(jnp.where(valid[:, None], pad(beta).astype(jnp.float32), 0.0), hv)  # f32[NC, Hv, C]

    pos = jnp.arange(chunk, dtype=jnp.int32)
    prev = jnp.concatenate([jnp.full((num_chunks, 1), -2, jnp.int32), seg[:, :-1]], axis=1)
    nxt = jnp.concatenate([seg[:, 1:], jnp.full((num_chunks, 1), -2, jnp.int32)], axis=1)
    first = lax.cummax(jnp.where(seg != prev, pos, 0), axis=1)  # i32[NC, C] segment start
    last = lax.cummin(jnp.where(seg != nxt, pos, chunk - 1), axis=1, reverse=True)  # segment end
    cs = jnp.cumsum(gch, axis=-1)
    gc = cs - jnp.take_along_axis(cs - gch, first[:, None, :], axis=-1)  # f32[NC, Hv, C]
    gl = jnp.take_along_axis(gc, last[:, None, :], axis=-1)
    if prep == "pallas":
        w, u, a = _prep_call(seg.reshape(tp), qn, kn, pad(v), gc, bch, num_warps=prep_num_warps,
                             inverse_dtype=inverse_dtype,
                             interpret=interpret)
        return qn, kn, w, u, a, gc, gl

    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    incl = (same & (pos[:, None] >= pos[None, :]))[:, None]  # [NC, 1, C, C]
    strict = (same & (pos[:, None] > pos[None, :]))[:, None]
    decay = jnp.exp(jnp.where(incl, gc[..., :, None] - gc[..., None, :], -jnp.inf))  # f32[NC, Hv, C, C]

    qc, kc = heads_first(qn, hk), heads_first(kn, hk)  # [NC, Hk, C, K]
    vc = heads_first(pad(v).astype(jnp.float32), hv)  # f32[NC, Hv, C, V]

    def expand(x):  # [NC, Hk, ...] -> [NC, Hv, ...]
        return jnp.repeat(x, group, axis=1) if group > 1 else x

    ein = functools.partial(jnp.einsum, precision=prec, preferred_element_type=jnp.float32)
    kk = expand(ein("nhik,nhjk->nhij", kc, kc))
    lmat = jnp.where(strict, kk * decay * bch[..., :, None], 0.0)
    tinv = _unit_lower_inverse(lmat, prep)  # f32[NC, Hv, C, C]
    kb = expand(kc.astype(jnp.float32)) * (bch * jnp.exp(gc))[..., None]
    hi = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST if dt == jnp.float32 else None,
                           preferred_element_type=jnp.float32)
    w = hi("nhij,nhjk->nhik", tinv.astype(dt), kb.astype(dt)).astype(dt)
    u = hi("nhij,nhjv->nhiv", tinv.astype(dt), (vc * bch[..., None]).astype(dt)).astype(dt)
    a = (expand(ein("nhik,nhjk->nhij", qc, kc)) * decay).astype(dt)
    return qn, kn, w, u, a, gc, gl


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm", "block_v", "num_warps", "num_stages", "prep", "prep_num_warps",
                     "inverse_dtype",
                     "split", "out_block_v", "interpret"),
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
    num_stages: int = 2,
    prep: str = "pallas",
    prep_num_warps: int = 4,
    inverse_dtype: str = "bf16",
    split: bool = False,
    out_block_v: int = 64,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked gated delta rule reading/writing states in ``pool`` at ``rows``; returns ``(o, pool)``.

    ``inverse_dtype``: operands of the 10 matmuls of the in-kernel inverse for bf16 inputs, ``"bf16"`` (default:
    measured faster than ``"tf32"`` on an H200 with the same output error, see benchmarks/RESULTS.md); float32
    inputs always use full f32. ``split=True``: the sequential kernel only carries the state (storing it per chunk, bf16 for bf16 inputs,
    and ``v_new``); a second, fully parallel kernel computes the outputs (fla's structure).

    ``block_v=None`` picks the widest value block (64, 32, 16) that still gives >= 256 programs: the
    sequential kernel has only ``N * Hv * V / block_v`` programs and is latency-bound when they are few.
    """
    num_tokens, _, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    _check_pow2("K", kd)
    _check_pow2("V", vd)
    if block_v is None:
        block_v = next((b for b in (64, 32) if rows.shape[0] * hv * (vd // b) >= 256), 16)
    block_v = min(block_v, vd)
    _check_pow2("block_v", block_v)
    if inverse_dtype not in ("tf32", "bf16"):
        raise ValueError(f"inverse_dtype must be 'tf32' or 'bf16', got {inverse_dtype!r}")
    if prep not in ("pallas", "solve", "doubling"):
        raise ValueError(f"prep must be 'pallas', 'solve' or 'doubling', got {prep!r}")
    qn, kn, w, u, a, gc, gl = _prepare(
        q, k, v, g, beta, cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk=CHUNK, prep=prep,
        prep_num_warps=prep_num_warps, inverse_dtype=inverse_dtype, interpret=interpret,
    )
    if split:
        o, pool = _chunk_call_split(
            qn, kn, w, u, a, gc, gl, pool, cu_seqlens, rows, flags, out_dtype=v.dtype, block_v=block_v,
            out_block_v=min(out_block_v, vd), num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        )
    else:
        o, pool = _chunk_call(
            qn, kn, w, u, a, gc, gl, pool, cu_seqlens, rows, flags, out_dtype=v.dtype, block_v=block_v,
            num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        )
    return o[:num_tokens], pool


def chunk_gated_delta_rule_pallas(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    *,
    cu_seqlens: jax.Array,  # i32[N+1]
    initial_state: jax.Array | None,  # f32[N, Hv, K, V]
    scale: float,
    use_qk_l2norm: bool,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Kernel for ``kvjax.ops.chunk_gated_delta_rule``: ``(o: [T, Hv, V], final: f32[N, Hv, K, V])``."""
    num_seqs = cu_seqlens.shape[0] - 1
    hv, kd, vd = v.shape[1], q.shape[2], v.shape[2]
    if initial_state is None:
        pool = jnp.zeros((num_seqs, hv, kd, vd), jnp.float32)
        flags = jnp.full((num_seqs,), FLAG_LIVE, jnp.int32)
    else:
        pool = jnp.array(initial_state, jnp.float32, copy=True)
        flags = jnp.full((num_seqs,), FLAG_LIVE | FLAG_HAS_INITIAL, jnp.int32)
    rows = jnp.arange(num_seqs, dtype=jnp.int32)
    return chunk_gated_delta_rule_pool(
        q, k, v, g, beta, pool, cu_seqlens=cu_seqlens, rows=rows, flags=flags, scale=scale,
        use_qk_l2norm=use_qk_l2norm, interpret=interpret,
    )
