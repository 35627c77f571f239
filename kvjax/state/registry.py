"""Cache layouts per attention kind, cache creation, deterministic naming and order, host (offload) copies.

Each attention kind owns its cache layout (DESIGN.md, "DSA"): a spec declares ``layout(num_pages) ->
{role: ShapeDtypeStruct}`` and :func:`create_kv_cache` builds ``dict[role, array]`` from it. The controller
:func:`create_caches` only names and orders: caches are ordered by ``(layer, role priority)`` whatever order
the specs come in, and named ``<role>_caches_<layer>``.

- :class:`GQACacheSpec`: roles ``key``, ``value``, each ``[P, page_size, head_dim]`` single-head pages shared
  by the layer's KV heads; with ``dtype=float8_e4m3fn`` also ``key_scale``, ``value_scale`` ``f32[P]``, one scale
  per page (:mod:`kvjax.state.kv_fp8`);
- :class:`MLACacheSpec`: role ``key`` ``[P, page_size, kv_lora_rank + rope_dim]``;
- :class:`DSACacheSpec`: roles ``key``, ``key_scale``, ``key_rope``, ``indexer``, ``indexer_scale`` (see
  :mod:`kvjax.state.dsa_cache`).

Role priority (the order within a layer) is :data:`ROLE_PRIORITY`.

Host copies (:func:`create_host_caches`, :func:`copy_caches`) live in the device's ``pinned_host`` memory
where the platform exposes it (checked here: jax 0.10.2 CPU; CUDA backends normally expose it too) and raise
``ValueError`` naming the platform and its memory kinds where it does not.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Union

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from kvjax.state.dsa_cache import FP8_DTYPE

ROLE_PRIORITY = ("key", "value", "key_scale", "value_scale", "key_rope", "indexer", "indexer_scale")
HOST_MEMORY_KIND = "pinned_host"


def _positive_int(spec: object, name: str) -> None:
    value = getattr(spec, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{type(spec).__name__}.{name} must be an int >= 1, got {value!r}")


def _layer(spec: object) -> None:
    value = spec.layer
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{type(spec).__name__}.layer must be an int >= 0, got {value!r}")


def _float_dtype(spec: object, name: str) -> None:
    """Field ``name`` must name a floating dtype (fp8 included)."""
    value = getattr(spec, name)
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{type(spec).__name__}.{name} must be a floating dtype (e.g. jnp.bfloat16), got {value!r}")


@dataclasses.dataclass(frozen=True)
class GQACacheSpec:
    """GQA/MHA layer: single-head K and V page pools (all KV heads of the layer draw from one pool).

    ``dtype=jnp.float8_e4m3fn`` (:data:`FP8_DTYPE`) makes block-wise fp8 pages: roles ``key`` / ``value`` f8e4m3
    ``[P, page_size, D]`` plus ``key_scale`` / ``value_scale`` ``f32[P]``. A page belongs to one KV head of one
    sequence (single-head pages), so one scale per page *is* one scale per (page, KV head): the block is the
    page's ``page_size x D`` values of one head. Other fp8 formats are refused.
    """

    layer: int  # layer index (cache names and order)
    num_kv_heads: int  # Hkv: rows per sequence in the head-wise block table (not part of the pool shape)
    page_size: int  # tokens per page
    head_dim: int  # D
    dtype: jnp.dtype = jnp.bfloat16  # page dtype (float8_e4m3fn: quantised pages with per-page scales)

    kind = "gqa"

    def __post_init__(self) -> None:
        _layer(self)
        for name in ("num_kv_heads", "page_size", "head_dim"):
            _positive_int(self, name)
        _float_dtype(self, "dtype")
        dtype = jnp.dtype(self.dtype)
        if dtype.itemsize == 1 and dtype != jnp.dtype(FP8_DTYPE):
            raise ValueError(f"GQACacheSpec.dtype: fp8 pages are {jnp.dtype(FP8_DTYPE).name} (with per-page "
                             f"scales), got {dtype.name}")

    @property
    def fp8(self) -> bool:
        """Whether the pages are fp8 with per-page scales (roles ``key_scale`` / ``value_scale``)."""
        return jnp.dtype(self.dtype) == jnp.dtype(FP8_DTYPE)

    def layout(self, num_pages: int) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (num_pages, self.page_size, self.head_dim)
        out = {"key": jax.ShapeDtypeStruct(shape, self.dtype), "value": jax.ShapeDtypeStruct(shape, self.dtype)}
        if self.fp8:
            out.update(key_scale=jax.ShapeDtypeStruct((num_pages,), jnp.float32),
                       value_scale=jax.ShapeDtypeStruct((num_pages,), jnp.float32))
        return out


@dataclasses.dataclass(frozen=True)
class MLACacheSpec:
    """MLA layer: one latent head ``[kv_c ‖ k_pe]`` per token."""

    layer: int
    page_size: int
    kv_lora_rank: int = 512  # R
    rope_dim: int = 64  # r
    dtype: jnp.dtype = jnp.bfloat16

    kind = "mla"

    def __post_init__(self) -> None:
        _layer(self)
        for name in ("page_size", "kv_lora_rank", "rope_dim"):
            _positive_int(self, name)
        _float_dtype(self, "dtype")

    def layout(self, num_pages: int) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (num_pages, self.page_size, self.kv_lora_rank + self.rope_dim)
        return {"key": jax.ShapeDtypeStruct(shape, self.dtype)}


@dataclasses.dataclass(frozen=True)
class DSACacheSpec:
    """DSA layer: fp8 latent + f32 block scales + bf16 rope (``key`` roles) and fp8 indexer key + scale."""

    layer: int
    page_size: int
    kv_lora_rank: int = 512  # R
    rope_dim: int = 64  # r
    index_head_dim: int = 128  # Di
    quant_block: int = 128  # values per f32 scale
    rope_dtype: jnp.dtype = jnp.bfloat16

    kind = "dsa"

    def __post_init__(self) -> None:
        _layer(self)
        for name in ("page_size", "kv_lora_rank", "rope_dim", "index_head_dim", "quant_block"):
            _positive_int(self, name)
        _float_dtype(self, "rope_dtype")
        for name in ("kv_lora_rank", "index_head_dim"):
            if getattr(self, name) % self.quant_block:
                raise ValueError(
                    f"DSACacheSpec.{name}={getattr(self, name)} must be a multiple of quant_block={self.quant_block}"
                )

    def layout(self, num_pages: int) -> dict[str, jax.ShapeDtypeStruct]:
        p, ps, blk = num_pages, self.page_size, self.quant_block
        sds = jax.ShapeDtypeStruct
        return {
            "key": sds((p, ps, self.kv_lora_rank), FP8_DTYPE),
            "key_scale": sds((p, ps, self.kv_lora_rank // blk), jnp.float32),
            "key_rope": sds((p, ps, self.rope_dim), self.rope_dtype),
            "indexer": sds((p, ps, self.index_head_dim), FP8_DTYPE),
            "indexer_scale": sds((p, ps, self.index_head_dim // blk), jnp.float32),
        }


CacheSpec = Union[GQACacheSpec, MLACacheSpec, DSACacheSpec]
_SPEC_TYPES = (GQACacheSpec, MLACacheSpec, DSACacheSpec)


def _check_num_pages(num_pages: int) -> None:
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")


def cache_layout(spec: CacheSpec, num_pages: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The spec's ``{role: ShapeDtypeStruct}`` in role-priority order (allocates nothing)."""
    if not isinstance(spec, _SPEC_TYPES):
        raise ValueError(f"unknown cache spec {spec!r}; expected one of {[t.__name__ for t in _SPEC_TYPES]}")
    _check_num_pages(num_pages)
    layout = spec.layout(num_pages)
    unknown = set(layout) - set(ROLE_PRIORITY)
    if unknown:
        raise ValueError(f"{type(spec).__name__} declares roles {sorted(unknown)} missing from ROLE_PRIORITY")
    return {role: layout[role] for role in ROLE_PRIORITY if role in layout}


