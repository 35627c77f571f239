"""The gated delta rule of a verification step (speculative decoding) on the slot pool: outputs, final states and
the state after every verification position, in one Pallas kernel (Triton lowering).

A verification row continues its state at ``ssm[layer, slot]`` through its ``1 + k`` tokens (``k`` drafts, at most
``J - 1``); the rollback after verification needs the state after each of them (:mod:`kvjax.state.gdn_spec`).
``_verify_kernel`` gives all of it from one read of the state: one program per state tile ``[K, block_v]`` of one
(row, value head), grid ``(value block, head, row)`` as the slot decode kernel's
(:mod:`kvjax.pallas.gdn.recurrent`). It walks the row's tokens with :func:`~kvjax.pallas.gdn.recurrent.token_update`,
stores each token's output, the state after its ``j``-th token into ``states[layer, row, j]`` and the state after
the last token into the pool (both aliased input -> output: in place under jit when donated). Rows whose slot is not
in ``1..S`` are padding (nothing read or written, outputs zero), and tokens outside every row get zero outputs.

With ``position_slots`` the kernel writes each position's state into a pool slot of its own instead (vLLM's
rollback: ``K + 1`` slots per request, the accepted one picked by index, no commit copy), so that the two rollbacks
can be measured side by side (``benchmarks/rollback.py``); the engine uses the step buffer.

It replaces, for a step whose rows all continue their state with few tokens each, the chunked kernel (its
preparation and sequential kernels, sized for chunks of 64 tokens) plus a recurrence of XLA ops per position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.base.device import next_pow2
from kvjax.pallas.gdn.common import col_block, head_cols, load, store, tile_mask
from kvjax.pallas.gdn.recurrent import (BLOCK_V, _block_v, layer_unsupported, token_update, zero_outside_rows,
                                        zero_tokens)

__all__ = ["gdn_verify_slots", "unsupported", "verify_slots"]


def _verify_kernel(
    slots_ref,  # i32[B]
    cu_ref,  # i32[B+1]
    *refs,  # to_slots: pos_ref i32[B, J], then q, k, v, g, beta, ssm_in; o, ssm. Else q_ref [T, Hk, K], k_ref
    #         [T, Hk, K], v_ref [T, Hv, V], g_ref f32[T, Hv], beta_ref [T, Hv], ssm_in_ref f32[L, S+1, Hv, K, V]
    #         (aliased with ssm_ref), states_in_ref f32[L, B, J, Hv, K, V] (aliased with states_ref); o_ref [T, Hv,
    #         V], ssm_ref f32[L, S+1, Hv, K, V] (each live row's state after its last token at its slot), states_ref
    #         f32[L, B, J, Hv, K, V] (the state after each of a row's positions at [layer])
    layer: int,
    group: int,
    scale: float,
    use_qk_l2norm: bool,
    block_v: int,
    num_tokens: int,
    to_slots: bool,
):
    if to_slots:
        pos_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, ssm_in_ref, o_ref, ssm_ref = refs
        positions = pos_ref.shape[1]
    else:
        q_ref, k_ref, v_ref, g_ref, beta_ref, ssm_in_ref, _, o_ref, ssm_ref, states_ref = refs
        positions = states_ref.shape[2]
    lay = jnp.asarray(layer, jnp.int32)  # an array index: interpret mode rejects a Python int under pl.when
    vb, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows = pl.num_programs(2)
    kd, vd = ssm_in_ref.shape[3], ssm_in_ref.shape[4]
    kc, kmask = head_cols(kd)
    vs, vmask = col_block(vb, block_v, vd)
    cols = (kc, kmask, vs, vmask)
    mask = tile_mask((next_pow2(kd), block_v), kmask, vmask)
    slot = slots_ref[n]
    live = (slot >= 1) & (slot < ssm_in_ref.shape[1])
    slot = jnp.where(live, slot, 0)
    start, end = cu_ref[n], cu_ref[n + 1]

    @pl.when(live)
    def _():
        s0 = load(ssm_in_ref, (lay, slot, h, kc, vs), mask, eviction_policy="evict_first")

        def step(t, s):  # s: f32[Kp, block_v]
            s, o = token_update(s, q_ref, k_ref, v_ref, g_ref, beta_ref, t, h, h // group, cols, scale=scale,
                                use_qk_l2norm=use_qk_l2norm)
            store(o_ref, (t, h, vs), o.astype(o_ref.dtype), vmask)
            j = jnp.minimum(t - start, positions - 1)
            if to_slots:
                dst = pos_ref[n, j]

                @pl.when((dst >= 1) & (dst < ssm_in_ref.shape[1]))
                def _():
                    store(ssm_ref, (lay, dst, h, kc, vs), s, mask)
            else:
                store(states_ref, (lay, n, j, h, kc, vs), s, mask)
            return s

        s = lax.fori_loop(start, end, step, s0)
        if not to_slots:
            store(ssm_ref, (lay, slot, h, kc, vs), s, mask, eviction_policy="evict_first")

    @pl.when(jnp.logical_not(live))
    def _():
        zero_tokens(o_ref, h, vs, vmask, start, end, block_v)

    zero_outside_rows(o_ref, h, vs, vmask, n, num_rows, start, end, num_tokens, block_v)


@functools.partial(jax.jit, static_argnames=("layer", "scale", "use_qk_l2norm", "block_v", "num_warps", "interpret"),
                   donate_argnames=("ssm", "states"))
def verify_slots(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]  GDN pool, donated, updated in place
    states: jax.Array | None,  # f32[L, B, J, Hv, K, V]  per-position states, donated, updated in place at [layer];
    #                            None with position_slots
    *,
    cu_seqlens: jax.Array,  # i32[B+1]
    slot_ids: jax.Array,  # i32[B]  outside 1..S = padding row
    layer: int,
    scale: float,
    use_qk_l2norm: bool = False,
    block_v: int | None = BLOCK_V,
    num_warps: int = 4,
    interpret: bool = False,
    position_slots: jax.Array | None = None,  # i32[B, J]  the per-position states' pool slots (vLLM's rollback)
) -> tuple[jax.Array, jax.Array, jax.Array | None]:  # (o [T, Hv, V] in v's dtype, ssm, states)
    """The verification kernel (module docstring) on arrays: row ``b`` runs tokens ``cu_seqlens[b]:cu_seqlens[b+1]``
    from ``ssm[layer, slot_ids[b]]``.

    ``position_slots`` (``states`` None): vLLM's rollback instead of the step buffer, for measuring the two
    (issue 36; benchmarks/rollback.py): the state after row ``b``'s ``j``-th token goes to
    ``ssm[layer, position_slots[b, j]]`` (a slot outside ``1..S``: not written) and nothing else of the pool is
    written (the row's slot keeps its state: the accepted position's slot becomes the row's state by index, no
    copy); returns ``(o, ssm, None)``."""
    num_tokens, hk, _ = q.shape
    hv, vd = ssm.shape[2], ssm.shape[4]
    bv = _block_v(vd, block_v)
    to_slots = position_slots is not None
    if to_slots == (states is not None):
        raise ValueError("verify_slots takes either states (the step buffer) or position_slots (pool slots)")
    kernel = functools.partial(_verify_kernel, layer=layer, group=hv // hk, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, block_v=bv, num_tokens=num_tokens, to_slots=to_slots)
    o_shape = jax.ShapeDtypeStruct((num_tokens, hv, vd), v.dtype)
    ssm_shape = jax.ShapeDtypeStruct(ssm.shape, jnp.float32)
    params = dict(grid=(pl.cdiv(vd, bv), hv, slot_ids.shape[0]),
                  compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret)
    if to_slots:
        o, ssm = pl.pallas_call(kernel, out_shape=(o_shape, ssm_shape), input_output_aliases={8: 1},
                                name="gdn_verify_to_slots", **params)(
            slot_ids, cu_seqlens, position_slots, q, k, v, g, beta, ssm)
        return o, ssm, None
    return pl.pallas_call(
        kernel,
        out_shape=(o_shape, ssm_shape, jax.ShapeDtypeStruct(states.shape, jnp.float32)),
        input_output_aliases={7: 1, 8: 2},
        name="gdn_verify_slots",
        **params,
    )(slot_ids, cu_seqlens, q, k, v, g, beta, ssm, states)


def gdn_verify_slots(
    call,  # kvjax.ops.gdn.DeltaRuleCall: q / k [T, Hk, K], v [T, Hv, V], g f32[T, Hv], beta [T, Hv],
    #        cu_seqlens i32[B+1], slot_ids i32[B]; layer a Python int, scale a float
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    states: jax.Array,  # f32[L, B, J, Hv, K, V]
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (o [T, Hv, V] in v's dtype, ssm, states)
    """Backend ``"pallas"`` of :func:`kvjax.ops.spec_states.gdn_verify_pool`: :func:`verify_slots` (the op checked
    the call and :func:`unsupported` accepted it)."""
    return verify_slots(call.q, call.k, call.v, call.g, call.beta, ssm, states, cu_seqlens=call.cu_seqlens,
                        slot_ids=call.slot_ids, layer=call.layer, scale=call.scale,
                        use_qk_l2norm=call.use_qk_l2norm, interpret=interpret)


def unsupported(call, ssm, states) -> str | None:  # a checked call of gdn_verify_pool and its two state arrays
    """Why the verification kernel cannot take a call, or ``None``: it indexes the pool and the states by a static
    Python-int ``layer`` (any K, V, rows and positions)."""
    del ssm, states
    return layer_unsupported(call.layer, "the verification kernel")
