"""Qwen3.5's fused GDN decode step (:func:`kvjax.ops.gdn_on_pool.gated_delta_decode_pool` of a
:class:`~kvjax.ops.gdn_on_pool.GatedDecodeCall`): the slot kernel reading
q / k / v from the packed conv output by column and projecting and computing the gates from the hidden state.

Reference: numpy gates (``a = x @ w_a.T``, ``b = x @ w_b.T`` rounded to the activations' dtype, ``g = -exp(A_log) *
log(1 + exp(a + dt_bias))``, ``beta = sigmoid(b)`` rounded to that dtype, as the unfused model path does), the
columns split by hand, then the pool oracle
:func:`kvjax.ops.gdn_on_pool.gdn_decode_pool_reference`. Tolerances: relative L2 error <= 2e-2 for bfloat16
outputs, <= 1e-4 for float32 ones and <= 1e-5 for the float32 states.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.base.device import NAMED
from kvjax.errors import UnknownImplError
from kvjax.ops import gdn_on_pool
from kvjax.ops.gdn import DeltaRuleCall
from kvjax.state import gdn_pool
from kvjax.state.gdn_pool import GDNStatePool

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the kernel output"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_call(rng, rows, hk, hv, kd, vd, dtype, num_slots, layers=2, hidden=32):
    """Random packed conv output, hidden state and gate weights (``a`` spread over softplus' curved and linear
    parts), gate parameters and a pool whose slot 0 is zero."""
    qkv = jnp.asarray(rng.standard_normal((rows, 2 * hk * kd + hv * vd)), dtype)
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    w_a = jnp.asarray(rng.standard_normal((hv, hidden)) * 4.0 / np.sqrt(hidden), dtype)  # torch layout [out, in]
    w_b = jnp.asarray(rng.standard_normal((hv, hidden)) * 2.0 / np.sqrt(hidden), dtype)
    a_log = jnp.asarray(np.log(rng.uniform(0.01, 0.2, hv)), dtype)
    dt_bias = jnp.asarray(rng.standard_normal(hv) + 2.0, dtype)
    ssm = rng.standard_normal((layers, num_slots + 1, hv, kd, vd)).astype(np.float32)
    ssm[:, 0] = 0.0
    return (qkv, x, w_a, w_b, a_log, dt_bias), jnp.asarray(ssm)


def reference(qkv, x, w_a, w_b, a_log, dt_bias, ssm, *, hk, layer, slot_ids, scale):
    """The decode step by hand: numpy projections, gates and column split, then the pool oracle."""
    f = lambda t: np.asarray(t, np.float64)  # noqa: E731
    rnd = lambda t: f(jnp.asarray(t, jnp.float32).astype(qkv.dtype))  # noqa: E731  (to the activations' dtype)
    rows, kd, vd = qkv.shape[0], ssm.shape[3], ssm.shape[4]
    a, b = rnd(f(x) @ f(w_a).T), rnd(f(x) @ f(w_b).T)
    g = -np.exp(f(a_log))[None] * np.log1p(np.exp(a + f(dt_bias)[None]))
    beta = jnp.asarray(1.0 / (1.0 + np.exp(-b)), jnp.float32).astype(qkv.dtype)
    cols = np.split(np.arange(qkv.shape[1]), [hk * kd, 2 * hk * kd])
    q, k, v = (jnp.asarray(np.asarray(qkv)[:, c]).reshape(rows, -1, d) for c, d in zip(cols, (kd, kd, vd)))
    call = DeltaRuleCall(q, k, v, jnp.asarray(g, jnp.float32), beta, scale=scale, slot_ids=jnp.asarray(slot_ids),
                         layer=layer, use_qk_l2norm=True)
    return gdn_on_pool.gdn_decode_pool_reference(call, ssm)


def check(rng, impl, *, rows, hk, hv, kd, vd, dtype, num_slots, hidden=32):
    args, ssm = make_call(rng, rows, hk, hv, kd, vd, dtype, num_slots, hidden=hidden)
    slots = rng.permutation(np.arange(1, num_slots + 1))[:rows].astype(np.int32)
    slots[::4] = 0
    slots[1] = num_slots + 1  # out of range: padding too
    scale = kd ** -0.5
    call = gdn_on_pool.GatedDecodeCall(*args, jnp.asarray(slots),  # a device array: ids not checked
                                     layer=1, scale=scale, use_qk_l2norm=True)
    o, new = gdn_on_pool.gated_delta_decode_pool(call, jnp.array(ssm, copy=True), impl=impl)
    ro, rssm = reference(*args, ssm, hk=hk, layer=1, slot_ids=slots, scale=scale)
    assert o.shape == (rows, hv, vd) and o.dtype == dtype and new.dtype == jnp.float32
    assert rel_err(o, ro) <= TOL[dtype], rel_err(o, ro)
    assert rel_err(new, rssm) <= 1e-5, rel_err(new, rssm)
    pad = (slots == 0) | (slots > num_slots)
    assert np.all(np.asarray(o, np.float32)[pad] == 0)
    live = set(slots[~pad].tolist())
    untouched = [s for s in range(num_slots + 1) if s not in live]
    np.testing.assert_array_equal(np.asarray(new)[:, untouched], np.asarray(ssm)[:, untouched])
    np.testing.assert_array_equal(np.asarray(new)[0], np.asarray(ssm)[0])


@pytest.mark.parametrize("dtype,hk,hv,kd,vd,hidden", [(jnp.bfloat16, 2, 4, 16, 32, 32), (jnp.float32, 1, 3, 16, 16, 16),
                                                      (jnp.float32, 2, 2, 12, 24, 24)])
def test_kernel_interpret_matches_the_hand_reference(rng, dtype, hk, hv, kd, vd, hidden):
    """The kernel (interpret mode) with GQA, head and hidden dims that are not powers of two, padding rows (slot
    0, out of range: zero output, nothing written), every other slot and the other layer unchanged."""
    check(rng, "slots:interpret", rows=9, hk=hk, hv=hv, kd=kd, vd=vd, dtype=dtype, num_slots=13, hidden=hidden)


def test_table_reference_matches_the_hand_reference(rng):
    check(rng, "reference", rows=9, hk=2, hv=4, kd=16, vd=32, dtype=jnp.float32, num_slots=13)


def test_pool_op_equals_the_unfused_decode(rng):
    """``gated_delta_decode`` on a :class:`GDNStatePool` equals ``gdn_decode`` of the split columns with the
    model's gates, the conv states untouched; the pool goes in and comes out."""
    args, ssm = make_call(rng, 6, 2, 4, 16, 16, jnp.float32, 8)
    conv = jnp.asarray(rng.standard_normal((2, 9, 96, 3)), jnp.float32)
    slots = np.array([3, 1, 0, 8, 5, 2], np.int32)
    call = gdn_on_pool.GatedDecodeCall(*args, slots, layer=0, scale=16 ** -0.5, use_qk_l2norm=True)
    o, pool = gdn_pool.gated_delta_decode(call, GDNStatePool(conv=conv, ssm=jnp.array(ssm, copy=True)),
                                         impl="slots:interpret")
    qkv, x, w_a, w_b, a_log, dt_bias = args
    q, k, v = gdn_on_pool.split_packed(qkv, 4, 16, 16)
    g, beta = gdn_on_pool.qwen_gates(x @ w_a.T, x @ w_b.T, a_log, dt_bias, jnp.float32)
    ro, rpool = gdn_pool.gdn_decode(q, k, v, g, beta, GDNStatePool(conv=conv, ssm=jnp.array(ssm, copy=True)),
                                   layer=0, slot_ids=slots, use_qk_l2norm=True, impl="reference")
    assert rel_err(o, ro) <= 1e-5 and rel_err(pool.ssm, rpool.ssm) <= 1e-6
    np.testing.assert_array_equal(np.asarray(pool.conv), np.asarray(conv))


