"""GDN state pool: slot 0 (PAD) is never written, gather/scatter round-trip, reset, zeros for fresh rows, jit."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvjax.config import GDNConfig
from kvjax.base.slots import check_slot_ids
from kvjax.errors import InvalidPlanError
from kvjax.state import gdn_pool
from kvjax.state.gdn_pool import GDNStatePool

CFG = GDNConfig(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=3, conv_kernel_size=3)
LAYERS, MAX_SEQS, BATCH = 3, 5, 4


def _states(rng, batch=BATCH, conv_dtype=np.float32):
    conv = rng.standard_normal((batch, CFG.conv_dim, CFG.conv_kernel_size - 1)).astype(conv_dtype)
    ssm = rng.standard_normal((batch, CFG.num_v_heads, CFG.head_k_dim, CFG.head_v_dim)).astype(np.float32)
    return conv, ssm


def _filled_pool(rng, conv_dtype=jnp.float32) -> GDNStatePool:
    """Every real slot of every layer holds random values (written through scatter); PAD stays zero."""
    pool = gdn_pool.create(CFG, LAYERS, MAX_SEQS, conv_dtype=conv_dtype)
    slots = np.arange(1, MAX_SEQS + 1, dtype=np.int32)
    for layer in range(LAYERS):
        pool = gdn_pool.scatter(pool, layer, slots, *_states(rng, MAX_SEQS))
    return pool


def _assert_pad_zero(pool):
    assert not np.any(np.asarray(pool.conv[:, 0])) and not np.any(np.asarray(pool.ssm[:, 0]))


def test_create_shapes_dtypes():
    pool = gdn_pool.create(CFG, LAYERS, MAX_SEQS)
    chex.assert_shape(pool.conv, (LAYERS, MAX_SEQS + 1, CFG.conv_dim, CFG.conv_kernel_size - 1))
    chex.assert_shape(pool.ssm, (LAYERS, MAX_SEQS + 1, 2, 4, 3))
    assert pool.conv.dtype == jnp.bfloat16 and pool.ssm.dtype == jnp.float32
    assert (pool.num_layers, pool.max_seqs) == (LAYERS, MAX_SEQS)
    assert pool.nbytes == pool.conv.nbytes + pool.ssm.nbytes
    assert len(jax.tree_util.tree_leaves(pool)) == 2  # a pytree of its two arrays


def test_scatter_gather_round_trip_and_pad_slot(rng):
    pool = _filled_pool(rng, conv_dtype=jnp.bfloat16)
    before = jax.tree_util.tree_map(np.asarray, pool)
    slot_ids = np.array([3, 0, 1, 0], np.int32)  # two PAD rows
    conv, ssm = _states(rng)
    pool = gdn_pool.scatter(pool, 1, slot_ids, conv, ssm)
    _assert_pad_zero(pool)
    got = gdn_pool.gather(pool, 1, slot_ids, np.array([True, True, True, False]))
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    got_conv, got_ssm = map(np.asarray, got)
    pool = jax.tree_util.tree_map(np.asarray, pool)
    np.testing.assert_array_equal(got_conv[[0, 2]], conv[[0, 2]].astype(jnp.bfloat16))
    np.testing.assert_array_equal(got_ssm[[0, 2]], ssm[[0, 2]])
    assert not np.any(np.asarray(got_conv[[1, 3]])) and not np.any(np.asarray(got_ssm[[1, 3]]))  # PAD rows
    untouched = np.ones(MAX_SEQS + 1, bool)
    untouched[[3, 1]] = False
    np.testing.assert_array_equal(pool.ssm[1, untouched], before.ssm[1, untouched])
    np.testing.assert_array_equal(pool.conv[[0, 2]], before.conv[[0, 2]])  # other layers untouched


def test_gather_without_initial_state_reads_zeros(rng):
    pool = _filled_pool(rng)
    slot_ids = np.array([2, 5, 4, 1], np.int32)
    has_init = np.array([False, True, False, True])
    conv, ssm = gdn_pool.gather(pool, 2, slot_ids, has_init)
    assert not np.any(np.asarray(conv[~has_init])) and not np.any(np.asarray(ssm[~has_init]))
    np.testing.assert_array_equal(conv[has_init], pool.conv[2, slot_ids[has_init]])
    np.testing.assert_array_equal(ssm[has_init], pool.ssm[2, slot_ids[has_init]])
    assert np.all(np.abs(np.asarray(pool.ssm[2, slot_ids[~has_init]])) > 0)  # the slots did hold state


def test_reset_zeroes_freed_slots_in_every_layer(rng):
    pool = _filled_pool(rng)
    before = jax.tree_util.tree_map(np.asarray, pool)
    pool = gdn_pool.reset(pool, np.array([4, 0, 2], np.int32))
    freed = np.zeros(MAX_SEQS + 1, bool)
    freed[[2, 4]] = True
    for a, b in ((pool.conv, before.conv), (pool.ssm, before.ssm)):
        assert not np.any(np.asarray(a[:, freed]))
        np.testing.assert_array_equal(a[:, ~freed], b[:, ~freed])
    _assert_pad_zero(pool)


def test_out_of_range_and_negative_ids_never_write_or_wrap(rng):
    pool = _filled_pool(rng)
    before = jax.tree_util.tree_map(np.asarray, pool)
    slot_ids = np.array([-1, MAX_SEQS + 1, 0, 2**30], np.int32)  # -1 must not wrap to the last slot
    pool = gdn_pool.scatter(pool, 0, slot_ids, *_states(rng))
    chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, pool), before)
    conv, ssm = gdn_pool.gather(pool, 0, slot_ids, np.ones(BATCH, bool))
    assert not np.any(np.asarray(conv)) and not np.any(np.asarray(ssm))


def test_traced_layer_under_jit_compiles_once(rng):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(pool, layer, slot_ids, conv, ssm):
        pool = gdn_pool.scatter(pool, layer, slot_ids, conv, ssm)
        return pool, gdn_pool.gather(pool, layer, slot_ids, slot_ids > 0)

    chex.clear_trace_counter()
    pool = _filled_pool(rng)
    for layer in range(LAYERS):
        slot_ids = rng.permutation(np.arange(MAX_SEQS + 1, dtype=np.int32))[:BATCH]
        conv, ssm = _states(rng)
        pool, (got_conv, got_ssm) = step(pool, jnp.int32(layer), slot_ids, conv, ssm)
        live = slot_ids > 0
        np.testing.assert_array_equal(got_ssm[live], ssm[live])
        np.testing.assert_array_equal(got_conv[live], conv[live])
        np.testing.assert_array_equal(pool.ssm[layer, slot_ids[live]], ssm[live])
        _assert_pad_zero(pool)


@given(ops=st.lists(st.tuples(st.integers(0, LAYERS - 1),
                              st.permutations(list(range(MAX_SEQS + 1))).map(lambda p: p[:BATCH]),
                              st.booleans()), min_size=1, max_size=6),
       seed=st.integers(0, 2**31 - 1))
def test_pool_matches_numpy_model(ops, seed):
    """Random scatters (PAD rows included) and resets == a numpy model that never touches slot 0."""
    rng = np.random.default_rng(seed)
    pool = gdn_pool.create(CFG, LAYERS, MAX_SEQS, conv_dtype=jnp.float32)
    model = jax.tree_util.tree_map(np.array, pool)
    for layer, ids, is_reset in ops:
        ids = np.asarray(ids, np.int32)
        if is_reset:
            pool = _jit_reset(pool, ids)
            model.conv[:, ids[ids > 0]] = 0
            model.ssm[:, ids[ids > 0]] = 0
        else:
            conv, ssm = _states(rng)
            pool = _jit_scatter(pool, layer, ids, conv, ssm)
            model.conv[layer, ids[ids > 0]] = conv[ids > 0]
            model.ssm[layer, ids[ids > 0]] = ssm[ids > 0]
    chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, pool), model)
    _assert_pad_zero(pool)


_jit_scatter = jax.jit(gdn_pool.scatter)
_jit_reset = jax.jit(gdn_pool.reset)


def test_bad_inputs_raise(rng):
    pool = gdn_pool.create(CFG, LAYERS, MAX_SEQS)
    ids = np.array([1, 2, 0, 3], np.int32)
    conv, ssm = _states(rng)
    has = np.array([True, False, True, True])
    with pytest.raises(ValueError, match="slot_ids must have dtype"):
        gdn_pool.gather(pool, 0, ids.astype(np.int64), has)
    with pytest.raises(ValueError, match="slot_ids must have rank 1"):
        gdn_pool.scatter(pool, 0, ids[None], conv, ssm)
    with pytest.raises(ValueError, match="has_initial_state must have dtype"):
        gdn_pool.gather(pool, 0, ids, has.astype(np.int32))
    with pytest.raises(ValueError, match="has_initial_state must have shape"):
        gdn_pool.gather(pool, 0, ids, has[:2])
    with pytest.raises(ValueError, match="layer=3 out of range"):
        gdn_pool.gather(pool, LAYERS, ids, has)
    with pytest.raises(ValueError, match="layer must have an integer dtype"):
        gdn_pool.gather(pool, jnp.float32(1), ids, has)
    with pytest.raises(ValueError, match="conv must have shape"):
        gdn_pool.scatter(pool, 0, ids, conv[:, :, :1], ssm)
    with pytest.raises(ValueError, match="ssm must have dtype"):
        gdn_pool.scatter(pool, 0, ids, conv, ssm.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="ssm must have shape"):
        gdn_pool.scatter(pool, 0, ids, conv, ssm[:3])
    with pytest.raises(ValueError, match="max_seqs must be an int >= 1"):
        gdn_pool.create(CFG, LAYERS, 0)


def test_check_slot_ids_names_bad_ids():
    check_slot_ids(np.array([0, 3, 0, 5, 1], np.int32), MAX_SEQS)  # repeated PAD is fine
    with pytest.raises(InvalidPlanError, match=r"out of range 0..5 .*\[-1, 6\]"):
        check_slot_ids(np.array([2, -1, 6, 0], np.int32), MAX_SEQS)
    with pytest.raises(InvalidPlanError, match=r"more than one row: \[3\]"):
        check_slot_ids(np.array([3, 0, 3, 0], np.int32), MAX_SEQS)
    with pytest.raises(InvalidPlanError, match="must be int32"):
        check_slot_ids(np.array([1, 2], np.int64), MAX_SEQS)
