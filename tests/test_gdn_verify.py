"""The few-token verification op (:func:`kvjax.ops.spec_states.gdn_verify_pool`): its reference and its Pallas kernel
(interpret mode here, compiled on a GPU) against independent oracles: outputs and final states equal the slot-pool
decode oracle's (the rows/flags recurrence over each row's tokens), the per-position states equal
:func:`~kvjax.ops.spec_states.verify_ssm_states`' (itself checked against the recurrent reference over each prefix in
``test_spec_states.py``); nothing else of the pool or the states buffer changes; bad calls raise naming the argument."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.errors import UnknownImplError
from kvjax.ops.gdn import DeltaRuleCall
from kvjax.ops.gdn_on_pool import gdn_decode_pool_reference
from kvjax.ops.spec_states import VERIFY_TABLE, gdn_verify_pool, verify_ssm_states
from kvjax.pallas.gdn import verify as verify_kernels

ATOL = 3e-5  # f32 state and outputs after a few recurrent steps of O(1) values, in another summation order


def _case(rng, lens, slots, *, hk=2, hv=4, kd=16, vd=32, layers=2, pad=2, J=4, dtype=jnp.float32, l2=True):
    """Random inputs: rows of ``lens`` tokens at GDN slots ``slots`` (0: padding row), then ``pad`` padding tokens;
    a random pool of ``layers`` layers and a random states buffer of ``J`` positions."""
    T = sum(lens) + pad
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    call = DeltaRuleCall(f(T, hk, kd).astype(dtype), f(T, hk, kd).astype(dtype), f(T, hv, vd).astype(dtype),
                         -jnp.abs(f(T, hv)) * 0.3, jax.nn.sigmoid(f(T, hv)).astype(dtype), cu_seqlens=cu,
                         scale=kd ** -0.5, slot_ids=jnp.asarray(slots, jnp.int32), layer=1, use_qk_l2norm=l2)
    ssm = 0.5 * f(layers, 7, hv, kd, vd)
    states = f(layers, len(lens), J, hv, kd, vd)
    return call, ssm, states


def _run(call, ssm, states, impl):
    """The op on copies (the kernel donates its state arrays)."""
    return gdn_verify_pool(call, jnp.array(ssm, copy=True), jnp.array(states, copy=True), impl=impl)


def _check_against_oracles(call, ssm, states, got, lens, slots, atol):
    o, new_ssm, new_states = (np.asarray(x, np.float32) for x in got)
    want_o, want_ssm = gdn_decode_pool_reference(call, ssm)  # independent: the ragged recurrence on the pool
    np.testing.assert_allclose(o, np.asarray(want_o, np.float32), atol=atol, rtol=1e-4)
    np.testing.assert_allclose(new_ssm, np.asarray(want_ssm), atol=atol, rtol=1e-4)
    J = states.shape[2]
    cu = np.asarray(call.cu_seqlens)
    index = jnp.asarray(cu[:-1, None] + np.arange(J), jnp.int32)
    live = np.asarray(slots) > 0
    valid = (np.arange(J)[None, :] < np.asarray(lens)[:, None]) & live[:, None]
    init = ssm[1, jnp.asarray(slots)]
    per = np.asarray(verify_ssm_states(call.k, call.v, call.g, call.beta, init, index, jnp.asarray(valid),
                                       use_qk_l2norm=call.use_qk_l2norm))
    want_states = np.where(valid[..., None, None, None], per, np.asarray(states[1]))
    np.testing.assert_allclose(new_states[1], want_states, atol=atol, rtol=1e-4)
    np.testing.assert_array_equal(new_states[0], np.asarray(states[0]))  # other layers untouched


@pytest.mark.parametrize("impl", ["reference", "pallas:interpret"])
@pytest.mark.parametrize("l2", [True, False])
def test_verify_equals_the_pool_recurrence_and_the_per_position_states(impl, l2):
    rng = np.random.default_rng(3)
    lens, slots = [3, 1, 4, 0, 2], [2, 5, 1, 0, 0]  # a padding row with no tokens, one (slot 0) with two
    call, ssm, states = _case(rng, lens, slots, l2=l2)
    got = jax.jit(lambda s, st: gdn_verify_pool(call, s, st, impl=impl))(ssm, states)  # call: static scale, layer
    _check_against_oracles(call, ssm, states, got, lens, slots, ATOL)


def test_verify_kernel_on_padded_head_dims_and_bf16_inputs():
    rng = np.random.default_rng(4)
    lens, slots = [2, 5, 1], [6, 3, 4]
    call, ssm, states = _case(rng, lens, slots, hk=1, hv=2, kd=12, vd=40, J=5, dtype=jnp.bfloat16)
    got = _run(call, ssm, states, "pallas:interpret")
    _check_against_oracles(call, ssm, states, got, lens, slots, 2e-2)  # bf16 outputs, rounded q / k / v


def test_untouched_slots_keep_their_states():
    rng = np.random.default_rng(5)
    call, ssm, states = _case(rng, [2, 3], [4, 2])
    _, new_ssm, _ = _run(call, ssm, states, "pallas:interpret")
    keep = [s for s in range(7) if s not in (4, 2)]
    np.testing.assert_array_equal(np.asarray(new_ssm)[1, keep], np.asarray(ssm)[1, keep])
    np.testing.assert_array_equal(np.asarray(new_ssm)[0], np.asarray(ssm)[0])


def test_bad_calls_raise_naming_the_argument():
    rng = np.random.default_rng(6)
    call, ssm, states = _case(rng, [2, 3], [4, 2])
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        gdn_verify_pool(dataclasses.replace(call, cu_seqlens=None), ssm, states)
    with pytest.raises(ValueError, match="has_initial_state must be None"):
        gdn_verify_pool(dataclasses.replace(call, has_initial_state=jnp.ones(2, bool)), ssm, states)
    with pytest.raises(ValueError, match="states"):
        gdn_verify_pool(call, ssm, states[:, :1])  # one row's buffer for two rows
    with pytest.raises(ValueError, match="states"):
        gdn_verify_pool(call, ssm, states.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="layer=5 out of range"):
        gdn_verify_pool(dataclasses.replace(call, layer=5), ssm, states)


def test_table_takes_the_kernel_for_a_static_layer_only():
    (call, ssm, states), _ = VERIFY_TABLE.examples["verify B=16 x 5 tokens H=32, int layer"]()
    assert VERIFY_TABLE.backend("pallas").shape_reason((call, ssm, states), {}) is None
    (call, ssm, states), _ = VERIFY_TABLE.examples["verify B=16 x 5 tokens H=32, traced layer"]()
    reason = VERIFY_TABLE.backend("pallas").shape_reason((call, ssm, states), {})
    assert reason is not None and "static Python-int layer" in reason
    with pytest.raises(UnknownImplError, match="static Python-int layer"):
        VERIFY_TABLE.choose("pallas:interpret", (call, ssm, states), {})


def _to_slots_case(rng, lens, slots, J, num_slots, **kw):
    """A case plus each row's ``J`` position slots: distinct fresh slots, some positions' slot out of range."""
    call, ssm, states = _case(rng, lens, slots, J=J, **kw)
    ssm = jnp.concatenate([ssm, 0.5 * jnp.asarray(rng.standard_normal((ssm.shape[0], num_slots - ssm.shape[1],
                                                                       *ssm.shape[2:])), jnp.float32)], axis=1)
    fresh = rng.permutation(np.arange(8, num_slots))[: len(lens) * J].reshape(len(lens), J)
    fresh[0, -1] = 0  # a position whose slot is out of range: not written
    return call, ssm, states, jnp.asarray(fresh, jnp.int32)


def _check_to_slots(call, ssm, states, pos, got, lens, slots, atol, rtol=1e-4):
    """The to-slots mode against the step-buffer mode (checked above against the oracles): the same outputs, the
    state after position ``j`` at ``ssm[layer, pos[b, j]]``, every other slot (the rows' own included) unchanged."""
    o, new_ssm, none = got
    assert none is None
    ref_o, _, ref_states = (np.asarray(x, np.float32) for x in _run(call, ssm, states, "reference"))
    np.testing.assert_allclose(np.asarray(o, np.float32), ref_o, atol=atol, rtol=rtol)
    want = np.array(ssm)
    pos = np.asarray(pos)
    for b, (n, slot) in enumerate(zip(lens, slots)):
        for j in range(n if slot else 0):
            if 1 <= pos[b, j] < want.shape[1]:
                want[call.layer, pos[b, j]] = ref_states[call.layer, b, j]
    np.testing.assert_allclose(np.asarray(new_ssm), want, atol=atol, rtol=rtol)


def test_verify_kernel_to_position_slots():
    rng = np.random.default_rng(5)
    lens, slots = [3, 1, 4, 0, 2], [2, 5, 1, 0, 0]
    call, ssm, states, pos = _to_slots_case(rng, lens, slots, 4, 40)
    got = verify_kernels.verify_slots(call.q, call.k, call.v, call.g, call.beta, jnp.array(ssm, copy=True), None,
                                      cu_seqlens=call.cu_seqlens, slot_ids=call.slot_ids, layer=call.layer,
                                      scale=call.scale, use_qk_l2norm=True, interpret=True, position_slots=pos)
    _check_to_slots(call, ssm, states, pos, got, lens, slots, ATOL)
    with pytest.raises(ValueError, match="either states"):
        verify_kernels.verify_slots(call.q, call.k, call.v, call.g, call.beta, ssm, states, cu_seqlens=call.cu_seqlens,
                                    slot_ids=call.slot_ids, layer=1, scale=call.scale, interpret=True,
                                    position_slots=pos)


@pytest.mark.gpu
@pytest.mark.parametrize("J", [2, 5])
def test_gpu_verify_kernel_equals_the_reference(J):
    rng = np.random.default_rng(7)
    lens = list(rng.integers(1, J + 1, 24)) + [0]
    slots = list(rng.permutation(np.arange(1, 40))[:24]) + [0]
    call, ssm, states = _case(rng, lens, slots, hk=4, hv=8, kd=128, vd=128, layers=3, J=J, dtype=jnp.bfloat16)
    call = dataclasses.replace(call, layer=2)
    ssm = jnp.concatenate([ssm, ssm[:, :1].repeat(40, axis=1)], axis=1)  # 47 slots
    want = gdn_verify_pool(call, ssm, states, impl="reference")
    got = _run(call, ssm, states, "pallas")
    for a, b in zip(got, want):  # bf16 inputs and outputs; the kernel's f32 recurrence in another order
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_verify_kernel_to_position_slots():
    rng = np.random.default_rng(8)
    lens = list(rng.integers(1, 6, 24)) + [0]
    slots = list(rng.permutation(np.arange(1, 7))) + list(rng.integers(1, 7, 18)) + [0]
    call, ssm, states, pos = _to_slots_case(rng, lens, [int(x) for x in slots], 5, 200, hk=4, hv=8, kd=128, vd=128,
                                            dtype=jnp.bfloat16)
    got = verify_kernels.verify_slots(call.q, call.k, call.v, call.g, call.beta, jnp.array(ssm, copy=True), None,
                                      cu_seqlens=call.cu_seqlens, slot_ids=call.slot_ids, layer=call.layer,
                                      scale=call.scale, use_qk_l2norm=True, position_slots=pos)
    _check_to_slots(call, ssm, states, pos, got, lens, slots, 2e-2, 2e-2)  # bf16 inputs, as the test above
