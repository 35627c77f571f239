"""Slot ids of the slot-addressed GDN state (the pool's arrays ``[L, S+1, ...]``): the device-side index map and
the host-side check.

Slot convention (DESIGN.md, "GDN slots"): slot 0 is the PAD sentinel, all zeros and never written; the host
slot allocator hands out ``1..S``; a batch row without a request carries slot 0. The slot id is the array
index (no ``+1`` offset). Device code cannot raise, so on device an id outside ``1..S`` (0, negative, too
large) is a padding row: :func:`slot_index` maps it to the out-of-range index ``S + 1`` (a negative id would
otherwise wrap around to the last slot), read with ``mode="fill"`` (zeros), written with ``mode="drop"``
(never). :func:`check_slot_ids` is the host (``debug``) check that catches such ids, and duplicates, in a plan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import InvalidPlanError

__all__ = ["PAD_SLOT", "check_slot_ids", "live_slots", "slot_index", "static_layer"]

PAD_SLOT = 0


def slot_index(slot_ids: jax.Array, num_slots: int) -> jax.Array:  # i32[B] -> i32[B]
    """Pool index of each slot id: valid ids ``1..S`` unchanged; PAD and anything out of range (negative
    included) -> ``S + 1 = num_slots``, which ``mode="fill"`` reads as zeros and ``mode="drop"`` never writes."""
    return jnp.where((slot_ids >= 1) & (slot_ids < num_slots), slot_ids, num_slots)


def live_slots(slot_ids: jax.Array, num_slots: int) -> jax.Array:  # i32[B] -> bool[B]
    """Whether each row's slot id is a real slot (``1..S``), i.e. the row is not padding."""
    return (slot_ids >= 1) & (slot_ids < num_slots)


def check_slot_ids(slot_ids, max_seqs: int) -> None:
    """Host (``debug``) validation of a batch's slot ids; raises :class:`InvalidPlanError` naming bad ids.

    Valid: int32, rank 1, every id in ``0..max_seqs`` (0 = PAD row), no non-zero id twice. Copies device
    arrays to the host, so call it on the plan (numpy) or only in debug runs.
    """
    ids = np.asarray(slot_ids)
    if ids.ndim != 1 or ids.dtype != np.int32:
        raise InvalidPlanError(f"slot_ids must be int32 of rank 1, got {ids.dtype} with shape {ids.shape}")
    bad = ids[(ids < 0) | (ids > max_seqs)]
    if bad.size:
        raise InvalidPlanError(f"slot_ids out of range 0..{max_seqs} (0 = PAD): {sorted(set(bad.tolist()))}")
    live, counts = np.unique(ids[ids != PAD_SLOT], return_counts=True)
    if np.any(counts > 1):
        raise InvalidPlanError(f"slot_ids used by more than one row: {live[counts > 1].tolist()}")


def static_layer(layer) -> int | None:
    """``layer`` as a Python int when it is one (numpy integers included), else ``None`` (a traced index)."""
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        return int(layer)
    return None
