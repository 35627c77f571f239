"""The host tier's copies on the device: packing pages and GDN checkpoints into rows of words, and the jitted
spill (gather) and load (scatter) programs, on one device or on every device of a mesh at once.

A spilled page is one row of unsigned words holding that page of every paged role of every layer bit for bit
(:func:`pack_pages`; ``word`` as wide as the narrowest role's dtype); a checkpoint likewise holds the conv and SSM
state of every GDN layer (:func:`pack_states`). Rows travel in *slabs*: ``chunk`` page rows, or one checkpoint row.

:class:`CopyPrograms` compiles the two programs for a *grid* of ``D x M`` devices (one device: ``1 x 1``; a mesh:
its ``("data", "model")`` shape). Every slab is ``word[D, M, rows, row]``: part ``(d, m)`` lives in the pinned host
memory of device ``(d, m)`` and holds rows of that device's own pages and checkpoint channels, so on a mesh each
device packs and unpacks its local share under ``shard_map`` (:meth:`ShardedModel.local_caches`) and nothing
crosses devices. The index arrays carry the same leading ``[D, M]`` axes (each device's local page ids and slots).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from kvjax.models.interface import ModelCaches
from kvjax.models.sharding import DATA, MODEL, ShardedModel, shard_map
from kvjax.state.registry import host_sharding


_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _word(arrays) -> object:
    """The unsigned word a packed row is made of: as wide as the narrowest dtype among ``arrays`` (a model whose
    roles are all f32 packs u32 words, one per element; an fp8 role makes it bytes)."""
    return _WORDS[min(x.dtype.itemsize for x in arrays)]


def _to_words(x: jax.Array, word) -> jax.Array:
    """``x`` (``[n, ...]``, any numeric dtype at least as wide as ``word``) as words ``word[n, words]``
    (traceable)."""
    return lax.bitcast_convert_type(x, word).reshape(x.shape[0], -1)


def _from_words(b: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """Rows ``b`` (``word[n, words]``) as ``dtype[n, *shape]`` (the inverse of :func:`_to_words`; traceable)."""
    ratio = jnp.dtype(dtype).itemsize // b.dtype.itemsize
    return lax.bitcast_convert_type(b.reshape(b.shape[0], *shape, *((ratio,) if ratio > 1 else ())), dtype)


def _layout(arrays: dict[str, jax.Array], axis: int, word) -> list[tuple[str, tuple[int, ...], object, int]]:
    """``(name, row shape, dtype, words)`` of one row of each array (its index ``axis`` dropped), sorted by name:
    the order rows are packed in."""
    out = []
    for name in sorted(arrays):
        x = arrays[name]
        shape = x.shape[:axis] + x.shape[axis + 1:]
        out.append((name, shape, x.dtype,
                    int(np.prod(shape, dtype=np.int64)) * x.dtype.itemsize // jnp.dtype(word).itemsize))
    return out


def pack_pages(pages: dict[str, jax.Array], idx: jax.Array) -> jax.Array:
    """Device pages ``idx`` (i32[n]) of every paged role ``{name: [P, page_size, ...]}`` as rows ``word[n, row]``
    (each role's bits in name order, :func:`_word`; traceable)."""
    word = _word(pages.values())
    return jnp.concatenate([_to_words(pages[name][idx], word) for name, *_ in _layout(pages, 0, word)], axis=1)


def unpack_pages(pages: dict[str, jax.Array], rows: jax.Array) -> dict[str, jax.Array]:
    """Rows ``word[n, row]`` of :func:`pack_pages` as ``{name: [n, page_size, ...]}`` shaped like ``pages``'."""
    out, at = {}, 0
    for name, shape, dtype, size in _layout(pages, 0, rows.dtype):
        out[name] = _from_words(rows[:, at: at + size], shape, dtype)
        at += size
    return out


def _states(gdn) -> dict[str, jax.Array]:
    return {"conv": gdn.conv, "ssm": gdn.ssm}


def pack_states(gdn, slots: jax.Array) -> jax.Array:
    """GDN slots ``slots`` (i32[c]) of every GDN layer (conv ``[L, S+1, ...]``, ssm ``f32[L, S+1, ...]``) as rows
    ``word[c, row]`` (traceable)."""
    word = _word(_states(gdn).values())
    return jnp.concatenate([_to_words(jnp.moveaxis(x[:, slots], 1, 0), word) for x in (gdn.conv, gdn.ssm)], axis=1)


def unpack_states(gdn, rows: jax.Array) -> dict[str, jax.Array]:
    """Rows ``word[c, row]`` of :func:`pack_states` as ``{"conv", "ssm": [L, c, ...]}``."""
    out, at = {}, 0
    for name, shape, dtype, size in _layout(_states(gdn), 1, rows.dtype):
        out[name] = jnp.moveaxis(_from_words(rows[:, at: at + size], shape, dtype), 0, 1)
        at += size
    return out


def gather(caches: ModelCaches, pages: jax.Array, slots: jax.Array, *, chunk: int) -> tuple[list, list]:
    """Device pages ``pages`` (i32[n * chunk]) packed as ``n`` slabs ``word[chunk, page row]``, and GDN slots
    ``slots`` (i32[c]) as ``c`` slabs ``word[1, checkpoint row]`` (traceable; ``chunk`` static)."""
    n = pages.shape[0] // chunk
    rows = pack_pages(caches.pages, pages) if n else None
    states = pack_states(caches.gdn, slots) if slots.shape[0] else None
    return ([rows[i * chunk: (i + 1) * chunk] for i in range(n)],
            [states[j: j + 1] for j in range(slots.shape[0])])


def scatter(caches: ModelCaches, page_slabs: list, src: jax.Array, dst: jax.Array, state_slabs: list,
            state_src: jax.Array, slots: jax.Array) -> ModelCaches:
    """``caches`` with rows ``src`` (i32[n]: row ``k * chunk + i`` is row ``i`` of ``page_slabs[k]``) of the page
    slabs written to device pages ``dst`` (i32[n]), and checkpoint slabs ``state_src`` (i32[c]: indices into
    ``state_slabs``, one row each) to GDN slots ``slots`` (i32[c]); an out-of-range destination writes nothing
    (traceable)."""
    if page_slabs:
        rows = unpack_pages(caches.pages, jnp.concatenate(page_slabs)[src])
        caches = dataclasses.replace(caches, pages={name: x.at[dst].set(rows[name], mode="drop")
                                                    for name, x in caches.pages.items()})
    if state_slabs:
        pool = caches.gdn
        new = unpack_states(pool, jnp.concatenate(state_slabs)[state_src])
        caches = dataclasses.replace(caches, gdn=dataclasses.replace(
            pool, conv=pool.conv.at[:, slots].set(new["conv"], mode="drop"),
            ssm=pool.ssm.at[:, slots].set(new["ssm"], mode="drop")))
    return caches


class CopyPrograms:
    """The jitted spill and load of a grid of devices (see the module docstring): ``sharded`` (a mesh's
    :class:`ShardedModel`) or ``device`` (one device; default the first local one). ``traced`` is called at each
    trace (the store counts compilations).

    - :meth:`gather` ``(caches, rows i32[D, M, n * chunk], slots i32[D, M, c], chunk)`` -> ``(n page slabs
      word[D, M, chunk, row], c checkpoint slabs word[D, M, 1, row])`` in ``pinned_host`` memory: each device packs
      its local pages ``rows[d, m]`` and GDN slots ``slots[d, m]``.
    - :meth:`load` ``(caches, page_slabs, src i32[D, M, N], dst i32[D, M, N], state_slabs, state_src i32[D, M, C],
      slots i32[D, M, C])`` -> caches (donated): the slabs move host -> device inside the program and each device
      writes rows ``src[d, m]`` of its parts of the page slabs (concatenated) to its local pages ``dst[d, m]``, and
      checkpoint slabs ``state_src[d, m]`` to its slots ``slots[d, m]``; out-of-range destinations write nothing.
    """

    def __init__(self, traced, *, sharded: ShardedModel | None = None, device: jax.Device | None = None) -> None:
        self.sharded = sharded
        if sharded is None:
            device = device or jax.local_devices()[0]
            self.host = host_sharding(device)  # ValueError where the platform has no pinned_host memory
            self.device = SingleDeviceSharding(device, memory_kind="device")
            self.grid = (1, 1)
        else:
            host_sharding(sharded.mesh.devices.flat[0])  # the same check
            self.host = NamedSharding(sharded.mesh, P(DATA, MODEL), memory_kind="pinned_host")
            self.device = NamedSharding(sharded.mesh, P(DATA, MODEL), memory_kind="device")
            self.grid = (sharded.data_size, sharded.model_size)

        def spill(caches, rows, slots, chunk):
            traced()
            grid = P(DATA, MODEL)
            out_specs = ([grid] * (rows.shape[-1] // chunk), [grid] * slots.shape[-1])
            return self._per_device(functools.partial(gather, chunk=chunk), caches, (rows, slots), out_specs)

        def load(caches, page_slabs, src, dst, state_slabs, state_src, slots):
            traced()
            page_slabs, state_slabs = jax.device_put((page_slabs, state_slabs), self.device)
            return self._per_device(scatter, caches, (page_slabs, src, dst, state_slabs, state_src, slots), None)

        self.gather = jax.jit(spill, static_argnums=(3,), out_shardings=self.host)
        self.load = jax.jit(load, donate_argnums=(0,))

    def on_device(self, tree):
        """``tree`` committed to the device memory of the grid (no copy where it already is); on one device, so
        that a jitted step sees the same argument placement whether or not a copy wrote the caches."""
        return tree if self.sharded is not None else jax.device_put(tree, self.device)

    def _per_device(self, fn, caches: ModelCaches, args: tuple, out_specs):
        """``fn(local caches, *local args)`` on every device of the grid: the leading ``[1, 1]`` of each grid
        argument (and of each returned slab) stripped / restored; on a mesh under ``shard_map`` (``out_specs``: the
        slabs' specs, ``None``: ``fn`` returns caches)."""
        sharded = self.sharded
        if sharded is None:
            return _regrid(fn(caches, *_ungrid(args)))

        def local(caches, *args):
            out = fn(sharded.local_caches(caches), *_ungrid(args))
            return sharded.global_caches(out) if out_specs is None else _regrid(out)

        specs = sharded.cache_specs(caches)
        in_specs = (specs, *(jax.tree.map(lambda _: P(DATA, MODEL), a) for a in args))
        return shard_map(local, sharded.mesh, in_specs, specs if out_specs is None else out_specs)(caches, *args)


def _ungrid(tree):
    """One device's block of grid arrays: the leading ``[1, 1]`` dropped (traceable)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[2:]), tree)


def _regrid(tree):
    """Arrays (not caches) with a leading ``[1, 1]``: one device's block of the grid (traceable)."""
    if isinstance(tree, ModelCaches):
        return tree
    return jax.tree.map(lambda x: x.reshape((1, 1) + x.shape), tree)
