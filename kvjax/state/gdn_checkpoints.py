"""Copies of GDN state between slots of one pool: the device half of prefix caching's state checkpoints.

With prefix caching the engine creates the GDN pool with ``max_seqs + num_checkpoints`` slots: slots
``1..max_seqs`` belong to running requests (one per block-table row), slots ``max_seqs + 1 ..`` hold checkpoints
(the recurrent state after a cached prompt block; :mod:`kvjax.sched.prefix_cache` decides which). A step
restores a checkpoint into a request's slot before the model runs (a cache hit resumes from it) and saves a
request's slot into a checkpoint after it (a prompt block just completed). Both are :func:`copy_slots`: one
gather and one scatter per pool array, over fixed-shape ``i32[B]`` source/destination pairs (``-1`` = no copy),
so the number of copies never changes the compiled step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.state.gdn_pool import GDNStatePool

__all__ = ["copy_slots", "restore", "save"]


def copy_slots(pool: GDNStatePool, src: jax.Array, dst: jax.Array) -> GDNStatePool:
    """Copy the conv and SSM state of slot ``src[k]`` into slot ``dst[k]`` in every layer, for every ``k``
    where both are valid slots (``1 .. S``; anything else, e.g. ``-1``, copies nothing).

    ``src``, ``dst``: i32[B]. Destinations must be distinct among the valid pairs, and no destination may be the
    source of another pair (all sources are read before any destination is written). Returns the new pool.
    """
    n = pool.conv.shape[1]  # S + 1 slots (slot 0 = PAD, never written)
    ok = (src >= 1) & (src < n) & (dst >= 1) & (dst < n)  # bool[B]
    s = jnp.where(ok, src, 0)  # i32[B]: a valid index to gather (ignored where not ok)
    d = jnp.where(ok, dst, n)  # i32[B]: n is out of range -> dropped
    return GDNStatePool(conv=pool.conv.at[:, d].set(pool.conv[:, s], mode="drop"),
                        ssm=pool.ssm.at[:, d].set(pool.ssm[:, s], mode="drop"))


def restore(pool: GDNStatePool, checkpoint: jax.Array, slots: jax.Array) -> GDNStatePool:
    """Before a step: copy checkpoint slot ``checkpoint[b]`` (i32[B], -1 none) into row ``b``'s slot
    ``slots[b]`` (i32[B])."""
    return copy_slots(pool, checkpoint, jnp.where(checkpoint >= 0, slots, -1))


def save(pool: GDNStatePool, slots: jax.Array, checkpoint: jax.Array) -> GDNStatePool:
    """After a step: copy row ``b``'s slot ``slots[b]`` (i32[B]) into checkpoint slot ``checkpoint[b]`` (i32[B],
    -1 none)."""
    return copy_slots(pool, jnp.where(checkpoint >= 0, slots, -1), checkpoint)
