"""GDN ops on the slot-addressed state pool (:class:`kvjax.state.gdn_pool.GDNStatePool`).

Batch row ``n`` owns the tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` and the slot ``slot_ids[n]``; rows whose
slot is not in ``1..S`` (slot 0 = PAD) are padding rows: nothing is read or written for them and their
tokens' outputs are zero. A live row starts from the pool's state at ``[layer, slot]`` when
``has_initial_state[n]`` (else from zeros) and its final state is written back there. Slot 0 is never written.

- :func:`gdn_prefill` / :func:`gdn_decode`: the gated delta rule (chunked / stepwise) on ``pool.ssm``. The
  Pallas paths update the pool in place (``input_output_aliases``); the functions are jitted with the pool
  donated. ``gdn_decode`` with ``cu_seqlens=None``, ``has_initial_state=None`` and a Python-int ``layer``
  runs the decode kernel straight on the pool by slot id, with no XLA work around it.
- :func:`conv_prefill` / :func:`conv_decode`: the causal conv1d on ``pool.conv``, dispatch ops
  ``"conv_prefill_pool"`` / ``"conv_decode_pool"`` (``(x, weight, bias, conv, *, layer, slot_ids,
  [has_initial_state, cu_seqlens,] activation)``). Reference = the fused XLA path (gather by slot,
  :mod:`kvjax.ops.conv` reference, scatter); ``"pallas"`` = :mod:`kvjax.pallas.conv` (in place by slot id).
  Padding rows get ``y = 0`` here too. ``impl="auto"`` picks Pallas on the GPU for both (H200, 2026-11-21,
  ``benchmarks/RESULTS.md``): the decode update takes 0.029 ms vs 0.072 ms for XLA at B=128, conv_dim 12288
  (25 MB moved: 5x its 6 us floor at copy bandwidth, not launch latency); prefill is a near tie (within 5% per
  call, Pallas up to 23% ahead when chained), both at about a third of copy bandwidth.

The oracle of every SSM path is the composition ``gather -> reference op -> scatter`` (registered as the
``"reference"`` implementation of the dispatch ops ``"gdn_prefill_pool"`` and ``"gdn_decode_pool"``, which
work on the SSM array ``f32[L, S+1, Hv, K, V]`` and take ``(q, k, v, g, beta, ssm, *, layer, slot_ids,
has_initial_state, cu_seqlens, scale, use_qk_l2norm)``, kernels also ``interpret=``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.ops import conv, dispatch, gdn
from kvjax.base.checks import check_array, check_cu_seqlens, check_int32
from kvjax.base.ragged import count_le
from kvjax.state.gdn_pool import GDNStatePool, check_slot_ids, slot_index

PREFILL_OP = "gdn_prefill_pool"
DECODE_OP = "gdn_decode_pool"
CONV_PREFILL_OP = "conv_prefill_pool"
CONV_DECODE_OP = "conv_decode_pool"


# ---------------------------------------------------------------------------------------------- SSM array level
def _live(slot_ids, num_slots: int):
    return (slot_ids >= 1) & (slot_ids < num_slots)


def _init_flags(slot_ids, has_initial_state):
    return jnp.ones(slot_ids.shape, jnp.bool_) if has_initial_state is None else has_initial_state


def _pool_reference(op_reference, q, k, v, g, beta, ssm, *, layer, slot_ids, has_initial_state, cu_seqlens,
                    scale, use_qk_l2norm):
    num_slots = ssm.shape[1]
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    live = _live(slot_ids, num_slots)
    idx = slot_index(slot_ids, num_slots)  # out of range: read as zeros, writes dropped
    read = live & _init_flags(slot_ids, has_initial_state)
    init = jnp.where(read[:, None, None, None], ssm.at[layer, idx].get(mode="fill", fill_value=0.0), 0.0)
    o, final = op_reference(
        q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=init, scale=scale, use_qk_l2norm=use_qk_l2norm
    )
    t = jnp.arange(q.shape[0], dtype=jnp.int32)
    row = count_le(cu_seqlens, t) - 1
    in_batch = (row >= 0) & (row < slot_ids.shape[0])
    row_live = in_batch & live[jnp.clip(row, 0, slot_ids.shape[0] - 1)]
    o = jnp.where(row_live[:, None, None], o, jnp.zeros_like(o))
    return o, ssm.at[layer, idx].set(final, mode="drop")


def gdn_prefill_pool_reference(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv] log-decay
    beta: jax.Array,  # [T, Hv]
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    **kw,  # layer, slot_ids, has_initial_state, cu_seqlens, scale, use_qk_l2norm (the normalised call)
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V], new ssm f32[L, S+1, Hv, K, V])
    """Oracle: gather the initial states, run ``chunk_gated_delta_rule_reference``, scatter the final ones."""
    return _pool_reference(gdn.chunk_gated_delta_rule_reference, q, k, v, g, beta, ssm, **kw)


def gdn_decode_pool_reference(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv] log-decay
    beta: jax.Array,  # [T, Hv]
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    **kw,  # layer, slot_ids, has_initial_state, cu_seqlens, scale, use_qk_l2norm (the normalised call)
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V], new ssm f32[L, S+1, Hv, K, V])
    """Oracle: gather the initial states, run ``recurrent_gated_delta_rule_reference``, scatter the final ones."""
    return _pool_reference(gdn.recurrent_gated_delta_rule_reference, q, k, v, g, beta, ssm, **kw)


def _rows_and_flags(ssm, layer, slot_ids, has_initial_state):
    """Flattened pool row per batch row and the kernel flags (bit0 read initial state, bit1 live)."""
    from kvjax.pallas.gdn_recurrent import FLAG_HAS_INITIAL, FLAG_LIVE

    live = _live(slot_ids, ssm.shape[1])
    rows = jnp.asarray(layer, jnp.int32) * ssm.shape[1] + jnp.where(live, slot_ids, 0)
    read = live & _init_flags(slot_ids, has_initial_state)
    flags = jnp.where(live, FLAG_LIVE, 0) | jnp.where(read, FLAG_HAS_INITIAL, 0)
    return rows.astype(jnp.int32), flags.astype(jnp.int32)


def _pool_kernel(kernel, q, k, v, g, beta, ssm, *, layer, slot_ids, has_initial_state, cu_seqlens, scale,
                 use_qk_l2norm, interpret, **tuning):
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    rows, flags = _rows_and_flags(ssm, layer, slot_ids, has_initial_state)
    flat = ssm.reshape(ssm.shape[0] * ssm.shape[1], *ssm.shape[2:])
    o, flat = kernel(
        q, k, v, g, beta, flat, cu_seqlens=cu_seqlens, rows=rows, flags=flags, scale=scale,
        use_qk_l2norm=use_qk_l2norm, interpret=interpret, **tuning,
    )
    return o, flat.reshape(ssm.shape)


def gdn_prefill_pool_pallas(q, k, v, g, beta, ssm, *, interpret: bool = False, **kw):
    """Chunked Pallas kernels on the pool (see :mod:`kvjax.pallas.gdn_chunk`)."""
    from kvjax.pallas.gdn_chunk import chunk_gated_delta_rule_pool

    return _pool_kernel(chunk_gated_delta_rule_pool, q, k, v, g, beta, ssm, interpret=interpret, **kw)


def gdn_decode_pool_pallas(q, k, v, g, beta, ssm, *, interpret: bool = False, **kw):
    """Recurrent Pallas kernel on the pool (see :mod:`kvjax.pallas.gdn_recurrent`).

    One token per row, every row continuing its state and a static layer: the slot-indexed fast path, on a
    Hopper GPU the Mosaic GPU kernel (:mod:`kvjax.pallas.gdn_decode_mgpu`, TMA state tiles), elsewhere the
    Triton one.
    """
    from kvjax.pallas import gdn_decode_mgpu, gdn_recurrent as rec, hopper_gpu

    one_token = kw["cu_seqlens"] is None
    if one_token and kw["has_initial_state"] is None and isinstance(kw["layer"], int):
        if not interpret and hopper_gpu() and gdn_decode_mgpu.unsupported(q, v, gdn_decode_mgpu.BLOCK_V) is None:
            return gdn_decode_mgpu.gdn_decode_mgpu(
                q, k, v, g, beta, ssm, slot_ids=kw["slot_ids"], layer=kw["layer"], scale=kw["scale"],
                use_qk_l2norm=kw["use_qk_l2norm"],
            )
        tuning = {key: kw[key] for key in ("block_v", "num_warps") if key in kw}
        return rec.recurrent_gated_delta_rule_slots(
            q, k, v, g, beta, ssm, slot_ids=kw["slot_ids"], layer=kw["layer"], scale=kw["scale"],
            use_qk_l2norm=kw["use_qk_l2norm"], interpret=interpret, **tuning,
        )
    return _pool_kernel(rec.recurrent_gated_delta_rule_pool, q, k, v, g, beta, ssm, interpret=interpret,
                        one_token_per_row=one_token, **kw)


# ---------------------------------------------------------------------------------------------- public (pool)
def _validate(q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, cu_seqlens, scale, use_qk_l2norm, impl):
    scale = gdn.validate_gdn_args(q, k, v, g, beta, cu_seqlens, None, scale, use_qk_l2norm, impl)
    hv, kd, vd = v.shape[1], q.shape[2], v.shape[2]
    check_array("pool.ssm", ssm, rank=5, dtypes=[jnp.float32], shape=(None, None, hv, kd, vd))
    num_seqs = cu_seqlens.shape[0] - 1
    check_int32("slot_ids", slot_ids, shape=(num_seqs,))
    if has_initial_state is not None:
        check_array("has_initial_state", has_initial_state, shape=(num_seqs,), dtypes=[jnp.bool_])
    num_layers, num_slots = ssm.shape[:2]
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer={layer} out of range for a GDN pool of {num_layers} layers")
    else:
        check_int32("layer", layer, rank=0)
    if isinstance(slot_ids, np.ndarray):  # host values: free to check (device code cannot raise)
        check_slot_ids(slot_ids, num_slots - 1)
    return scale


@functools.partial(jax.jit, static_argnames=("op", "impl", "static_layer", "scale", "use_qk_l2norm"),
                   donate_argnames=("ssm",))
def _run(op, impl, q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, cu_seqlens, *, static_layer, scale,
         use_qk_l2norm):
    fn = dispatch.resolve(op, impl)
    return fn(
        q, k, v, g, beta, ssm, layer=layer if static_layer is None else static_layer, slot_ids=slot_ids,
        has_initial_state=has_initial_state, cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm,
    )


def _public(op, q, k, v, g, beta, pool, layer, slot_ids, has_initial_state, cu_seqlens, scale, use_qk_l2norm,
            impl):
    if isinstance(pool, GDNStatePool):
        ssm, wrap = pool.ssm, functools.partial(dataclasses.replace, pool)
    elif hasattr(pool, "shape") and hasattr(pool, "dtype"):  # the bare SSM array (returned as an array)
        ssm, wrap = pool, None
    else:
        raise ValueError(f"pool must be a GDNStatePool or its ssm array, got {type(pool).__name__}")
    check_cu = np.arange(slot_ids.shape[0] + 1, dtype=np.int32) if cu_seqlens is None else cu_seqlens
    scale = _validate(q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, check_cu, scale,
                      use_qk_l2norm, impl)
    dispatch.resolve(op, impl)  # unknown impl -> UnknownImplError before tracing
    static = isinstance(layer, (int, np.integer)) and not isinstance(layer, bool)
    o, ssm = _run(
        op, impl, q, k, v, g, beta, ssm, None if static else layer, jnp.asarray(slot_ids),
        None if has_initial_state is None else jnp.asarray(has_initial_state),
        None if cu_seqlens is None else jnp.asarray(cu_seqlens),
        static_layer=int(layer) if static else None, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
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
    """
    return _public(PREFILL_OP, q, k, v, g, beta, pool, layer, slot_ids, has_initial_state, cu_seqlens, scale,
                   use_qk_l2norm, impl)


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
    if cu_seqlens is None and q.shape[0] != slot_ids.shape[0]:
        raise ValueError(f"without cu_seqlens decode takes one token per row: q has {q.shape[0]} tokens, "
                         f"slot_ids {slot_ids.shape[0]} rows")
    return _public(DECODE_OP, q, k, v, g, beta, pool, layer, slot_ids, has_initial_state, cu_seqlens, scale,
                   use_qk_l2norm, impl)


