"""GDN ops on the slot-addressed state pool (:class:`kvjax.state.gdn_pool.GDNStatePool`): pool in, pool out.

Each function checks the pool's type, runs the array-level op (:mod:`kvjax.ops.gdn_slots` on ``pool.ssm``,
:mod:`kvjax.ops.conv` on ``pool.conv``; those modules hold the contracts, the one argument check, references
and backend tables) and returns the pool with that array replaced. The kernels donate the array under their
own jit and update it in place; inside a jitted step with the caches donated (the engine's) the whole step
updates the pool in place.

- :func:`gdn_prefill` / :func:`gdn_decode`: the gated delta rule (chunked / stepwise) on ``pool.ssm``;
  ``gdn_decode`` with ``cu_seqlens=None``, ``has_initial_state=None`` and a Python-int ``layer`` runs the slot
  decode kernel straight on the pool by slot id, with no XLA work around it (on a GPU, ``impl="auto"``).
- :func:`gated_delta_decode`: Qwen3.5's decode step from a :class:`~kvjax.ops.gdn_slots.GatedDecodeCall` (the
  packed conv output and the gate inputs; the same kernel reading q / k / v by column and computing the gates).
- :func:`conv_prefill` / :func:`conv_decode`: the causal conv1d on ``pool.conv``.

Batch row ``n`` owns the tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` and the slot ``slot_ids[n]``; rows whose
slot is not in ``1..S`` (slot 0 = PAD) are padding rows: nothing is read or written for them and their tokens'
outputs are zero. Slot 0 is never written.
"""

from __future__ import annotations

import dataclasses

import jax

from kvjax.ops import conv, gdn_slots
from kvjax.state.gdn_pool import GDNStatePool


# ---------------------------------------------------------------------------------------------- SSM
def _ssm_of(pool):
    """``(ssm, rewrap)`` of a :class:`GDNStatePool` (rewrap puts the new ssm back) or of a bare ssm array."""
    if isinstance(pool, GDNStatePool):
        return pool.ssm, lambda ssm: dataclasses.replace(pool, ssm=ssm)
    if hasattr(pool, "shape") and hasattr(pool, "dtype"):  # the bare SSM array (returned as an array)
        return pool, lambda ssm: ssm
    raise ValueError(f"pool must be a GDNStatePool or its ssm array, got {type(pool).__name__}")


def gdn_prefill(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv] log-decay
    beta: jax.Array,  # [T, Hv]
    pool: GDNStatePool | jax.Array,  # ssm f32[L, S+1, Hv, K, V] (donated by the kernels); or the bare ssm array
    *,
    layer: int | jax.Array,  # GDN layer index (int, or traced i32[])
    slot_ids: jax.Array,  # i32[N]  0 = padding row
    has_initial_state: jax.Array,  # bool[N]
    cu_seqlens: jax.Array,  # i32[N+1]
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    impl: str = "auto",
) -> tuple[jax.Array, GDNStatePool | jax.Array]:
    """Chunked gated delta rule (prefill / extend) on the pool; returns ``(o: [T, Hv, V], pool)``.

    ``pool`` may be the :class:`GDNStatePool` (returned with its ``ssm`` replaced, ``conv`` untouched) or
    its bare ``ssm`` array (returned as the updated array).

    Reads ``pool.ssm[layer, slot_ids[n]]`` for rows with ``has_initial_state``, writes every live row's final
    state there in one in-place update (slot 0 never touched). The kernels donate ``pool.ssm``: use the returned
    pool.
    See :func:`kvjax.ops.gdn_slots.gdn_prefill_pool` for errors and implementations.
    """
    ssm, rewrap = _ssm_of(pool)
    o, ssm = gdn_slots.gdn_prefill_pool(q, k, v, g, beta, ssm, layer=layer, slot_ids=slot_ids,
                                        has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, scale=scale,
                                        use_qk_l2norm=use_qk_l2norm, impl=impl)
    return o, rewrap(ssm)