def create_kv_cache(spec: CacheSpec, num_pages: int, *, sharding=None) -> dict[str, jax.Array]:
    """Zero-filled cache of one layer: ``dict[role, array]`` in role-priority order.

    ``sharding``: optional ``jax.sharding.Sharding`` the arrays are created with (e.g. a host memory kind).
    """
    make = jax.jit(jnp.zeros, static_argnums=(0, 1), out_shardings=sharding)  # created in place, no copy
    return {role: make(sds.shape, sds.dtype) for role, sds in cache_layout(spec, num_pages).items()}


def cache_name(role: str, layer: int) -> str:
    """``<role>_caches_<layer>``, e.g. ``key_caches_3``."""
    return f"{role}_caches_{layer}"


def _ordered(specs: Iterable[CacheSpec]) -> list[CacheSpec]:
    specs = list(specs)
    layers = [s.layer for s in specs if isinstance(s, _SPEC_TYPES)]
    dupes = sorted({l for l in layers if layers.count(l) > 1})
    if dupes:
        raise ValueError(f"several cache specs for layer(s) {dupes}; one spec per layer")
    return sorted(specs, key=lambda s: getattr(s, "layer", -1))


def cache_names(specs: Iterable[CacheSpec], num_pages: int = 1) -> list[str]:
    """Names of :func:`create_caches`' arrays in their order (layer, then role priority)."""
    return [cache_name(role, s.layer) for s in _ordered(specs) for role in cache_layout(s, num_pages)]


