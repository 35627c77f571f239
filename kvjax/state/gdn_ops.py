"""GDN ops on the slot-addressed state pool (:class:`kvjax.state.gdn_pool.GDNStatePool`): pool in, pool out.

Each function validates on the host, then runs the array-level op (:mod:`kvjax.ops.gdn_slots` on
``pool.ssm``, :mod:`kvjax.ops.conv` on ``pool.conv``; those modules hold the contracts, references and
backend tables) under jit with the pool donated, so the kernels update it in place.

- :func:`gdn_prefill` / :func:`gdn_decode`: the gated delta rule (chunked / stepwise) on ``pool.ssm``;
  ``gdn_decode`` with ``cu_seqlens=None``, ``has_initial_state=None`` and a Python-int ``layer`` runs the slot
  decode kernel straight on the pool by slot id, with no XLA work around it (on a GPU, ``impl="auto"``).
- :func:`gated_delta_decode`: Qwen3.5's decode step from the packed conv output and the raw gate projections
  (the same kernel reading q / k / v by column and computing the gates).
- :func:`conv_prefill` / :func:`conv_decode`: the causal conv1d on ``pool.conv``.

Batch row ``n`` owns the tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` and the slot ``slot_ids[n]``; rows whose
slot is not in ``1..S`` (slot 0 = PAD) are padding rows: nothing is read or written for them and their tokens'
outputs are zero. Slot 0 is never written.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax.ops import conv, gdn_slots
from kvjax.state.gdn_pool import GDNStatePool


# ---------------------------------------------------------------------------------------------- SSM
@functools.partial(jax.jit, static_argnames=("op", "impl", "static_layer", "scale", "use_qk_l2norm"),
                   donate_argnames=("ssm",))
def _run(op, impl, q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, cu_seqlens, *, static_layer, scale,
         use_qk_l2norm):
    return op(
        q, k, v, g, beta, ssm, layer=layer if static_layer is None else static_layer, slot_ids=slot_ids,
        has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm,
        impl=impl,
    )


def _public(op, table, q, k, v, g, beta, pool, layer, slot_ids, has_initial_state, cu_seqlens, scale,
            use_qk_l2norm, impl):
    if isinstance(pool, GDNStatePool):
        ssm, wrap = pool.ssm, functools.partial(dataclasses.replace, pool)
    elif hasattr(pool, "shape") and hasattr(pool, "dtype"):  # the bare SSM array (returned as an array)
        ssm, wrap = pool, None
    else:
        raise ValueError(f"pool must be a GDNStatePool or its ssm array, got {type(pool).__name__}")
    scale = gdn_slots.validate_pool_args(q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, cu_seqlens,
                                         scale, use_qk_l2norm, impl)
    table.validate_impl(impl)  # unknown impl -> UnknownImplError before tracing
    static = gdn_slots.static_layer(layer)
    o, ssm = _run(
        op, impl, q, k, v, g, beta, ssm, None if static is not None else layer, jnp.asarray(slot_ids),
        None if has_initial_state is None else jnp.asarray(has_initial_state),
        None if cu_seqlens is None else jnp.asarray(cu_seqlens),
        static_layer=static, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
    )
    return o, (ssm if wrap is None else wrap(ssm=ssm))


def gdn_prefill(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv] log-decay
    beta: jax.Array,  # [T, Hv]
    pool: GDNStatePool | jax.Array,  # ssm f32[L, S+1, Hv, K, V] (donated); or the bare ssm array
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
    state there in one in-place update (slot 0 never touched). ``pool.ssm`` is donated: use the returned pool.
    See :func:`kvjax.ops.gdn_slots.gdn_prefill_pool` for errors and implementations.
    """
    return _public(gdn_slots.gdn_prefill_pool, gdn_slots.PREFILL_TABLE, q, k, v, g, beta, pool, layer, slot_ids,
                   has_initial_state, cu_seqlens, scale, use_qk_l2norm, impl)


