"""Chunked gated delta rule (prefill / extend): Pallas kernels (Triton lowering) for the sequential part.

The token stream is cut into global chunks of ``C`` tokens (``C = 64``) *without* repacking the ragged batch:
a chunk may hold the tail of one sequence and the head of the next, and every intra-chunk quantity is masked
to pairs of tokens of the same sequence ("segments"). Two stages:

1. :func:`kvjax.pallas.gdn_chunk_prep._prepare` (parallel over all chunks and heads; the state-independent
   part, fla's "WY" form, from the raw q / k): per segment cumulative log-decay ``gc``,
   ``T = (I + tril(beta k k^T decay, -1))^-1``, ``w = T (beta exp(gc) k)``, ``u = T (beta v)``, the causal
   intra-chunk scores ``A = (q k^T) * decay`` and per-token row factors ``qf = |q|^-1 scale exp(gc)``,
   ``kf = |k|^-1 exp(g_last - gc)`` (the l2norm folded in: no normalised copy of q / k exists).
2. ``_chunk_kernel`` (one program per (sequence row, value head, block of value columns)): walks the row's
   chunks in order with the state slice ``S: f32[K, block_v]`` in registers::

       v_new = u - w S;   o = (qf * q) S + A v_new;   S = exp(g_last) S + (kf * k)^T v_new

   reading the initial state from, and writing the final state to, a pool ``f32[R, Hv, K, V]`` at the row's
   index (aliased input -> output: in place under jit with a donated pool), exactly like
   :mod:`kvjax.pallas.gdn_recurrent` (same ``rows`` / ``flags`` convention). Each program writes the outputs
   of its own sequence's tokens (masked stores); the first and last rows also zero the tokens outside every
   sequence. The split form (``_chunk_state_kernel`` + ``_chunk_out_kernel``, fla's structure) carries only
   the state sequentially and computes the outputs in a second, fully parallel kernel.

Matmul operands are in the input dtype (bf16 in serving: like fla, states are rounded to bf16 for the
tensor-core products and accumulate in f32); for float32 inputs every product runs at full f32 precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.pallas.gdn_chunk_prep import _dot, _prepare
from kvjax.pallas.gdn_recurrent import FLAG_HAS_INITIAL, FLAG_LIVE, _check_pow2, state_as_pool
from kvjax.pallas.paged_common import count_le

CHUNK = 64


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
        sb = s.astype(dt)
        v_new = u_ref[c, h, :, vs].astype(jnp.float32) - dot(w_ref[c, h, :, :], sb)
        v_new = jnp.where(in_seq[:, None], v_new, 0.0)
        vb_ = v_new.astype(dt)
        qg = (q_ref[rs, hk, :].astype(jnp.float32) * qf_ref[c, h, :][:, None]).astype(dt)
        o = dot(qg, sb) + dot(a_ref[c, h, :, :], vb_)
        o = jnp.where(in_seq[:, None], o, 0.0)
        plt.store(o_ref.at[rs, h, vs], o.astype(o_ref.dtype), mask=own[:, None])
        kg = (k_ref[rs, hk, :].astype(jnp.float32) * jnp.where(in_seq, kf_ref[c, h, :], 0.0)[:, None]).astype(dt)
        return s * _chunk_decay(gl_ref, c, h, start, end, live, chunk) + dot(kg, vb_, contract_a=0)

    s = lax.fori_loop(lo // chunk, (hi + chunk - 1) // chunk, body, s0)

    @pl.when(live)
    def _():
        pool_ref[row, h, :, vs] = s


def _chunk_call(q, k, w, u, a, qf, kf, gl, pool, cu_seqlens, rows, flags, *, out_dtype, block_v,
                num_warps, num_stages, interpret):
    tp, hk, kd = q.shape
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
        input_output_aliases={11: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="gdn_chunk",
    )(cu_seqlens, rows, flags, q, k, w, u, a, qf, kf, gl, pool)


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
        kg = (k_ref[rs, hk, :].astype(jnp.float32) * jnp.where(in_seq, kf_ref[c, h, :], 0.0)[:, None]).astype(dt)
        return s * _chunk_decay(gl_ref, c, h, start, end, live, chunk) + dot(kg, vb_, contract_a=0)

    s = lax.fori_loop(lo // chunk, (hi + chunk - 1) // chunk, body, s0)

    @pl.when(live)
    def _():
        pool_ref[row, h, :, vs] = s


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
        qg = (q_ref[rs, hk, :].astype(jnp.float32) * qf_ref[c, h, :][:, None]).astype(dt)
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
    n = count_le(first, pair) - 1
    ok = (n >= 0) & (pair < stop[jnp.clip(n, 0, num_seqs - 1)])
    return jnp.where(ok, n, -1)


def _chunk_call_split(q, k, w, u, a, qf, kf, gl, pool, cu_seqlens, rows, flags, *, out_dtype, block_v,
                      out_block_v, num_warps, num_stages, interpret):
    tp, hk, kd = q.shape
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
    )(cu_seqlens, rows, flags, k, w, u, kf, gl, pool)
    o = pl.pallas_call(
        functools.partial(_chunk_out_kernel, group=hv // hk, chunk=chunk, block_v=out_block_v,
                          precision=precision),
        out_shape=jax.ShapeDtypeStruct((tp, hv, vd), out_dtype),
        grid=(nc + num_seqs, hv, vd // out_block_v),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_out",
    )(cu_seqlens, flags, _pair_table(cu_seqlens, nc, chunk), q, a, qf, h, vn)
    return o, pool


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
    inputs always use full f32. ``split=True``: the sequential kernel only carries the state (storing it per
    chunk, bf16 for bf16 inputs, and ``v_new``); a second, fully parallel kernel computes the outputs (fla's
    structure).

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
    qp, kp, w, u, a, qf, kf, gl = _prepare(
        q, k, v, g, beta, cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk=CHUNK, prep=prep,
        prep_num_warps=prep_num_warps, inverse_dtype=inverse_dtype, interpret=interpret,
    )
    if split:
        o, pool = _chunk_call_split(
            qp, kp, w, u, a, qf, kf, gl, pool, cu_seqlens, rows, flags, out_dtype=v.dtype, block_v=block_v,
            out_block_v=min(out_block_v, vd), num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        )
    else:
        o, pool = _chunk_call(
            qp, kp, w, u, a, qf, kf, gl, pool, cu_seqlens, rows, flags, out_dtype=v.dtype, block_v=block_v,
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
    pool, rows, flags = state_as_pool(initial_state, cu_seqlens.shape[0] - 1, v.shape[1], q.shape[2], v.shape[2])
    return chunk_gated_delta_rule_pool(
        q, k, v, g, beta, pool, cu_seqlens=cu_seqlens, rows=rows, flags=flags, scale=scale,
        use_qk_l2norm=use_qk_l2norm, interpret=interpret,
    )
