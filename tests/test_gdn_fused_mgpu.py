"""GDN chunked prefill with FlashQLA's layout: the Mosaic GPU preparation's ``outputs="inverse"`` (no ``w`` / ``u``)
and the fused sequential pass (``seq_mgpu_call(fused=True)``: ``v_new = Tb (v - kr * (k S))`` from raw ``v``).

CPU: both kernels under the Mosaic GPU interpreter (their products in jnp) and their lowering for CUDA without a
GPU. GPU (``gpu`` marker): the compiled kernels through the ``"mosaic-fused"`` backend. References: ``Tb`` against a
float32 numpy inverse per chunk; the whole forward against the f32 recurrent reference (the bf16 bound of the GDN
tests, relative L2 error <= 2e-2) and against the Triton sequential kernel (1e-2, as ``test_gdn_seq_mgpu.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.gdn import make_inputs, rel_err

TB_TOL = 2e-3  # Tb against the f32 inverse: bf16 operands of the doubling products, one bf16 rounding (seen: 2e-4)
WU_TOL = 1e-2  # w, u against Tb (kr * k), Tb v: the default kernel's bf16 roundings of beta exp(gc) k, beta v, T


def _segments(cu, tp):  # i32[Tp] sequence id per token, -1 outside every sequence
    t = np.arange(tp)
    seq = np.searchsorted(np.asarray(cu), t, side="right") - 1
    return np.where((seq >= 0) & (seq < len(cu) - 1), seq, -1).astype(np.int32)


def _reference_tb(seg, k, g, beta, hv, l2):
    """f32 numpy ``(I + tril(beta k~ k~^T * decay, -1))^-1 diag(beta)`` and ``kr = |k|^-1 exp(gc)`` per chunk of
    64 and value head."""
    tp, hk, _ = k.shape
    nc = tp // 64
    k = np.asarray(k, np.float32)
    rk = 1.0 / np.sqrt(np.sum(k * k, -1) + 1e-6) if l2 else np.ones(k.shape[:2], np.float32)  # [Tp, Hk]
    k = k * rk[..., None]
    g, beta = np.asarray(g, np.float32), np.asarray(beta, np.float32)
    tb = np.zeros((nc, hv, 64, 64), np.float32)
    kr = np.zeros((nc, hv, 64), np.float32)
    for c in range(nc):
        rs = slice(64 * c, 64 * c + 64)
        s = seg[rs]
        same = (s[:, None] == s[None, :]) & (s[None, :] >= 0)
        keep = same & np.tri(64, dtype=bool)
        for h in range(hv):
            kc = k[rs, h // (hv // hk)]
            gc = np.sum(np.where(keep, g[rs, h][None, :], 0.0), axis=1)
            decay = np.where(keep, np.exp(gc[:, None] - gc[None, :]), 0.0)
            lmat = np.tril(beta[rs, h][:, None] * (kc @ kc.T) * decay, -1)
            tb[c, h] = np.linalg.inv(np.eye(64) + lmat) * beta[rs, h][None, :]
            kr[c, h] = np.where(s >= 0, rk[rs, h // (hv // hk)] * np.exp(gc), 0.0)
    return tb, kr


def _prep_inputs(rng, lens, hk, hv, kd, vd, l2, lead=3):
    q, k, v, g, beta, cu, _ = make_inputs(rng, lens, hk, hv, kd, vd, jnp.bfloat16, pad_tokens=4, unit_qk=not l2)
    cu = cu + lead
    tp = -(-(q.shape[0] + lead) // 64) * 64

    def pad(x):
        return jnp.pad(x, [(lead, tp - lead - x.shape[0])] + [(0, 0)] * (x.ndim - 1))

    seg = _segments(cu, tp)
    valid = jnp.asarray(seg >= 0)[:, None]
    gp = jnp.where(valid, pad(g), 0.0)
    bp = jnp.where(valid, pad(beta).astype(jnp.float32), 0.0)
    return jnp.asarray(seg), pad(q), pad(k), pad(v), gp, bp


@pytest.mark.parametrize("hk,hv,kd,vd,l2", [(1, 2, 64, 64, True), (1, 1, 128, 64, False)])
def test_prep_inverse_interpret(rng, hk, hv, kd, vd, l2):
    """``outputs="inverse"``: ``Tb`` within bf16 of the f32 inverse times ``diag(beta)`` of every chunk (three
    sequences sharing chunks, tokens outside every sequence), ``kr`` within f32 rounding of ``|k|^-1 exp(gc)``;
    ``A`` and the row factors equal to the default outputs' bit for bit; and the identities the fused pass
    rests on: ``w = Tb (kr * k)``, ``u = Tb v`` within bf16."""
    from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call

    seg, q, k, v, g, beta = _prep_inputs(rng, [5, 23, 70], hk, hv, kd, vd, l2)
    kw = dict(chunk=64, scale=kd ** -0.5, use_qk_l2norm=l2, interpret=True)
    tb, a, qf, kf, gl, kr = prep_mgpu_call(seg, q, k, v, g, beta, outputs="inverse", **kw)
    w, u, a0, qf0, kf0, gl0 = prep_mgpu_call(seg, q, k, v, g, beta, **kw)
    nc = q.shape[0] // 64
    assert tb.shape == (nc, hv, 64, 64) and tb.dtype == jnp.bfloat16 and kr.shape == (nc, hv, 64)
    want_tb, want_kr = _reference_tb(np.asarray(seg), k, g, beta, hv, l2)
    assert rel_err(tb, want_tb) <= TB_TOL, rel_err(tb, want_tb)
    np.testing.assert_allclose(np.asarray(kr), want_kr, rtol=1e-4, atol=1e-6)
    for got, want in ((a, a0), (qf, qf0), (kf, kf0), (gl, gl0)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    f32 = np.float32
    kc = np.asarray(k, f32).reshape(nc, 64, hk, kd).transpose(0, 2, 1, 3).repeat(hv // hk, axis=1)
    vc = np.asarray(v, f32).reshape(nc, 64, hv, vd).transpose(0, 2, 1, 3)
    tbf = np.asarray(tb, f32)
    assert rel_err(tbf @ (np.asarray(kr)[..., None] * kc), w) <= WU_TOL
    assert rel_err(tbf @ vc, u) <= WU_TOL


def test_prep_inverse_lowers_for_cuda():
    """``outputs="inverse"`` lowers to a Mosaic GPU module for CUDA without a GPU (K = 128 and 64, one and two value
    heads per CTA), under the Lane semantics."""
    from jax import export

    from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call

    sds, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    for kd, vd, hk, hv, value_heads in [(128, 128, 2, 4, 0), (64, 128, 1, 2, 1)]:
        tp = 256
        args = (sds((tp,), jnp.int32), sds((tp, hk, kd), bf16), sds((tp, hk, kd), bf16), sds((tp, hv, vd), bf16),
                sds((tp, hv), f32), sds((tp, hv), f32))
        fn = jax.jit(lambda *a, vh=value_heads: prep_mgpu_call(*a, chunk=64, scale=0.1, use_qk_l2norm=True,
                                                               value_heads=vh, outputs="inverse"))
        assert "mosaic_gpu" in export.export(fn, platforms=["cuda"])(*args).mlir_module()
