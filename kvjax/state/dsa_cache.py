"""DSA (DeepSeek sparse attention) paged cache: fp8 latent key with block scales, bf16 rope, fp8 indexer key.

Representation (one array per role, so that ``create_kv_cache(spec, num_pages) -> dict[role, array]`` holds;
the seed packs the same bytes into one uint8 array per role, which kvjax does not need: typed arrays are
simpler to read, to write, and to tile in Pallas; the bytes per token are identical, 656 + 132):

| role            | array                                   | per token                           |
|-----------------|-----------------------------------------|-------------------------------------|
| ``key``         | f8e4m3[P, page_size, R]  (R = 512)      | latent ``kv_c`` quantised           |
| ``key_scale``   | f32[P, page_size, R // block]           | one scale per ``block`` (128) values |
| ``key_rope``    | bf16[P, page_size, r]  (r = 64)         | rope key, not quantised             |
| ``indexer``     | f8e4m3[P, page_size, Di]  (Di = 128)    | lightning-indexer key quantised     |
| ``indexer_scale`` | f32[P, page_size, Di // block]        | its scale(s)                        |

Quantisation is blockwise: ``scale = amax(|x|) / 448`` over each ``block`` consecutive values, ``q = x / scale``
rounded to e4m3 (a block of zeros gets scale 0 and quantises to 0, never NaN); dequantise ``q * scale``.
All writes take a slot mapping ``i32[T]`` / ``i32[T, 1]`` (``-1`` = skip) and are one scatter per array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.base.checks import check_array, check_float
from kvjax.base.fp8 import (  # noqa: F401 (FP8_* and the quantisers are re-exported for cache users)
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
)
from kvjax.state.kv_cache import gather_tokens, scatter_tokens
from kvjax.state.latent_cache import _token_slots

KEY_ROLES = ("key", "key_scale", "key_rope")
INDEXER_ROLES = ("indexer", "indexer_scale")


def _require(cache: dict, roles: tuple[str, ...]) -> None:
    missing = [r for r in roles if r not in cache]
    if missing:
        raise ValueError(f"DSA cache lacks roles {missing}; got roles {sorted(cache)}")


def _block(values: jax.Array, scales: jax.Array, name: str) -> int:
    n, nb = values.shape[-1], scales.shape[-1]
    if nb < 1 or n % nb:
        raise ValueError(f"{name}: width {n} is not a multiple of its {nb} scales per token")
    return n // nb


def write_dsa_key(
    cache: dict[str, jax.Array],  # roles key / key_scale / key_rope (see the module table)
    kv_c: jax.Array,  # [T, R] latent (R = 512)
    k_pe: jax.Array,  # [T, r] rope key (r = 64)
    slot_mapping: jax.Array,  # i32[T] or i32[T, 1]; -1 = skip
) -> dict[str, jax.Array]:
    """Quantise ``kv_c`` blockwise to fp8 and write it, its scales and the bf16 rope key at ``slot_mapping``."""
    _require(cache, KEY_ROLES)
    check_float("kv_c", kv_c, rank=2, shape=(None, cache["key"].shape[-1]))
    check_float("k_pe", k_pe, shape=(kv_c.shape[0], cache["key_rope"].shape[-1]))
    slots = _token_slots(slot_mapping, kv_c.shape[0])
    q, scale = quantize_fp8_blockwise(kv_c, _block(cache["key"], cache["key_scale"], "key"))
    return {
        **cache,
        "key": scatter_tokens(cache["key"], q, slots),
        "key_scale": scatter_tokens(cache["key_scale"], scale, slots),
        "key_rope": scatter_tokens(cache["key_rope"], k_pe, slots),
    }


def write_dsa_indexer(
    cache: dict[str, jax.Array],  # roles indexer / indexer_scale
    index_k: jax.Array,  # [T, Di] indexer key (Di = 128)
    slot_mapping: jax.Array,  # i32[T] or i32[T, 1]; -1 = skip
) -> dict[str, jax.Array]:
    """Quantise the indexer keys blockwise to fp8 and write them and their scales at ``slot_mapping``."""
    _require(cache, INDEXER_ROLES)
    check_float("index_k", index_k, rank=2, shape=(None, cache["indexer"].shape[-1]))
    slots = _token_slots(slot_mapping, index_k.shape[0])
    q, scale = quantize_fp8_blockwise(index_k, _block(cache["indexer"], cache["indexer_scale"], "indexer"))
    return {
        **cache,
        "indexer": scatter_tokens(cache["indexer"], q, slots),
        "indexer_scale": scatter_tokens(cache["indexer_scale"], scale, slots),
    }


def gather_dsa_key(
    cache: dict[str, jax.Array],
    slots: jax.Array,  # i32[...]; negative = none
) -> jax.Array:  # f32[..., R + r]: dequantised latent ‖ rope; zeros at negative slots
    """Dequantised ``[kv_c ‖ k_pe]`` rows at ``slots`` (the MLA latent layout), for references."""
    _require(cache, KEY_ROLES)
    latent = dequantize_fp8_blockwise(gather_tokens(cache["key"], slots), gather_tokens(cache["key_scale"], slots))
    rope = gather_tokens(cache["key_rope"], slots).astype(jnp.float32)
    return jnp.concatenate([latent, rope], axis=-1)


def gather_dsa_indexer(
    cache: dict[str, jax.Array],
    slots: jax.Array,  # i32[...]; negative = none
) -> jax.Array:  # f32[..., Di]; zeros at negative slots
    """Dequantised indexer keys at ``slots``, for references."""
    _require(cache, INDEXER_ROLES)
    check_array("indexer", cache["indexer"], rank=3)
    return dequantize_fp8_blockwise(gather_tokens(cache["indexer"], slots),
                                    gather_tokens(cache["indexer_scale"], slots))
