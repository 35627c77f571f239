"""GDN ops on the slot-addressed state pool: prefill/extend and decode read and write SSM states by slot id.

The SSM pool is ``ssm: f32[L, S+1, Hv, K, V]`` (``kvjax.state`` GDN pool layout; slot 0 is the PAD sentinel,
never written). Batch row ``n`` owns the tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` and the slot
``slot_ids[n]`` (0 = padding row). For every live row (slot > 0) the op starts from
``ssm[layer, slot]`` when ``has_initial_state[n]`` is true and from zeros otherwise, runs the gated delta
rule (:mod:`kvjax.ops.gdn`) over the row's tokens and stores the final state back at ``ssm[layer, slot]``.
Padding rows (slot 0) are neither read nor written and their tokens' outputs are zero.

The Pallas paths update the pool in place (``input_output_aliases``); the public functions are jitted with
the pool donated, so calling them eagerly, or from a jitted step that donates its caches, moves only the
live rows' states. The reference path is the composition ``gather -> reference op -> scatter`` (the oracle).

Op names in the dispatch registry: ``"gdn_prefill_pool"`` (chunked kernel) and ``"gdn_decode_pool"``
(recurrent kernel). Implementations take ``(q, k, v, g, beta, ssm, *, layer, slot_ids, has_initial_state,
cu_seqlens, scale, use_qk_l2norm)`` (kernels also ``interpret=``) and return ``(o, ssm)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.ops import dispatch, gdn
from kvjax.ops._checks import check_array, check_int32

PREFILL_OP = "gdn_prefill_pool"
DECODE_OP = "gdn_decode_pool"


def _rows_and_flags(ssm, layer, slot_ids, has_initial_state):
    """Flattened pool row per batch row and the kernel flags (bit0 read initial state, bit1 live)."""
    from kvjax.pallas.gdn_recurrent import FLAG_HAS_INITIAL, FLAG_LIVE

    live = slot_ids > 0
    rows = jnp.asarray(layer, jnp.int32) * ssm.shape[1] + slot_ids
    flags = jnp.where(live, FLAG_LIVE, 0) | jnp.where(live & has_initial_state, FLAG_HAS_INITIAL, 0)
    return rows.astype(jnp.int32), flags.astype(jnp.int32)


def _pool_reference(op_reference, q, k, v, g, beta, ssm, *, layer, slot_ids, has_initial_state, cu_seqlens,
                    scale, use_qk_l2norm):
    num_slots = ssm.shape[1]
    live = slot_ids > 0
    init = jnp.where((live & has_initial_state)[:, None, None, None], ssm[layer, slot_ids], 0.0)
    o, final = op_reference(
        q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=init, scale=scale, use_qk_l2norm=use_qk_l2norm
    )
    t = jnp.arange(q.shape[0], dtype=jnp.int32)
    row = jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1
    row_live = jnp.where((row >= 0) & (row < slot_ids.shape[0]), live[jnp.clip(row, 0, slot_ids.shape[0] - 1)],
                         False)
    o = jnp.where(row_live[:, None, None], o, jnp.zeros_like(o))
    dest = jnp.where(live, slot_ids, num_slots)  # padding rows -> out of range -> dropped
    return o, ssm.at[layer, dest].set(final, mode="drop")


def gdn_prefill_pool_reference(q, k, v, g, beta, ssm, **kw):
    """Oracle: gather the initial states, run ``chunk_gated_delta_rule_reference``, scatter the final ones."""
    return _pool_reference(gdn.chunk_gated_delta_rule_reference, q, k, v, g, beta, ssm, **kw)


def gdn_decode_pool_reference(q, k, v, g, beta, ssm, **kw):
    """Oracle: gather the initial states, run ``recurrent_gated_delta_rule_reference``, scatter the final ones."""
    if kw["cu_seqlens"] is None:
        kw["cu_seqlens"] = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return _pool_reference(gdn.recurrent_gated_delta_rule_reference, q, k, v, g, beta, ssm, **kw)


def _pool_kernel(kernel, q, k, v, g, beta, ssm, *, layer, slot_ids, has_initial_state, cu_seqlens, scale,
                 use_qk_l2norm, interpret, **tuning):
    rows, flags = _rows_and_flags(ssm, layer, slot_ids, has_initial_state)
    flat = ssm.reshape(ssm.shape[0] * ssm.shape[1], *ssm.shape[2:])
    o, flat = kernel(
        q, k, v, g, beta, flat, cu_seqlens=cu_seqlens, rows=rows, flags=flags, scale=scale,
        use_qk_l2norm=use_qk_l2norm, interpret=interpret, **tuning,
    )
    return o, flat.reshape(ssm.shape)


def gdn_prefill_pool_pallas(q, k, v, g, beta, ssm, *, interpret: bool = False, **kw):
    """Chunked Pallas kernel on the pool (see :mod:`kvjax.pallas.gdn_chunk`)."""
    from kvjax.pallas.gdn_chunk import chunk_gated_delta_rule_pool

    return _pool_kernel(chunk_gated_delta_rule_pool, q, k, v, g, beta, ssm, interpret=interpret, **kw)


def gdn_decode_pool_pallas(q, k, v, g, beta, ssm, *, interpret: bool = False, **kw):
    """Recurrent Pallas kernel on the pool (see :mod:`kvjax.pallas.gdn_recurrent`).

    ``cu_seqlens=None`` (one token per row) selects the kernel's decode fast path.
    """
    from kvjax.pallas.gdn_recurrent import recurrent_gated_delta_rule_pool

    if kw["cu_seqlens"] is None:
        kw = dict(kw, cu_seqlens=jnp.arange(q.shape[0] + 1, dtype=jnp.int32), one_token_per_row=True)
    return _pool_kernel(recurrent_gated_delta_rule_pool, q, k, v, g, beta, ssm, interpret=interpret, **kw)


def _validate(q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, cu_seqlens, scale, use_qk_l2norm, impl):
    scale = gdn._validate(q, k, v, g, beta, cu_seqlens, None, scale, use_qk_l2norm, impl)
    hv, kd, vd = v.shape[1], q.shape[2], v.shape[2]
    check_array("ssm", ssm, rank=5, dtypes=[jnp.float32], shape=(None, None, hv, kd, vd))
    num_seqs = cu_seqlens.shape[0] - 1
    check_int32("slot_ids", slot_ids, shape=(num_seqs,))
    check_array("has_initial_state", has_initial_state, shape=(num_seqs,), dtypes=[jnp.bool_])
    num_layers, num_slots = ssm.shape[:2]
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer={layer} out of range for an SSM pool of {num_layers} layers")
    else:
        check_int32("layer", layer, rank=0)
    if isinstance(slot_ids, np.ndarray):  # host values: free to check
        if np.any(slot_ids < 0) or np.any(slot_ids >= num_slots):
            raise ValueError(f"slot_ids must lie in [0, {num_slots - 1}] (0 = padding row), got {slot_ids}")
        live = slot_ids[slot_ids > 0]
        if len(np.unique(live)) != len(live):
            raise ValueError(f"two batch rows share a live GDN slot: slot_ids={slot_ids}")
    return scale


@functools.partial(jax.jit, static_argnames=("op", "impl", "scale", "use_qk_l2norm"), donate_argnames=("ssm",))
def _run(op, impl, q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, cu_seqlens, *, scale, use_qk_l2norm):
    fn = dispatch.resolve(op, impl)
    return fn(
        q, k, v, g, beta, ssm, layer=layer, slot_ids=slot_ids, has_initial_state=has_initial_state,
        cu_seqlens=cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm,
    )


def _public(op, q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, cu_seqlens, scale, use_qk_l2norm,
            impl):
    one_token = cu_seqlens is None  # decode: one token per row
    check_cu = np.arange(slot_ids.shape[0] + 1, dtype=np.int32) if one_token else cu_seqlens
    scale = _validate(q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, check_cu, scale,
                      use_qk_l2norm, impl)
    dispatch.resolve(op, impl)  # unknown impl -> UnknownImplError before tracing
    return _run(op, impl, q, k, v, g, beta, ssm, jnp.asarray(layer, jnp.int32), jnp.asarray(slot_ids),
                jnp.asarray(has_initial_state), None if one_token else jnp.asarray(cu_seqlens), scale=scale,
                use_qk_l2norm=bool(use_qk_l2norm))


def gdn_prefill(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv] log-decay
    beta: jax.Array,  # [T, Hv]
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]  donated
    *,
    layer: int | jax.Array,  # which GDN layer of the pool (int or i32[])
    slot_ids: jax.Array,  # i32[N]  0 = padding row
    has_initial_state: jax.Array,  # bool[N]
    cu_seqlens: jax.Array,  # i32[N+1]
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Chunked gated delta rule (prefill / extend) on the pool; returns ``(o: [T, Hv, V], ssm)``.

    Reads ``ssm[layer, slot_ids[n]]`` for rows with ``has_initial_state``, writes every live row's final state
    there (one in-place update, slot 0 never touched). ``ssm`` is donated: use the returned pool.
    """
    return _public(PREFILL_OP, q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, cu_seqlens, scale,
                   use_qk_l2norm, impl)