# ---------------------------------------------------------------------------------------------- conv
def _conv_rows(conv_pool, layer, slot_ids, has_initial_state):
    num_slots = conv_pool.shape[1]
    live = _live(slot_ids, num_slots)
    idx = slot_index(slot_ids, num_slots)
    read = live & _init_flags(slot_ids, has_initial_state)
    state = conv_pool.at[layer, idx].get(mode="fill", fill_value=0)
    return live, idx, jnp.where(read[:, None, None], state, jnp.zeros((), state.dtype))


def conv_prefill_pool_reference(
    x: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None,  # [D]
    conv_pool: jax.Array,  # [L, S+1, D, W-1]
    *,
    layer: int | jax.Array,  # i32[]
    slot_ids: jax.Array,  # i32[N]
    has_initial_state: jax.Array,  # bool[N]
    cu_seqlens: jax.Array,  # i32[N+1]
    activation: str | None,
) -> tuple[jax.Array, jax.Array]:  # (y [T, D], new conv pool)
    """Oracle (and the fused-XLA path): gather the initial states, ``causal_conv1d_reference``, zero the
    padding rows' outputs, scatter the final states (slot 0 and out-of-range ids dropped)."""
    live, idx, init = _conv_rows(conv_pool, layer, slot_ids, has_initial_state)
    y, final = conv.causal_conv1d_reference(x, weight, bias, cu_seqlens=cu_seqlens, initial_state=init,
                                            activation=activation)
    row = jnp.clip(count_le(cu_seqlens, jnp.arange(x.shape[0], dtype=jnp.int32)) - 1, 0, slot_ids.shape[0] - 1)
    y = jnp.where(live[row][:, None], y, jnp.zeros((), y.dtype))
    return y, conv_pool.at[layer, idx].set(final.astype(conv_pool.dtype), mode="drop")


