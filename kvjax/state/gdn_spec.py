"""GDN and conv state rollback for speculative decoding: per-position states of a verification step, and the
accepted one written back to each row's slot.

The choice (issue 36): per-position states kept in the step and the accepted one scattered back (as SGLang), not
``K + 1`` state slots per request in the pool (as vLLM). It is the simpler exact one here: the pool, the slot
allocator, prefix caching's checkpoint slots and every GDN kernel stay as they are (a verification row is an
ordinary ragged row whose final state the chunked kernel writes as always), the extra memory lives only during a
verification step (``[L, B, K+1, ...]`` instead of ``[L, S, K, ...]`` for the engine's lifetime), and the
rollback is one scatter per array. Measured on one layer's verification work (``benchmarks/rollback.py``), the
pool-slot form moves three state transfers fewer a row and is 1.5x faster from 16 rows (RESULTS.md, "GDN state
rollback"); adopting it means moving each row's slot to its accepted position's after every sub-step.

A step: :func:`attach` puts zeroed :class:`VerifyStates` on the pool before the model runs; each GDN layer calls
:func:`record` (the states after each of its verification rows' positions, from the row's state before the step
and the step's conv inputs and gates) after its chunked kernel, or, in a step whose rows all continue their state
with few tokens each (a verification burst's sub-step: ``StepInputs.max_query_len``), :func:`verify` in place of
the chunked kernel (one call gives the outputs, the final states and the per-position states:
:func:`kvjax.ops.spec_states.gdn_verify_pool`); after sampling, :func:`commit` writes, for every verification row,
the state after its last accepted position into its slot (every layer) and drops the buffers (a verification
burst keeps them for its next sub-step, and :func:`detach` drops them after the last).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.base.slots import slot_index
from kvjax.ops.gdn import DeltaRuleCall
from kvjax.ops.spec_states import gdn_verify_pool, verify_conv_states, verify_ssm_states
from kvjax.state.gdn_pool import GDNStatePool

__all__ = ["VerifyStates", "attach", "commit", "detach", "record", "verify"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyStates:
    """Per-position states of a verification step's rows (see the module docstring)."""

    first: jax.Array  # i32[B]: token index (into T) of each row's first verification position
    count: jax.Array  # i32[B]: verification positions of each row (its 1 + k tokens); 0: not a verification row
    conv: jax.Array  # [L, B, J, conv_dim, W-1] (the pool's conv dtype): conv state after position j
    ssm: jax.Array  # f32[L, B, J, Hv, K, V]: recurrent state after position j

    def positions(self) -> tuple[jax.Array, jax.Array]:
        """``(index i32[B, J], valid bool[B, J])``: the token of each row's position ``j`` and whether it has one."""
        j = jnp.arange(self.conv.shape[2], dtype=jnp.int32)
        return self.first[:, None] + j, j < self.count[:, None]


def attach(pool: GDNStatePool, first: jax.Array, count: jax.Array, positions: int) -> GDNStatePool:
    """``pool`` carrying :class:`VerifyStates` for rows ``first`` / ``count`` (i32[B] each) of up to ``positions``
    (static, ``K + 1``) verification positions: zeroed buffers, or, where ``pool`` still carries a previous
    sub-step's (``commit(..., keep=True)``), those buffers with their stale contents. Stale is exact: every position
    :func:`commit` reads (``j < count``) is written by the step's :func:`record` or :func:`verify` first, and a
    verification burst then writes no ``[L, B, K + 1, ...]`` zeros each sub-step."""
    spec = pool.spec
    if spec is not None:
        if spec.ssm.shape[1:3] != (first.shape[0], positions):
            raise ValueError(f"attach: the carried VerifyStates hold {spec.ssm.shape[1:3]} rows x positions, the "
                             f"step needs {(first.shape[0], positions)}")
        return dataclasses.replace(pool, spec=dataclasses.replace(spec, first=first, count=count))
    L, _, D, W1 = pool.conv.shape
    B = first.shape[0]
    spec = VerifyStates(first=first, count=count, conv=jnp.zeros((L, B, positions, D, W1), pool.conv.dtype),
                        ssm=jnp.zeros((L, B, positions, *pool.ssm.shape[2:]), jnp.float32))
    return dataclasses.replace(pool, spec=spec)