def test_bad_calls_name_the_argument(rng):
    args, ssm = make_call(rng, 4, 2, 4, 16, 16, jnp.float32, 6)
    qkv, x, w_a, w_b, a_log, dt_bias = args
    slots = np.array([1, 2, 0, 3], np.int32)
    def call(*xs, layer=0, impl="auto"):
        return gdn_on_pool.gated_delta_decode_pool(
            gdn_on_pool.GatedDecodeCall(*xs, slots, layer=layer, scale=0.25, use_qk_l2norm=True), ssm, impl)

    with pytest.raises(ValueError, match="qkv has 127 columns"):
        call(qkv[:, :127], x, w_a, w_b, a_log, dt_bias)
    with pytest.raises(ValueError, match="w_a"):
        call(qkv, x, w_a[:3], w_b, a_log, dt_bias)
    with pytest.raises(ValueError, match="w_b"):
        call(qkv, x, w_a, w_b[:, :31], a_log, dt_bias)
    with pytest.raises(ValueError, match="x"):
        call(qkv, x[:3], w_a, w_b, a_log, dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        call(qkv, x, w_a, w_b, a_log, dt_bias[:2])
    with pytest.raises(ValueError, match="layer=2 out of range"):
        call(*args, layer=2)
    with pytest.raises(UnknownImplError, match="no implementation 'fast'"):
        call(*args, impl="fast")
    with pytest.raises(ValueError, match="layer must be a Python int"):
        gdn_on_pool.GatedDecodeCall(*args, slots, layer=jnp.int32(0), scale=0.25)
    with pytest.raises(ValueError, match="scale must be a positive"):
        gdn_on_pool.GatedDecodeCall(*args, slots, layer=0, scale=None)
    pool = GDNStatePool(conv=jnp.zeros((2, 7, 96, 3)), ssm=ssm)
    with pytest.raises(ValueError, match="w_a"):
        gdn_pool.gated_delta_decode(gdn_on_pool.GatedDecodeCall(qkv, x, w_a[:3], w_b, a_log, dt_bias, slots, layer=0,
                                                             scale=0.25), pool, impl="slots:interpret")
    assert not pool.ssm.is_deleted()  # nothing donated on a bad call


def test_table_chooses_as_documented():
    table = gdn_on_pool.GATED_DECODE_TABLE
    for name, make in table.examples.items():
        args, kwargs = make()
        assert table.choose("auto", args, kwargs, NAMED["h100"])[0] == "slots", name
        assert table.choose("auto", args, kwargs, NAMED["cpu"])[0] == "reference", name
        assert "needs a GPU" in dict(table.explain(args, kwargs, NAMED["cpu"]))["slots"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hk,hv", [(jnp.bfloat16, 4, 8), (jnp.float32, 2, 2), (jnp.bfloat16, 16, 32)])
def test_kernel_gpu(rng, dtype, hk, hv):
    """The compiled kernel at K = V = 128 (the gpu preset's GDN heads: Hk=4, Hv=8; hidden 1024), padding rows."""
    check(rng, "slots", rows=37, hk=hk, hv=hv, kd=128, vd=128, dtype=dtype, num_slots=45, hidden=1024)