def gdn_decode(
    q: jax.Array,  # [T, Hk, K]  (T = B: one token per row, unless cu_seqlens is given)
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    pool: GDNStatePool | jax.Array,  # ssm f32[L, S+1, Hv, K, V] (donated by the kernels); or the bare ssm array
    *,
    layer: int | jax.Array,
    slot_ids: jax.Array,  # i32[B]  0 = padding row
    has_initial_state: jax.Array | None = None,  # bool[B]; None = every live row continues its state
    cu_seqlens: jax.Array | None = None,  # i32[B+1] (a few tokens per row, verification); None = one each
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    impl: str = "auto",
) -> tuple[jax.Array, GDNStatePool | jax.Array]:
    """Stepwise gated delta rule (decode) on the pool; same contract as :func:`gdn_prefill`.

    Padding rows cost no state traffic. With ``cu_seqlens=None``, ``has_initial_state=None`` and an int
    ``layer`` the kernel indexes the pool by slot id directly (no XLA op before or after it).
    """
    ssm, rewrap = _ssm_of(pool)
    o, ssm = gdn_slots.gdn_decode_pool(q, k, v, g, beta, ssm, layer=layer, slot_ids=slot_ids,
                                       has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, scale=scale,
                                       use_qk_l2norm=use_qk_l2norm, impl=impl)
    return o, rewrap(ssm)


def gated_delta_decode(
    call: gdn_slots.GatedDecodeCall,  # qkv [B, 2*Hk*K + Hv*V], x [B, D], gate weights, slot_ids i32[B], layer
    pool: GDNStatePool,  # ssm f32[L, S+1, Hv, K, V] (donated by the kernel)
    impl: str = "auto",
) -> tuple[jax.Array, GDNStatePool]:
    """Qwen3.5's GDN decode step on the pool; returns ``(o: [B, Hv, V], pool)`` with every live row's state
    at ``pool.ssm[call.layer, call.slot_ids[b]]`` advanced one token (``conv`` untouched).

    Equals :func:`gdn_decode` of the split ``q, k, v`` and the gates :func:`kvjax.ops.gdn_slots.qwen_gates` of
    ``x @ w_a.T``, ``x @ w_b.T``; see :func:`kvjax.ops.gdn_slots.gated_delta_decode_pool` (checks, errors)."""
    _check_pool(pool)
    o, ssm = gdn_slots.gated_delta_decode_pool(call, pool.ssm, impl)
    return o, dataclasses.replace(pool, ssm=ssm)


# ---------------------------------------------------------------------------------------------- conv
def _check_pool(pool) -> None:
    if not isinstance(pool, GDNStatePool):
        raise ValueError(f"pool must be a kvjax.state.gdn_pool.GDNStatePool, got {type(pool).__name__}")


def conv_prefill(
    x: jax.Array,  # [T, D]  (D = conv_dim)
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None,  # [D]
    pool: GDNStatePool,  # conv [L, S+1, D, W-1] (donated by the kernels)
    *,
    layer: int | jax.Array,
    slot_ids: jax.Array,  # i32[N]  outside 1..S = padding row
    has_initial_state: jax.Array,  # bool[N]
    cu_seqlens: jax.Array,  # i32[N+1]
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, GDNStatePool]:
    """Varlen causal conv1d starting from each live row's conv state in the pool (zeros where not
    ``has_initial_state``); writes the final states back in place (slot 0 never written). Padding rows read
    and write nothing and their tokens get ``y = 0``. Returns ``(y: [T, D], pool)``; the kernels donate ``pool.conv``.

    ``impl``: ``"reference"`` = fused XLA (gather, :func:`kvjax.ops.conv.causal_conv1d_reference`,
    scatter); ``"pallas"`` / ``"interpret"`` = :func:`kvjax.pallas.gdn.conv.conv_prefill_slots`; ``"auto"`` =
    Pallas on the GPU (measured a near tie with XLA, see :mod:`kvjax.ops.conv`), the reference elsewhere.
    """
    _check_pool(pool)
    y, new = conv.conv_prefill_pool(x, weight, bias, pool.conv, layer=layer, slot_ids=slot_ids,
                                    has_initial_state=has_initial_state, cu_seqlens=cu_seqlens,
                                    activation=activation, impl=impl)
    return y, dataclasses.replace(pool, conv=new)


def conv_decode(
    x: jax.Array,  # [B, D]
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None,  # [D]
    pool: GDNStatePool,  # conv [L, S+1, D, W-1] (donated by the kernels)
    *,
    layer: int | jax.Array,
    slot_ids: jax.Array,  # i32[B]  outside 1..S = padding row
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, GDNStatePool]:
    """One token per row: conv with the row's state from the pool, shifted state written back in place.
    Padding rows read and write nothing and get ``y = 0``. Returns ``(y: [B, D], pool)``; the kernels donate ``pool.conv``.
    ``impl`` as in :func:`conv_prefill` (``"pallas"``: :func:`kvjax.pallas.gdn.conv.conv_update_slots`)."""
    _check_pool(pool)
    y, new = conv.conv_decode_pool(x, weight, bias, pool.conv, layer=layer, slot_ids=slot_ids,
                                   activation=activation, impl=impl)
    return y, dataclasses.replace(pool, conv=new)