def record(pool: GDNStatePool, layer: int, conv_in: jax.Array, conv0: jax.Array, k: jax.Array, v: jax.Array,
           g: jax.Array, beta: jax.Array, ssm0: jax.Array, *, use_qk_l2norm: bool) -> GDNStatePool:
    """Record GDN layer ``layer``'s per-position states in ``pool.spec`` (no-op without it).

    ``conv_in``: [T, conv_dim], the step's conv inputs; ``conv0``: [B, conv_dim, W-1] and ``ssm0``: f32[B, Hv, K, V],
    each row's states before the step (:func:`kvjax.state.gdn_pool.gather`); ``k`` [T, Hk, K], ``v`` [T, Hv, V],
    ``g`` f32[T, Hv], ``beta`` [T, Hv]: the layer's gated delta rule inputs."""
    spec = pool.spec
    if spec is None:
        return pool
    index, valid = spec.positions()
    ssm = verify_ssm_states(k, v, g, beta, ssm0, index, valid, use_qk_l2norm=use_qk_l2norm)  # f32[B, J, Hv, K, V]
    spec = dataclasses.replace(_with_conv(spec, layer, conv_in, conv0), ssm=spec.ssm.at[layer].set(ssm))
    return dataclasses.replace(pool, spec=spec)


def _with_conv(spec: VerifyStates, layer: int, conv_in: jax.Array, conv0: jax.Array) -> VerifyStates:
    """``spec`` holding layer ``layer``'s conv state after each verification position (``conv_in`` [T, conv_dim],
    ``conv0`` [B, conv_dim, W-1]: :func:`record`'s)."""
    conv = verify_conv_states(conv_in, conv0, spec.positions()[0])  # [B, J, D, W-1]
    return dataclasses.replace(spec, conv=spec.conv.at[layer].set(conv.astype(spec.conv.dtype)))


def verify(pool: GDNStatePool, layer: int, conv_in: jax.Array, conv0: jax.Array, q: jax.Array, k: jax.Array,
           v: jax.Array, g: jax.Array, beta: jax.Array, slot_ids: jax.Array, cu_seqlens: jax.Array, *, scale: float,
           use_qk_l2norm: bool, impl: str = "auto") -> tuple[jax.Array, GDNStatePool]:
    """GDN layer ``layer``'s gated delta rule in a step whose rows all continue their state with at most ``J``
    tokens each (``pool.spec`` attached, ``J`` its positions), recording its per-position states: ``(o [T, Hv, V],
    pool)`` with each live row's state after its tokens in its slot and ``pool.spec`` holding the layer's conv and
    recurrent states after each position (:func:`kvjax.ops.spec_states.gdn_verify_pool`).

    ``conv_in`` [T, conv_dim]: the step's conv inputs; ``conv0`` [B, conv_dim, W-1]: each row's conv state before
    the step; ``q``/``k`` [T, Hk, K], ``v`` [T, Hv, V], ``g`` f32[T, Hv], ``beta`` [T, Hv]: the layer's inputs;
    ``slot_ids`` i32[B], ``cu_seqlens`` i32[B+1]."""
    call = DeltaRuleCall(q, k, v, g, beta, cu_seqlens, scale, slot_ids, None, layer, use_qk_l2norm=use_qk_l2norm)
    o, ssm, states = gdn_verify_pool(call, pool.ssm, pool.spec.ssm, impl)
    spec = dataclasses.replace(_with_conv(pool.spec, layer, conv_in, conv0), ssm=states)
    return o, dataclasses.replace(pool, ssm=ssm, spec=spec)


def commit(pool: GDNStatePool, slots: jax.Array, accepted: jax.Array, *, keep: bool = False) -> GDNStatePool:
    """``pool`` with each verification row's slot (``slots``: i32[B]) holding, in every layer, the states after its
    position ``accepted[b]`` (i32[B], clipped to its positions); other rows' slots untouched. Its
    :class:`VerifyStates` dropped, or with ``keep`` (static) kept for the next sub-step's :func:`attach` (a
    verification burst; :func:`detach` after the last)."""
    spec = pool.spec
    B = spec.first.shape[0]
    j = jnp.clip(accepted, 0, jnp.maximum(spec.count - 1, 0))  # i32[B]
    rows = jnp.arange(B)
    n = pool.conv.shape[1]
    idx = jnp.where(spec.count > 0, slot_index(slots, n), n)  # i32[B]: out of range -> dropped
    conv = spec.conv[:, rows, j]  # [L, B, D, W-1]
    ssm = spec.ssm[:, rows, j]  # f32[L, B, Hv, K, V]
    return GDNStatePool(conv=pool.conv.at[:, idx].set(conv, mode="drop"),
                        ssm=pool.ssm.at[:, idx].set(ssm, mode="drop"), spec=spec if keep else None)


def detach(pool: GDNStatePool) -> GDNStatePool:
    """``pool`` without the :class:`VerifyStates` a ``commit(..., keep=True)`` left on it."""
    return dataclasses.replace(pool, spec=None)