def create_caches(specs: Iterable[CacheSpec], num_pages: int, *, sharding=None) -> dict[str, jax.Array]:
    """Create every layer's cache; returns ``{<role>_caches_<layer>: array}`` ordered by (layer, role priority).

    The order depends only on the specs' layers and roles, never on the order they are given in.
    """
    out = {}
    for spec in _ordered(specs):
        for role, array in create_kv_cache(spec, num_pages, sharding=sharding).items():
            out[cache_name(role, spec.layer)] = array
    return out


def host_sharding(device: jax.Device | None = None, memory_kind: str = HOST_MEMORY_KIND) -> SingleDeviceSharding:
    """Sharding that places arrays in ``memory_kind`` of ``device``; ``ValueError`` where the platform lacks it."""
    device = device or jax.local_devices()[0]
    kinds = sorted(m.kind for m in device.addressable_memories())
    if memory_kind not in kinds:
        raise ValueError(
            f"host (offload) caches need memory kind {memory_kind!r}, which platform {device.platform!r} "
            f"({device.device_kind}) does not expose; its memory kinds are {kinds}"
        )
    return SingleDeviceSharding(device, memory_kind=memory_kind)


def create_host_caches(
    specs: Iterable[CacheSpec],
    num_pages: int,
    *,
    device: jax.Device | None = None,
    memory_kind: str = HOST_MEMORY_KIND,
) -> dict[str, jax.Array]:
    """:func:`create_caches` in host memory (default ``pinned_host``) for offloading pages.

    Raises ``ValueError`` naming the platform and its memory kinds where ``memory_kind`` is unavailable.
    """
    return create_caches(specs, num_pages, sharding=host_sharding(device, memory_kind))


def copy_caches(caches: dict[str, jax.Array], *, memory_kind: str, device: jax.Device | None = None) -> dict:
    """Copy every array of ``caches`` to ``memory_kind`` (``"pinned_host"`` to offload, ``"device"`` back)."""
    sharding = host_sharding(device, memory_kind)
    return {name: jax.device_put(array, sharding) for name, array in caches.items()}
