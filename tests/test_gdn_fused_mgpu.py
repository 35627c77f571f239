"""GDN chunked prefill with FlashQLA's layout: the Mosaic GPU preparation's ``outputs="inverse"`` (no ``w`` / ``u``)
and the fused sequential pass (``seq_mgpu_fused_call``: ``v_new = Tb (v - kr * (k S))`` from raw ``v``).

CPU: both kernels under the Mosaic GPU interpreter (their products in jnp) and their lowering for CUDA without a
GPU; the ``"mosaic-fused"`` backends of both prefill tables (``auto`` takes them on Hopper where they were measured
fastest: :func:`kvjax.pallas.gdn.chunk.mosaic_fused_preferred`). GPU (``gpu`` marker): the compiled kernels, also
through the ``"mosaic-fused"`` backends (``chunk_gated_delta_rule`` and the slot-pool ``gdn_prefill_pool`` against
its gather -> reference -> scatter oracle). The preparation's ``outputs="inverse"`` runs its value heads' inverses
in lockstep (its only form). References: ``Tb`` against a float32 numpy inverse per chunk; the whole forward
against the f32 recurrent reference (the bf16 bound of the GDN tests, relative L2 error <= 2e-2) and against the
Triton sequential kernel on the same tokens (1e-2: other bf16 roundings).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.gdn import GPU_LENS, TOL, check_pool_op, make_inputs, rel_err, row_flags
from helpers.mosaic_interpret import cache_thread_programs
from kvjax.base.device import current_device
from kvjax.errors import UnknownImplError
from kvjax.ops import gdn, gdn_on_pool
from kvjax.state import gdn_pool
from kvjax.pallas.gdn.prep import padded_operands

SAME_TOL = 1e-2  # against the Triton sequential kernel (other bf16 roundings: Tb, kr * (k S), v - ...)
TB_TOL = 2e-3  # Tb against the f32 inverse: bf16 operands of the doubling products, one bf16 rounding (seen: 2e-4)
WU_TOL = 1e-2  # w, u against Tb (kr * k), Tb v: the default kernel's bf16 roundings of beta exp(gc) k, beta v, T


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
    """The preparation's operands (:func:`padded_operands`) with ``lead`` tokens outside every sequence in front."""
    q, k, v, g, beta, cu, _ = make_inputs(rng, lens, hk, hv, kd, vd, jnp.bfloat16, pad_tokens=4, unit_qk=not l2)
    front = [jnp.pad(x, [(lead, 0)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta)]
    return padded_operands(*front, cu + lead, 64)


@pytest.mark.parametrize("hk,hv,kd,vd,l2", [(1, 2, 64, 64, True), (1, 1, 128, 64, False)])
def test_prep_inverse_interpret(rng, hk, hv, kd, vd, l2):
    """``outputs="inverse"``: ``Tb`` within bf16 of the f32 inverse times ``diag(beta)`` of every chunk (three
    sequences sharing chunks, tokens outside every sequence), ``kr`` within f32 rounding of ``|k|^-1 exp(gc)``;
    ``A`` and the row factors equal to the default outputs' bit for bit; and the identities the fused pass
    rests on: ``w = Tb (kr * k)``, ``u = Tb v`` within bf16."""
    from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call

    seg, q, k, v, g, beta = _prep_inputs(rng, [5, 23, 70], hk, hv, kd, vd, l2)
    kw = dict(chunk=64, scale=kd ** -0.5, use_qk_l2norm=l2, interpret=True)
    tb, a, rowf = prep_mgpu_call(seg, q, k, v, g, beta, outputs="inverse", **kw)
    qf, kf, gl, kr = (rowf[:, :, i] for i in range(4))
    w, u, a0, qf0, kf0, gl0 = prep_mgpu_call(seg, q, k, v, g, beta, **kw)
    nc = q.shape[0] // 64
    assert tb.shape == (nc, hv, 64, 64) and tb.dtype == jnp.bfloat16 and rowf.shape == (nc, hv, 4, 64)
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


def check_inverse(rng, lens, hk, hv, kd, vd, *, value_heads, l2, interpret, lead=3):
    """``prep_mgpu_call(outputs="inverse")`` (the value heads' inverses in lockstep) against the f32 references
    (:func:`_reference_tb`): ``Tb`` within bf16, ``kr`` within f32 rounding; ``A`` and the row factors equal to
    ``outputs="all"``'s bit for bit (the same f32 arithmetic); and ``outputs="all"``'s ``w = Tb (kr * k)``,
    ``u = Tb v`` within the bf16 roundings of ``beta exp(gc) k``, ``beta v`` and ``T``."""
    from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call

    seg, q, k, v, g, beta = _prep_inputs(rng, lens, hk, hv, kd, vd, l2, lead=lead)
    kw = dict(chunk=64, scale=kd ** -0.5, use_qk_l2norm=l2, value_heads=value_heads, interpret=interpret)
    tb, a, rowf = prep_mgpu_call(seg, q, k, v, g, beta, outputs="inverse", **kw)
    qf, kf, gl, kr = (rowf[:, :, i] for i in range(4))
    w, u, *rest = prep_mgpu_call(seg, q, k, v, g, beta, outputs="all", **kw)
    for i, (x, y) in enumerate(zip((a, qf, kf, gl), rest)):
        diff = float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
        assert x.shape == y.shape and x.dtype == y.dtype and diff == 0, (i, diff)
    want_tb, want_kr = _reference_tb(np.asarray(seg), k, g, beta, hv, l2)
    assert rel_err(tb, want_tb) <= TB_TOL, rel_err(tb, want_tb)
    np.testing.assert_allclose(np.asarray(kr), want_kr, rtol=1e-4, atol=1e-6)
    nc = q.shape[0] // 64
    kc = np.asarray(k, np.float32).reshape(nc, 64, hk, kd).transpose(0, 2, 1, 3).repeat(hv // hk, axis=1)
    vc = np.asarray(v, np.float32).reshape(nc, 64, hv, vd).transpose(0, 2, 1, 3)
    assert rel_err(want_tb @ (want_kr[..., None] * kc), w) <= WU_TOL, rel_err(want_tb @ (want_kr[..., None] * kc), w)
    assert rel_err(want_tb @ vc, u) <= WU_TOL, rel_err(want_tb @ vc, u)


@pytest.mark.parametrize("hk,hv,kd,vd,value_heads,l2", [
    (1, 4, 64, 64, 0, True),  # 4 heads a CTA in lockstep
    (1, 2, 128, 128, 0, False),  # the benchmark shapes' CTA: 2 heads
    (2, 2, 128, 64, 0, True)])  # 1 head a CTA
def test_prep_inverse_heads_interpret(rng, monkeypatch, hk, hv, kd, vd, value_heads, l2):
    """The lockstep inverses of ``outputs="inverse"`` under the Mosaic GPU interpreter (:func:`check_inverse`):
    K = V = 64 and 128, 1, 2 and 4 value heads a CTA, three sequences sharing one chunk, tokens outside every
    sequence at both ends."""
    cache_thread_programs(monkeypatch)
    check_inverse(rng, [5, 30, 20], hk, hv, kd, vd, value_heads=value_heads, l2=l2, interpret=True)


def test_prep_lowers_for_cuda_benchmark_cta():
    """The preparation lowers to a Mosaic GPU module for CUDA without a GPU at the benchmark shapes' CTA
    (K = V = 128, 2 value heads): both ``outputs`` under the Lane semantics, both under Warpgroup (jax 0.11's
    default)."""
    from jax import export
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call

    sds, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    lane, warpgroup = plgpu.LoweringSemantics.Lane, plgpu.LoweringSemantics.Warpgroup
    for outputs in ("all", "inverse"):
        for sem in (lane, warpgroup):
            kd, vd, hk, hv, tp = 128, 128, 2, 4, 256
            args = (sds((tp,), jnp.int32), sds((tp, hk, kd), bf16), sds((tp, hk, kd), bf16),
                    sds((tp, hv, vd), bf16), sds((tp, hv), f32), sds((tp, hv), f32))
            fn = jax.jit(lambda *a, o=outputs, s=sem: prep_mgpu_call(
                *a, chunk=64, scale=0.1, use_qk_l2norm=True, outputs=o, semantics=s))
            assert "mosaic_gpu" in export.export(fn, platforms=["cuda"])(*args).mlir_module()


def check_fused(rng, lens, hk, hv, kd, vd, *, block_v, interpret, lead=2, pad_tokens=5, l2=True):
    """The pool kernel with ``seq="fused"`` against the recurrent reference and ``seq="triton"``: ``lead`` tokens
    before the first sequence and ``pad_tokens`` after the last (outputs zero), a row without initial state, a
    padding row (its pool row untouched), an ungated value head."""
    from kvjax.pallas.gdn.chunk import chunk_gated_delta_rule_pool

    q, k, v, g, beta, cu, s0 = make_inputs(rng, lens, hk, hv, kd, vd, jnp.bfloat16, pad_tokens=pad_tokens,
                                           unit_qk=not l2)
    g = g.at[:, hv - 1].set(0.0)
    cu = cu + lead
    n = len(lens)
    flags, pad_row = row_flags(n)
    kw = dict(cu_seqlens=cu, rows=jnp.arange(n, dtype=jnp.int32), flags=flags, scale=kd ** -0.5, use_qk_l2norm=l2,
              interpret=interpret)
    o, pool = chunk_gated_delta_rule_pool(q, k, v, g, beta, jnp.array(s0, copy=True), seq="fused",
                                          block_v=block_v, **kw)
    to, tpool = chunk_gated_delta_rule_pool(q, k, v, g, beta, jnp.array(s0, copy=True), seq="triton",
                                            segment_chunks=0, **kw)
    init = s0.at[min(2, n - 1)].set(0.0)
    ro, rf = gdn.recurrent_gated_delta_rule_reference(gdn.DeltaRuleCall(q, k, v, g, beta, cu, kd ** -0.5,
                                                                        use_qk_l2norm=l2), init)
    live = np.asarray(flags) != 0
    c = [int(x) for x in cu]
    keep = np.zeros(o.shape[0], bool)
    keep[c[0]:c[-1]] = True
    if pad_row:  # the padding row's tokens are zeros, its pool row unchanged
        keep[c[3]:c[4]] = False
        assert np.all(np.asarray(o[c[3]:c[4]], np.float32) == 0)
        np.testing.assert_array_equal(np.asarray(pool[3]), np.asarray(s0[3]))
    assert o.shape == v.shape and o.dtype == v.dtype and pool.shape == s0.shape
    assert rel_err(o[keep], ro[keep]) <= TOL[jnp.bfloat16], rel_err(o[keep], ro[keep])
    assert rel_err(pool[live], rf[live]) <= TOL[jnp.bfloat16], rel_err(pool[live], rf[live])
    assert rel_err(o, to) <= SAME_TOL and rel_err(pool, tpool) <= SAME_TOL, (rel_err(o, to), rel_err(pool, tpool))
    outside = np.concatenate([np.asarray(o[:c[0]], np.float32), np.asarray(o[c[-1]:], np.float32)])
    assert np.all(outside == 0), "tokens outside every sequence must be zero"


@pytest.mark.parametrize("hk,hv,kd,vd,block_v", [(1, 2, 64, 64, 32), (1, 1, 128, 128, 64)])
def test_fused_interpret(rng, hk, hv, kd, vd, block_v):
    """The whole forward in FlashQLA's layout (inverse-only preparation, fused pass) under the interpreter:
    sequences that start and end inside chunks, an empty one, a row without initial state, a padding row; value
    blocks of 32 and 64 columns (64- and 128-byte swizzles), K = V = 64 and 128."""
    check_fused(rng, [5, 0, 23, 40, 70], hk, hv, kd, vd, block_v=block_v, interpret=True)


@pytest.mark.slow
def test_fused_kernel_variants_interpret(rng):
    """``seq_mgpu_fused_call`` itself against the Triton sequential kernel on the default preparation's operands:
    without the overlap (2 stages) and with it at 3 stages on rows at chunk edges (an empty row on a chunk boundary,
    three rows sharing a chunk, an empty last row), as segments would be walked from given start states; with two
    consumer warpgroups of 32 columns sharing the ring (a producer warpgroup, the state tiles in the ring's memory) on
    two rows sharing a chunk, one without an initial state (the interpreter takes ~7 s a CTA there; the GPU test
    walks the ragged grid); one consumer issuing its own copies (3 stages) and beside a producer warpgroup that issues
    them (2 stages); an engine step's bucket (one 64-column block): a padding row without tokens (no work) between
    live rows, and a last padding row that owns the tokens past every sequence."""
    from kvjax.pallas.gdn.chunk import _chunk_call
    from kvjax.pallas.gdn.prep import prepare
    from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call
    from kvjax.pallas.gdn.seq_mgpu import seq_mgpu_fused_call

    cases = [([64, 0, 30, 5, 29, 0], [3, 3, 2, 3, 3, 3], [(False, 2, 1, None), (True, 3, 1, False),
                                                          (True, 2, 1, True)], 0, 32),
             ([40, 88], [3, 2], [(True, 2, 2, None)], 0, 32),
             ([3, 0, 100, 0], [3, 0, 2, 0], [(True, 2, 1, None)], 25, 64)]  # (lens, flags, forms, pad, block_v)
    for lens, flags, forms, pad, bv in cases:
        q, k, v, g, beta, cu, s0 = make_inputs(rng, lens, 1, 1, 64, 64, jnp.bfloat16, pad_tokens=pad)
        ops = prepare(q, k, v, g, beta, cu, scale=0.125, use_qk_l2norm=True, chunk=64, interpret=True)
        seg = padded_operands(q, k, v, g, beta, cu, 64)[0]
        bf = beta.astype(jnp.float32)
        tb, a, rowf = prep_mgpu_call(seg, q, k, v, g, bf, chunk=64, scale=0.125, use_qk_l2norm=True,
                                     outputs="inverse", interpret=True)
        rows, flags = jnp.arange(len(lens), dtype=jnp.int32), jnp.asarray(flags, jnp.int32)
        want = _chunk_call(*ops, jnp.array(s0, copy=True), cu, rows, flags, out_dtype=jnp.bfloat16, block_v=32,
                           num_warps=4, num_stages=2, interpret=True)
        for overlap, stages, wgs, producer in forms:
            got = seq_mgpu_fused_call(q, k, v, tb, a, rowf, jnp.array(s0, copy=True), cu, rows, flags,
                                      out_dtype=jnp.bfloat16, block_v=bv, stages=stages, overlap=overlap,
                                      warpgroups=wgs, producer=producer, interpret=True)
            assert rel_err(got[0], want[0]) <= SAME_TOL and rel_err(got[1], want[1]) <= SAME_TOL, (
                lens, overlap, stages, wgs, producer, rel_err(got[0], want[0]), rel_err(got[1], want[1]))


def test_fused_lowers_for_cuda():
    """The fused pass lowers to a Mosaic GPU module for CUDA without a GPU (the Tb product on the ring's Tb tile,
    the raw v box of the ring) at K = V = 128 with value blocks of 32 (3 stages) and 64 (2 stages), K = 64 with
    V = 128 in one block, without the overlap once (and there with Pallas's automatic barriers, off by default), with
    two 64-column consumer warpgroups (a producer warpgroup and a ``RefUnion`` of the ring and the state tiles), one
    consumer beside a producer (the default with the overlap: the ``_p`` kernel) or issuing its own copies, under the
    Lane semantics; and the whole forward (``seq="fused"``: both kernels) at K = V = 128."""
    from jax import export

    from kvjax.pallas.gdn.chunk import chunk_gated_delta_rule_pool
    from kvjax.pallas.gdn.seq_mgpu import seq_mgpu_fused_call

    sds, bf16, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    for kd, vd, hk, hv, n, block_v, stages, overlap, wgs, prod in [(128, 128, 2, 4, 3, 32, 3, True, 1, None),
                                                                    (128, 128, 2, 4, 1, 64, 2, True, 1, None),
                                                                    (64, 128, 1, 2, 2, 128, 2, True, 1, None),
                                                                    (128, 128, 2, 4, 2, 64, 2, False, 1, None),
                                                                    (128, 128, 2, 4, 2, 64, 2, True, 2, None),
                                                                    (128, 128, 2, 4, 1, 32, 2, True, 1, False)]:
        tp, nc = 256, 4
        args = (sds((tp, hk, kd), bf16), sds((tp, hk, kd), bf16), sds((tp, hv, vd), bf16),
                sds((nc, hv, 64, 64), bf16), sds((nc, hv, 64, 64), bf16), sds((nc, hv, 4, 64), f32),
                sds((n + 2, hv, kd, vd), f32), sds((n + 1,), i32), sds((n,), i32), sds((n,), i32))
        fn = jax.jit(lambda *a, bv=block_v, st=stages, ov=overlap, w=wgs, p=prod: seq_mgpu_fused_call(
            *a, out_dtype=bf16, block_v=bv, stages=st, overlap=ov, warpgroups=w, producer=p, auto_barriers=not ov))
        module = export.export(fn, platforms=["cuda"])(*args).mlir_module()
        producer = wgs == 1 and overlap and prod is None  # the default with the overlap
        assert "mosaic_gpu" in module and (("gdn_seq_mgpu_fused_p" in module) == producer)
    t, hk, hv = 200, 2, 4
    args = (sds((t, hk, 128), bf16), sds((t, hk, 128), bf16), sds((t, hv, 128), bf16), sds((t, hv), f32),
            sds((t, hv), bf16), sds((3, hv, 128, 128), f32))
    fn = jax.jit(lambda q, k, v, g, b, p: chunk_gated_delta_rule_pool(
        q, k, v, g, b, p, cu_seqlens=jnp.asarray([0, 70, 150], i32), rows=jnp.asarray([0, 2], i32),
        flags=jnp.asarray([3, 3], i32), scale=0.1, use_qk_l2norm=True, seq="fused"))
    module = export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert "gdn_seq_mgpu_fused" in module and module.count("mosaic_gpu") >= 2


def test_fused_refusals(rng):
    """What the fused pass and path refuse, with the reason; the stages that fit its shared memory."""
    from kvjax.pallas.gdn.chunk import chunk_gated_delta_rule_pool
    from kvjax.pallas.gdn.seq_mgpu import (SMEM_BYTES, auto_block_v, auto_layout, auto_stages,
                                           seq_mgpu_fused_call, shape_reason, smem_bytes)

    def operands(dtype=jnp.bfloat16, kd=64, vd=64, chunk=64):  # q, Tb, v
        return (jnp.zeros((128, 1, kd), dtype), jnp.zeros((2, 2, chunk, chunk), dtype),
                jnp.zeros((128, 2, vd), dtype))

    assert shape_reason(*operands(), block_v=64) is None
    for args, block_v, match in [(operands(jnp.float32), 64, "bf16.*float32"), (operands(kd=96), 64, "K=96"),
                                 (operands(vd=32), 32, "V=32"), (operands(chunk=32), 32, "chunks of 64, got 32"),
                                 (operands(), 16, "block_v in .* got 16"),
                                 (operands(vd=64), 128, "dividing V=64, got 128")]:
        assert re.search(match, shape_reason(*args, block_v=block_v)), (match, shape_reason(*args, block_v=block_v))
    assert smem_bytes(128, 64, 2) <= SMEM_BYTES < smem_bytes(128, 64, 3)
    assert smem_bytes(128, 32, 3) <= SMEM_BYTES and smem_bytes(128, 128, 1) <= SMEM_BYTES
    assert auto_block_v(1, 32, 128) == 32 and auto_block_v(4, 32, 128) == 64
    # two 64-column consumers and two slots fit only with the f32 state tiles in the ring's memory
    assert smem_bytes(128, 64, 2, 2) <= SMEM_BYTES < smem_bytes(128, 64, 2, 2) + 2 * 4 * 128 * 64
    assert auto_layout(4, 32, 128) == (64, 2) and auto_layout(1, 32, 128) == (32, 1)
    assert auto_layout(8, 16, 64) == (64, 1) and auto_layout(3, 32, 128) == (64, 1)
    q, tb, v = operands(kd=128, vd=128)
    rest = (jnp.zeros((2, 2, 64, 64), jnp.bfloat16), jnp.zeros((2, 2, 4, 64))) + (
        jnp.zeros((1, 2, 128, 128)), jnp.asarray([0, 128], jnp.int32), jnp.zeros((1,), jnp.int32),
        jnp.full((1,), 3, jnp.int32))
    with pytest.raises(ValueError, match="stages must be >= 1 and fit"):
        seq_mgpu_fused_call(q, q, v, tb, *rest, out_dtype=jnp.bfloat16, block_v=64, stages=3, producer=False)
    with pytest.raises(ValueError, match="stages must be >= 1 and fit"):
        seq_mgpu_fused_call(q, q, v, tb, *rest, out_dtype=jnp.bfloat16, block_v=64, stages=4)
    with pytest.raises(ValueError, match="needs bf16 outputs, got float32"):
        seq_mgpu_fused_call(q, q, v, tb, *rest, out_dtype=jnp.float32, block_v=64)
    for wgs, block_v in [(0, 64), (True, 64), (2.0, 64), (4, 64), (3, None)]:
        with pytest.raises(ValueError, match="warpgroups must be a positive int|block_v in"):
            seq_mgpu_fused_call(q, q, v, tb, *rest, out_dtype=jnp.bfloat16, block_v=block_v, warpgroups=wgs)
    for wgs, overlap in [(2, False), (1, False)]:
        with pytest.raises(ValueError, match=f"a producer warpgroup \\(warpgroups={wgs}\\) needs overlap=True"):
            seq_mgpu_fused_call(q, q, v, tb, *rest, out_dtype=jnp.bfloat16, warpgroups=wgs, producer=wgs == 1 or None,
                                overlap=overlap)
    for wgs, producer in [(2, False), (1, 1), (1, "yes")]:
        with pytest.raises(ValueError, match=f"producer must be a bool .* got {producer!r} \\(warpgroups={wgs}\\)"):
            seq_mgpu_fused_call(q, q, v, tb, *rest, out_dtype=jnp.bfloat16, warpgroups=wgs, producer=producer)
    # one consumer beside a producer: the state tiles in the ring's memory, so 2 slots of 64 columns fit with room
    assert smem_bytes(128, 64, 2, 1, True) < smem_bytes(128, 64, 2, 1) == smem_bytes(128, 64, 2, 1, False)
    # stages=None: 3 slots for one 32-column consumer beside a producer (measured), else 2, or what fits
    assert [auto_stages(128, bv, w, p) for bv, w, p in [(32, 1, True), (64, 1, True), (64, 2, True), (32, 1, False),
                                                         (128, 1, False)]] == [3, 2, 2, 2, 1]
    qq, kk, vv, g, beta, cu, s0 = make_inputs(rng, [40], 1, 1, 64, 64, jnp.bfloat16)
    kw = dict(cu_seqlens=cu, rows=jnp.zeros((1,), jnp.int32), flags=jnp.full((1,), 3, jnp.int32), scale=0.1,
              interpret=True)
    with pytest.raises(ValueError, match="seq='fused' has no chunk parallelism"):
        chunk_gated_delta_rule_pool(qq, kk, vv, g, beta, s0, seq="fused", segment_chunks=4, **kw)
    with pytest.raises(ValueError, match="seq must be 'triton' or 'fused', got 'mosaic'"):
        chunk_gated_delta_rule_pool(qq, kk, vv, g, beta, s0, seq="mosaic", **kw)


def test_mosaic_fused_backend_by_name_and_auto(rng):
    """``impl="mosaic-fused"`` runs FlashQLA's layout (here under the interpreter) within the bf16 bound of the
    recurrent reference at two short sequences of two value heads, where ``auto`` would not take it (by name its
    ``prefer`` rule does not apply). On Hopper ``auto`` takes it, in both prefill tables, for the examples where it
    was measured fastest (one sequence of 16 or 32 value heads at 8192 and 32768 tokens, four sequences of 4096
    tokens, sixteen of 512) and ``"mosaic"`` for one sequence of 8 value heads and 8192 tokens and for an engine
    step's bucket of 64 rows in 2048 tokens, with ``explain`` saying why; it declines what the Mosaic GPU
    preparation kernel declines, and non-Hopper devices, with the reason."""
    from kvjax.base.device import NAMED
    from kvjax.ops import gdn_on_pool
    from kvjax.pallas.gdn import chunk as chunk_kernels

    q, k, v, g, beta, cu, s0 = make_inputs(rng, [70, 9], 1, 2, 64, 64, jnp.bfloat16, pad_tokens=3)
    call = gdn.DeltaRuleCall(q, k, v, g, beta, cu, 0.125, use_qk_l2norm=True)
    assert "got 2 sequences, 82 tokens" in chunk_kernels.mosaic_fused_preferred(call, s0)
    o, f = gdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=s0, scale=0.125,
                                      use_qk_l2norm=True, impl="mosaic-fused:interpret")
    ro, rf = gdn.recurrent_gated_delta_rule_reference(call, s0)
    assert rel_err(o, ro) <= TOL[jnp.bfloat16] and rel_err(f, rf) <= TOL[jnp.bfloat16], (rel_err(o, ro),
                                                                                        rel_err(f, rf))
    chunk_names = ("prefill N=1 T=8192 H=32 K=V=128", "prefill N=4 T=16384 H=32 K=V=128",
                   "prefill N=1 T=8192 H=16 K=V=128", "prefill N=1 T=32768 H=16 K=V=128",
                   "prefill N=16 T=8192 H=16 K=V=128")
    pool_names = ("prefill N=1 T=8192 H=32", "prefill N=4 T=16384 H=32", "prefill N=1 T=8192 H=16, traced layer",
                  "prefill N=1 T=32768 H=16", "prefill N=16 T=8192 H=16")
    for table, fused, narrow, engine in (
            (gdn.CHUNK_TABLE, chunk_names, "prefill N=1 T=8192 H=8 K=V=128",
             "prefill N=64 T=2048 H=32 K=V=128 (an engine step's bucket)"),
            (gdn_on_pool.PREFILL_TABLE, pool_names, "prefill N=1 T=8192 H=8",
             "prefill N=64 T=2048 H=32 (an engine step's bucket)")):
        assert "mosaic-seq" not in table.names()
        for name in fused:
            args, kwargs = table.examples[name]()
            for device in ("h100", "h200"):
                assert table.choose("auto", args, kwargs, NAMED[device])[0] == "mosaic-fused", name
                assert dict(table.explain(args, kwargs, NAMED[device]))["mosaic-fused"] is None
            assert table.choose("auto", args, kwargs, NAMED["a100"])[0] == "pallas"
        for name, want in ((narrow, "got 8 value heads, 8192 tokens"), (engine, "got 64 sequences, 2048 tokens")):
            args, kwargs = table.examples[name]()
            assert table.choose("auto", args, kwargs, NAMED["h100"])[0] == "mosaic"
            why = dict(table.explain(args, kwargs, NAMED["h100"]))["mosaic-fused"]
            assert why.startswith("auto passes it over") and want in why, why
            assert table.choose("mosaic-fused", args, kwargs, NAMED["h100"])[0] == "mosaic-fused"
    args, kwargs = gdn.CHUNK_TABLE.examples["prefill N=2 T=512 H=8 K=96 V=128"]()
    assert "K and V in" in dict(gdn.CHUNK_TABLE.explain(args, kwargs, NAMED["h100"]))["mosaic-fused"]
    with pytest.raises(UnknownImplError, match="K and V in"):
        gdn.CHUNK_TABLE.choose("mosaic-fused", args, kwargs, NAMED["h100"])
    assert "Hopper" in dict(gdn.CHUNK_TABLE.explain(args, kwargs, NAMED["a100"]))["mosaic-fused"]


def test_prefill_pool_mosaic_fused_interpret(rng):
    """``gdn_prefill_pool(impl="mosaic-fused")`` (the slot-pool entry of the fused path) under the interpreter against
    the op's reference (:func:`helpers.gdn.check_pool_op`: gather -> f32 reference -> scatter): ragged rows with an
    empty one, a padding slot, rows without initial state, a traced layer; other slots and layers untouched."""
    check_pool_op(rng, gdn_pool.gdn_prefill, [5, 0, 66, 3], [2, 0, 3, 1], [True, False, False, True], hk=1, hv=2,
                  kd=64, vd=64, dtype=jnp.bfloat16, impl="mosaic-fused:interpret", num_slots=4, static_layer=False)


def test_prefill_pool_fused_lowers_for_cuda():
    """The slot-pool entry of the fused path (``gdn_prefill_pool``'s ``"mosaic-fused"``: slot rows and flags, the
    flattened pool, both Mosaic GPU kernels) lowers to a Mosaic GPU module for CUDA without a GPU, at one sequence of
    32 value heads (``auto``'s shape) and at three ragged rows, with a traced layer."""
    from jax import export

    from kvjax.pallas.gdn import chunk as chunk_kernels

    sds, bf16, f32, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.int32
    for t, n, hk, hv in [(256, 1, 16, 32), (200, 3, 2, 4)]:
        args = (sds((t, hk, 128), bf16), sds((t, hk, 128), bf16), sds((t, hv, 128), bf16), sds((t, hv), f32),
                sds((t, hv), bf16), sds((n + 1,), i32), sds((n,), i32), sds((n,), jnp.bool_), sds((), i32),
                sds((2, n + 3, hv, 128, 128), f32))

        def fn(q, k, v, g, b, cu, slots, has_init, layer, ssm):
            call = gdn.DeltaRuleCall(q, k, v, g, b, cu, 0.1, slot_ids=slots, has_initial_state=has_init,
                                     layer=layer, use_qk_l2norm=True)
            return chunk_kernels.gdn_prefill_pool_mosaic_fused(call, ssm)

        module = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
        assert "gdn_seq_mgpu_fused" in module and module.count("mosaic_gpu") >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("hk,hv,kd,vd,block_v,l2", [
    (2, 4, 128, 128, None, True), (2, 4, 128, 128, 32, False), (2, 2, 64, 64, 64, True),
    (1, 2, 128, 128, 128, True), (2, 4, 64, 128, 32, True)])
def test_fused_gpu(rng, hk, hv, kd, vd, block_v, l2):
    """The compiled kernels (inverse-only preparation, fused pass) on the GDN tests' ragged grid (lengths 1..4096,
    an empty sequence, chunk-crossing boundaries), 70 padding tokens, gated and ungated heads, with and without
    the in-kernel l2norm, each value block width."""
    check_fused(rng, GPU_LENS, hk, hv, kd, vd, block_v=block_v, interpret=False, lead=7, pad_tokens=70, l2=l2)


@pytest.mark.gpu
def test_fused_gpu_two_warpgroups(rng):
    """The compiled pass with two 64-column consumer warpgroups sharing one ring (``auto_layout``'s pick here: 9 rows
    x 16 value heads >= 128 CTAs' worth) on the GDN tests' ragged grid, against the recurrent reference and the
    Triton pass."""
    from kvjax.pallas.gdn.seq_mgpu import auto_layout

    assert auto_layout(len(GPU_LENS), 16, 128) == (64, 2)
    check_fused(rng, GPU_LENS, 8, 16, 128, 128, block_v=None, interpret=False, lead=7, pad_tokens=70)


@pytest.mark.gpu
def test_fused_gpu_producer(rng):
    """The compiled pass with one consumer warpgroup beside a producer warpgroup that issues the ring's copies (the
    default) gives the same bits as the consumer issuing them itself (2 stages, 32 and 64 value columns; 3 stages, 32
    columns), on the GDN tests' ragged grid with padding rows."""
    from kvjax.pallas.gdn.prep_mgpu import prep_mgpu_call
    from kvjax.pallas.gdn.seq_mgpu import seq_mgpu_fused_call

    q, k, v, g, beta, cu, s0 = make_inputs(rng, GPU_LENS, 2, 4, 128, 128, jnp.bfloat16, pad_tokens=70)
    seg, q, k, v, g, beta = padded_operands(q, k, v, g, beta, cu, 64)
    tb, a, rowf = prep_mgpu_call(seg, q, k, v, g, beta, chunk=64, scale=128 ** -0.5, use_qk_l2norm=True,
                                 outputs="inverse")
    n = len(GPU_LENS)
    flags, _ = row_flags(n)
    rows = jnp.arange(n, dtype=jnp.int32)
    for block_v, stages in ((32, 2), (64, 2), (32, 3)):
        got, want = (seq_mgpu_fused_call(q, k, v, tb, a, rowf, jnp.array(s0, copy=True), cu, rows, flags,
                                         out_dtype=jnp.bfloat16, block_v=block_v, stages=stages, warpgroups=1,
                                         producer=p) for p in (True, False))
        np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.gpu
def test_fused_backend_gpu_one_long_sequence(rng):
    """``impl="mosaic-fused"`` on one sequence of 8192 tokens at FlashQLA's head counts of one key head's group
    (Hk 1, Hv 2, K = V = 128) against the reference."""
    q, k, v, g, beta, cu, s0 = make_inputs(rng, [8192], 1, 2, 128, 128, jnp.bfloat16)
    call = gdn.DeltaRuleCall(q, k, v, g, beta, cu, 128 ** -0.5, use_qk_l2norm=True)
    o, f = gdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=s0, scale=128 ** -0.5,
                                      use_qk_l2norm=True, impl="mosaic-fused")
    ro, rf = gdn.recurrent_gated_delta_rule_reference(call, s0)
    assert rel_err(o, ro) <= TOL[jnp.bfloat16] and rel_err(f, rf) <= TOL[jnp.bfloat16], (rel_err(o, ro),
                                                                                        rel_err(f, rf))


