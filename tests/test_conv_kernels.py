"""Pallas causal conv1d kernels on the GDN conv pool (``kvjax.pallas.gdn.conv``) against the fused-XLA oracle.

The oracle is the pool ops' reference path in ``kvjax.ops.conv`` (gather by slot, ``causal_conv1d`` reference,
scatter). CPU: interpret mode on small ragged batches; GPU (``gpu`` marker): the compiled kernels at larger
shapes and the in-place check. Pool rows that must not be read (slot 0, slots of no row, rows starting from
zeros) and inputs that must not be read (bucket padding, padding rows' tokens) hold NaN: a single read of
them shows up as a NaN in the outputs. Tolerances: outputs relative L2 error <= 1e-6 for float32 inputs,
<= 1e-2 for bfloat16 ones (both sides compute in float32 and round once); states are copies of inputs and
must match exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.errors import UnknownImplError
from kvjax.ops import conv
from kvjax.pallas.gdn.conv import conv_prefill_slots, conv_update_slots
from kvjax.state import gdn_pool
from kvjax.state.gdn_pool import GDNStatePool

TOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the kernel output (a poisoned value was read)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_pool(rng, layers, num_slots, dim, width, dtype):
    """Random states everywhere, NaN in slot 0 (never read, never written)."""
    c = rng.standard_normal((layers, num_slots, dim, width - 1)).astype(np.float32)
    c[:, 0] = np.nan
    return GDNStatePool(conv=jnp.asarray(c, dtype), ssm=jnp.asarray(rng.standard_normal((layers, num_slots, 1, 2, 2)),
                                                                    jnp.float32))


def poison_unread(pool, layer, slots, read):
    """NaN in every slot of ``layer`` that no row reads (including live rows starting from zeros)."""
    c = np.array(pool.conv, np.float32)
    keep = {int(s) for s, r in zip(slots, read) if r and 1 <= s < c.shape[1]}
    for s in range(c.shape[1]):
        if s not in keep:
            c[layer, s] = np.nan
    return GDNStatePool(conv=jnp.asarray(c, pool.conv.dtype), ssm=pool.ssm)


def check_states(new, old, ref, layer, slots):
    """Live rows' slots equal the oracle's exactly; every other byte of the pool is unchanged."""
    new, old, ref = (np.asarray(a, np.float32) for a in (new, old, ref))
    live = [int(s) for s in slots if 1 <= s < new.shape[1]]
    np.testing.assert_array_equal(new[layer, live], ref[layer, live])
    untouched = np.ones(new.shape[:2], bool)
    untouched[layer, live] = False
    np.testing.assert_array_equal(new[untouched], old[untouched])  # NaN == NaN here (slot 0 included)


def ragged(rng, lens, dim, dtype, num_slots, *, pad_tokens=3, bad_slots=(0, -2)):
    """x with NaN bucket padding; random distinct slots; padding rows get ids from ``bad_slots``."""
    lens = list(lens)
    n = len(lens) + len(bad_slots)
    order = rng.permutation(n)
    all_lens = (lens + [int(rng.integers(0, 3)) for _ in bad_slots])
    all_lens = [all_lens[i] for i in order]
    live_ids = rng.permutation(np.arange(1, num_slots))[: len(lens)]
    slots = np.concatenate([live_ids, np.asarray(bad_slots)]).astype(np.int32)[order]
    cu = np.concatenate([[0], np.cumsum(all_lens)]).astype(np.int32)
    x = rng.standard_normal((int(cu[-1]) + pad_tokens, dim)).astype(np.float32)
    x[cu[-1]:] = np.nan
    for i, s in enumerate(slots):
        if not 1 <= s < num_slots:
            x[cu[i]:cu[i + 1]] = np.nan  # padding rows' tokens: never read
    has_init = rng.random(n) < 0.6
    return jnp.asarray(x, dtype), cu, slots, has_init


def weights(rng, dim, width, with_bias):
    w = jnp.asarray(rng.standard_normal((dim, width)) * 0.5, jnp.float32)
    b = jnp.asarray(rng.standard_normal(dim), jnp.float32) if with_bias else None
    return w, b


def run_prefill(rng, lens, *, dim, width, dtype, state_dtype, activation, with_bias, impl, layers=2,
                num_slots=12, layer=1, **tuning):
    pool = make_pool(rng, layers, num_slots, dim, width, state_dtype)
    x, cu, slots, has_init = ragged(rng, lens, dim, dtype, num_slots)
    pool = poison_unread(pool, layer, slots, has_init)
    w, b = weights(rng, dim, width, with_bias)
    args = dict(layer=layer, slot_ids=jnp.asarray(slots), has_initial_state=jnp.asarray(has_init),
                cu_seqlens=jnp.asarray(cu), activation=activation)
    old = np.asarray(pool.conv, np.float32)
    call = conv.ConvPoolCall(x, w, b, **args)
    ry, rconv = conv.conv_prefill_pool_reference(call, pool.conv)
    if tuning:
        y, new = conv_prefill_slots(call, jnp.array(pool.conv), interpret=impl == "interpret", **tuning)
    else:
        y, out = gdn_pool.conv_prefill(x, w, b, pool, impl=impl, **args)
        new = out.conv
    assert rel_err(y, ry) <= TOL[dtype]
    yn = np.asarray(y, np.float32)
    for i, s in enumerate(slots):
        if not 1 <= s < num_slots:
            assert np.all(yn[cu[i]:cu[i + 1]] == 0), "padding row output"
    assert np.all(yn[cu[-1]:] == 0), "bucket padding output"
    check_states(new, old, rconv, layer, slots)


def run_decode(rng, batch, *, dim, width, dtype, state_dtype, activation, with_bias, impl, layers=2,
               num_slots=12, layer=0, **tuning):
    pool = make_pool(rng, layers, num_slots, dim, width, state_dtype)
    live_ids = rng.permutation(np.arange(1, num_slots))[: batch - 3]
    slots = rng.permutation(np.concatenate([live_ids, [0, -1, num_slots + 2]])).astype(np.int32)
    pool = poison_unread(pool, layer, slots, np.ones(batch, bool))
    x = rng.standard_normal((batch, dim)).astype(np.float32)
    x[~((slots >= 1) & (slots < num_slots))] = np.nan
    x = jnp.asarray(x, dtype)
    w, b = weights(rng, dim, width, with_bias)
    old = np.asarray(pool.conv, np.float32)
    call = conv.ConvPoolCall(x, w, b, layer, jnp.asarray(slots), activation=activation)
    ry, rconv = conv.conv_decode_pool_reference(call, pool.conv)
    if tuning:
        y, new = conv_update_slots(call, jnp.array(pool.conv), interpret=impl == "interpret", **tuning)
    else:
        ssm0 = np.asarray(pool.ssm)
        y, out = gdn_pool.conv_decode(x, w, b, pool, layer=layer, slot_ids=jnp.asarray(slots), activation=activation,
                                       impl=impl)
        new = out.conv
        np.testing.assert_array_equal(np.asarray(out.ssm), ssm0)  # the pool (ssm too) is donated
    assert rel_err(y, ry) <= TOL[dtype]
    assert np.all(np.asarray(y, np.float32)[~((slots >= 1) & (slots < num_slots))] == 0)
    check_states(new, old, rconv, layer, slots)


LENS = [0, 1, 2, 3, 4, 5, 37]  # 0, 1, 2, W-1, W, W+1 and one spanning several token blocks (W = 4)


def test_reference_path_matches_the_conv_op(rng):
    """The oracle itself: live rows equal ``causal_conv1d`` on the gathered states, padding rows give 0."""
    dim, width, num_slots = 24, 4, 9
    pool = make_pool(rng, 2, num_slots, dim, width, jnp.float32)
    x, cu, slots, has_init = ragged(rng, [3, 0, 6, 1], dim, jnp.float32, num_slots)
    w, b = weights(rng, dim, width, True)
    c = np.asarray(pool.conv)
    live = (slots >= 1) & (slots < num_slots)
    init = np.where((live & has_init)[:, None, None], c[1, np.where(live, slots, 1)], 0.0)
    ry, rfinal = conv.causal_conv1d(jnp.nan_to_num(x), w, b, cu_seqlens=jnp.asarray(cu),
                                    initial_state=jnp.asarray(init), impl="reference")
    call = conv.ConvPoolCall(x, w, b, 1, jnp.asarray(slots), jnp.asarray(has_init), jnp.asarray(cu), "silu")
    y, new = conv.conv_prefill_pool_reference(call, pool.conv)
    tok_live = np.repeat(live, np.diff(cu))
    np.testing.assert_allclose(np.asarray(y)[: cu[-1]][tok_live], np.asarray(ry)[: cu[-1]][tok_live], rtol=1e-6,
                               atol=1e-6)
    assert np.all(np.asarray(y)[: cu[-1]][~tok_live] == 0)
    np.testing.assert_array_equal(np.asarray(new)[1, slots[live]], np.asarray(rfinal)[live])


@pytest.mark.parametrize("activation,with_bias,dtype,state_dtype", [
    ("silu", True, jnp.bfloat16, jnp.bfloat16),
    (None, False, jnp.float32, jnp.float32),
])
def test_decode_interpret(rng, activation, with_bias, dtype, state_dtype):
    run_decode(rng, 9, dim=40, width=4, dtype=dtype, state_dtype=state_dtype, activation=activation,
               with_bias=with_bias, impl="interpret")


def test_decode_interpret_channel_blocks(rng):
    """Several channel blocks with a ragged tail (D=40, block_d=16), width 3, f32 state with bf16 x."""
    run_decode(rng, 6, dim=40, width=3, dtype=jnp.bfloat16, state_dtype=jnp.float32, activation="silu",
               with_bias=True, impl="interpret", block_d=16)


@pytest.mark.parametrize("activation,with_bias,dtype,state_dtype", [
    ("silu", False, jnp.bfloat16, jnp.bfloat16),
    (None, True, jnp.float32, jnp.float32),
])
def test_prefill_interpret(rng, activation, with_bias, dtype, state_dtype):
    run_prefill(rng, LENS, dim=24, width=4, dtype=dtype, state_dtype=state_dtype, activation=activation,
                with_bias=with_bias, impl="interpret")


def test_prefill_interpret_straddling_blocks(rng):
    """Token blocks of 8 straddle sequences; D=40 in blocks of 16 with a tail; width 2 (one state column)."""
    run_prefill(rng, [5, 1, 0, 9, 2, 3], dim=40, width=2, dtype=jnp.bfloat16, state_dtype=jnp.bfloat16,
                activation="silu", with_bias=True, impl="interpret", block_t=8, block_d=16)
    run_prefill(rng, [1, 0, 2, 13], dim=24, width=4, dtype=jnp.float32, state_dtype=jnp.bfloat16,
                activation="silu", with_bias=False, impl="interpret", block_t=4, block_d=8)


def test_impl_names():
    pool = GDNStatePool(conv=jnp.zeros((1, 3, 8, 3), jnp.bfloat16), ssm=jnp.zeros((1, 3, 1, 2, 2)))
    x, w = jnp.ones((2, 8), jnp.bfloat16), jnp.ones((8, 4), jnp.float32)
    slots = np.array([1, 2], np.int32)
    with pytest.raises(UnknownImplError):
        gdn_pool.conv_decode(x, w, None, pool, layer=0, slot_ids=slots, impl="nope")
    with pytest.raises(UnknownImplError):
        gdn_pool.conv_prefill(x, w, None, pool, layer=0, slot_ids=slots, has_initial_state=np.ones(2, bool),
                               cu_seqlens=np.array([0, 1, 2], np.int32), impl="triton")
    with pytest.raises(ValueError, match="impl"):
        gdn_pool.conv_decode(x, w, None, pool, layer=0, slot_ids=slots, impl=None)


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,state_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32)])
@pytest.mark.parametrize("activation,with_bias", [("silu", False), (None, True)])
def test_conv_kernels_gpu(rng, dtype, state_dtype, activation, with_bias):
    lens = [0, 1, 2, 3, 4, 5, 63, 64, 65, 777, 4096] + [int(v) for v in rng.integers(1, 40, 20)]
    run_prefill(rng, lens, dim=2048 + 64, width=4, dtype=dtype, state_dtype=state_dtype, activation=activation,
                with_bias=with_bias, impl="pallas", num_slots=40)
    run_decode(rng, 96, dim=6144, width=4, dtype=dtype, state_dtype=state_dtype, activation=activation,
               with_bias=with_bias, impl="pallas", num_slots=128)


@pytest.mark.gpu
@pytest.mark.parametrize("block_t,block_d,num_warps", [(16, 256, 4), (64, 64, 2)])
def test_prefill_tunings_gpu(rng, block_t, block_d, num_warps):
    run_prefill(rng, LENS + [300], dim=1000, width=4, dtype=jnp.bfloat16, state_dtype=jnp.bfloat16,
                activation="silu", with_bias=True, impl="pallas", block_t=block_t, block_d=block_d,
                num_warps=num_warps)


@pytest.mark.gpu
def test_conv_in_place_gpu(rng):
    """Under jit with the pool donated the compiled step holds no copy of the conv pool."""
    pool = make_pool(rng, 2, 64, 4096, 4, jnp.bfloat16)
    w, _ = weights(rng, 4096, 4, False)
    slots = jnp.asarray(rng.permutation(np.arange(1, 64))[:32], jnp.int32)
    xd = jnp.asarray(rng.standard_normal((32, 4096)), jnp.bfloat16)
    xp = jnp.asarray(rng.standard_normal((320, 4096)), jnp.bfloat16)
    cu = jnp.arange(0, 321, 10, dtype=jnp.int32)
    has_init = jnp.ones((32,), jnp.bool_)
    steps = {
        "decode": lambda p: gdn_pool.conv_decode(xd, w, None, p, layer=1, slot_ids=slots, impl="pallas"),
        "prefill": lambda p: gdn_pool.conv_prefill(xp, w, None, p, layer=1, slot_ids=slots,
                                                    has_initial_state=has_init, cu_seqlens=cu, impl="pallas"),
    }
    for name, fn in steps.items():
        hlo = jax.jit(fn, donate_argnums=0).lower(pool).compile().as_text()
        copies = [ln for ln in hlo.splitlines() if " copy(" in ln and "bf16[2,64,4096,3]" in ln]
        assert not copies, f"{name}: the conv pool is copied:\n" + "\n".join(copies)
