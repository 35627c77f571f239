"""Preparation stage of the chunked gated delta rule as a Mosaic GPU kernel (Hopper: TMA copies, wgmma).

Same inputs, outputs and arithmetic as :mod:`kvjax.pallas.gdn.prep`'s Triton kernel (``PrepConfig(kernel=
"mosaic")`` picks this one): per global chunk of ``C = 64`` tokens and value head the segment cumulative decay
``gc`` / ``gl``, ``A = (q k^T) * decay``, ``T = (I + L)^-1`` with ``L = tril(beta k k^T * decay, -1)``,
``w = T (beta exp(gc) k)``, ``u = T (beta v)`` and the row factors ``qf``, ``kf``, on the raw q / k (the l2norm
and ``scale`` are per-row / per-column factors of the f32 products).

One CTA (one warpgroup) per (chunk, key head) and its ``Hv / Hk`` value heads (or, with ``value_heads``, per
chunk and block of that many value heads of one key head: more and smaller CTAs, ``q k^T`` / ``k k^T`` formed by
each). At entry it issues every TMA copy it will need into swizzled shared memory: the chunk's segment ids, q and
k rows, and per value head the v rows and the (transposed) log-decay and beta rows, so the value heads' loads
overlap the key head's products. All
products are wgmma with f32 accumulators in registers: ``q k^T`` and ``k k^T`` (issued together), then per value
head the inverse by doubling as in the Triton kernel (``(I + D)^-1`` of the 16x16 block diagonal by the products
``(I - D)(I + D^2)(I + D^4)(I + D^8)``, then ``(I + F)^-1`` of the rest; the independent products of a step are
issued together: 8 dependent steps for the 10 products), each product's left operand in registers (bf16, the
wgmma layout of the previous accumulator) and its right operand stored to one shared 64x64 bf16 tile; ``w`` and
``u`` (issued together) take ``T`` in bf16. Every operand is rounded to bf16 where the Triton kernel rounds it
(``PrepConfig.inverse_dtype="bf16"``). ``A``, ``w``, ``u`` and the row factors go back by TMA from shared memory
(``w`` through q's tile, which takes ``beta exp(gc) k`` once q is read, ``u`` through v's own tile). Shared
memory at ``K = V = 128``: 49.5 KB + 17 KB per value head of the CTA.

Row and column vectors: a per-token vector is a wgmma row vector (``Layout.WGMMA.reduce(1)``, broadcast along
columns) or column vector (``reduce(0)``). A column sum of a ``[C, C]`` array crosses the warpgroup's four warps,
so no column form is computed that way: the segment ids and (for ``outputs="inverse"``, whose ``Tb`` scales
columns by beta) beta are copied twice (one shared-memory vector read as a row vector, one as a column vector), the
log-decay once (read as a column vector), and the row vectors the kernel
forms, ``gc`` (a row sum over the segment's earlier tokens) and ``|k|^-1`` (from the diagonal of ``k k^T``), are
stored to shared memory and read back as column vectors. No shared-memory vector is read in two layouts (under jax
0.11's Warpgroup semantics the two reads become one value that no layout can serve). Measured on an H200 (issue 38,
RESULTS.md) against column sums of masked diagonals: the same bits, ``outputs="inverse"`` 1.19-1.41x and
``outputs="all"`` 1.11-1.21x faster.

Work per CTA at ``K = V = 128`` and per value head: ``q k^T`` and ``k k^T`` (2 MFLOP, once per CTA), 10
inverse products (5.2 MFLOP), ``w`` and ``u`` (2 MFLOP); reads 32 KB (q, k) per CTA and 16.5 KB (v, g, beta)
per value head, writes 40.8 KB per value head (w, u, A, three f32 row factors).

``outputs="inverse"`` (FlashQLA's layout, for the fused sequential pass ``seq_mgpu_fused_call``, which forms
``v_new = Tb (v - kr * (k S))`` from raw v): no v load and no ``w`` / ``u`` products or stores; per value head the
kernel writes ``Tb = T diag(beta)`` (bf16 64 x 64, through the inverse's operand tile), ``A``, ``qf``, ``kf``,
``gl`` and ``kr = |k|^-1 exp(gc)`` (the row factor that ``w``'s product folded into ``k``). Per value head at
``K = V = 128``: the 10 inverse products only (5.2 MFLOP; no 2 MFLOP of ``w`` / ``u``), reads 0.75 KB (g, beta
twice), writes 17 KB (Tb, A, four f32 row factors) instead of 16.5 KB read and 40.8 KB written.

``outputs="inverse"`` runs its value heads' inverses in lockstep (issue 38: the kernel is bound by the inverse's
latency, 8 dependent wgmma waits per value head, not by its bytes; measured on an H200 1.06-1.08x faster than one
head after another at 2 heads a CTA, which was then deleted; for ``outputs="all"`` the lockstep form lost, 0.95-0.98x,
and was deleted). First per head ``A``, the row factors and the inverse's first operands (``-D``, the block diagonal
of ``-L``, in bf16 in the head's operand tile ``op_s[j]``; the rest of ``L`` in bf16 in its second tile
``lo_s[j]``); then each dependent step of the doubling issues the products of all ``G`` heads of the CTA as one wgmma
group with one wait (the 8 waits are shared by the heads, not repeated per head); then per head ``Tb`` in
``op_s[j]``. The products whose left operand is a stored power take it from its tile, and ``(I + D)^-1`` waits in
bf16 in ``lo_s[j]`` for the last product, so per head at most 3.5 f32 ``[C, C]`` arrays are live in the inverse
(112 registers a thread, 224 for two heads: an estimate, not a measurement), and ``q k^T`` / ``k k^T`` are dead
once the last head's ``A`` and ``L`` are formed. Every value is rounded as in the one-head-after-another form it
replaced, whose outputs it matched bit for bit on an H200. Shared memory: ``2 G - 1`` more 8 KB tiles (``op_s`` is
``bf16[G, C, C]``, and ``lo_s``): 76 KB a CTA at ``K = V = 128`` and ``G`` = 2 heads, so two CTAs still fit an SM's
shared memory.

Needs a Hopper GPU (or the Mosaic GPU interpreter, which runs the same data flow with ``jnp.dot`` products: it has
no transposed or register wgmma operands), bf16 q / k / v, ``K`` and ``V`` in ``SUPPORTED_HEAD_DIMS``, chunks of
64 and at most ``MAX_GROUP`` value heads per key head (the value tiles of all of them are in shared memory).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas.gdn.common import L2NORM_EPS
from kvjax.pallas.mgpu_common import interpret_params, iota, swizzled

CHUNK = 64  # tokens per chunk: one wgmma M tile of one warpgroup
SUB = 16  # diagonal block size of the inverse (as the Triton kernel)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_GROUP = 4  # value heads per key head (their v tiles share the CTA's shared memory)
_ROW = plgpu.Layout.WGMMA.reduce(1)  # f32[C] indexed by row, broadcast along columns
_COL = plgpu.Layout.WGMMA.reduce(0)  # f32[C] indexed by column, broadcast along rows


def shape_reason(q: jax.Array, k: jax.Array, v: jax.Array, *, chunk: int) -> str | None:
    """What this kernel cannot take (``"needs ..., got ..."``), or None: bf16 q / k / v, K and V in
    ``SUPPORTED_HEAD_DIMS``, ``chunk == CHUNK``, ``Hv`` a multiple of ``Hk`` with at most ``MAX_GROUP`` value heads
    per key head."""
    if not (q.dtype == k.dtype == v.dtype == jnp.bfloat16):
        return f"needs bf16 q / k / v, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS or v.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"needs K and V in {SUPPORTED_HEAD_DIMS}, got K={q.shape[-1]}, V={v.shape[-1]}"
    if chunk != CHUNK:
        return f"needs chunk == {CHUNK}, got {chunk}"
    hk, hv = q.shape[1], v.shape[1]
    if hv % hk or hv // hk > MAX_GROUP:
        return f"needs Hv a multiple of Hk with Hv / Hk <= {MAX_GROUP}, got Hk={hk}, Hv={hv}"
    return None


def _kernel(*refs, group: int, heads: int, scale: float, use_qk_l2norm: bool, inverse_only: bool, interpret: bool):
    """``refs``: the inputs, outputs and scratch below; with ``inverse_only`` (the value heads' inverses in
    lockstep) no ``v_ref``, ``w_ref``, ``u_ref``, ``v_s``; ``rowf_ref`` in place of ``qf_ref`` .. ``gl_ref`` and
    ``tb_ref`` after it; ``op_s`` is ``bf16[G, C, C]`` (G = the CTA's value heads) and ``lo_s`` (``bf16[G, C, C]``,
    swizzled: ``L`` off its block diagonal, then ``(I + D)^-1``) comes last."""
    if inverse_only:
        refs, lo_s = refs[:-1], refs[-1]
        (seg_ref,  # i32[Tp]  sequence id per token, -1 outside every sequence
         q_ref,  # bf16[Tp, Hk, K]  raw q
         k_ref,  # bf16[Tp, Hk, K]  raw k
         g_ref,  # f32[Hv, Tp]  log-decay (0 outside every sequence)
         b_ref,  # f32[Hv, Tp]  beta (0 outside every sequence)
         a_ref,  # bf16[NC, Hv, C, C]
         rowf_ref,  # f32[NC, Hv, 4, C]  qf, kf, gl and kr = |k|^-1 exp(gc) (v_new = Tb (v - kr * (k S)))
         tb_ref,  # bf16[NC, Hv, C, C]  T diag(beta)
         seg_s, q_s, k_s, tok_s, rk_s, a_s, vec_s, op_s, qk_bar, v_bar) = refs
        v_ref = w_ref = u_ref = v_s = None
    else:
        (seg_ref, q_ref, k_ref,
         v_ref,  # bf16[Tp, Hv, V]
         g_ref, b_ref,
         w_ref,  # bf16[NC, Hv, C, K]
         u_ref,  # bf16[NC, Hv, C, V]
         a_ref, qf_ref, kf_ref, gl_ref,
         seg_s,  # i32[2, C]  the segment ids twice: read as a row vector ([0]) and as a column vector ([1])
         q_s,  # bf16[C, K]  swizzled: q, then per value head beta exp(gc) k, then w
         k_s,  # bf16[C, K]  swizzled
         v_s,  # bf16[G, C, V]  swizzled: v, then beta v, then u (G = the CTA's value heads)
         tok_s,  # f32[G, 4, C]  per value head g (read as a column vector), beta (row; inverse_only also [2], read
         #         as a column), gc (written as a row vector, read as a column vector)
         rk_s,  # f32[C]  use_qk_l2norm: |k|^-1, written as a row vector, read as a column vector
         a_s,  # bf16[C, C]  swizzled: A
         vec_s,  # f32[3, C]  qf, kf, gl (inverse_only: f32[4, C], and kr)
         op_s,  # bf16[C, C]  swizzled: right operand of the inverse's products (inverse_only: bf16[G, C, C], then Tb)
         qk_bar,  # barrier: seg (twice), q, k loaded (4 arrivals)
         v_bar,  # barriers [G]: v, g, beta of value head j loaded (3 arrivals; inverse_only: g, beta twice)
         ) = refs
        tb_ref = rowf_ref = None
    c = lax.axis_index("chunk")
    h0 = lax.axis_index("heads") * heads  # the CTA's first value head
    hk = lax.div(h0, jnp.int32(group))
    chunk = CHUNK
    rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    f32, bf16 = jnp.float32, jnp.bfloat16
    kd = q_s.shape[1]
    vd = None if inverse_only else v_s.shape[2]

    for i in range(2):
        plgpu.copy_gmem_to_smem(seg_ref.at[rows], seg_s.at[i], qk_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[rows, hk], q_s, qk_bar)
    plgpu.copy_gmem_to_smem(k_ref.at[rows, hk], k_s, qk_bar)
    for j in range(heads):
        h = h0 + j
        if not inverse_only:
            plgpu.copy_gmem_to_smem(v_ref.at[rows, h], v_s.at[j], v_bar.at[j])
        for i, src in enumerate((g_ref, b_ref, b_ref) if inverse_only else (g_ref, b_ref)):
            plgpu.copy_gmem_to_smem(src.at[h, rows], tok_s.at[j, i], v_bar.at[j])

    def vec(ref, layout):  # a per-token vector of shared memory as a row or column vector
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout, optimized=False)

    def tile(ref):  # a bf16 tile of shared memory in the wgmma layout
        return ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)

    def bc_row(x, cols=chunk):  # row vector -> [C, cols]
        return lax.broadcast_in_dim(x, (chunk, cols), [0])

    def bc_col(x):  # column vector -> [C, C]
        return lax.broadcast_in_dim(x, (chunk, chunk), [1])

    def operand(a):  # a left operand: a bf16 shared-memory ref as is, an f32 array (an accumulator) in bf16
        return a.astype(bf16) if a.dtype == f32 else a

    def products(*pairs):  # f32 ``a @ b`` for each (a, b): a ref or array, b a ref (maybe transposed); together
        if interpret:  # the interpreter has no transposed or register wgmma operands: the same products in jnp
            out = []
            for a, b, trans in pairs:
                a = a.astype(bf16) if a.dtype == f32 else a[...]
                b = b[...].T if trans else b[...]
                out.append(jnp.dot(a, b, preferred_element_type=f32))
            return out

        def body(*accs):
            for acc, (a, b, trans) in zip(accs, pairs):
                plgpu.wgmma(acc, operand(a), plgpu.transpose_ref(b, (1, 0)) if trans else b)
            return tuple(acc[...] for acc in accs)

        shapes = [(chunk, b.shape[0] if trans else b.shape[1]) for _, b, trans in pairs]
        return list(pl.run_scoped(body, *[plgpu.ACC(s, f32) for s in shapes]))

    def stored(x):  # x (f32 [C, C]) as the right operand tile, in bf16
        op_s[...] = x.astype(bf16)
        plgpu.commit_smem()
        return op_s, False

    ri = iota((chunk, chunk), 0, interpret)
    ci = iota((chunk, chunk), 1, interpret)
    eye = ri == ci
    eye_f = jnp.where(eye, 1.0, 0.0)
    block_diag = (ri & ~(SUB - 1)) == (ci & ~(SUB - 1))

    def inverse(lmat):  # f32[C, C] (I + lmat)^-1 of a strictly lower lmat, as prep._unit_lower_inverse
        power = -jnp.where(block_diag, lmat, 0.0)
        inv_d = eye_f + power
        (power,) = products((power, *stored(power)))
        steps = int(np.log2(SUB)) - 1
        for i in range(steps):  # inv_d (I + power) and the next power^2 read the same stored power
            b = stored(power)
            if i < steps - 1:
                xp, power = products((inv_d, *b), (power, *b))
            else:
                (xp,) = products((inv_d, *b))
            inv_d = inv_d + xp
        (power,) = products((inv_d, *stored(jnp.where(block_diag, 0.0, lmat))))
        power = -power
        inv_f = eye_f + power
        steps = int(np.log2(chunk // SUB)) - 1
        if steps:
            (power,) = products((power, *stored(power)))
        for i in range(steps):
            b = stored(power)
            if i < steps - 1:
                xp, power = products((inv_f, *b), (power, *b))
            else:
                (xp,) = products((inv_f, *b))
            inv_f = inv_f + xp
        (tinv,) = products((inv_f, *stored(inv_d)))
        return tinv

    plgpu.barrier_wait(qk_bar)
    seg_r, seg_c = vec(seg_s.at[0], _ROW), vec(seg_s.at[1], _COL)
    in_seq = seg_r >= 0
    same = (bc_row(seg_r) == bc_col(seg_c)) & bc_row(in_seq)
    keep = same & (ri >= ci)
    qk, kk = products((q_s, k_s, True), (k_s, k_s, True))
    if use_qk_l2norm:
        q_rows = tile(q_s).astype(f32)
        rq = lax.rsqrt(jnp.sum(q_rows * q_rows, axis=1) + L2NORM_EPS)
        kk_diag = jnp.where(eye, kk, 0.0)
        rk = lax.rsqrt(jnp.sum(kk_diag, axis=1) + L2NORM_EPS)
        rk_s[...] = rk
        plgpu.commit_smem()
        rk_c = vec(rk_s, _COL)
        qk = qk * bc_row(rq * scale) * bc_col(rk_c)
        kk = kk * bc_row(rk) * bc_col(rk_c)
    else:
        rq = rk = jnp.ones((chunk,), f32) if interpret else plgpu.layout_cast(jnp.ones((chunk,), f32), _ROW)
        qk = qk * scale

    kb_s = q_s  # q is read: its tile takes beta exp(gc) k, then w

    def head_rows(j, h, stage):  # value head j (h) of the CTA: gc, beta, decay; writes A, the row factors and stage's
        plgpu.barrier_wait(v_bar.at[j])
        g_c, beta = vec(tok_s.at[j, 0], _COL), vec(tok_s.at[j, 1], _ROW)
        gc = jnp.sum(jnp.where(keep, bc_col(g_c), 0.0), axis=1)  # row vector
        gl = jnp.sum(jnp.where(same, bc_col(g_c), 0.0), axis=1)
        tok_s.at[j, 3][...] = gc
        plgpu.commit_smem()
        gc_c = vec(tok_s.at[j, 3], _COL)  # gc as a column vector, through shared memory
        decay = jnp.exp(jnp.where(keep, bc_row(gc) - bc_col(gc_c), -jnp.inf))  # f32[C, C]
        if j:  # the previous head's output copies must have read a_s, vec_s and kb_s
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        else:  # every thread must have read q (its row norms) before kb_s (q's tile) is written
            plgpu.commit_smem()
        vec_s.at[0][...] = jnp.where(in_seq, rq * scale * jnp.exp(gc), 0.0)
        vec_s.at[1][...] = jnp.where(in_seq, rk * jnp.exp(gl - gc), 0.0)
        vec_s.at[2][...] = gl
        a_s[...] = (qk * decay).astype(bf16)
        if inverse_only:
            vec_s.at[3][...] = jnp.where(in_seq, rk * jnp.exp(gc), 0.0)
        stage(gc, beta)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(a_s, a_ref.at[c, h])
        if inverse_only:  # the four row factors stacked: one copy (the fused pass loads them with one)
            plgpu.copy_smem_to_gmem(vec_s, rowf_ref.at[c, h])
        else:
            for i, out in enumerate((qf_ref, kf_ref, gl_ref)):
                plgpu.copy_smem_to_gmem(vec_s.at[i], out.at[c, h])
        return gc, beta, decay

    def scaled_kv(j, gc, beta):  # kb_s = beta exp(gc) k and v_s[j] = beta v, in bf16
        kb_s[...] = (tile(k_s).astype(f32) * bc_row(rk * beta * jnp.exp(gc), kd)).astype(bf16)
        v_j = v_s.at[j]
        v_j[...] = (tile(v_j).astype(f32) * bc_row(beta, vd)).astype(bf16)

    def tb_tile(tinv, beta_c):  # Tb = T diag(beta), rounded once to bf16 (as w / u take T); beta_c: column vector
        return (tinv * bc_col(beta_c)).astype(bf16)

    def doubling(invs, steps):  # inv_j (I + P^2) (I + P^4) ... for each head: invs[j] = I + P_j, op_s[j] = bf16(P_j)
        ops = [op_s.at[i] for i in range(len(invs))]
        powers = products(*[(o, o, False) for o in ops])
        for i in range(steps):  # inv (I + power) and the next power^2 read the same stored power, all heads at once
            for o, p in zip(ops, powers):
                o[...] = p.astype(bf16)
            plgpu.commit_smem()
            last = i == steps - 1
            out = products(*[(inv, o, False) for inv, o in zip(invs, ops)],
                           *([] if last else [(o, o, False) for o in ops]))
            invs, powers = [inv + xp for inv, xp in zip(invs, out)], out[len(invs):]
        return invs

    def lockstep_inverses():  # inverse_only: every value head's inverse in lockstep (a step's products: one group)
        inv_d, betas = [], []
        for j in range(heads):
            gc, beta, decay = head_rows(j, h0 + j, lambda gc, beta: None)
            betas.append(vec(tok_s.at[j, 2], _COL))  # beta as a column vector: Tb's column scale
            lmat = jnp.where(ri > ci, kk * decay, 0.0) * bc_row(beta)
            power = -jnp.where(block_diag, lmat, 0.0)
            op_s.at[j][...] = power.astype(bf16)
            lo_s.at[j][...] = jnp.where(block_diag, 0.0, lmat).astype(bf16)
            inv_d.append(eye_f + power)
        plgpu.commit_smem()
        inv_d = doubling(inv_d, int(np.log2(SUB)) - 1)  # (I + D)^-1 of each head
        accs = products(*[(inv, lo_s.at[j], False) for j, inv in enumerate(inv_d)])
        inv_f = []
        for j, (inv, acc) in enumerate(zip(inv_d, accs)):  # F = (I + D)^-1 (L - D); lo_s takes (I + D)^-1
            power = -acc
            op_s.at[j][...] = power.astype(bf16)
            lo_s.at[j][...] = inv.astype(bf16)
            inv_f.append(eye_f + power)
        plgpu.commit_smem()
        steps = int(np.log2(chunk // SUB)) - 1
        if steps:
            inv_f = doubling(inv_f, steps)
        tinv = products(*[(inv, lo_s.at[j], False) for j, inv in enumerate(inv_f)])
        for j, t in enumerate(tinv):  # op_s[j] takes Tb
            op_s.at[j][...] = tb_tile(t, betas[j])
        plgpu.commit_smem()
        for j in range(heads):
            plgpu.copy_smem_to_gmem(op_s.at[j], tb_ref.at[c, h0 + j])

    if inverse_only:
        lockstep_inverses()
        plgpu.wait_smem_to_gmem(0)
        return
    for j in range(heads):
        h = h0 + j
        gc, beta, decay = head_rows(j, h, lambda gc, beta: scaled_kv(j, gc, beta))
        lmat = jnp.where(ri > ci, kk * decay, 0.0) * bc_row(beta)
        tinv = inverse(lmat)
        v_j = v_s.at[j]
        w, u = products((tinv, kb_s, False), (tinv, v_j, False))
        kb_s[...] = w.astype(bf16)
        v_j[...] = u.astype(bf16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(kb_s, w_ref.at[c, h])
        plgpu.copy_smem_to_gmem(v_j, u_ref.at[c, h])
    plgpu.wait_smem_to_gmem(0)


def prep_mgpu_call(
    seg: jax.Array,  # i32[Tp]
    q: jax.Array,  # bf16[Tp, Hk, K]
    k: jax.Array,  # bf16[Tp, Hk, K]
    v: jax.Array,  # bf16[Tp, Hv, V]  (outputs="inverse": only its shape and dtype are read)
    g: jax.Array,  # f32[Tp, Hv]  0 outside every sequence
    beta: jax.Array,  # f32[Tp, Hv]  0 outside every sequence
    *,
    chunk: int,
    scale: float,
    use_qk_l2norm: bool,
    value_heads: int = 0,
    outputs: str = "all",
    auto_barriers: bool = False,
    semantics: plgpu.LoweringSemantics = plgpu.LoweringSemantics.Lane,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:  # (w, u, a, qf, kf, gl) as prep._prep_call; "inverse": (tb, a, rowf)
    """The preparation kernel's outputs, as :func:`kvjax.pallas.gdn.prep._prep_call` (``Tp`` a multiple of
    ``chunk``): ``w [NC, Hv, C, K]``, ``u [NC, Hv, C, V]``, ``a [NC, Hv, C, C]`` in bf16, ``qf, kf, gl: f32[NC, Hv,
    C]``. ``outputs="inverse"`` (for the fused sequential pass, ``seq_mgpu_fused_call``): no v load, no
    ``w`` / ``u`` products or stores; returns ``tb: bf16[NC, Hv, C, C]`` (``T diag(beta)``, the f32 inverse times
    beta rounded once to bf16), ``a`` as above and ``rowf: f32[NC, Hv, 4, C]``, the row factors ``qf``, ``kf``, ``gl``
    as above and ``kr`` (``|k|^-1 exp(gc)``, 0 outside every sequence) stacked, so that the fused pass loads them with
    one copy; ``w S = tb (kr * (k S))`` and ``u = tb v`` up to bf16 roundings. ``value_heads``: value heads per CTA, a
    divisor of ``Hv / Hk`` (0: all ``Hv / Hk`` of a key head; fewer means more CTAs, less shared memory each, and ``q
    k^T`` / ``k k^T`` formed once per CTA). ``ValueError``
    for what :func:`shape_reason` rejects, for a ``value_heads`` that does not divide ``Hv / Hk`` and for other
    ``outputs``. ``auto_barriers``: Pallas's automatic warpgroup barriers around every shared-memory store and copy
    issue; off by default: every store that another thread or an async read (wgmma, TMA store) reads is followed by
    ``commit_smem``, an output tile is rewritten only after ``wait_smem_to_gmem``, and the in-place scale of ``v`` by
    beta reads and writes each row in the warp that holds it (without them the kernel was 1.03-1.04x faster, the
    same bits; H200, benchmarks/RESULTS.md). ``semantics``: the Mosaic GPU lowering; Lane (jax 0.10's default) takes
    the register layouts the kernel names, so jax 0.10 and 0.11 lower the same program; Warpgroup (jax 0.11's
    default) infers them and lowers too. ``"all"`` runs the CTA's value heads one after another; ``"inverse"`` runs
    their inverses in lockstep (each dependent step's products of all of them in one wgmma group, one wait; see the
    module's docstring)."""
    reason = shape_reason(q, k, v, chunk=chunk)
    if reason:
        raise ValueError(f"prep_mgpu {reason}")
    if outputs not in ("all", "inverse"):
        raise ValueError(f"prep_mgpu outputs must be 'all' or 'inverse', got {outputs!r}")
    inverse_only = outputs == "inverse"
    tp, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    group = hv // hk
    heads = value_heads or group
    if group % heads:
        raise ValueError(f"prep_mgpu value_heads must divide Hv / Hk = {group}, got {value_heads}")
    nc = tp // chunk
    bf16 = jnp.bfloat16
    rowf = jax.ShapeDtypeStruct((nc, hv, chunk), jnp.float32)
    tiles = jax.ShapeDtypeStruct((nc, hv, chunk, chunk), bf16)
    v_tiles = () if inverse_only else (plgpu.SMEM((heads, chunk, vd), bf16, transforms=swizzled(bf16)),)
    scratch = (
        plgpu.SMEM((2, chunk), jnp.int32),
        plgpu.SMEM((chunk, kd), bf16, transforms=swizzled(bf16)),
        plgpu.SMEM((chunk, kd), bf16, transforms=swizzled(bf16)),
        *v_tiles,
        plgpu.SMEM((heads, 4, chunk), jnp.float32),
        plgpu.SMEM((chunk,), jnp.float32),
        plgpu.SMEM((chunk, chunk), bf16, transforms=swizzled(bf16)),
        plgpu.SMEM((4 if inverse_only else 3, chunk), jnp.float32),
        plgpu.SMEM((heads, chunk, chunk) if inverse_only else (chunk, chunk), bf16, transforms=swizzled(bf16)),
        plgpu.Barrier(num_arrivals=4),
        plgpu.Barrier(num_arrivals=3, num_barriers=heads),
        *([plgpu.SMEM((heads, chunk, chunk), bf16, transforms=swizzled(bf16))] if inverse_only else []),
    )
    kernel = functools.partial(_kernel, group=group, heads=heads, scale=scale, use_qk_l2norm=use_qk_l2norm,
                               inverse_only=inverse_only, interpret=interpret)
    if inverse_only:
        out_type = (tiles, jax.ShapeDtypeStruct((nc, hv, 4, chunk), jnp.float32), tiles)
        args = (seg, q, k, g.T, beta.T)
    else:
        out_type = (jax.ShapeDtypeStruct((nc, hv, chunk, kd), bf16), jax.ShapeDtypeStruct((nc, hv, chunk, vd), bf16),
                    tiles, rowf, rowf, rowf)
        args = (seg, q, k, v, g.T, beta.T)
    out = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(nc, hv // heads),
        grid_names=("chunk", "heads"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=semantics,
                                             unsafe_no_auto_barriers=not auto_barriers),
        interpret=interpret_params() if interpret else None,
    )(*args)
    if inverse_only:
        a, rowf, tb = out
        return tb, a, rowf
    return out
