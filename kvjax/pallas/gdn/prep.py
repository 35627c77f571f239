"""Preparation stage of the chunked gated delta rule: the state-independent per-chunk quantities.

For every global chunk of ``C`` tokens and value head (all in parallel; see :mod:`kvjax.pallas.gdn.chunk`
for how chunks are shared by sequences): the per-sequence cumulative log-decay ``gc``, its value ``gl`` at
the sequence's last token in the chunk, ``T = (I + tril(beta k k^T * decay, -1))^-1``, ``w = T (beta exp(gc) k)``,
``u = T (beta v)``, the causal intra-chunk scores ``A = (q k^T) * decay`` (fla's "WY" form, q and k l2-normed
when asked and q scaled) and the per-token row factors ``qf``, ``kf`` with which the sequential kernels scale
the raw q and k rows.

``_prep_kernel`` (Pallas, Triton lowering) computes all of it in one kernel from the raw inputs (the l2norm,
the segment cumulative decay and the inverse included); :func:`prepare` only adds the segment ids and padding.
It reads q / k / v rows as power-of-two blocks of lanes and writes ``w`` / ``u`` at their true K / V (masked
where K or V is not a power of two, :mod:`kvjax.pallas.gdn.common`).

Work per (chunk, value head) at ``C = 64``, ``K = V = 128`` (bf16): the products ``q k^T``, ``k k^T`` (1 MFLOP
each), the inverse and ``w``, ``u``; 48 KB read (q, k, v rows) and 41 KB written (w, u, A, row factors). The inverse
(:class:`PrepConfig` ``inverse``): ``"doubling"``, 10 dependent ``64^3`` products (5.2 MFLOP), ``w`` and ``u`` as
``64 x 64`` by ``64 x 128`` products (1 MFLOP each); ``"blocks"``, the four ``16 x 16`` diagonal blocks by 6
products of ``16^3`` each and 16 more ``16^3`` products to merge them (0.33 MFLOP), ``k k^T``, ``w`` and ``u`` from
the 10 lower ``16``-row blocks only (0.66 MFLOP each); ``"substitution"``, the diagonal blocks by f32 row steps
(about 0.03 MFLOP off the tensor cores) and the same merge (0.13 MFLOP). One program per (chunk, key head): it
reads q / k once, forms ``q k^T`` / ``k k^T`` once and runs the per-value-head part (decay, ``A``, inverse, ``w``,
``u``) for the key head's ``Hv / Hk`` value heads (RESULTS.md "GDN chunked prefill, FlashQLA recipe" holds the
program shapes measured against it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.base.device import next_pow2
from kvjax.base.ragged import count_le
from kvjax.pallas.gdn.common import L2NORM_EPS, f32_precision, head_cols, load, store, tile_mask
from kvjax.pallas.gdn.common import dot as _dot

SUB = 16  # diagonal block size of the in-kernel inverse
INVERSE_DTYPES = ("bf16", "tf32")
INVERSES = ("doubling", "blocks", "substitution")


@dataclasses.dataclass(frozen=True)
class PrepConfig:
    """How the preparation kernel runs (the prepared quantities do not depend on it, up to rounding).

    ``num_warps``: Triton warps. ``inverse_dtype``: operands of the inverse's products for bf16 inputs,
    ``"bf16"`` (one bf16 pass; measured faster than ``"tf32"`` with the same output error, RESULTS.md "GDN chunked
    prefill") or ``"tf32"`` (float32 inputs always take the other products' precision).

    ``inverse``: how ``T = (I + L)^-1`` is formed (:func:`_unit_lower_inverse`, :func:`_block_unit_lower_inverse`):
    ``"doubling"`` (whole-chunk ``C x C`` doubling products), ``"blocks"`` (the ``16 x 16`` diagonal blocks by a
    short doubling, merged by block forward substitution; ``L``, ``T``, ``w``, ``u`` in ``16``-row blocks) or
    ``"substitution"`` (as ``"blocks"``, the diagonal blocks by row forward substitution in f32).
    """

    num_warps: int = 4
    inverse_dtype: str = "bf16"
    inverse: str = "doubling"

    def __post_init__(self):
        if not (isinstance(self.num_warps, int) and not isinstance(self.num_warps, bool) and self.num_warps >= 1):
            raise ValueError(f"PrepConfig.num_warps must be a positive int, got {self.num_warps!r}")
        if self.inverse_dtype not in INVERSE_DTYPES:
            raise ValueError(f"PrepConfig.inverse_dtype must be one of {INVERSE_DTYPES}, got {self.inverse_dtype!r}")
        if self.inverse not in INVERSES:
            raise ValueError(f"PrepConfig.inverse must be one of {INVERSES}, got {self.inverse!r}")


def _dot_t(a, b, *, precision):
    """``a @ b.T`` with float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _unit_lower_inverse(
    lmat: jax.Array,  # f32[C, C]  strictly lower
    mm,
    chunk: int,
) -> jax.Array:  # f32[C, C]
    """``(I + lmat)^-1`` without a row loop: with ``D`` the 16x16 block diagonal of ``lmat`` and ``E`` the rest,
    ``I + L = (I + D)(I + F)`` with ``F = (I + D)^-1 E``; ``D`` is nilpotent of order 16 and ``F`` of order
    ``C / 16``, so both inverses are finite products ``(I - X)(I + X^2)(I + X^4)...`` (10 products at C = 64)."""
    ri = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    ci = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
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
    return mm(inv_f, inv_d)


def _diag_inverses(
    diag: list,  # f32[SUB, SUB] each  strictly lower diagonal blocks
    mm,
    method: str,
) -> list:  # f32[SUB, SUB] each  (I + block)^-1
    """``(I + L_ii)^-1`` of the ``SUB x SUB`` diagonal blocks, side by side: ``"blocks"``: the doubling product
    ``(I - X)(I + X^2)(I + X^4)(I + X^8)`` (6 products of ``16^3`` per block, 4 deep); ``"substitution"``: row
    ``i`` of the inverse is ``e_i - sum_{j < i} L[i, j] T[j]``, one loop of 15 f32 row steps over every block
    (no product)."""
    ri = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    ci = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    eye = (ri == ci).astype(jnp.float32)
    if method == "substitution":
        def row_step(i, invs):
            out = []
            for lmat, inv in zip(diag, invs):
                row_l = jnp.sum(jnp.where(ri == i, lmat, 0.0), axis=0)  # f32[SUB]  L[i, :]
                out.append(inv - jnp.where(ri == i, jnp.sum(row_l[:, None] * inv, axis=0)[None, :], 0.0))
            return tuple(out)

        return list(lax.fori_loop(1, SUB, row_step, tuple(eye for _ in diag)))
    out = []
    for lmat in diag:
        power = -lmat
        inv = eye + power
        for _ in range(int(np.log2(SUB)) - 1):
            power = mm(power, power)
            inv = inv + mm(inv, power)
        out.append(inv)
    return out


def _block_unit_lower_inverse(
    blocks: dict,  # (i, j) -> f32[SUB, SUB]  block (i, j), i >= j, of the strictly lower lmat
    num_blocks: int,
    mm,
    method: str,
) -> dict:  # (i, j) -> f32[SUB, SUB]  block (i, j), i >= j, of (I + lmat)^-1
    """Block forward substitution for ``T = (I + L)^-1`` from ``SUB``-row blocks: ``T_ii = (I + L_ii)^-1``
    (:func:`_diag_inverses`) and ``T_ij = -T_ii sum_{j <= m < i} L_im T_mj`` for ``i > j``. At ``C = 64`` (4 blocks):
    the 4 diagonal inverses side by side, then 16 products of ``16^3`` (the longest chain: ``T_30`` after ``T_20``
    after ``T_10``, 6 products deep)."""
    t = dict(zip([(i, i) for i in range(num_blocks)],
                 _diag_inverses([blocks[i, i] for i in range(num_blocks)], mm, method)))
    for d in range(1, num_blocks):  # block diagonal d below the main one: needs only the diagonals above
        for j in range(num_blocks - d):
            i = j + d
            acc = mm(blocks[i, j], t[j, j])
            for m in range(j + 1, i):
                acc = acc + mm(blocks[i, m], t[m, j])
            t[i, j] = -mm(t[i, i], acc)
    return t


def _prep_kernel(
    seg_ref,  # i32[Tp]  sequence id per token, -1 outside every sequence
    q_ref,  # [Tp, Hk, K]  raw q
    k_ref,  # [Tp, Hk, K]  raw k
    v_ref,  # [Tp, Hv, V]
    g_ref,  # f32[Tp, Hv]  log-decay (0 outside every sequence)
    b_ref,  # f32[Tp, Hv]  beta (0 outside every sequence)
    w_ref,  # [NC, Hv, C, K]
    u_ref,  # [NC, Hv, C, V]
    a_ref,  # [NC, Hv, C, C]
    qf_ref,  # f32[NC, Hv, C]  q row factor of the sequential kernels
    kf_ref,  # f32[NC, Hv, C]  k row factor of the sequential kernels
    gl_ref,  # f32[NC, Hv, C]  gc at the segment's last token in the chunk
    *,
    group: int,
    chunk: int,
    scale: float,
    use_qk_l2norm: bool,
    precision,
    inv_precision,
    inverse: str,
):
    """Program ``(c, hk)`` = chunk ``c``, key head ``hk`` and its ``group`` value heads. Per chunk: the segment
    decay, ``L``, ``T = (I + L)^-1``, ``w``, ``u``, ``A`` and the row factors, with whole-chunk matmuls on the *raw*
    q / k (the l2norm and ``scale`` are per-row factors applied to the f32 products, so no normalised copy of q / k
    is ever written).

    With ``inverse != "doubling"``, ``L``, ``T``, ``w`` and ``u`` are formed in ``SUB``-row blocks
    (:func:`_block_unit_lower_inverse`; each block's ``gc`` from the same masked row sum over the whole chunk) and
    only the lower blocks of ``k k^T`` are computed.

    Segment cumulative decay without a scan: ``gc_i = sum_{j <= i, seg_j = seg_i} g_j`` (a masked row sum of
    the ``[C, C]`` same-segment mask) and ``gl_i = sum_{seg_j = seg_i} g_j``. Row factors: ``qf = |q|^-1
    scale exp(gc)`` and ``kf = |k|^-1 exp(gl - gc)`` (0 outside every sequence).
    """
    c, hk = pl.program_id(0), pl.program_id(1)
    heads = [hk * group + j for j in range(group)]
    dt = w_ref.dtype
    dot = functools.partial(_dot, precision=precision)
    if inv_precision == "bf16":  # one bf16 pass per product of the inverse (bf16 operands, f32 accumulation)
        def mm(a, b):
            return _dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), precision=None)
    else:
        mm = functools.partial(_dot, precision=inv_precision)
    kd, vd = q_ref.shape[2], v_ref.shape[2]
    (kc, kmask), (vc, vmask) = head_cols(kd), head_cols(vd)
    k_lanes = tile_mask((chunk, next_pow2(kd)), None, kmask)  # bool[C, Kp] | None
    v_lanes = tile_mask((chunk, next_pow2(vd)), None, vmask)  # bool[C, Vp] | None

    full = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    seg = seg_ref[full]
    q = load(q_ref, (full, hk, kc), k_lanes)
    k = load(k_ref, (full, hk, kc), k_lanes)
    ri = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    ci = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    keep = same & (ri >= ci)
    in_seq = seg >= 0

    def inv_norm(x):  # f32[rows]  |x|^-1 per row (1 without the l2norm)
        if not use_qk_l2norm:
            return jnp.ones((x.shape[0],), jnp.float32)
        xf = x.astype(jnp.float32)
        return lax.rsqrt(jnp.sum(xf * xf, axis=1) + L2NORM_EPS)

    rq, rk = inv_norm(q), inv_norm(k)
    qk = _dot_t(q, k, precision=precision) * (rq * scale)[:, None] * rk[None, :]
    if inverse == "doubling":
        kk = _dot_t(k, k, precision=precision) * rk[:, None] * rk[None, :]
    else:  # SUB-row blocks: raw k rows, their norms and the lower blocks of k k^T (shared by the value heads)
        nb = chunk // SUB
        sub = [pl.ds(pl.multiple_of(c * chunk + i * SUB, SUB), SUB) for i in range(nb)]
        kb_lanes = tile_mask((SUB, next_pow2(kd)), None, kmask)  # bool[SUB, Kp] | None
        vb_lanes = tile_mask((SUB, next_pow2(vd)), None, vmask)  # bool[SUB, Vp] | None
        seg_b = [seg_ref[sub[i]] for i in range(nb)]  # i32[SUB] each
        k_b = [load(k_ref, (sub[i], hk, kc), kb_lanes) for i in range(nb)]  # [SUB, Kp] each
        rk_b = [inv_norm(x) for x in k_b]
        ri_b = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
        ci_b = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
        kk_b, keep_b = {}, {}
        for i in range(nb):
            for j in range(i + 1):
                kk_b[i, j] = _dot_t(k_b[i], k_b[j], precision=precision) * rk_b[i][:, None] * rk_b[j][None, :]
                m = (seg_b[i][:, None] == seg_b[j][None, :]) & (seg_b[i][:, None] >= 0)
                keep_b[i, j] = m & (ri_b > ci_b) if i == j else m
        ci_row = lax.broadcasted_iota(jnp.int32, (SUB, chunk), 1)
        row_keep = [(seg_b[i][:, None] == seg[None, :]) & (seg_b[i][:, None] >= 0)
                    & (i * SUB + lax.broadcasted_iota(jnp.int32, (SUB, chunk), 0) >= ci_row) for i in range(nb)]
    for h in heads:
        g = g_ref[full, h]
        beta = b_ref[full, h]
        gc = jnp.sum(jnp.where(keep, g[None, :], 0.0), axis=1)  # f32[C]
        gl = jnp.sum(jnp.where(same, g[None, :], 0.0), axis=1)
        qf_ref[c, h, :] = jnp.where(in_seq, rq * scale * jnp.exp(gc), 0.0)
        kf_ref[c, h, :] = jnp.where(in_seq, rk * jnp.exp(gl - gc), 0.0)
        gl_ref[c, h, :] = gl
        decay = jnp.exp(jnp.where(keep, gc[:, None] - gc[None, :], -jnp.inf))  # f32[C, C]
        a_ref[c, h, :, :] = (qk * decay).astype(dt)
        if inverse == "doubling":
            lmat = jnp.where(ri > ci, kk * decay, 0.0) * beta[:, None]
            tinv = _unit_lower_inverse(lmat, mm, chunk).astype(dt)
            kb = (k.astype(jnp.float32) * (rk * beta * jnp.exp(gc))[:, None]).astype(dt)
            store(w_ref, (c, h, slice(None), kc), dot(tinv, kb).astype(dt), k_lanes)
            vb = (load(v_ref, (full, h, vc), v_lanes).astype(jnp.float32) * beta[:, None]).astype(dt)
            store(u_ref, (c, h, slice(None), vc), dot(tinv, vb).astype(dt), v_lanes)
            continue
        gc_b = [jnp.sum(jnp.where(row_keep[i], g[None, :], 0.0), axis=1) for i in range(nb)]  # f32[SUB] each
        beta_b = [b_ref[sub[i], h] for i in range(nb)]
        lmat = {}
        for (i, j), kkij in kk_b.items():
            dec = jnp.exp(jnp.where(keep_b[i, j], gc_b[i][:, None] - gc_b[j][None, :], -jnp.inf))
            lmat[i, j] = jnp.where(keep_b[i, j], kkij * dec, 0.0) * beta_b[i][:, None]
        tinv = _block_unit_lower_inverse(lmat, nb, mm, inverse)
        kb = [(k_b[j].astype(jnp.float32) * (rk_b[j] * beta_b[j] * jnp.exp(gc_b[j]))[:, None]).astype(dt)
              for j in range(nb)]
        vb = [(load(v_ref, (sub[j], h, vc), vb_lanes).astype(jnp.float32) * beta_b[j][:, None]).astype(dt)
              for j in range(nb)]
        for i in range(nb):
            t_ii = tinv[i, i].astype(dt)
            w_i, u_i = dot(t_ii, kb[i]), dot(t_ii, vb[i])  # f32[SUB, Kp], f32[SUB, Vp]
            for j in range(i):
                t_ij = tinv[i, j].astype(dt)
                w_i, u_i = w_i + dot(t_ij, kb[j]), u_i + dot(t_ij, vb[j])
            rows = pl.ds(i * SUB, SUB)
            store(w_ref, (c, h, rows, kc), w_i.astype(dt), kb_lanes)
            store(u_ref, (c, h, rows, vc), u_i.astype(dt), vb_lanes)


