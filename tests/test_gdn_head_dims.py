"""The Pallas GDN kernels at head dims that are not powers of two (issue #17 item 8), against the references.

The kernels pad K and V to power-of-two blocks inside the kernel and mask loads and stores; the pool keeps its
true K, V. CPU: interpret mode at K/V in {96, 80, 192} (and K=12 with value blocks overrunning V); GPU (``gpu``
marker): the same shapes compiled on the issue's length grid. Tolerances are those of ``test_gdn_kernels``:
relative L2 error <= 1e-4 for float32 inputs, <= 2e-2 for bfloat16 inputs.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers.gdn import GPU_LENS, TOL, check_pool_op, check_public_kernel, make_inputs, make_pool, rel_err
from kvjax.ops import gdn, gdn_on_pool
from kvjax.state import gdn_pool

ODD_DIMS = [(96, 80), (80, 192), (192, 96)]


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("kd,vd", ODD_DIMS)
def test_kernels_any_head_dim_interpret(rng, kind, kd, vd):
    """The public-op kernels at K, V not powers of two (GQA, ragged rows crossing a chunk, an empty row, bucket
    padding) against the float32 reference, f32 tolerance."""
    check_public_kernel(rng, kind, [3, 0, 70, 1], 1, 2, kd, vd, jnp.float32, l2=True, init=True, interpret=True)


def test_public_ops_any_head_dim_interpret(rng):
    """Through the ops (``impl="interpret"``, bf16, no l2norm): K=96, V=80 runs the kernels, not an error."""
    q, k, v, g, beta, cu, s0 = make_inputs(rng, [5, 66], 2, 4, 96, 80, jnp.bfloat16, pad_tokens=2, unit_qk=True)
    for op in (gdn.chunk_gated_delta_rule, gdn.recurrent_gated_delta_rule):
        o, f = op(q, k, v, g, beta, cu_seqlens=np.asarray(cu), initial_state=s0, impl="interpret")
        ro, rf = op(q, k, v, g, beta, cu_seqlens=np.asarray(cu), initial_state=s0, impl="reference")
        assert rel_err(o, ro) <= TOL[jnp.bfloat16] and rel_err(f, rf) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("op,one_token,impl", [("decode", True, "slots:interpret"), ("decode", False, "interpret"),
                                               ("prefill", False, "interpret")])
def test_pool_ops_any_head_dim_interpret(rng, op, one_token, impl):
    """The pool kernels at K=96, V=80 (the pool keeps its true K, V): values, PAD slot, other slots and the other
    layer untouched (a store past K or V would land in the next head's or slot's state)."""
    lens = [1] * 5 if one_token else ([2, 1, 0, 3, 1] if op == "decode" else [5, 0, 66, 3, 1])
    has_init = None if one_token else [True, True, False, True, True]
    fn = gdn_pool.gdn_decode if op == "decode" else gdn_pool.gdn_prefill
    check_pool_op(rng, fn, lens, [4, 0, 2, 6, 1], has_init, hk=1, hv=2, kd=96, vd=80, dtype=jnp.float32,
                  impl=impl, num_slots=7, one_token=one_token)


def test_slot_and_recurrent_kernels_value_blocks_overrunning_v_interpret(rng):
    """Value blocks of 64 over V=80 (the second block overruns V by 48 lanes), K=12 padded to 16."""
    from kvjax.pallas.gdn.common import state_as_pool
    from kvjax.pallas.gdn.recurrent import recurrent_gated_delta_rule_pool, recurrent_gated_delta_rule_slots

    q, k, v, g, beta, cu, s0 = make_inputs(rng, [4, 1, 6], 1, 2, 12, 80, jnp.float32, pad_tokens=2)
    pool, rows, flags = state_as_pool(s0, 3, 2, 12, 80)
    o, f = recurrent_gated_delta_rule_pool(q, k, v, g, beta, pool, cu_seqlens=cu, rows=rows, flags=flags,
                                           scale=0.25, use_qk_l2norm=True, block_v=64, interpret=True)
    ro, rf = gdn.recurrent_gated_delta_rule_reference(gdn.DeltaRuleCall(q, k, v, g, beta, cu, 0.25, use_qk_l2norm=True),
                                                      s0)
    assert rel_err(o, ro) <= 1e-5 and rel_err(f, rf) <= 1e-5
    q, k, v, g, beta, _, _ = make_inputs(rng, [1] * 4, 1, 2, 12, 80, jnp.float32)
    ssm = make_pool(rng, 2, 5, 2, 12, 80).ssm
    slots = jnp.asarray([3, 0, 1, 5], jnp.int32)
    o, new = recurrent_gated_delta_rule_slots(q, k, v, g, beta, jnp.array(ssm, copy=True), slot_ids=slots, layer=1,
                                              scale=0.3, use_qk_l2norm=True, block_v=64, interpret=True)
    ro, rnew = gdn_on_pool.gdn_decode_pool_reference(
        gdn.DeltaRuleCall(q, k, v, g, beta, scale=0.3, slot_ids=slots, layer=1, use_qk_l2norm=True), ssm)
    assert rel_err(o, ro) <= 1e-5
    np.testing.assert_allclose(np.asarray(new), np.asarray(rnew), rtol=1e-5, atol=1e-5)


# GPU: the same non-power-of-two head dims, compiled (the lead runs these on an H100).
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kd,vd", ODD_DIMS)
def test_kernels_any_head_dim_gpu(rng, kind, dtype, kd, vd):
    check_public_kernel(rng, kind, GPU_LENS, 2, 4, kd, vd, dtype, l2=True, init=True, interpret=False,
                        pad_tokens=100)


@pytest.mark.gpu
@pytest.mark.parametrize("op,lens,one_token,impl", [(gdn_pool.gdn_decode, [1] * 16, True, "slots"),
                                                   (gdn_pool.gdn_decode, [1, 3, 0, 2] * 4, False, "pallas"),
                                                   (gdn_pool.gdn_prefill, GPU_LENS, False, "pallas")])
@pytest.mark.parametrize("kd,vd", ODD_DIMS)
def test_pool_ops_any_head_dim_gpu(rng, op, lens, one_token, impl, kd, vd):
    n = len(lens)
    slots = rng.permutation(np.arange(1, n + 4))[:n].astype(np.int32)
    slots[::4] = 0
    has_init = None if one_token else rng.uniform(size=n) < 0.7
    check_pool_op(rng, op, lens, slots, has_init, hk=2, hv=4, kd=kd, vd=vd, dtype=jnp.bfloat16, impl=impl,
                  num_slots=n + 3, one_token=one_token)


def test_chunk_parallelism_only_where_the_scan_tile_fits(rng):
    """Chunk parallelism's scan kernel holds one segment's ``M`` (``next_pow2(K)^2`` values of the input dtype) in
    shared memory: 256 KB at float32 K = 192 (Triton 3.6 for sm_90), past a Hopper CTA's 227 KB; the GPU test of
    that shape failed (HISTORY run 251). On the GPU test's length grid (one 4096-token row, where ``auto`` takes
    chunk parallelism) the CUDA lowering has the scan kernel at float32 K = 96 and bfloat16 K = 192 and not at
    float32 K = 192; asking for segments there is a ``ValueError`` naming the value."""
    import jax

    from helpers.gdn import public_kernel
    from kvjax.pallas.gdn.chunk import CP_MAX_M_BYTES, chunk_gated_delta_rule_pool, cp_unsupported

    assert cp_unsupported(96, jnp.float32) is None and cp_unsupported(192, jnp.bfloat16) is None
    assert cp_unsupported(128, jnp.float32) is None
    why = cp_unsupported(192, jnp.float32)
    assert "K=192 in float32" in why and str(256 * 256 * 4) in why and str(CP_MAX_M_BYTES) in why
    for kd, vd, dtype, scan in ((96, 80, jnp.float32, True), (192, 96, jnp.bfloat16, True),
                                (192, 96, jnp.float32, False)):
        args = make_inputs(rng, GPU_LENS, 2, 4, kd, vd, dtype, pad_tokens=100)
        text = jax.jit(public_kernel("chunk", kd)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert ("gdn_chunk_scan" in text) == scan, (kd, vd, dtype)
        assert ("gdn_chunk_transition" in text) == scan, (kd, vd, dtype)
    q, k, v, g, beta, cu, s0 = make_inputs(rng, [70, 9], 1, 2, 192, 96, jnp.float32, pad_tokens=3)
    pool = jnp.zeros((3, 2, 192, 96), jnp.float32)
    with pytest.raises(ValueError, match="segment_chunks=8: no chunk parallelism at K=192 in float32"):
        chunk_gated_delta_rule_pool(q, k, v, g, beta, pool, cu_seqlens=cu, rows=jnp.asarray([1, 2], jnp.int32),
                                    flags=jnp.asarray([1, 1], jnp.int32), scale=0.1, segment_chunks=8,
                                    interpret=True)