@pytest.mark.gpu
@pytest.mark.parametrize("lens,hk,hv,kd,vd", [
    (GPU_LENS, 2, 4, 128, 128),  # ragged rows (lengths 1..4096, an empty one, chunk-crossing boundaries)
    ([3000, 70, 0, 129, 1], 1, 2, 64, 64),
    ([2048], 16, 32, 128, 128)])  # auto's shape: one sequence of 32 value heads
def test_prefill_pool_mosaic_fused_gpu(rng, lens, hk, hv, kd, vd):
    """The compiled ``gdn_prefill_pool(impl="mosaic-fused")`` against the op's reference
    (:func:`helpers.gdn.check_pool_op`: gather -> f32 reference -> scatter, relative L2 error <= 2e-2 in bf16):
    random slots with padding rows and rows without initial state, the last layer of two; other slots, the other
    layer and slot 0 untouched. At one sequence of 32 value heads also ``impl="auto"``, which takes it on Hopper."""
    n = len(lens)
    slots = rng.permutation(np.arange(1, n + 4))[:n].astype(np.int32)
    slots[1::4] = 0  # padding rows
    has_init = rng.uniform(size=n) < 0.7
    check_pool_op(rng, gdn_pool.gdn_prefill, lens, slots, has_init, hk=hk, hv=hv, kd=kd, vd=vd, dtype=jnp.bfloat16,
                  impl="mosaic-fused", num_slots=n + 3)
    if n == 1 and current_device().hopper:
        args, kwargs = gdn_on_pool.PREFILL_TABLE.examples["prefill N=1 T=8192 H=32"]()
        assert gdn_on_pool.PREFILL_TABLE.choose("auto", args, kwargs)[0] == "mosaic-fused"
        check_pool_op(rng, gdn_pool.gdn_prefill, lens, slots, [True], hk=hk, hv=hv, kd=kd, vd=vd,
                      dtype=jnp.bfloat16, impl="auto", num_slots=n + 3)


@pytest.mark.gpu
@pytest.mark.parametrize("hk,hv,kd,vd,value_heads,l2", [
    (2, 4, 128, 128, 0, True), (2, 4, 128, 128, 0, False), (1, 4, 64, 64, 0, True),
    (1, 4, 64, 128, 0, True), (2, 4, 128, 128, 1, True)])
def test_prep_inverse_gpu(rng, hk, hv, kd, vd, value_heads, l2):
    """The compiled ``outputs="inverse"`` (the value heads' inverses in lockstep) on the GDN tests' ragged grid
    (lengths 1..4096, an empty sequence, chunk-crossing boundaries), :func:`check_inverse`: ``Tb`` and ``kr``
    against the f32 references, ``A`` and the row factors equal to ``outputs="all"``'s, ``w`` / ``u`` within
    bf16 of ``Tb (kr * k)`` / ``Tb v``."""
    check_inverse(rng, GPU_LENS, hk, hv, kd, vd, value_heads=value_heads, l2=l2, interpret=False, lead=7)