def conv_decode_pool_reference(
    x: jax.Array,  # [B, D]
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None,  # [D]
    conv_pool: jax.Array,  # [L, S+1, D, W-1]
    *,
    layer: int | jax.Array,  # i32[]
    slot_ids: jax.Array,  # i32[B]
    activation: str | None,
) -> tuple[jax.Array, jax.Array]:  # (y [B, D], new conv pool)
    """Oracle (and the fused-XLA path): gather by slot, ``causal_conv1d_update_reference``, scatter back."""
    live, idx, state = _conv_rows(conv_pool, layer, slot_ids, None)
    y, new = conv.causal_conv1d_update_reference(x, state, weight, bias, activation=activation)
    y = jnp.where(live[:, None], y, jnp.zeros((), y.dtype))
    return y, conv_pool.at[layer, idx].set(new, mode="drop")


def conv_prefill_pool_pallas(x, weight, bias, conv_pool, *, interpret: bool = False, **kw):
    """Pallas token-block ``y`` kernel + final-state kernel on the pool (:mod:`kvjax.pallas.conv`)."""
    from kvjax.pallas.conv import conv_prefill_slots

    return conv_prefill_slots(x, weight, bias, conv_pool, interpret=interpret, **kw)


def conv_decode_pool_pallas(x, weight, bias, conv_pool, *, interpret: bool = False, **kw):
    """Pallas conv update straight on the pool by slot id (:mod:`kvjax.pallas.conv`)."""
    from kvjax.pallas.conv import conv_update_slots

    return conv_update_slots(x, weight, bias, conv_pool, interpret=interpret, **kw)


