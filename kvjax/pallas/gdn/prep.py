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
each), the inverse (10 dependent ``64^3`` products, 5.2 MFLOP), ``w`` and ``u`` (1 MFLOP each); 48 KB read
(q, k, v rows) and 41 KB written (w, u, A, row factors). One program per (chunk, key head): it reads q / k once,
forms ``q k^T`` / ``k k^T`` once and runs the per-value-head part (decay, ``A``, inverse, ``w``, ``u``) for the
key head's ``Hv / Hk`` value heads (RESULTS.md "GDN chunked prefill, FlashQLA recipe" holds the program shapes
measured against it).
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
from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call

SUB = 16  # diagonal block size of the in-kernel inverse
INVERSE_DTYPES = ("bf16", "tf32")
KERNELS = ("triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class PrepConfig:
    """How the preparation kernel runs (the prepared quantities do not depend on it, up to rounding).

    ``num_warps``: Triton warps. ``inverse_dtype``: operands of the inverse's products for bf16 inputs,
    ``"bf16"`` (one bf16 pass; measured faster than ``"tf32"`` with the same output error, RESULTS.md "GDN chunked
    prefill") or ``"tf32"`` (float32 inputs always take the other products' precision). ``kernel``: ``"triton"``
    (:func:`_prep_kernel`) or ``"mosaic"`` (:mod:`kvjax.pallas.gdn.prep_mgpu`, Hopper wgmma: bf16 inputs, the
    ``"bf16"`` inverse, the shapes its ``shape_reason`` accepts; ``num_warps`` does not apply).
    ``value_heads`` (``"mosaic"`` only): value heads per CTA, a divisor of ``Hv / Hk``; 0 = all of a key head's.
    """

    num_warps: int = 4
    inverse_dtype: str = "bf16"
    kernel: str = "triton"
    value_heads: int = 0

    def __post_init__(self):
        if not (isinstance(self.num_warps, int) and not isinstance(self.num_warps, bool) and self.num_warps >= 1):
            raise ValueError(f"PrepConfig.num_warps must be a positive int, got {self.num_warps!r}")
        if self.inverse_dtype not in INVERSE_DTYPES:
            raise ValueError(f"PrepConfig.inverse_dtype must be one of {INVERSE_DTYPES}, got {self.inverse_dtype!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"PrepConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not (isinstance(self.value_heads, int) and not isinstance(self.value_heads, bool) and self.value_heads >= 0):
            raise ValueError(f"PrepConfig.value_heads must be an int >= 0, got {self.value_heads!r}")
        if self.kernel != "mosaic" and self.value_heads:
            raise ValueError(f"PrepConfig.value_heads applies to kernel='mosaic' only, got {self.value_heads!r}")
        if self.kernel == "mosaic" and self.inverse_dtype != "bf16":
            raise ValueError(f"PrepConfig(kernel='mosaic') takes inverse_dtype='bf16' only, got {self.inverse_dtype!r}")


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
):
    """Program ``(c, hk)`` = chunk ``c``, key head ``hk`` and its ``group`` value heads. Per chunk: the segment
    decay, ``L``, ``T = (I + L)^-1``, ``w``, ``u``, ``A`` and the row factors, with whole-chunk matmuls on the *raw*
    q / k (the l2norm and ``scale`` are per-row factors applied to the f32 products, so no normalised copy of q / k
    is ever written).

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
    if use_qk_l2norm:
        qf32, kf32 = q.astype(jnp.float32), k.astype(jnp.float32)
        rq = lax.rsqrt(jnp.sum(qf32 * qf32, axis=1) + L2NORM_EPS)
        rk = lax.rsqrt(jnp.sum(kf32 * kf32, axis=1) + L2NORM_EPS)
    else:
        rq = rk = jnp.ones((chunk,), jnp.float32)
    qk = _dot_t(q, k, precision=precision) * (rq * scale)[:, None] * rk[None, :]
    kk = _dot_t(k, k, precision=precision) * rk[:, None] * rk[None, :]
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
        lmat = jnp.where(ri > ci, kk * decay, 0.0) * beta[:, None]
        tinv = _unit_lower_inverse(lmat, mm, chunk).astype(dt)
        kb = (k.astype(jnp.float32) * (rk * beta * jnp.exp(gc))[:, None]).astype(dt)
        store(w_ref, (c, h, slice(None), kc), dot(tinv, kb).astype(dt), k_lanes)
        vb = (load(v_ref, (full, h, vc), v_lanes).astype(jnp.float32) * beta[:, None]).astype(dt)
        store(u_ref, (c, h, slice(None), vc), dot(tinv, vb).astype(dt), v_lanes)


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
                               precision=precision, inv_precision=inv_precision)
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



def padded_operands(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    cu_seqlens: jax.Array,  # i32[N+1]
    chunk: int,
) -> tuple[jax.Array, ...]:
    """The preparation kernels' operands: the segment ids ``seg: i32[Tp]`` (a token's sequence, -1 outside every
    sequence), q / k / v padded to ``Tp`` (a multiple of ``chunk``) tokens, and ``g`` / ``beta`` as ``f32[Tp, Hv]``,
    zero outside every sequence."""
    num_tokens = q.shape[0]
    tp = -(-num_tokens // chunk) * chunk
    num_seqs = cu_seqlens.shape[0] - 1

    def pad(x):
        return x if tp == num_tokens else jnp.pad(x, [(0, tp - num_tokens)] + [(0, 0)] * (x.ndim - 1))

    t = jnp.arange(tp, dtype=jnp.int32)
    seq = count_le(cu_seqlens, t) - 1
    valid = (seq >= 0) & (seq < num_seqs) & (t < num_tokens)
    seg = jnp.where(valid, seq, -1)  # i32[Tp]
    gp = jnp.where(valid[:, None], pad(g).astype(jnp.float32), 0.0)  # f32[Tp, Hv]
    bp = jnp.where(valid[:, None], pad(beta).astype(jnp.float32), 0.0)  # f32[Tp, Hv]
    return seg, pad(q), pad(k), pad(v), gp, bp

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
    :func:`_prep_kernel` (or, with ``config.kernel="mosaic"``, :func:`kvjax.pallas.gdn.prep_mgpu.prep_mgpu_call`,
    which raises ``ValueError`` for shapes it does not take); only the segment ids and the padding are XLA.
    """
    if not isinstance(config, PrepConfig):
        raise ValueError(f"config must be a PrepConfig, got {config!r}")
    seg, qp, kp, vp, gp, bp = padded_operands(q, k, v, g, beta, cu_seqlens, chunk)
    if config.kernel == "mosaic":
        w, u, a, qf, kf, gl = prep_mgpu_call(seg, qp, kp, vp, gp, bp, chunk=chunk, scale=scale,
                                             use_qk_l2norm=use_qk_l2norm, value_heads=config.value_heads,
                                             interpret=interpret)
    else:
        w, u, a, qf, kf, gl = _prep_call(
            seg, qp, kp, vp, gp, bp, chunk=chunk, scale=scale, use_qk_l2norm=use_qk_l2norm, config=config,
            interpret=interpret)
    return qp, kp, w, u, a, qf, kf, gl
