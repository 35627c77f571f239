"""Preparation stage of the chunked gated delta rule: the state-independent per-chunk quantities.

For every global chunk of ``C = 64`` tokens and value head (all in parallel; see :mod:`kvjax.pallas.gdn_chunk`
for how chunks are shared by sequences): the per-sequence cumulative log-decay ``gc``, its value ``gl`` at
the sequence's last token in the chunk, ``T = (I + tril(beta k k^T * decay, -1))^-1``, ``w = T (beta exp(gc) k)``,
``u = T (beta v)`` and the causal intra-chunk scores ``A = (q k^T) * decay`` (fla's "WY" form).

``_prep_kernel`` (Pallas, Triton lowering) computes ``w``, ``u``, ``A`` with whole-chunk matmuls;
``_prepare`` adds the cheap XLA parts (l2norm, cumulative decay) and keeps two pure-XLA variants of the
inverse (batched triangular solve, nilpotent doubling) as cross-checks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.pallas.gdn_recurrent import L2NORM_EPS

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

    ``prep="pallas"``: ``w``, ``u``, ``A`` by :func:`_prep_kernel` (block-nilpotent inverse, whole-chunk matmuls);
    ``"solve"`` / ``"doubling"``: pure XLA (batched triangular solve / nilpotent doubling), kept as cross-checks.
    """
    num_tokens, hk, _ = q.shape
    hv = v.shape[1]
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