def gdn_decode(
    q: jax.Array,  # [T, Hk, K]  (T = B for one token per row)
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]  donated
    *,
    layer: int | jax.Array,
    slot_ids: jax.Array,  # i32[B]  0 = padding row
    has_initial_state: jax.Array | None = None,  # bool[B]; None = all true (decode continues a sequence)
    cu_seqlens: jax.Array | None = None,  # i32[B+1]; None = one token per row (fast path)
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Stepwise gated delta rule (decode, or a few tokens per row for verification) on the pool.

    Same contract as :func:`gdn_prefill`; padding rows cost no state traffic.
    """
    num_rows = slot_ids.shape[0]
    if cu_seqlens is None:
        if q.shape[0] != num_rows:
            raise ValueError(f"without cu_seqlens decode takes one token per row: q has {q.shape[0]} tokens, "
                             f"slot_ids {num_rows} rows")
    if has_initial_state is None:
        has_initial_state = np.ones((num_rows,), np.bool_)
    return _public(DECODE_OP, q, k, v, g, beta, ssm, layer, slot_ids, has_initial_state, cu_seqlens, scale,
                   use_qk_l2norm, impl)


dispatch.register_reference(PREFILL_OP, gdn_prefill_pool_reference)
dispatch.register_reference(DECODE_OP, gdn_decode_pool_reference)
dispatch.register_kernel(PREFILL_OP, "pallas", "kvjax.ops.gdn_state:gdn_prefill_pool_pallas", platforms=("gpu",))
dispatch.register_kernel(DECODE_OP, "pallas", "kvjax.ops.gdn_state:gdn_decode_pool_pallas", platforms=("gpu",))
