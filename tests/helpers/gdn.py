"""The GDN kernel tests' inputs and checks: random ragged batches, a random state pool, a public kernel against the
float32 reference and a pool op against the gather -> reference -> scatter oracle. Tolerances: relative L2 error
<= 1e-4 for float32 inputs, <= 2e-2 for bfloat16 inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.ops import gdn
from kvjax.pallas.gdn.chunk import chunk_gated_delta_rule_pallas
from kvjax.pallas.gdn.common import FLAG_HAS_INITIAL, FLAG_LIVE
from kvjax.pallas.gdn.recurrent import recurrent_gated_delta_rule_pallas
from kvjax.state.gdn_pool import GDNStatePool

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the kernel output"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def row_flags(n: int):
    """Flags of ``n`` pool-kernel rows: live with an initial state, except row 2 (no initial state: zeros) and, with
    more than 3 rows, row 3 (padding: not live, its pool row untouched). Returns (i32[n] flags, whether a padding
    row is there)."""
    flags = np.full((n,), FLAG_LIVE | FLAG_HAS_INITIAL, np.int32)
    flags[min(2, n - 1)] = FLAG_LIVE
    pad_row = n > 3
    if pad_row:
        flags[3] = 0
    return jnp.asarray(flags), pad_row


def make_inputs(rng, lens, hk, hv, kd, vd, dtype, *, pad_tokens=0, unit_qk=False):
    """Random ragged batch. ``unit_qk``: q/k of norm ~1 (without in-kernel l2norm, ``beta |k|^2`` must stay
    below 2 or the delta rule diverges over long sequences, in the reference too)."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1]) + pad_tokens
    std = kd ** -0.5 if unit_qk else 1.0
    q = jnp.asarray(rng.standard_normal((t, hk, kd)) * std, dtype)
    k = jnp.asarray(rng.standard_normal((t, hk, kd)) * std, dtype)
    v = jnp.asarray(rng.standard_normal((t, hv, vd)), dtype)
    g = jnp.asarray(np.log(rng.uniform(0.6, 1.0, (t, hv))), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.05, 1.0, (t, hv)), dtype)
    s0 = jnp.asarray(rng.standard_normal((len(lens), hv, kd, vd)), jnp.float32)
    return q, k, v, g, beta, jnp.asarray(cu), s0


KERNELS = {"chunk": chunk_gated_delta_rule_pallas, "recurrent": recurrent_gated_delta_rule_pallas}


def public_kernel(kind, kd):
    """``KERNELS[kind]`` compiled (not interpreted) as a function of :func:`make_inputs`' arrays, scale ``kd ** -0.5``
    and the in-kernel l2norm: a function of arrays only, for ``jax.jit(...).trace(...).lower(...)``."""
    def fn(q, k, v, g, beta, cu, s0):
        return KERNELS[kind](gdn.DeltaRuleCall(q, k, v, g, beta, cu, kd ** -0.5, use_qk_l2norm=True), s0)
    return fn


def check_public_kernel(rng, kind, lens, hk, hv, kd, vd, dtype, *, l2, init, interpret, pad_tokens=3):
    q, k, v, g, beta, cu, s0 = make_inputs(rng, lens, hk, hv, kd, vd, dtype, pad_tokens=pad_tokens,
                                           unit_qk=not l2)
    call, init_state = gdn.DeltaRuleCall(q, k, v, g, beta, cu, kd ** -0.5, use_qk_l2norm=l2), s0 if init else None
    o, f = KERNELS[kind](call, init_state, interpret=interpret)
    ro, rf = gdn.recurrent_gated_delta_rule_reference(call, init_state)
    assert o.shape == ro.shape and o.dtype == v.dtype and f.shape == rf.shape and f.dtype == jnp.float32
    assert rel_err(o, ro) <= TOL[dtype], rel_err(o, ro)
    assert rel_err(f, rf) <= TOL[dtype], rel_err(f, rf)
    assert np.all(np.asarray(o[int(cu[-1]):], np.float32) == 0), "tokens outside every sequence must be zero"


def make_pool(rng, layers, num_slots, hv, kd, vd, conv_dim=24, width=4):
    ssm = rng.standard_normal((layers, num_slots + 1, hv, kd, vd)).astype(np.float32)
    convs = rng.standard_normal((layers, num_slots + 1, conv_dim, width - 1)).astype(np.float32)
    ssm[:, 0], convs[:, 0] = 0.0, 0.0
    return GDNStatePool(conv=jnp.asarray(convs, jnp.bfloat16), ssm=jnp.asarray(ssm))


def check_pool_op(rng, op, lens, slots, has_init, *, hk, hv, kd, vd, dtype, impl, num_slots, layers=2,
                  one_token=False, static_layer=True):
    """Kernel vs the gather -> reference -> scatter oracle; PAD slot, other slots, other layer, conv untouched."""
    q, k, v, g, beta, cu, _ = make_inputs(rng, lens, hk, hv, kd, vd, dtype, pad_tokens=0 if one_token else 2)
    pool = make_pool(rng, layers, num_slots, hv, kd, vd)
    ssm0 = np.asarray(pool.ssm)
    layer = layers - 1 if static_layer else jnp.int32(layers - 1)
    kw = dict(layer=layer, slot_ids=np.asarray(slots, np.int32),
              has_initial_state=None if has_init is None else np.asarray(has_init, np.bool_),
              cu_seqlens=None if one_token else np.asarray(cu), use_qk_l2norm=True)
    o, out = op(q, k, v, g, beta, pool, impl=impl, **kw)
    ro, rout = op(q, k, v, g, beta, GDNStatePool(conv=pool.conv, ssm=jnp.asarray(ssm0)), impl="reference", **kw)
    new, ref = np.asarray(out.ssm), np.asarray(rout.ssm)
    assert rel_err(o, ro) <= TOL[dtype]
    assert rel_err(new, ref) <= TOL[dtype]
    assert np.all(new[:, 0] == 0), "PAD slot 0 was written"
    touched = {int(s) for s in slots if s > 0}
    for s in range(1, num_slots + 1):
        if s not in touched:
            np.testing.assert_array_equal(new[:, s], ssm0[:, s], err_msg=f"slot {s} is not in the batch")
    np.testing.assert_array_equal(new[0], ssm0[0], err_msg="another layer was written")
    assert out.conv is pool.conv or np.array_equal(np.asarray(out.conv, np.float32),
                                                   np.asarray(pool.conv, np.float32))
    for n, s in enumerate(slots):
        if s == 0:
            assert np.all(np.asarray(o[int(cu[n]):int(cu[n + 1])], np.float32) == 0), "padding row output"


GPU_LENS = [1, 4096, 0, 63, 64, 65, 777, 2, 130]
