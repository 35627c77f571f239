"""Paged single-head K/V pools and token writes by slot mapping.

An attention layer's pool holds single-head pages ``[num_pages, page_size, ...]`` shared by all its KV heads
(DESIGN.md, "Pages and head-wise block tables"). New tokens are written by a slot mapping ``i32[T, H]``:
``slot = page * page_size + offset`` for token ``t`` of KV head ``h``; a negative slot (``-1``) skips the
write. Every write here is ONE vectorised scatter (``.at[...].set(..., mode="drop")``) with negative slots
mapped past the end of the pool so that they drop; nothing is written in a Python loop.

Slots past the end of the pool are dropped as well (device code cannot raise): validate plans on the host
(``StepInputs`` / the scheduler's debug path) to catch them. A valid plan never writes one slot twice in a
step; if it did, which value lands is unspecified.

fp8 pages (:class:`kvjax.state.registry.GQACacheSpec` with ``dtype=float8_e4m3fn``; :func:`write_kv_fp8`): each
page has one f32 scale ``s`` (``key_scale`` / ``value_scale`` ``f32[P]``), the smallest power of two with
``amax <= 448 s`` (:func:`kvjax.base.fp8.pow2_scale`), ``amax`` the largest ``|x|`` written to the page since
its first token (offset 0); a page holds ``round_e4m3(x / s)`` and reads as ``q * s``. **Fill rule**: a write
whose tokens raise a page's ``amax`` past ``448 s`` requantises the page's earlier tokens to the new scale
``s' = 2**k s``; that is a shift of their exponents, exact for every value that stays in e4m3's normal range
(``|x| >= 2**-6 s'``), so a page written token by token holds the same bits there as the page written at once.
Per element, ``|x - q s| <= 2**-4 |x| + 2**-9 s`` (3 mantissa bits: half an ulp is ``2**-4`` relative; below
the normal range the subnormal spacing is ``2**-9 s``, half of it per rounding, and the roundings of a value
that the page's growth pushes below the normal range sum to less than ``2**-9`` of the final scale). A write
at offset 0 starts the page afresh (its old scale is a previous owner's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.base.checks import check_array, check_float, check_int32
from kvjax.base.fp8 import FP8_DTYPE, FP8_MAX, pow2_scale

FP8_ROLES = ("key", "value", "key_scale", "value_scale")


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


def is_fp8_cache(cache: dict[str, jax.Array]) -> bool:
    """Whether a GQA cache dict holds fp8 pages with scales (checked: :func:`check_gqa_cache`)."""
    check_gqa_cache(cache)
    return "key_scale" in cache


def check_gqa_cache(cache: dict[str, jax.Array]) -> None:
    """``ValueError`` naming what is wrong with a GQA cache dict: a missing role, ``key`` / ``value`` of other
    shapes or dtypes, fp8 pages without their scales, scales beside pages that are not float8_e4m3fn, or scales
    that are not ``f32[P]``."""
    for role in ("key", "value"):
        if role not in cache:
            raise ValueError(f"GQA cache needs role {role!r}; got roles {sorted(cache)}")
    check_array("key", cache["key"], rank=3)
    check_array("value", cache["value"], shape=cache["key"].shape, dtypes=[cache["key"].dtype])
    fp8 = jnp.dtype(cache["key"].dtype) == jnp.dtype(FP8_DTYPE)
    scales = [r for r in ("key_scale", "value_scale") if r in cache]
    if fp8 and len(scales) < 2:
        missing = sorted({"key_scale", "value_scale"} - set(scales))
        raise ValueError(f"fp8 GQA pages need roles {missing} (f32[P] per-page scales); got roles {sorted(cache)}")
    if not fp8:
        if scales:
            raise ValueError(f"roles {scales} go with float8_e4m3fn pages, but the pages are {cache['key'].dtype}")
        if jnp.dtype(cache["key"].dtype).itemsize == 1:
            raise ValueError(f"fp8 GQA pages are float8_e4m3fn (with per-page scales), got {cache['key'].dtype}")
        return
    for role in scales:
        check_array(role, cache[role], shape=(cache["key"].shape[0],), dtypes=[jnp.float32])


def write_kv_cache(
    cache: dict[str, jax.Array],  # roles "key", "value": [P, page_size, D] (+ "key_scale", "value_scale": f32[P])
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T, Hkv]; -1 = skip
    *,
    cu_seqlens: jax.Array | None = None,  # i32[B+1]: rows' token offsets (needed for fp8 pages)
) -> dict[str, jax.Array]:
    """Write a step's K/V into a GQA cache dict from :func:`kvjax.state.registry.create_kv_cache`: :func:`write_kv`
    for float pages, :func:`write_kv_fp8` for fp8 pages (which needs ``cu_seqlens``). Returns the new dict."""
    if not is_fp8_cache(cache):
        k_pages, v_pages = write_kv(cache["key"], cache["value"], k, v, slot_mapping)
        return {**cache, "key": k_pages, "value": v_pages}
    if cu_seqlens is None:
        raise ValueError("fp8 GQA pages need cu_seqlens (a row's first token may continue a page: see write_kv_fp8)")
    return write_kv_fp8(cache, k, v, slot_mapping, cu_seqlens)


def write_kv_fp8(
    cache: dict[str, jax.Array],  # key / value: f8e4m3[P, page_size, D]; key_scale / value_scale: f32[P]
    k: jax.Array,  # [T, Hkv, D] float
    v: jax.Array,  # [T, Hkv, D] float
    slot_mapping: jax.Array,  # i32[T, Hkv]; -1 = skip
    cu_seqlens: jax.Array,  # i32[B+1]: row b's tokens are cu[b] .. cu[b+1]-1, at consecutive positions
) -> dict[str, jax.Array]:
    """Quantise and write a step's K/V into fp8 pages, per the module docstring's fill rule; returns the new dict.

    A page a step writes from offset 0 gets the scale of what the step writes to it; a page a row's first
    token continues (offset > 0) keeps its earlier tokens, requantised if its scale grows. That is every page a
    valid plan writes: one row per page, at consecutive offsets. Cost: one gather and one scatter of the ``B x Hkv``
    continued pages, then one scatter of the tokens.
    """
    check_gqa_cache(cache)
    if "key_scale" not in cache:
        raise ValueError(f"write_kv_fp8 needs fp8 pages with scales, got {cache['key'].dtype} pages")
    check_int32("slot_mapping", slot_mapping, rank=2)
    check_float("k", k, shape=(*slot_mapping.shape, cache["key"].shape[2]))
    check_float("v", v, shape=k.shape)
    check_int32("cu_seqlens", cu_seqlens, rank=1)
    k_pages, k_scale = _write_fp8_pages(cache["key"], cache["key_scale"], k, slot_mapping, cu_seqlens)
    v_pages, v_scale = _write_fp8_pages(cache["value"], cache["value_scale"], v, slot_mapping, cu_seqlens)
    return {**cache, "key": k_pages, "value": v_pages, "key_scale": k_scale, "value_scale": v_scale}


def _write_fp8_pages(pages, scale, x, slot_mapping, cu_seqlens):
    """One pool: pages f8[P, ps, D], scale f32[P], x [T, H, D] -> (pages, scale)."""
    num_pages, page_size = pages.shape[:2]
    num_slots = num_pages * page_size
    t = slot_mapping.shape[0]
    ok = (slot_mapping >= 0) & (slot_mapping < num_slots)
    page = jnp.where(ok, slot_mapping // page_size, num_pages)  # i32[T, H]; num_pages = dropped
    x = x.astype(jnp.float32)
    amax = jnp.zeros(num_pages, jnp.float32).at[page].max(jnp.max(jnp.abs(x), axis=-1), mode="drop")
    touched = jnp.zeros(num_pages, bool).at[page].set(True, mode="drop")
    first = jnp.clip(cu_seqlens[:-1], 0, max(t - 1, 0))  # i32[B]: each row's first token
    cslot = slot_mapping[first]  # i32[B, H]
    cont = ((cu_seqlens[1:] > cu_seqlens[:-1])[:, None] & (cslot >= 0) & (cslot < num_slots)
            & (cslot % page_size > 0))  # bool[B, H]: the row continues a page holding earlier tokens
    cpage = jnp.where(cont, cslot // page_size, num_pages)  # i32[B, H]
    kept = jnp.zeros(num_pages, bool).at[cpage].set(True, mode="drop")
    old = jnp.where(kept, scale, 0.0)  # f32[P]: a page started afresh forgets its previous owner's scale
    new = jnp.where(touched, jnp.maximum(old, pow2_scale(amax)), scale)  # f32[P]
    safe = jnp.minimum(cpage, num_pages - 1)
    grown = cont & (old[safe] > 0) & (new[safe] > old[safe])  # bool[B, H]
    ratio = jnp.where(grown, old[safe] / jnp.where(grown, new[safe], 1.0), 1.0)  # power of two <= 1
    blocks = (pages[safe].astype(jnp.float32) * ratio[..., None, None]).astype(pages.dtype)  # f8[B, H, ps, D]
    pages = pages.at[jnp.where(grown, cpage, num_pages)].set(blocks, mode="drop")
    s_tok = new[jnp.minimum(page, num_pages - 1)]  # f32[T, H]
    q = jnp.clip(x / jnp.where(s_tok > 0, s_tok, 1.0)[..., None], -FP8_MAX, FP8_MAX)
    return scatter_tokens(pages, q.astype(pages.dtype), slot_mapping), new


def dequantize_pages(
    pages: jax.Array,  # f8e4m3[P, page_size, D]
    scale: jax.Array,  # f32[P]
) -> jax.Array:  # f32[P, page_size, D]
    """Every page's values ``q * s`` (references and tests; the whole pool)."""
    return pages.astype(jnp.float32) * scale[:, None, None]
