"""The GDN state pool: every GDN layer's conv state and f32 SSM state, addressed by slot.

Slot convention (DESIGN.md, "GDN slots"): the pool has ``max_seqs + 1`` slots; slot 0 is the PAD sentinel,
all zeros and never written; the host slot allocator hands out ``1..max_seqs``; a batch row without a
request carries slot 0. The slot id is the array index: there is no ``+1`` offset anywhere.

Device code cannot raise, so on device an id outside ``1..max_seqs`` (0, negative, too large) reads as zeros
and is never written: it is mapped to the out-of-range index ``max_seqs + 1`` (negative ids would otherwise
wrap around to the last slot), then ``mode="fill"`` / ``mode="drop"``. Validate plans on the host with
:func:`check_slot_ids` (the ``debug`` path) to catch such ids, and duplicates, before a step. Both slot-id
helpers, :func:`slot_index` and :func:`check_slot_ids`, live in :mod:`kvjax.ops.gdn_slots` (the array-level
pool ops use them too) and are re-exported here.

Every update is one vectorised scatter per array and returns a new pool (donate it under jit).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.base.checks import check_array, check_float, check_int32
from kvjax.config import GDNConfig
from kvjax.ops.gdn_slots import PAD_SLOT, check_slot_ids, slot_index

__all__ = ["PAD_SLOT", "GDNStatePool", "check_slot_ids", "create", "gather", "reset", "scatter", "slot_index"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNStatePool:
    """Conv and SSM state of every GDN layer for ``max_seqs`` sequences plus the PAD slot 0."""

    conv: jax.Array  # [L, S+1, conv_dim, W-1]: the last W-1 conv inputs of each slot (oldest first)
    ssm: jax.Array  # f32[L, S+1, Hv, K, V]: recurrent state of each slot

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