def gdn_decode(
    q: jax.Array,  # [T, Hk, K]  (T = B: one token per row, unless cu_seqlens is given)
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    pool: GDNStatePool | jax.Array,  # ssm f32[L, S+1, Hv, K, V] (donated); or the bare ssm array
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
    return _public(gdn_slots.gdn_decode_pool, gdn_slots.DECODE_TABLE, q, k, v, g, beta, pool, layer, slot_ids,
                   has_initial_state, cu_seqlens, scale, use_qk_l2norm, impl)


@functools.partial(jax.jit, static_argnames=("impl", "layer", "scale", "use_qk_l2norm"), donate_argnames=("ssm",))
def _gated_run(impl, qkv, x, w_a, w_b, a_log, dt_bias, ssm, slot_ids, *, layer, scale, use_qk_l2norm):
    return gdn_slots.gated_delta_decode_pool(qkv, x, w_a, w_b, a_log, dt_bias, ssm, layer=layer, slot_ids=slot_ids,
                                             scale=scale, use_qk_l2norm=use_qk_l2norm, impl=impl)


def gated_delta_decode(
    qkv: jax.Array,  # [B, 2*Hk*K + Hv*V]  conv output (q | k | v), one token per row
    x: jax.Array,  # [B, D]  hidden state the gates are projected from
    w_a: jax.Array,  # [Hv, D]  in_proj_a weight (torch layout)
    w_b: jax.Array,  # [Hv, D]  in_proj_b weight
    a_log: jax.Array,  # [Hv]
    dt_bias: jax.Array,  # [Hv]
    pool: GDNStatePool,  # ssm f32[L, S+1, Hv, K, V] (donated)
    *,
    layer: int,
    slot_ids: jax.Array,  # i32[B]  0 = padding row
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    impl: str = "auto",
) -> tuple[jax.Array, GDNStatePool]:
    """Qwen3.5's GDN decode step on the pool; returns ``(o: [B, Hv, V], pool)`` with every live row's state
    at ``pool.ssm[layer, slot_ids[b]]`` advanced one token (``conv`` untouched; ``pool.ssm`` donated).

    Equals :func:`gdn_decode` of the split ``q, k, v`` and the gates :func:`kvjax.ops.gdn_slots.qwen_gates` of
    ``x @ w_a.T``, ``x @ w_b.T``; see :func:`kvjax.ops.gdn_slots.gated_delta_decode_pool`."""
    _check_pool(pool)
    if gdn_slots.static_layer(layer) is None:
        raise ValueError(f"layer must be a Python int, got {type(layer).__name__}")
    scale = gdn_slots.validate_gated_args(qkv, x, w_a, w_b, a_log, dt_bias, pool.ssm, layer, slot_ids, scale,
                                          use_qk_l2norm, impl)
    gdn_slots.GATED_DECODE_TABLE.validate_impl(impl)
    o, ssm = _gated_run(impl, qkv, x, w_a, w_b, a_log, dt_bias, pool.ssm, jnp.asarray(slot_ids), layer=int(layer),
                        scale=scale, use_qk_l2norm=bool(use_qk_l2norm))
    return o, dataclasses.replace(pool, ssm=ssm)


# ---------------------------------------------------------------------------------------------- conv
@functools.partial(jax.jit, static_argnames=("op", "impl", "activation"), donate_argnames=("pool",))
def _conv_run(op, impl, x, weight, bias, pool, layer, slot_ids, meta, *, activation):
    y, new = op(x, weight, bias, pool.conv, layer=layer, slot_ids=slot_ids, activation=activation, impl=impl, **meta)
    return y, dataclasses.replace(pool, conv=new)


def _check_pool(pool) -> None:
    if not isinstance(pool, GDNStatePool):
        raise ValueError(f"pool must be a kvjax.state.gdn_pool.GDNStatePool, got {type(pool).__name__}")


def conv_prefill(
    x: jax.Array,  # [T, D]  (D = conv_dim)
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None,  # [D]
    pool: GDNStatePool,  # conv [L, S+1, D, W-1] (donated)
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
    and write nothing and their tokens get ``y = 0``. Returns ``(y: [T, D], pool)``; ``pool`` is donated.

    ``impl``: ``"reference"`` = fused XLA (gather, :func:`kvjax.ops.conv.causal_conv1d_reference`,
    scatter); ``"pallas"`` / ``"interpret"`` = :func:`kvjax.pallas.gdn.conv.conv_prefill_slots`; ``"auto"`` =
    Pallas on the GPU (measured a near tie with XLA, see :mod:`kvjax.ops.conv`), the reference elsewhere.
    """
    _check_pool(pool)
    conv.validate_pool_args(x, weight, bias, pool.conv, layer, slot_ids, activation, impl, cu_seqlens,
                            has_initial_state)
    conv.CONV_PREFILL_TABLE.validate_impl(impl)  # unknown impl -> UnknownImplError before tracing
    meta = {"has_initial_state": jnp.asarray(has_initial_state), "cu_seqlens": jnp.asarray(cu_seqlens)}
    return _conv_run(conv.conv_prefill_pool, impl, x, weight, bias, pool, jnp.asarray(layer, jnp.int32),
                     jnp.asarray(slot_ids), meta, activation=activation)


def conv_decode(
    x: jax.Array,  # [B, D]
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None,  # [D]
    pool: GDNStatePool,  # conv [L, S+1, D, W-1] (donated)
    *,
    layer: int | jax.Array,
    slot_ids: jax.Array,  # i32[B]  outside 1..S = padding row
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, GDNStatePool]:
    """One token per row: conv with the row's state from the pool, shifted state written back in place.
    Padding rows read and write nothing and get ``y = 0``. Returns ``(y: [B, D], pool)``; ``pool`` is donated.
    ``impl`` as in :func:`conv_prefill` (``"pallas"``: :func:`kvjax.pallas.gdn.conv.conv_update_slots`)."""
    _check_pool(pool)
    conv.validate_pool_args(x, weight, bias, pool.conv, layer, slot_ids, activation, impl)
    conv.CONV_DECODE_TABLE.validate_impl(impl)
    return _conv_run(conv.conv_decode_pool, impl, x, weight, bias, pool, jnp.asarray(layer, jnp.int32),
                     jnp.asarray(slot_ids), {}, activation=activation)

