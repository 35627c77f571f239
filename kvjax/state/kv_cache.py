"""Paged single-head K/V pools and token writes by slot mapping.

An attention layer's pool holds single-head pages ``[num_pages, page_size, ...]`` shared by all its KV heads
(DESIGN.md, "Pages and head-wise block tables"). New tokens are written by a slot mapping ``i32[T, H]``:
``slot = page * page_size + offset`` for token ``t`` of KV head ``h``; a negative slot (``-1``) skips the
write. Every write here is ONE vectorised scatter (``.at[...].set(..., mode="drop")``) with negative slots
mapped past the end of the pool so that they drop; nothing is written in a Python loop.

Slots past the end of the pool are dropped as well (device code cannot raise): validate plans on the host
(``StepInputs`` / the scheduler's debug path) to catch them. A valid plan never writes one slot twice in a
step; if it did, which value lands is unspecified.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.base.checks import check_array, check_int32


def scatter_tokens(
    pages: jax.Array,  # [P, page_size, *F]
    values: jax.Array,  # [T, H, *F] (or [T, *F] with slot_mapping i32[T])
    slot_mapping: jax.Array,  # i32[T, H] (or i32[T]); page * page_size + offset, negative = skip
) -> jax.Array:  # [P, page_size, *F]: a new array
    """Write ``values[t, h]`` to ``pages[slot // page_size, slot % page_size]`` for every slot in range.

    Slots outside ``[0, P * page_size)`` are skipped. Values are cast to the pool's dtype. One scatter; returns
    the new pool (the input is not modified).
    """
    check_int32("slot_mapping", slot_mapping)
    check_array("pages", pages)
    check_array("values", values)
    feat = pages.shape[2:]
    lead = slot_mapping.shape
    if tuple(values.shape) != (*lead, *feat):
        raise ValueError(
            f"values must have shape {(*lead, *feat)} (slot_mapping shape {tuple(lead)} + page feature shape "
            f"{tuple(feat)}), got {tuple(values.shape)}"
        )
    num_slots = pages.shape[0] * pages.shape[1]
    flat = pages.reshape(num_slots, *feat)
    slots = slot_mapping.reshape(-1)
    slots = jnp.where(slots < 0, num_slots, slots)  # negative -> out of range -> dropped
    flat = flat.at[slots].set(values.reshape(-1, *feat).astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)


def gather_tokens(
    pages: jax.Array,  # [P, page_size, *F]
    slots: jax.Array,  # i32[...]; negative (or past the pool) = none
) -> jax.Array:  # [..., *F]: zeros where the slot is negative or >= P * page_size
    """Read the token rows at ``slots`` (``page * page_size + offset``).

    Slots outside ``[0, P * page_size)`` read as zeros (never another token's row), mirroring
    :func:`scatter_tokens`, which drops them.
    """
    check_int32("slots", slots)
    num_slots = pages.shape[0] * pages.shape[1]
    flat = pages.reshape(num_slots, *pages.shape[2:])
    rows = flat[jnp.clip(slots, 0, num_slots - 1)]
    keep = ((slots >= 0) & (slots < num_slots)).reshape(*slots.shape, *([1] * (pages.ndim - 2)))
    return jnp.where(keep, rows, jnp.zeros((), pages.dtype))


def write_kv(
    k_pages: jax.Array,  # [P, page_size, D]
    v_pages: jax.Array,  # [P, page_size, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T, Hkv]; -1 = skip
) -> tuple[jax.Array, jax.Array]:  # (k_pages, v_pages), new arrays
    """Write this step's keys and values of every KV head into the single-head page pools."""
    check_int32("slot_mapping", slot_mapping, rank=2)
    check_array("k_pages", k_pages, rank=3)
    check_array("v_pages", v_pages, shape=k_pages.shape)
    check_array("k", k, shape=(*slot_mapping.shape, k_pages.shape[2]))
    check_array("v", v, shape=k.shape)
    return scatter_tokens(k_pages, k, slot_mapping), scatter_tokens(v_pages, v, slot_mapping)


def write_kv_cache(
    cache: dict[str, jax.Array],  # roles "key", "value": [P, page_size, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T, Hkv]; -1 = skip
) -> dict[str, jax.Array]:
    """:func:`write_kv` on a GQA cache dict from :func:`kvjax.state.registry.create_kv_cache`."""
    for role in ("key", "value"):
        if role not in cache:
            raise ValueError(f"GQA cache needs role {role!r}; got roles {sorted(cache)}")
    k_pages, v_pages = write_kv(cache["key"], cache["value"], k, v, slot_mapping)
    return {**cache, "key": k_pages, "value": v_pages}
