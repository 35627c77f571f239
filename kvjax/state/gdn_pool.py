"""The GDN state pool: every GDN layer's conv state and f32 SSM state, addressed by slot, and the ops on it
(pool in, pool out).

Slot convention (DESIGN.md, "GDN slots"; :mod:`kvjax.base.slots`): the pool has ``max_seqs + 1`` slots; slot 0
is the PAD sentinel, all zeros and never written; the host slot allocator hands out ``1..max_seqs``; a batch
row without a request carries slot 0. The slot id is the array index: there is no ``+1`` offset anywhere.
Device code cannot raise, so on device an id outside ``1..max_seqs`` (0, negative, too large) reads as zeros
and is never written (:func:`~kvjax.base.slots.slot_index`); validate plans on the host with
:func:`~kvjax.base.slots.check_slot_ids` (the ``debug`` path) to catch such ids, and duplicates, before a step.

- :func:`create`, :func:`gather`, :func:`scatter`, :func:`reset`: the pool itself; every update is one
  vectorised scatter per array and returns a new pool (donate it under jit).
- :func:`gdn_prefill` / :func:`gdn_decode`: the gated delta rule (chunked / stepwise) on ``pool.ssm``;
  ``gdn_decode`` with ``cu_seqlens=None``, ``has_initial_state=None`` and a Python-int ``layer`` runs the slot
  decode kernel straight on the pool by slot id, with no XLA work around it (on a GPU, ``impl="auto"``).
- :func:`gated_delta_decode`: Qwen3.5's decode step from a :class:`~kvjax.ops.gdn_on_pool.GatedDecodeCall` (the
  packed conv output and the gate inputs; the same kernel reading q / k / v by column and computing the gates).
- :func:`conv_prefill` / :func:`conv_decode`: the causal conv1d on ``pool.conv``.

The op functions check the pool's type, run the array-level op (:mod:`kvjax.ops.gdn_on_pool` on ``pool.ssm``,
:mod:`kvjax.ops.conv` on ``pool.conv``; those modules hold the contracts, the one argument check, references
and backend tables) and return the pool with that array replaced, with no jit of their own. The kernels donate
the array under their own jit and update it in place; inside a jitted step with the caches donated (the
engine's) the whole step updates the pool in place. Batch row ``n`` owns the tokens
``cu_seqlens[n]:cu_seqlens[n+1]`` and the slot ``slot_ids[n]``; padding rows read and write nothing and their
tokens' outputs are zero.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.base.checks import check_array, check_float, check_int32
from kvjax.base.slots import slot_index
from kvjax.config import GDNConfig
from kvjax.ops import conv as conv_ops
from kvjax.ops import gdn_on_pool
from kvjax.ops.gdn import DeltaRuleCall

__all__ = ["GDNStatePool", "conv_decode", "conv_prefill", "create", "gated_delta_decode", "gather", "gdn_decode",
           "gdn_prefill", "reset", "scatter"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNStatePool:
    """Conv and SSM state of every GDN layer for ``max_seqs`` sequences plus the PAD slot 0."""

    conv: jax.Array  # [L, S+1, conv_dim, W-1]: the last W-1 conv inputs of each slot (oldest first)
    ssm: jax.Array  # f32[L, S+1, Hv, K, V]: recurrent state of each slot
    # a verification step's per-position states while its forward runs (kvjax.state.gdn_spec.VerifyStates: the
    # GDN layers record into it, the step commits the accepted ones and drops it; a verification burst keeps it
    # between sub-steps); None otherwise
    spec: Any = None

    @property
    def num_layers(self) -> int:
        return self.conv.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.conv.shape[1] - 1

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


def create(
    cfg: GDNConfig, num_layers: int, max_seqs: int, conv_dtype=jnp.bfloat16
) -> GDNStatePool:
    """An all-zero pool for ``num_layers`` GDN layers of shape ``cfg`` and slots ``0..max_seqs``.

    ``num_layers=0`` (an attention-only model) gives a valid empty pool (arrays of shape ``[0, S+1, ...]``):
    :func:`reset` is then a no-op and no layer index is valid.
    """
    for name, value, low in (("num_layers", num_layers, 0), ("max_seqs", max_seqs, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not jnp.issubdtype(conv_dtype, jnp.floating):
        raise ValueError(f"conv_dtype must be a floating dtype, got {conv_dtype!r}")
    slots = max_seqs + 1
    return GDNStatePool(
        conv=jnp.zeros((num_layers, slots, cfg.conv_dim, cfg.conv_kernel_size - 1), conv_dtype),
        ssm=jnp.zeros((num_layers, slots, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim), jnp.float32),
    )


def _check_layer(pool: GDNStatePool, layer) -> None:
    if isinstance(layer, bool):
        raise ValueError(f"layer must be an int or an integer scalar array, got {layer!r}")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= layer < pool.num_layers:
            raise ValueError(f"layer={layer} out of range for a pool of {pool.num_layers} layers")
        return
    check_array("layer", layer, rank=0)
    if not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer must have an integer dtype, got {layer.dtype}")


def _check_slots(pool: GDNStatePool, layer, slot_ids) -> int:
    _check_layer(pool, layer)
    check_int32("slot_ids", slot_ids, rank=1)
    return slot_ids.shape[0]


def gather(
    pool: GDNStatePool,
    layer: int | jax.Array,  # Python int or traced i32[]
    slot_ids: jax.Array,  # i32[B]
    has_initial_state: jax.Array,  # bool[B]
) -> tuple[jax.Array, jax.Array]:  # ([B, conv_dim, W-1] pool dtype, f32[B, Hv, K, V])
    """Initial states of a batch: the slot's state where ``has_initial_state``, zeros elsewhere.

    Rows with ``has_initial_state=False`` read zeros whatever their slot holds (a fresh request in a reused
    slot); PAD rows (slot 0) and out-of-range ids read zeros. The pool is not changed.
    """
    batch = _check_slots(pool, layer, slot_ids)
    check_array("has_initial_state", has_initial_state, shape=(batch,), dtypes=[jnp.bool_])
    idx = slot_index(slot_ids, pool.conv.shape[1])
    conv = pool.conv.at[layer, idx].get(mode="fill", fill_value=0)
    ssm = pool.ssm.at[layer, idx].get(mode="fill", fill_value=0)
    conv = jnp.where(has_initial_state[:, None, None], conv, jnp.zeros((), conv.dtype))
    ssm = jnp.where(has_initial_state[:, None, None, None], ssm, jnp.zeros((), ssm.dtype))
    return conv, ssm


def scatter(
    pool: GDNStatePool,
    layer: int | jax.Array,  # Python int or traced i32[]
    slot_ids: jax.Array,  # i32[B]
    conv: jax.Array,  # [B, conv_dim, W-1] float (cast to the pool's conv dtype)
    ssm: jax.Array,  # f32[B, Hv, K, V]
) -> GDNStatePool:
    """Write each row's final states to its slot of ``layer``; rows with slot 0 (PAD) are dropped.

    One scatter per array. Non-zero ids must be distinct (if not, which row lands is unspecified).
    """
    batch = _check_slots(pool, layer, slot_ids)
    check_float("conv", conv, shape=(batch, *pool.conv.shape[2:]))
    check_array("ssm", ssm, shape=(batch, *pool.ssm.shape[2:]), dtypes=[jnp.float32])
    idx = slot_index(slot_ids, pool.conv.shape[1])
    return GDNStatePool(
        conv=pool.conv.at[layer, idx].set(conv.astype(pool.conv.dtype), mode="drop"),
        ssm=pool.ssm.at[layer, idx].set(ssm, mode="drop"),
    )


def reset(pool: GDNStatePool, slot_ids: jax.Array) -> GDNStatePool:  # slot_ids: i32[F]
    """Zero the given (freed) slots in every layer; slot 0 and out-of-range ids are ignored."""
    check_int32("slot_ids", slot_ids, rank=1)
    idx = slot_index(slot_ids, pool.conv.shape[1])
    return GDNStatePool(
        conv=pool.conv.at[:, idx].set(jnp.zeros((), pool.conv.dtype), mode="drop"),
        ssm=pool.ssm.at[:, idx].set(0.0, mode="drop"),
    )


# ---------------------------------------------------------------------------------------------- SSM
def _ssm_of(pool):
    """``(ssm, rewrap)`` of a :class:`GDNStatePool` (rewrap puts the new ssm back) or of a bare ssm array."""
    if isinstance(pool, GDNStatePool):
        return pool.ssm, lambda ssm: dataclasses.replace(pool, ssm=ssm)
    if hasattr(pool, "shape") and hasattr(pool, "dtype"):  # the bare SSM array (returned as an array)
        return pool, lambda ssm: ssm
    raise ValueError(f"pool must be a GDNStatePool or its ssm array, got {type(pool).__name__}")


def _delta_rule_on_pool(op: Callable, name: str, doc: str) -> Callable:
    """The pool function of the slot-pool op ``op(call, ssm, impl)`` of :mod:`kvjax.ops.gdn_on_pool`: its arguments
    made one :class:`~kvjax.ops.gdn.DeltaRuleCall`, ``op`` run on the pool's ``ssm``, the pool returned with it
    replaced."""

    def on_pool(
        q: jax.Array,  # [T, Hk, K]  (T = N without cu_seqlens: one token per row)
        k: jax.Array,  # [T, Hk, K]
        v: jax.Array,  # [T, Hv, V]
        g: jax.Array,  # f32[T, Hv] log-decay
        beta: jax.Array,  # [T, Hv]
        pool: GDNStatePool | jax.Array,  # ssm f32[L, S+1, Hv, K, V] (donated by the kernels); or the bare ssm array
        *,
        layer: int | jax.Array,  # GDN layer index (int, or traced i32[])
        slot_ids: jax.Array,  # i32[N]  0 = padding row
        has_initial_state: jax.Array | None = None,  # bool[N]; None = every live row continues its state
        cu_seqlens: jax.Array | None = None,  # i32[N+1]; None = one token per row
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        impl: str = "auto",
    ) -> tuple[jax.Array, GDNStatePool | jax.Array]:
        ssm, rewrap = _ssm_of(pool)
        call = DeltaRuleCall(q, k, v, g, beta, cu_seqlens, scale, slot_ids, has_initial_state, layer,
                             use_qk_l2norm=use_qk_l2norm)
        o, ssm = op(call, ssm, impl)
        return o, rewrap(ssm)

    on_pool.__name__ = on_pool.__qualname__ = name
    on_pool.__doc__ = doc
    return on_pool


gdn_prefill = _delta_rule_on_pool(gdn_on_pool.gdn_prefill_pool, "gdn_prefill", """Chunked gated delta rule (prefill /
    extend) on the pool; returns ``(o: [T, Hv, V], pool)``.

    ``pool`` may be the :class:`GDNStatePool` (returned with its ``ssm`` replaced, ``conv`` untouched) or its bare
    ``ssm`` array (returned as the updated array). Reads ``pool.ssm[layer, slot_ids[n]]`` for rows with
    ``has_initial_state``, writes every live row's final state there in one in-place update (slot 0 never
    touched). The kernels donate ``pool.ssm``: use the returned pool. See
    :func:`kvjax.ops.gdn_on_pool.gdn_prefill_pool` for errors and implementations.
    """)

gdn_decode = _delta_rule_on_pool(gdn_on_pool.gdn_decode_pool, "gdn_decode", """Stepwise gated delta rule (decode) on
    the pool; same contract as :func:`gdn_prefill`.

    Padding rows cost no state traffic. With ``cu_seqlens=None``, ``has_initial_state=None`` and an int ``layer``
    the kernel indexes the pool by slot id directly (no XLA op before or after it).
    """)


def gated_delta_decode(
    call: gdn_on_pool.GatedDecodeCall,  # qkv [B, 2*Hk*K + Hv*V], x [B, D], gate weights, slot_ids i32[B], layer
    pool: GDNStatePool,  # ssm f32[L, S+1, Hv, K, V] (donated by the kernel)
    impl: str = "auto",
) -> tuple[jax.Array, GDNStatePool]:
    """Qwen3.5's GDN decode step on the pool; returns ``(o: [B, Hv, V], pool)`` with every live row's state
    at ``pool.ssm[call.layer, call.slot_ids[b]]`` advanced one token (``conv`` untouched).

    Equals :func:`gdn_decode` of the split ``q, k, v`` and the gates :func:`kvjax.ops.gdn_on_pool.qwen_gates` of
    ``x @ w_a.T``, ``x @ w_b.T``; see :func:`kvjax.ops.gdn_on_pool.gated_delta_decode_pool` (checks, errors)."""
    _check_pool(pool)
    o, ssm = gdn_on_pool.gated_delta_decode_pool(call, pool.ssm, impl)
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
    Pallas on the GPU (RESULTS.md, "Causal conv1d on the pool"), the reference elsewhere.
    """
    _check_pool(pool)
    call = conv_ops.ConvPoolCall(x, weight, bias, layer, slot_ids, has_initial_state, cu_seqlens, activation)
    y, new = conv_ops.conv_prefill_pool(call, pool.conv, impl)
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
    y, new = conv_ops.conv_decode_pool(conv_ops.ConvPoolCall(x, weight, bias, layer, slot_ids, activation=activation),
                                       pool.conv, impl)
    return y, dataclasses.replace(pool, conv=new)

