"""The device side of the prefix cache's host tier: spilled blocks in pinned host memory, and the jitted copies.

The scheduler's prefix cache (:mod:`kvjax.sched.prefix_cache`, :mod:`kvjax.sched.host_tier`) decides what moves
and logs it as :class:`~kvjax.sched.host_tier.CopyOp` groups with host ids; :class:`HostStore` executes a plan's
log before the engine dispatches the plan's step, in log order up to :func:`coalesce` (the same copies in fewer
groups: every page and checkpoint slot still read and written in log order). The host data is held in *slabs*:
arrays of unsigned words ``word[rows, row]`` in ``pinned_host`` memory, one row per page (the page of every paged
role of every layer, each role's bits laid end to end: :func:`pack_pages`; ``word`` as wide as the narrowest role's
dtype) or per GDN checkpoint (every GDN layer's conv and SSM state: :func:`pack_states`). Packing makes a copy's cost in
host calls independent of the model's layer and role count: a spill makes one array per ``chunk`` pages (one per
checkpoint), a load moves one array per slab it reads.

- ``out`` (spill): the named device pages and checkpoint slots are gathered, packed and placed in ``pinned_host``
  memory (``out_shardings``) by a jitted call per power of two in the binary form of the spill's slab counts (a
  spill of 13 page slabs: calls of 8, 4 and 1; the checkpoints ride along), so each count compiles once and only
  the last page slab of a spill is padded (its missing rows gather page 0).
- ``in`` (load): one jitted call with the caches donated takes every slab the load reads (``pinned_host``
  arguments), moves them to the device inside its program, unpacks the named rows and writes them into their device
  pages and checkpoint slots (slab counts padded to powers of two by repeating a slab, destinations padded out of
  range: dropped).
- ``drop``: host ids forgotten; a slab no id maps to any more is released.

The bookkeeping is numpy: host id -> (slab, row) in one array indexed by id (ids are never reused), live rows per
slab; no per-page Python loop. Nothing waits for the device: the spill's bytes land in host memory whenever the
device gets there, and nothing reads them on the host.

Ordering and overlap. Every copy takes the caches the previous dispatch returned and the step takes what the
copies return, so on the device the copies run after the step in flight (step N) and before the step that needs
them (N + 1): a spill reads a page before anything reuses it, a load lands before the step reads it. The engine
plans and issues step N + 1 -- its copies included -- before it waits for step N. On the device's critical path:
the gather / scatter of the pages concerned with the transfers inside their programs (a spill's device -> host, a
load's host -> device); on the host's, the time spent issuing the copies (the engine's ``t_copy``). The load's
transfer was a separate batched ``jax.device_put`` that overlapped step N until HISTORY run 128 (H200, the
multi-turn host-tier workload): inside the scatter's program the host issues one call where it issued two, and the
copy issue fell from 12.1% to 9.2% of the step, tok/s 1.07x, the same tokens.

One device only (a mesh engine refuses a host tier).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import SingleDeviceSharding

from kvjax.engine.sizing import cache_bytes_model
from kvjax.models.interface import CausalLM, ModelCaches
from kvjax.sched.host_tier import CopyOp
from kvjax.sched.prefix_cache import PrefixCacheConfig
from kvjax.state.registry import host_sharding


def host_tier_config(prefix: PrefixCacheConfig | None, host_cache_bytes: int, model: CausalLM, *, page_size: int,
                     dtype, cache_options: dict | None, mesh) -> PrefixCacheConfig | None:
    """``prefix`` with a host tier of ``host_cache_bytes`` (checked by ``EngineOptions``; 0: unchanged), its page
    and checkpoint bytes read from ``model``'s caches. ``ValueError`` (nothing built yet) for a host tier on a
    mesh, or one too small for a page."""
    if not host_cache_bytes or prefix is None:
        return prefix
    if mesh is not None:
        raise ValueError("host_cache_bytes: the host tier runs on one device, not on a mesh (yet)")
    page_bytes, slot_bytes, _ = cache_bytes_model(model, page_size=page_size, dtype=dtype,
                                                  cache_options=cache_options)
    if host_cache_bytes < page_bytes:
        raise ValueError(f"host_cache_bytes={host_cache_bytes} holds no page ({page_bytes} bytes over every layer)")
    return dataclasses.replace(prefix, host_bytes=int(host_cache_bytes), page_bytes=page_bytes,
                               ckpt_bytes=slot_bytes if prefix.gdn else 0)



def coalesce(ops: Sequence[CopyOp]) -> list[CopyOp]:
    """The copies of ``ops`` (a log, in order) in fewer groups, each device page and checkpoint slot read and written
    in the same order: a spill joins the last spill before it when the loads in between write none of the pages and
    slots it reads; adjacent loads join when they write distinct pages and slots; drops (they read no device data,
    and no later copy reads a dropped id) go last, in one group. A scheduler's log alternates spills and loads
    (each admission's allocation spills, then its attach loads), so this saves most of the host calls."""
    out: list[CopyOp] = []
    drops: list[CopyOp] = []
    for op in ops:
        if op.kind == "drop":
            drops.append(op)
            continue
        if op.kind == "in":
            if out and out[-1].kind == "in" and _disjoint(out[-1], op):
                out[-1] = _join(out[-1], op)
            else:
                out.append(op)
            continue
        i = len(out)
        while i and out[i - 1].kind == "in" and _disjoint(out[i - 1], op):
            i -= 1
        if i and out[i - 1].kind == "out":
            out[i - 1] = _join(out[i - 1], op)
        else:
            out.append(op)
    if drops:
        out.append(functools.reduce(_join, drops))
    return out


def _slab_bytes(pages: list, states: list) -> int:
    """Bytes of a copy's page slabs and checkpoint slabs (every page slab has one shape, every checkpoint slab
    another: one size read per kind)."""
    return (len(pages) * pages[0].nbytes if pages else 0) + (len(states) * states[0].nbytes if states else 0)


def _disjoint(a: CopyOp, b: CopyOp) -> bool:
    """No device page or checkpoint slot of ``a`` is one of ``b``'s (Python sets: a group names tens of pages,
    where ``np.isin``'s sort costs more than the lookups)."""
    return all(not (len(x) and len(y)) or set(x.tolist()).isdisjoint(y.tolist())
               for x, y in ((a.pages_dev, b.pages_dev), (a.ckpts_dev, b.ckpts_dev)))


def _join(a: CopyOp, b: CopyOp) -> CopyOp:
    """One group of ``a``'s copies then ``b``'s (of one kind)."""
    return CopyOp(a.kind, *(np.concatenate([getattr(a, f), getattr(b, f)])
                            for f in ("pages_dev", "pages_host", "ckpts_dev", "ckpts_host")))


def _bucket(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _powers(n: int) -> list[int]:
    """The powers of two of ``n``'s binary form, largest first (13 -> [8, 4, 1])."""
    return [1 << b for b in reversed(range(int(n).bit_length())) if n >> b & 1]


def _pad(x, n: int, value: int) -> np.ndarray:
    out = np.full(n, value, np.int32)
    out[: len(x)] = x
    return out


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


def gather(caches: ModelCaches, pages: jax.Array, slots: jax.Array, chunk: int) -> tuple[list, list]:
    """Device pages ``pages`` (i32[n * chunk]) packed as ``n`` slabs ``word[chunk, page row]``, and GDN slots
    ``slots`` (i32[c]) as ``c`` slabs ``word[1, checkpoint row]`` (traceable; ``chunk`` static)."""
    n = pages.shape[0] // chunk
    rows = pack_pages(caches.pages, pages) if n else None
    states = pack_states(caches.gdn, slots) if slots.shape[0] else None
    return ([rows[i * chunk: (i + 1) * chunk] for i in range(n)],
            [states[j: j + 1] for j in range(slots.shape[0])])


def scatter(caches: ModelCaches, page_slabs: list, src: jax.Array, dst: jax.Array, state_slabs: list,
            slots: jax.Array) -> ModelCaches:
    """``caches`` with rows ``src`` (i32[n]: row ``k * chunk + i`` is row ``i`` of ``page_slabs[k]``) of the page
    slabs written to device pages ``dst`` (i32[n]), and the checkpoint slabs (one row each) to GDN slots
    ``slots`` (i32[len(state_slabs)]); an out-of-range destination writes nothing (traceable)."""
    if page_slabs:
        rows = unpack_pages(caches.pages, jnp.concatenate(page_slabs)[src])
        caches = dataclasses.replace(caches, pages={name: x.at[dst].set(rows[name], mode="drop")
                                                    for name, x in caches.pages.items()})
    if state_slabs:
        pool = caches.gdn
        new = unpack_states(pool, jnp.concatenate(state_slabs))
        caches = dataclasses.replace(caches, gdn=dataclasses.replace(
            pool, conv=pool.conv.at[:, slots].set(new["conv"], mode="drop"),
            ssm=pool.ssm.at[:, slots].set(new["ssm"], mode="drop")))
    return caches


@dataclasses.dataclass
class CopyStats:
    """What a :class:`HostStore` moved (cumulative): bytes each way (slab padding included: a load moves every
    slab it reads whole), pages and checkpoints each way, host calls issued (jitted copies and batched
    transfers), and ``t_sync``: seconds of copies waited for to the end (:attr:`HostStore.sync`)."""

    bytes_out: int = 0
    bytes_in: int = 0
    pages_out: int = 0
    pages_in: int = 0
    ckpts_out: int = 0
    ckpts_in: int = 0
    calls: int = 0
    t_sync: float = 0.0


class HostStore:
    """Spilled prefix-cache blocks in ``pinned_host`` memory of ``device`` and the copies between tiers (see the
    module docstring). :meth:`apply` executes a plan's copy log on the caches; :attr:`stats` counts what moved;
    :attr:`bytes_held` is the host memory the slabs hold. ``chunk``: pages per slab (a power of two; a spill packs
    its pages in slabs of this many, a load moves every slab it reads whole). ``sync = True`` (a measurement, not
    for serving): each :meth:`apply` first waits for the device, then for its own copies, and adds that time to
    ``stats.t_sync``."""

    def __init__(self, device: jax.Device | None = None, chunk: int = 16) -> None:
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"HostStore.chunk must be a power of two >= 1, got {chunk!r}")
        device = device or jax.local_devices()[0]
        self._host = host_sharding(device)  # ValueError where the platform has no pinned_host memory
        self._device = SingleDeviceSharding(device, memory_kind="device")
        self.chunk = chunk
        self.traces = 0  # compilations of the copies (each jitted function traces once per shape)
        self._gather = jax.jit(self._counted(gather), static_argnums=(3,), out_shardings=self._host)
        dev = self._device

        def load(caches, page_slabs, src, dst, state_slabs, slots):  # the host -> device transfer inside the program
            return scatter(caches, jax.device_put(page_slabs, dev), src, dst, jax.device_put(state_slabs, dev), slots)

        self._scatter = jax.jit(self._counted(load), donate_argnums=(0,))
        self.slabs: dict[int, jax.Array] = {}  # slab id -> word[rows, row] in pinned_host memory
        self.live: dict[int, int] = {}  # slab id -> host ids mapping into it
        self._loc = np.full((0, 2), -1, np.int64)  # i64[ids, 2]: host id -> (slab, row); -1: not held
        self._next = 0
        self.stats = CopyStats()
        self.sync = False

    def on_device(self, caches: ModelCaches) -> ModelCaches:
        """``caches`` committed to the device (no copy): the copies' outputs are (their inputs include committed
        slabs), and a jitted step compiles again for committed arguments after uncommitted ones."""
        return jax.device_put(caches, self._device)

    def _counted(self, fn):
        def traced(*args):
            self.traces += 1
            return fn(*args)
        return traced

    @property
    def bytes_held(self) -> int:
        return sum(x.nbytes for x in self.slabs.values())

    def held(self) -> np.ndarray:
        """``i64[k]``: the host ids this store holds data for."""
        return np.nonzero(self._loc[:, 0] >= 0)[0]

    def apply(self, caches: ModelCaches, ops: Sequence[CopyOp],
              probe: Callable[[], None] | None = None) -> ModelCaches:
        """Execute ``ops`` (a plan's copy log, in order) and return the caches to dispatch the plan's step with
        (``caches`` is donated when a load writes it; use only the returned ones). ``probe`` is called after each
        group of copies is issued (the engine looks there whether the device has gone idle)."""
        if self.sync and ops:
            jax.block_until_ready(caches)
            t0 = time.perf_counter()
            caches = self._apply(caches, ops, probe)
            jax.block_until_ready((caches, list(self.slabs.values())))
            self.stats.t_sync += time.perf_counter() - t0
            return caches
        return self._apply(caches, ops, probe)

    def _apply(self, caches: ModelCaches, ops: Sequence[CopyOp], probe: Callable[[], None] | None) -> ModelCaches:
        for op in coalesce(ops):
            if op.kind == "out":
                self._out(caches, op)
            elif op.kind == "in":
                caches = self._in(caches, op)
            else:
                self._release(np.concatenate([op.pages_host, op.ckpts_host]))
            if probe is not None:
                probe()
        return caches

    def _place(self, ids: np.ndarray, rows_per_slab: int) -> np.ndarray:
        """Map host ids ``ids`` (i64[k]) to fresh slabs of ``rows_per_slab`` rows, in order; returns the slab ids."""
        k = len(ids)
        if not k:
            return np.zeros(0, np.int64)
        n = -(-k // rows_per_slab)
        top = int(ids.max()) + 1
        if top > len(self._loc):
            grown = np.full((max(top, 2 * len(self._loc)), 2), -1, np.int64)
            grown[: len(self._loc)] = self._loc
            self._loc = grown
        slab, row = np.divmod(np.arange(k), rows_per_slab)
        self._loc[ids, 0], self._loc[ids, 1] = slab + self._next, row
        self.live.update(zip(range(self._next, self._next + n),
                             [rows_per_slab] * (n - 1) + [k - (n - 1) * rows_per_slab]))
        self._next += n
        return np.arange(self._next - n, self._next)

    def _out(self, caches: ModelCaches, op: CopyOp) -> None:
        c = self.chunk
        n = -(-op.num_pages // c)
        page_slabs, state_slabs = self._place(op.pages_host, c), self._place(op.ckpts_host, 1)
        rows = _pad(op.pages_dev, n * c, 0)  # the last slab's missing rows gather page 0
        slots = op.ckpts_dev.astype(np.int32)
        pages: list = []
        states: list = []
        calls_p, calls_c = _powers(n), _powers(op.num_ckpts)
        at_p = at_c = 0
        for i in range(max(len(calls_p), len(calls_c))):  # one call per power of two of each count
            k = calls_p[i] if i < len(calls_p) else 0
            m = calls_c[i] if i < len(calls_c) else 0
            p, s = self._gather(caches, rows[at_p * c: (at_p + k) * c], slots[at_c: at_c + m], c)
            pages += p
            states += s
            at_p, at_c = at_p + k, at_c + m
            self.stats.calls += 1
        self.slabs.update(zip([*page_slabs.tolist(), *state_slabs.tolist()], pages + states))
        self.stats.bytes_out += _slab_bytes(pages, states)
        self.stats.pages_out += op.num_pages
        self.stats.ckpts_out += op.num_ckpts

    def _in(self, caches: ModelCaches, op: CopyOp) -> ModelCaches:
        loc, cloc = self._loc[op.pages_host], self._loc[op.ckpts_host]
        if (loc[:, 0] < 0).any() or (cloc[:, 0] < 0).any():
            raise AssertionError("host tier: a load reads a host id this store does not hold")
        ids, inv = np.unique(loc[:, 0], return_inverse=True)  # the page slabs the load reads
        src = inv.reshape(-1) * self.chunk + loc[:, 1]
        moved = [self.slabs[s] for s in ids.tolist()] + [self.slabs[s] for s in cloc[:, 0].tolist()]  # pinned_host
        pages, states = moved[: len(ids)], moved[len(ids):]
        self.stats.bytes_in += _slab_bytes(pages, states)
        # counts padded to powers of two (repeating a slab) so the scatter compiles a few times; padding writes
        # nowhere (destinations out of range)
        n, m = (_bucket(len(pages)) if pages else 0), (_bucket(len(states)) if states else 0)
        num_pages = next(iter(caches.pages.values())).shape[0]
        num_slots = caches.gdn.ssm.shape[1] if caches.gdn is not None else 0
        caches = self._scatter(caches, pages + pages[:1] * (n - len(pages)), _pad(src, n * self.chunk, 0),
                               _pad(op.pages_dev, n * self.chunk, num_pages), states + states[:1] * (m - len(states)),
                               _pad(op.ckpts_dev, m, num_slots))
        self.stats.calls += 1
        self._release(np.concatenate([op.pages_host, op.ckpts_host]))
        self.stats.pages_in += op.num_pages
        self.stats.ckpts_in += op.num_ckpts
        return caches

    def _release(self, ids: np.ndarray) -> None:
        """Forget host ids ``ids`` (i64[k]); release the slabs no id maps to any more."""
        if not len(ids):
            return
        slabs, counts = np.unique(self._loc[ids, 0], return_counts=True)
        if (slabs < 0).any():
            raise AssertionError("host tier: releasing a host id this store does not hold")
        self._loc[ids] = -1
        for s, k in zip(slabs.tolist(), counts.tolist()):
            self.live[s] -= k
            if self.live[s] <= 0:
                del self.live[s], self.slabs[s]