def _conv_impl(op: str, impl: str) -> str:
    if not isinstance(impl, str):
        raise ValueError(f"impl must be a string, got {impl!r}")
    dispatch.resolve(op, impl)  # unknown impl -> UnknownImplError before tracing
    return impl


@functools.partial(jax.jit, static_argnames=("op", "impl", "activation"), donate_argnames=("pool",))
def _conv_run(op, impl, x, weight, bias, pool, layer, slot_ids, meta, *, activation):
    fn = dispatch.resolve(op, impl)
    y, new = fn(x, weight, bias, pool.conv, layer=layer, slot_ids=slot_ids, activation=activation, **meta)
    return y, dataclasses.replace(pool, conv=new)


def _check_conv(x, weight, bias, pool, layer, slot_ids, rows: int, activation):
    if not isinstance(pool, GDNStatePool):
        raise ValueError(f"pool must be a kvjax.state.gdn_pool.GDNStatePool, got {type(pool).__name__}")
    check_array("x", x, rank=2)
    conv._check_weights(weight, bias, x.shape[1], activation)
    if pool.conv.shape[2:] != (x.shape[1], weight.shape[1] - 1):
        raise ValueError(f"pool.conv has per-slot shape {pool.conv.shape[2:]}, expected "
                         f"(D={x.shape[1]}, W-1={weight.shape[1] - 1}) from x {x.shape} and weight {weight.shape}")
    check_int32("slot_ids", slot_ids, shape=(rows,))
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < pool.conv.shape[0]:
        raise ValueError(f"layer={layer} out of range for a GDN pool of {pool.conv.shape[0]} layers")
    if isinstance(slot_ids, np.ndarray):
        check_slot_ids(slot_ids, pool.conv.shape[1] - 1)


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
    scatter); ``"pallas"`` / ``"interpret"`` = :func:`kvjax.pallas.conv.conv_prefill_slots`; ``"auto"`` =
    Pallas on the GPU (measured a near tie with XLA, see the module docstring), the reference elsewhere.
    """
    _check_conv(x, weight, bias, pool, layer, slot_ids, cu_seqlens.shape[0] - 1, activation)
    check_cu_seqlens(cu_seqlens, x.shape[0])
    check_array("has_initial_state", has_initial_state, shape=(slot_ids.shape[0],), dtypes=[jnp.bool_])
    impl = _conv_impl(CONV_PREFILL_OP, impl)
    meta = {"has_initial_state": jnp.asarray(has_initial_state), "cu_seqlens": jnp.asarray(cu_seqlens)}
    return _conv_run(CONV_PREFILL_OP, impl, x, weight, bias, pool, jnp.asarray(layer, jnp.int32),
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
    ``impl`` as in :func:`conv_prefill` (``"pallas"``: :func:`kvjax.pallas.conv.conv_update_slots`)."""
    _check_conv(x, weight, bias, pool, layer, slot_ids, x.shape[0], activation)
    impl = _conv_impl(CONV_DECODE_OP, impl)
    return _conv_run(CONV_DECODE_OP, impl, x, weight, bias, pool, jnp.asarray(layer, jnp.int32),
                     jnp.asarray(slot_ids), {}, activation=activation)


dispatch.register_reference(PREFILL_OP, gdn_prefill_pool_reference)
dispatch.register_reference(DECODE_OP, gdn_decode_pool_reference)
dispatch.register_kernel(PREFILL_OP, "pallas", "kvjax.state.gdn_ops:gdn_prefill_pool_pallas", platforms=("gpu",))
dispatch.register_kernel(DECODE_OP, "pallas", "kvjax.state.gdn_ops:gdn_decode_pool_pallas", platforms=("gpu",))
dispatch.register_reference(CONV_PREFILL_OP, conv_prefill_pool_reference)
dispatch.register_reference(CONV_DECODE_OP, conv_decode_pool_reference)
dispatch.register_kernel(CONV_PREFILL_OP, "pallas", "kvjax.state.gdn_ops:conv_prefill_pool_pallas",
                         platforms=("gpu",))
dispatch.register_kernel(CONV_DECODE_OP, "pallas", "kvjax.state.gdn_ops:conv_decode_pool_pallas",
                         platforms=("gpu",))