def _prep_call(seg, q, k, v, g, beta, *, chunk, scale, use_qk_l2norm, config: PrepConfig, interpret):
    tp, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    nc = tp // chunk
    dt = q.dtype
    precision = f32_precision(interpret) if dt == jnp.float32 else None
    # products of the inverse: as the others for f32 inputs; for bf16 inputs one TF32 pass (full f32 in interpret
    # mode, where TF32 does not exist) or one bf16 pass (T is rounded to bf16 right after, as in fla)
    if dt == jnp.float32:
        inv_precision = precision
    elif config.inverse_dtype == "bf16":
        inv_precision = "bf16"
    else:
        inv_precision = lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32
    kernel = functools.partial(_prep_kernel, group=hv // hk, chunk=chunk, scale=scale, use_qk_l2norm=use_qk_l2norm,
                               precision=precision, inv_precision=inv_precision,
                               inverse=config.inverse)
    rowf = jax.ShapeDtypeStruct((nc, hv, chunk), jnp.float32)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((nc, hv, chunk, kd), dt),
            jax.ShapeDtypeStruct((nc, hv, chunk, vd), dt),
            jax.ShapeDtypeStruct((nc, hv, chunk, chunk), dt),
            rowf, rowf, rowf,
        ),
        grid=(nc, hk),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_prep",
    )(seg, q, k, v, g, beta)


