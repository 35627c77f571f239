"""MLA paged latent cache: one latent head ``[num_pages, page_size, kv_lora_rank + rope_dim]`` per layer.

Each token stores ``[kv_c ‖ k_pe]`` (512 + 64 for DeepSeek): the compressed KV (keys' no-rope part and values
after weight absorption) followed by the shared rope key. Block tables are ``i32[B, 1, max_blocks]`` and the
slot mapping is ``i32[T]`` or ``i32[T, 1]`` (``page * page_size + offset``, ``-1`` = skip), see DESIGN.md, "MLA".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.base.checks import check_array, check_float, check_int32
from kvjax.state.kv_cache import gather_tokens, scatter_tokens


def _token_slots(slot_mapping: jax.Array, num_tokens: int) -> jax.Array:  # i32[T]
    check_int32("slot_mapping", slot_mapping)
    if tuple(slot_mapping.shape) not in ((num_tokens,), (num_tokens, 1)):
        raise ValueError(
            f"slot_mapping must have shape ({num_tokens},) or ({num_tokens}, 1) (one latent head), "
            f"got {tuple(slot_mapping.shape)}"
        )
    return slot_mapping.reshape(num_tokens)


def write_latent(
    latent_pages: jax.Array,  # [P, page_size, R + r]
    kv_c: jax.Array,  # [T, R] compressed KV (e.g. R = kv_lora_rank = 512)
    k_pe: jax.Array,  # [T, r] rope key (e.g. r = 64)
    slot_mapping: jax.Array,  # i32[T] or i32[T, 1]; -1 = skip
) -> jax.Array:  # [P, page_size, R + r]: a new array
    """Write ``[kv_c ‖ k_pe]`` of each new token into the paged latent cache (one scatter, cast to its dtype)."""
    check_array("latent_pages", latent_pages, rank=3)
    check_float("kv_c", kv_c, rank=2)
    check_float("k_pe", k_pe, rank=2)
    t = kv_c.shape[0]
    if k_pe.shape[0] != t:
        raise ValueError(f"k_pe has {k_pe.shape[0]} tokens but kv_c has {t}")
    if kv_c.shape[1] + k_pe.shape[1] != latent_pages.shape[2]:
        raise ValueError(
            f"kv_c width {kv_c.shape[1]} + k_pe width {k_pe.shape[1]} != latent width {latent_pages.shape[2]} "
            f"(latent_pages shape {tuple(latent_pages.shape)})"
        )
    rows = jnp.concatenate([kv_c.astype(latent_pages.dtype), k_pe.astype(latent_pages.dtype)], axis=-1)
    return scatter_tokens(latent_pages, rows, _token_slots(slot_mapping, t))


def write_latent_cache(
    cache: dict[str, jax.Array],  # role "key": [P, page_size, R + r]
    kv_c: jax.Array,  # [T, R]
    k_pe: jax.Array,  # [T, r]
    slot_mapping: jax.Array,  # i32[T] or i32[T, 1]
) -> dict[str, jax.Array]:
    """:func:`write_latent` on an MLA cache dict from :func:`kvjax.state.registry.create_kv_cache`."""
    if "key" not in cache:
        raise ValueError(f"MLA cache needs role 'key'; got roles {sorted(cache)}")
    return {**cache, "key": write_latent(cache["key"], kv_c, k_pe, slot_mapping)}


def gather_latent(
    latent_pages: jax.Array,  # [P, page_size, R + r]
    slots: jax.Array,  # i32[...]; negative = none
) -> jax.Array:  # [..., R + r]; zeros at negative slots
    """Read latent rows at ``slots`` (``page * page_size + offset``)."""
    return gather_tokens(latent_pages, slots)
