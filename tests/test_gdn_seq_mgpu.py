"""The Mosaic GPU sequential kernel of the chunked gated delta rule (:mod:`kvjax.pallas.gdn.seq_mgpu`).

CPU: the kernel under the Mosaic GPU interpreter (its products in jnp; the TMA ring, barriers, the row-exact output
copies and the state copies as compiled), its lowering for CUDA without a GPU, and its refusals. GPU (``gpu``
marker): the compiled kernel. Both against the f32 recurrent reference (the bf16 bound of the GDN tests, relative
L2 error <= 2e-2) and against the Triton sequential kernel on the same prepared operands, which rounds the same
operands to bf16 except ``qf * q`` and ``kf * k`` (this kernel scales the f32 products instead): 1e-2.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.gdn import GPU_LENS, TOL, make_inputs, rel_err, row_flags
from kvjax.ops import gdn

SAME_TOL = 1e-2  # against the Triton sequential kernel (other bf16 roundings of the row factors)


def check_seq(rng, lens, hk, hv, kd, vd, *, block_v, segment_chunks, interpret, lead=2, pad_tokens=5,
              ungated=True, l2=True, mosaic_prep=False):
    """The pool kernel with ``seq="mosaic"`` against the recurrent reference and ``seq="triton"``: ``lead``
    tokens before the first sequence and ``pad_tokens`` after the last (outputs zero), a row that starts from
    zeros (no initial state), a padding row (its pool row untouched), with ``ungated`` a value head of ``g = 0``;
    ``mosaic_prep``: both runs with the Mosaic GPU preparation kernel."""
    from kvjax.pallas.gdn.chunk import chunk_gated_delta_rule_pool
    from kvjax.pallas.gdn.prep import PrepConfig

    q, k, v, g, beta, cu, s0 = make_inputs(rng, lens, hk, hv, kd, vd, jnp.bfloat16, pad_tokens=pad_tokens,
                                           unit_qk=not l2)
    if ungated:
        g = g.at[:, hv - 1].set(0.0)
    cu = cu + lead
    n = len(lens)
    flags, pad_row = row_flags(n)
    scale = kd ** -0.5
    kw = dict(cu_seqlens=cu, rows=jnp.arange(n, dtype=jnp.int32), flags=flags, scale=scale, use_qk_l2norm=l2,
              block_v=block_v, segment_chunks=segment_chunks, interpret=interpret,
              prep=PrepConfig(kernel="mosaic") if mosaic_prep else PrepConfig())
    o, pool = chunk_gated_delta_rule_pool(q, k, v, g, beta, jnp.array(s0, copy=True), seq="mosaic", **kw)
    to, tpool = chunk_gated_delta_rule_pool(q, k, v, g, beta, jnp.array(s0, copy=True), seq="triton",
                                            **{**kw, "block_v": None})
    init = s0.at[min(2, n - 1)].set(0.0)
    call = gdn.DeltaRuleCall(q, k, v, g, beta, cu, scale, use_qk_l2norm=l2)
    ro, rf = gdn.recurrent_gated_delta_rule_reference(call, init)
    live = np.asarray(flags) != 0
    o_seq = o[int(cu[0]):int(cu[-1])]
    if pad_row:  # the padding row's tokens are zeros in the kernels' output, its pool row unchanged
        o_seq = jnp.concatenate([o[int(cu[0]):int(cu[3])], o[int(cu[4]):int(cu[-1])]])
        ro = jnp.concatenate([ro[int(cu[0]):int(cu[3])], ro[int(cu[4]):int(cu[-1])]])
        assert np.all(np.asarray(o[int(cu[3]):int(cu[4])], np.float32) == 0)
        np.testing.assert_array_equal(np.asarray(pool[3]), np.asarray(s0[3]))
    else:
        ro = ro[int(cu[0]):int(cu[-1])]
    assert o.shape == v.shape and o.dtype == v.dtype and pool.shape == s0.shape
    assert rel_err(o_seq, ro) <= TOL[jnp.bfloat16], rel_err(o_seq, ro)
    assert rel_err(pool[live], rf[live]) <= TOL[jnp.bfloat16], rel_err(pool[live], rf[live])
    assert rel_err(o, to) <= SAME_TOL and rel_err(pool, tpool) <= SAME_TOL, (rel_err(o, to), rel_err(pool, tpool))
    outside = np.concatenate([np.asarray(o[:int(cu[0])], np.float32), np.asarray(o[int(cu[-1]):], np.float32)])
    assert np.all(outside == 0), "tokens outside every sequence must be zero"


@pytest.mark.parametrize("hk,hv,kd,vd,block_v,segment_chunks", [(1, 2, 64, 64, 32, 0), (1, 1, 64, 128, 64, 0),
                                                                 (1, 2, 64, 64, 64, 1)])
def test_seq_mosaic_interpret(rng, hk, hv, kd, vd, block_v, segment_chunks):
    """Sequences that start and end inside a chunk (the row-exact output copies of 1..63 rows), an empty one, a row
    without initial state, a padding row; one and two value blocks per head (32 and 64 columns: 64- and 128-byte
    swizzles); and under chunk parallelism (segments of one chunk: the kernel walks every segment from the scan's
    start states)."""
    check_seq(rng, [5, 0, 23, 40, 70], hk, hv, kd, vd, block_v=block_v, segment_chunks=segment_chunks,
              interpret=True)


def test_seq_mosaic_kernel_variants_interpret(rng):
    """``seq_mgpu_call`` itself on the prepared operands against the Triton sequential kernel (``chunk._chunk_call``)
    for the ring and loop variants: without the overlap (the next chunk's copies issued one step ahead, its products
    in its own step), and with it at 1 stage (no prefetch: a slot refilled right after it is read) and 3 stages.
    Rows at chunk edges: an empty row on a chunk boundary (no chunk to walk), three rows sharing a chunk, an empty
    last row at the padded end (its one clamped, unused chunk)."""
    from kvjax.pallas.gdn.chunk import _chunk_call
    from kvjax.pallas.gdn.prep import prepare
    from kvjax.pallas.gdn.seq_mgpu import seq_mgpu_call

    lens = [64, 0, 30, 5, 29, 0]
    q, k, v, g, beta, cu, s0 = make_inputs(rng, lens, 1, 1, 64, 64, jnp.bfloat16)
    ops = prepare(q, k, v, g, beta, cu, scale=0.125, use_qk_l2norm=True, chunk=64, interpret=True)
    n = len(lens)
    rows, flags = jnp.arange(n, dtype=jnp.int32), jnp.asarray([3, 3, 2, 3, 3, 3], jnp.int32)
    want = _chunk_call(*ops, jnp.array(s0, copy=True), cu, rows, flags, out_dtype=jnp.bfloat16, block_v=32,
                       num_warps=4, num_stages=2, interpret=True)
    for overlap, stages in [(False, 2), (True, 1), (True, 3)]:
        got = seq_mgpu_call(*ops, jnp.array(s0, copy=True), cu, rows, flags, out_dtype=jnp.bfloat16, block_v=32,
                            stages=stages, overlap=overlap, interpret=True)
        assert rel_err(got[0], want[0]) <= SAME_TOL and rel_err(got[1], want[1]) <= SAME_TOL, (
            overlap, stages, rel_err(got[0], want[0]), rel_err(got[1], want[1]))


def test_seq_mosaic_lowers_for_cuda():
    """The kernel lowers to a Mosaic GPU module for CUDA without a GPU (wgmma operands, the transposed ``k``
    operand, TMA boxes of the ring and of the partial output copies) at K = V = 128 with value blocks of 32 (3
    stages) and 64 (2 stages), K = 64 with V = 128 in one block, without the overlap once, under the Lane
    semantics that it passes on every jax (it names its register layouts)."""
    from jax import export

    from kvjax.pallas.gdn.seq_mgpu import seq_mgpu_call

    sds = jax.ShapeDtypeStruct
    for kd, vd, hk, hv, n, block_v, stages, overlap in [(128, 128, 2, 4, 3, 32, 3, True),
                                                         (128, 128, 2, 4, 1, 64, 2, True),
                                                         (64, 128, 1, 2, 2, 128, 2, True),
                                                         (128, 128, 2, 4, 2, 64, 2, False)]:
        tp, nc, bf16, f32 = 256, 4, jnp.bfloat16, jnp.float32
        args = (sds((tp, hk, kd), bf16), sds((tp, hk, kd), bf16), sds((nc, hv, 64, kd), bf16),
                sds((nc, hv, 64, vd), bf16), sds((nc, hv, 64, 64), bf16), sds((nc, hv, 64), f32),
                sds((nc, hv, 64), f32), sds((nc, hv, 64), f32), sds((n + 2, hv, kd, vd), f32),
                sds((n + 1,), jnp.int32), sds((n,), jnp.int32), sds((n,), jnp.int32))
        fn = jax.jit(lambda *a, bv=block_v, st=stages, ov=overlap: seq_mgpu_call(*a, out_dtype=bf16, block_v=bv,
                                                                                stages=st, overlap=ov))
        assert "mosaic_gpu" in export.export(fn, platforms=["cuda"])(*args).mlir_module()


def test_seq_mosaic_refusals(rng):
    """What the kernel refuses, with the reason."""
    from kvjax.pallas.gdn.chunk import chunk_gated_delta_rule_pool
    from kvjax.pallas.gdn.seq_mgpu import SMEM_BYTES, auto_block_v, seq_mgpu_call, shape_reason, smem_bytes

    def operands(dtype=jnp.bfloat16, kd=64, vd=64, chunk=64):
        return (jnp.zeros((128, 1, kd), dtype), jnp.zeros((2, 2, chunk, kd), dtype),
                jnp.zeros((2, 2, chunk, vd), dtype))

    assert shape_reason(*operands(), block_v=64) is None
    for args, block_v, match in [(operands(jnp.float32), 64, "bf16.*float32"), (operands(kd=96), 64, "K=96"),
                                 (operands(vd=32), 32, "V=32"), (operands(chunk=32), 32, "chunks of 64, got 32"),
                                 (operands(), 16, "block_v in .* got 16"),
                                 (operands(vd=64), 128, "dividing V=64, got 128")]:
        assert re.search(match, shape_reason(*args, block_v=block_v)), (match, shape_reason(*args, block_v=block_v))
    assert smem_bytes(128, 64, 2) <= SMEM_BYTES < smem_bytes(128, 64, 3)
    assert smem_bytes(128, 32, 3) <= SMEM_BYTES
    assert auto_block_v(1, 32, 128) == 32 and auto_block_v(4, 32, 128) == 64
    q, w, u = operands(kd=128, vd=128)
    rest = (jnp.zeros((2, 2, 64, 64), jnp.bfloat16),) + (jnp.zeros((2, 2, 64)),) * 3 + (
        jnp.zeros((1, 2, 128, 128)), jnp.asarray([0, 128], jnp.int32), jnp.zeros((1,), jnp.int32),
        jnp.full((1,), 3, jnp.int32))
    with pytest.raises(ValueError, match="stages must be >= 1 and fit"):
        seq_mgpu_call(q, q, w, u, *rest, out_dtype=jnp.bfloat16, block_v=64, stages=3)
    with pytest.raises(ValueError, match="needs bf16 outputs, got float32"):
        seq_mgpu_call(q, q, w, u, *rest, out_dtype=jnp.float32, block_v=64)
    qq, kk, v, g, beta, cu, s0 = make_inputs(rng, [40], 1, 1, 64, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="seq must be 'triton', 'mosaic' or 'fused', got 'cuda'"):
        chunk_gated_delta_rule_pool(qq, kk, v, g, beta, s0, cu_seqlens=cu, rows=jnp.zeros((1,), jnp.int32),
                                    flags=jnp.full((1,), 3, jnp.int32), scale=0.1, seq="cuda", interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("hk,hv,kd,vd,block_v,segment_chunks,l2", [
    (2, 4, 128, 128, None, 0, True), (2, 4, 128, 128, 32, 0, False), (2, 2, 64, 64, 64, 0, True),
    (1, 2, 128, 128, 128, 0, True), (2, 4, 128, 128, 64, 8, True), (2, 4, 64, 128, 32, 0, True)])
def test_seq_mosaic_gpu(rng, hk, hv, kd, vd, block_v, segment_chunks, l2):
    """The compiled kernel on the GDN tests' ragged grid (lengths 1..4096, an empty sequence, chunk-crossing
    boundaries), 70 padding tokens, gated and ungated heads, with and without the in-kernel l2norm, each value
    block width, and under chunk parallelism (segments of 8 chunks)."""
    check_seq(rng, GPU_LENS, hk, hv, kd, vd, block_v=block_v, segment_chunks=segment_chunks, interpret=False,
              lead=7, pad_tokens=70, l2=l2)


@pytest.mark.gpu
def test_seq_mosaic_gpu_one_long_sequence(rng):
    """One sequence of 8192 tokens at FlashQLA's head counts of one key head's group (Hk 1, Hv 2, K = V = 128),
    the whole pool kernel with both Mosaic GPU kernels (preparation and sequential) against the reference."""
    check_seq(rng, [8192], 1, 2, 128, 128, block_v=None, segment_chunks=0, interpret=False, lead=0,
              pad_tokens=0, mosaic_prep=True)


def test_mosaic_seq_backend_takes_one_sequence_of_many_heads(rng, monkeypatch):
    """``"mosaic-seq"`` runs both Mosaic GPU kernels (here under the interpreter, with the head floor lowered to
    this small call's) within the bf16 bound of the recurrent reference; ``auto`` takes it on Hopper for one
    sequence of at least ``MOSAIC_SEQ_MIN_HEADS`` value heads (where it was measured faster) and ``"mosaic"``
    elsewhere; it declines several sequences, fewer heads and what the Mosaic GPU preparation kernel declines,
    with the reason."""
    from kvjax.base.device import NAMED
    from kvjax.ops import gdn_on_pool
    from kvjax.pallas.gdn import chunk as chunk_kernels

    q, k, v, g, beta, cu, s0 = make_inputs(rng, [70], 1, 2, 64, 64, jnp.bfloat16, pad_tokens=3)
    call = gdn.DeltaRuleCall(q, k, v, g, beta, cu, 0.125, use_qk_l2norm=True)
    assert "needs one sequence of >= 32 value heads" in chunk_kernels.mosaic_seq_unsupported(call, s0)
    monkeypatch.setattr(chunk_kernels, "MOSAIC_SEQ_MIN_HEADS", 2)
    o, f = gdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=s0, scale=0.125,
                                      use_qk_l2norm=True, impl="mosaic-seq:interpret")
    ro, rf = gdn.recurrent_gated_delta_rule_reference(call, s0)
    assert rel_err(o, ro) <= TOL[jnp.bfloat16] and rel_err(f, rf) <= TOL[jnp.bfloat16], (rel_err(o, ro),
                                                                                        rel_err(f, rf))
    monkeypatch.undo()
    for table, one, many, narrow in (
            (gdn.CHUNK_TABLE, "prefill N=1 T=8192 H=32 K=V=128", "prefill N=4 T=16384 H=32 K=V=128",
             "prefill N=1 T=8192 H=16 K=V=128"),
            (gdn_on_pool.PREFILL_TABLE, "prefill N=1 T=8192 H=32", "prefill N=4 T=16384 H=32",
             "prefill N=1 T=8192 H=16, traced layer")):
        args, kwargs = table.examples[one]()
        assert table.choose("auto", args, kwargs, NAMED["h100"])[0] == "mosaic-seq"
        assert table.choose("auto", args, kwargs, NAMED["a100"])[0] == "pallas"
        for name, want in ((many, "4 sequences of 32"), (narrow, "1 sequences of 16")):
            args, kwargs = table.examples[name]()
            assert table.choose("auto", args, kwargs, NAMED["h100"])[0] == "mosaic"
            assert want in dict(table.explain(args, kwargs, NAMED["h100"]))["mosaic-seq"]
    args, kwargs = gdn.CHUNK_TABLE.examples["prefill N=2 T=512 H=8 K=96 V=128"]()
    reasons = dict(gdn.CHUNK_TABLE.explain(args, kwargs, NAMED["h100"]))
    assert "K and V in" in reasons["mosaic-seq"]
    assert "Hopper" in dict(gdn.CHUNK_TABLE.explain(args, kwargs, NAMED["a100"]))["mosaic-seq"]