def prepare(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    cu_seqlens: jax.Array,  # i32[N+1]
    *,
    scale: float,
    use_qk_l2norm: bool,
    chunk: int,
    config: PrepConfig = PrepConfig(),
    interpret: bool = False,
):
    """State-independent per-chunk quantities (see the module docstring); all chunks and heads in parallel.

    ``config``: how the kernel runs (:class:`PrepConfig`).

    Returns ``(q, k, w, u, a, qf, kf, gl)``: q / k padded to ``Tp = NC * C`` tokens but otherwise *raw* (the
    sequential kernels scale their rows by ``qf`` / ``kf``), ``w: [NC, Hv, C, K]``, ``u: [NC, Hv, C, V]``,
    ``a: [NC, Hv, C, C]`` in the input dtype and ``qf, kf, gl: f32[NC, Hv, C]``. Everything is computed by
    :func:`_prep_kernel`; only the segment ids and the padding are XLA.
    """
    if not isinstance(config, PrepConfig):
        raise ValueError(f"config must be a PrepConfig, got {config!r}")
    num_tokens = q.shape[0]
    num_chunks = -(-num_tokens // chunk)
    tp = num_chunks * chunk
    num_seqs = cu_seqlens.shape[0] - 1

    def pad(x):
        return x if tp == num_tokens else jnp.pad(x, [(0, tp - num_tokens)] + [(0, 0)] * (x.ndim - 1))

    t = jnp.arange(tp, dtype=jnp.int32)
    seq = count_le(cu_seqlens, t) - 1
    valid = (seq >= 0) & (seq < num_seqs) & (t < num_tokens)
    seg = jnp.where(valid, seq, -1)  # i32[Tp]
    qp, kp, vp = pad(q), pad(k), pad(v)
    gp = jnp.where(valid[:, None], pad(g).astype(jnp.float32), 0.0)  # f32[Tp, Hv]
    bp = jnp.where(valid[:, None], pad(beta).astype(jnp.float32), 0.0)
    w, u, a, qf, kf, gl = _prep_call(
        seg, qp, kp, vp, gp, bp, chunk=chunk, scale=scale, use_qk_l2norm=use_qk_l2norm, config=config,
        interpret=interpret)
    return qp, kp, w, u, a, qf, kf, gl
