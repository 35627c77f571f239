"""The device side of the prefix cache's host tier: spilled blocks in pinned host memory, and the jitted copies.

The scheduler's prefix cache (:mod:`kvjax.sched.prefix_cache`, :mod:`kvjax.sched.host_tier`) decides what moves
and logs it as :class:`~kvjax.sched.host_tier.CopyOp` groups with host ids; :class:`HostStore` executes a plan's
log before the engine dispatches the plan's step. The host data is held in *slabs*: arrays of unsigned words
``word[rows, row]`` in ``pinned_host`` memory, one row per page (the page of every paged role of every layer, each
role's bits laid end to end: :func:`pack_pages`; ``word`` as wide as the narrowest role's dtype) or per GDN
checkpoint (every GDN layer's conv and SSM state: :func:`pack_states`), ``chunk`` page rows to a slab, one
checkpoint to a slab. Packing makes a copy's cost independent of the model's layer and role count.

A whole log costs the host at most two calls: one batched ``jax.device_put`` of every held slab its loads read,
and one jitted :func:`copy_program` with the caches donated that gathers every spilled page and checkpoint (its
outputs placed in ``pinned_host`` memory by ``out_shardings``: the log's spilled pages packed ``chunk`` to a slab,
one slab per checkpoint) and scatters every loaded row into its device page or checkpoint slot. The host resolves
the log's order first (numpy, :meth:`HostStore._plan`): each spilled and loaded row gets its source, a device page
/ slot as it was before the log or a row of a loaded slab -- a spill of a page that an earlier load of the log
wrote copies that load's source, a load of a copy that the log spilled reads the spill's row, a page two loads
write keeps the last one's -- so the program gathers from its input caches, then scatters into them, and the
result equals executing the log copy by copy. The loads read their rows from a table that holds the spilled rows,
so every write of a cache array depends on every read of it and XLA updates the donated buffers in place. Counts
are padded to powers of two so a few shapes compile: spilled slabs and checkpoints (the padding outputs cross to
the host too and are dropped), loaded slabs (repeating a slab) and loaded rows (destinations out of range:
dropped). ``drop``: host ids forgotten; a slab no id maps to any more is released.

The bookkeeping is numpy: host id -> (slab, row) in one array indexed by id (ids are never reused), live rows per
slab; no per-page Python loop. Nothing waits for the device: the spill's bytes land in host memory whenever the
device gets there, and nothing reads them on the host.

Ordering and overlap. The copy program takes the caches the previous dispatch returned and the step takes what
it returns, so on the device the copies run after the step in flight (step N) and before the step that needs
them (N + 1): a spill reads a page before anything reuses it, a load lands before the step reads it. A load's
host -> device transfer is an asynchronous DMA issued while step N (which does not need it) still runs, because
the engine plans and issues step N + 1 -- its copies included -- before it waits for step N. What stays on the
device's critical path is the gather / scatter of the pages concerned and the spill's device -> host transfer
(inside the program); on the host's, the time spent resolving and issuing the copies (the engine's ``t_copy``).

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



def _bucket(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


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


def pack_states(states: dict[str, jax.Array], slots: jax.Array) -> jax.Array:
    """GDN slots ``slots`` (i32[c]) of every GDN layer (``{"conv": [L, S+1, ...], "ssm": f32[L, S+1, ...]}``) as rows
    ``word[c, row]`` (traceable)."""
    word = _word(states.values())
    return jnp.concatenate([_to_words(jnp.moveaxis(states[name][:, slots], 1, 0), word)
                            for name, *_ in _layout(states, 1, word)], axis=1)


def unpack_states(states: dict[str, jax.Array], rows: jax.Array) -> dict[str, jax.Array]:
    """Rows ``word[c, row]`` of :func:`pack_states` as ``{"conv", "ssm": [L, c, ...]}``."""
    out, at = {}, 0
    for name, shape, dtype, size in _layout(states, 1, rows.dtype):
        out[name] = jnp.moveaxis(_from_words(rows[:, at: at + size], shape, dtype), 0, 1)
        at += size
    return out


DEVICE, HELD, BOTH = 1, 2, 3  # where spilled rows come from: the caches before the log, loaded slabs, either


def _spilled(pack: Callable[[jax.Array], jax.Array], loaded: jax.Array | None, code: jax.Array, base: int,
             source: int) -> jax.Array:
    """The rows a spill copies, by source code ``code`` (i32[r]): ``code < base``: device page / slot ``code`` of the
    caches as they were before the log (packed by ``pack``); ``code >= base``: row ``code - base`` of the loaded
    slabs ``loaded`` (``word[l, row]``: a page an earlier load of the log wrote). ``source`` (static): which kinds
    ``code`` holds (traceable)."""
    if source & DEVICE:  # one row gathered as two: XLA copies the whole caches for a one-row gather it then writes
        safe = jnp.clip(code, 0, base - 1)
        dev = pack(jnp.concatenate([safe, safe]))[:1] if code.shape[0] == 1 else pack(safe)
        if source == DEVICE:
            return dev
    got = loaded[jnp.clip(code - base, 0, loaded.shape[0] - 1)]
    return got if source == HELD else jnp.where((code < base)[:, None], dev, got)


def _copies(arrays: dict[str, jax.Array], axis: int, pack, unpack, slabs: list, spill: jax.Array, src: jax.Array,
            dst: jax.Array, source: int) -> tuple[dict[str, jax.Array], jax.Array | None]:
    """One kind's (pages' or checkpoints') spill and loads on ``arrays`` (indexed along ``axis``): the spilled rows
    (:func:`_spilled`; None for none), then rows ``src`` of the table ``[spilled rows; loaded slabs' rows]`` written
    to ``dst`` (out of range: dropped). The loads' rows are read from that table, so every write of ``arrays``
    depends on every read of it: the compiler updates the donated buffers in place (traceable)."""
    base = next(iter(arrays.values())).shape[axis]
    loaded = jnp.concatenate(slabs) if slabs else None
    out = _spilled(functools.partial(pack, arrays), loaded, spill, base, source) if spill.shape[0] else None
    if dst.shape[0]:
        table = jnp.concatenate([x for x in (out, loaded) if x is not None])
        rows = unpack(arrays, table[src])
        at = (slice(None),) * axis
        arrays = {name: x.at[(*at, dst)].set(rows[name], mode="drop") for name, x in arrays.items()}
    return arrays, out


def copy_program(pages: dict[str, jax.Array], states: dict[str, jax.Array] | None, page_slabs: list,
                 state_slabs: list, idx: jax.Array, sizes: tuple[int, ...], sources: tuple[int, int]):
    """A copy log's device work in one program (traceable; ``sizes`` and ``sources`` static).

    ``pages``: every paged role ``{name: [P, page_size, ...]}``; ``states``: ``{"conv", "ssm": [L, S+1, ...]}`` or
    None; ``page_slabs`` / ``state_slabs``: the held slabs the log reads, on the device (``word[chunk, row]`` /
    ``word[1, row]``); ``sizes = (chunk, sp, lp, sc, lc)``; ``idx`` (i32[sp + 2 lp + sc + 2 lc]): the spilled pages'
    source codes (``sp``, :func:`_spilled`), the loaded pages' table rows and destination pages (``lp`` each,
    :func:`_copies`), then the same for checkpoints (``sc``, ``lc``, ``lc``); ``sources``: :func:`_spilled`'s
    ``source`` of the spilled pages and checkpoints. The host resolved the log's order into these codes (each names
    the caches as they were before the log or a loaded row), so the program gathers from its input caches and then
    scatters into them. Returns the caches ``(pages, states)``, the spilled page slabs (``sp / chunk`` of
    ``word[chunk, row]``) and the spilled checkpoints (``sc`` of ``word[1, row]``)."""
    chunk, sp, lp, sc, lc = sizes
    cuts = np.cumsum([0, sp, lp, lp, sc, lc, lc]).tolist()
    part = [idx[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    pages, out_pages = _copies(pages, 0, pack_pages, unpack_pages, page_slabs, *part[:3], sources[0])
    out_states = None
    if states is not None:
        states, out_states = _copies(states, 1, pack_states, unpack_states, state_slabs, *part[3:], sources[1])
    return ((pages, states), [out_pages[i * chunk: (i + 1) * chunk] for i in range(sp // chunk)],
            [out_states[j: j + 1] for j in range(sc)])


def _cat(parts: list) -> np.ndarray:
    """``parts`` (i64 arrays) end to end."""
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)


def _local(spill: np.ndarray, loads: list[tuple[np.ndarray, np.ndarray]], base: int, rows: int,
           spilled_rows: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """A log's codes as :func:`copy_program` reads them. ``spill`` (i64[s]): the spilled rows' sources (``< base``:
    a device page / slot; else a held row ``base + slab * rows + row``); ``loads``: each load's (destinations,
    rows: a held row, or ``-1 - i`` for the log's ``i``-th spilled row); ``spilled_rows``: the spilled rows padded.
    Returns ``(spill codes, destinations, table rows)`` -- the ``i``-th held slab read is ``base + i * rows + row``
    in the spill codes and ``spilled_rows + i * rows + row`` in the table, one load per destination (the last) --
    and the held slabs read (i64[m])."""
    dst, src = _cat([d for d, _ in loads]), _cat([s for _, s in loads])
    if len(dst):  # the last load of each destination
        _, last = np.unique(dst[::-1], return_index=True)
        keep = len(dst) - 1 - last
        dst, src = dst[keep], src[keep]
    codes = np.concatenate([spill, src])
    held = codes >= base
    slabs, inv = np.unique((codes[held] - base) // rows, return_inverse=True)
    local = np.zeros(len(codes), np.int64)
    local[held] = inv.reshape(-1) * rows + (codes[held] - base) % rows
    s = len(spill)
    return (np.where(held[:s], base + local[:s], spill), dst,
            np.where(held[s:], spilled_rows + local[s:], -1 - src)), slabs


def _source_kind(codes: np.ndarray, base: int) -> int:
    """:func:`_spilled`'s ``source`` for codes ``codes`` (0 for none)."""
    held = codes >= base
    return (DEVICE if not held.all() else 0) | (HELD if held.any() else 0)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A copy log resolved on the host: what :meth:`HostStore._run` passes to :func:`copy_program`."""

    idx: np.ndarray  # i32[sp + 2 lp + sc + 2 lc]: copy_program's idx
    sizes: tuple[int, ...]  # copy_program's sizes
    sources: tuple[int, ...]  # copy_program's sources
    reads: tuple[np.ndarray, np.ndarray]  # (i64[m], i64[k]): the held page / checkpoint slabs the log reads
    loaded: tuple[int, int]  # copy_program's page / checkpoint slab inputs: m and k padded (0 when m, k are 0)
    spilled: tuple[np.ndarray, np.ndarray]  # (i64[n], i64[c]): the slab ids the spill's outputs become
    counts: tuple[int, int, int, int]  # pages out, checkpoints out, pages in, checkpoints in
    release: np.ndarray  # i64[r]: the host ids the log consumes (loads) or drops




@dataclasses.dataclass
class CopyStats:
    """What a :class:`HostStore` moved (cumulative): bytes each way (padding included: every output of a spill's
    program crosses to the host, a load moves every slab it reads whole), pages and checkpoints each way, host
    calls issued (batched transfers and jitted copies: at most two a log), and ``t_sync``: seconds of copies waited
    for to the end (:attr:`HostStore.sync`)."""

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
        self.traces = 0  # compilations of the copy program (one per shape)
        self._copy = jax.jit(self._counted(copy_program), static_argnums=(5, 6), donate_argnums=(0, 1),
                             out_shardings=(self._device, self._host, self._host))
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
        (``caches`` is donated when a copy runs; use only the returned ones). ``probe`` is called after each host
        call (the engine looks there whether the device has gone idle)."""
        if self.sync and ops:
            jax.block_until_ready(caches)
            t0 = time.perf_counter()
            caches = self._apply(caches, ops, probe)
            jax.block_until_ready((caches, list(self.slabs.values())))
            self.stats.t_sync += time.perf_counter() - t0
            return caches
        return self._apply(caches, ops, probe)

    def _apply(self, caches: ModelCaches, ops: Sequence[CopyOp], probe: Callable[[], None] | None) -> ModelCaches:
        plan = None
        if any(op.kind != "drop" for op in ops):
            plan = self._plan(ops, next(iter(caches.pages.values())).shape[0],
                              caches.gdn.ssm.shape[1] if caches.gdn is not None else 0)
            moved = self._load(plan)
            if moved and probe is not None:
                probe()
            caches = self._run(caches, plan, moved)
            if probe is not None:
                probe()
        self._release(plan.release if plan is not None else _cat([op.pages_host for op in ops]
                                                                   + [op.ckpts_host for op in ops]))
        return caches

    def _plan(self, ops: Sequence[CopyOp], num_pages: int, num_slots: int) -> _Plan:
        """Resolve the log ``ops`` (a spill or load among them) on the host. The spilled ids are placed
        in fresh slabs (the whole log's pages packed ``chunk`` to a slab); walking the log in order, each spilled
        row and each loaded row gets its source (:func:`_local`): a device page / slot as it was before the
        log, or a row of a held slab, where a spill of a page that an earlier load of the log wrote reads that
        load's source, and a load of an id that the log spilled reads that spill's source. A page or slot that
        several loads write keeps the last one's."""
        c = self.chunk
        outs = [op for op in ops if op.kind == "out"]
        new_p = self._place(_cat([op.pages_host for op in outs]), c)
        new_c = self._place(_cat([op.ckpts_host for op in outs]), 1)
        spill_p = np.zeros(sum(op.num_pages for op in outs), np.int64)
        spill_c = np.zeros(sum(op.num_ckpts for op in outs), np.int64)
        over_p, over_c = np.full(num_pages, -1, np.int64), np.full(num_slots, -1, np.int64)
        load_p: list[tuple[np.ndarray, np.ndarray]] = []  # (destination pages, source codes) of each load
        load_c: list[tuple[np.ndarray, np.ndarray]] = []
        at_p = at_c = 0
        for op in ops:
            if op.kind == "out":
                for d, over, spill, at in ((op.pages_dev, over_p, spill_p, at_p), (op.ckpts_dev, over_c, spill_c, at_c)):
                    o = over[d]
                    spill[at: at + len(d)] = np.where(o >= 0, o, d)
                at_p, at_c = at_p + op.num_pages, at_c + op.num_ckpts
            elif op.kind == "in":
                for h, d, over, spill, new, rows, base, out in (
                        (op.pages_host, op.pages_dev, over_p, spill_p, new_p, c, num_pages, load_p),
                        (op.ckpts_host, op.ckpts_dev, over_c, spill_c, new_c, 1, num_slots, load_c)):
                    if len(h):
                        source, row = self._source(h, new, rows, spill, base)
                        over[d] = source
                        out.append((d, row))
        n, k = _bucket(len(new_p)) if len(new_p) else 0, _bucket(len(new_c)) if len(new_c) else 0
        (spill_p, dst_p, src_p), reads_p = _local(spill_p, load_p, num_pages, c, n * c)
        (spill_c, dst_c, src_c), reads_c = _local(spill_c, load_c, num_slots, 1, k)
        lp = c * _bucket(max(len(reads_p), -(-len(dst_p) // c))) if len(dst_p) else 0
        lc = _bucket(max(len(reads_c), len(dst_c))) if len(dst_c) else 0
        idx = np.concatenate([_pad(spill_p, n * c, spill_p[0] if len(spill_p) else 0), _pad(src_p, lp, 0),
                              _pad(dst_p, lp, num_pages), _pad(spill_c, k, spill_c[0] if len(spill_c) else 0),
                              _pad(src_c, lc, 0), _pad(dst_c, lc, num_slots)])
        loads = [op for op in ops if op.kind == "in"]
        return _Plan(idx=idx, sizes=(c, n * c, lp, k, lc),
                     sources=(_source_kind(spill_p, num_pages), _source_kind(spill_c, num_slots)),
                     reads=(reads_p, reads_c),
                     loaded=(lp // c if len(reads_p) else 0, lc if len(reads_c) else 0), spilled=(new_p, new_c),
                     counts=(len(spill_p), len(spill_c), sum(op.num_pages for op in loads),
                             sum(op.num_ckpts for op in loads)),
                     release=_cat([op.pages_host for op in ops if op.kind != "out"]
                                  + [op.ckpts_host for op in ops if op.kind != "out"]))

    def _source(self, ids: np.ndarray, new: np.ndarray, rows: int, spill: np.ndarray,
                base: int) -> tuple[np.ndarray, np.ndarray]:
        """Where loading host ids ``ids`` reads (i64[k] each): their source (:func:`_local`'s spill codes: a spill
        of the page later in the log copies it) and their row (:func:`_local`'s load rows). An id in one of the
        log's own slabs ``new`` (``rows`` to a slab; ``spill``: the spilled rows' sources) is that spill's row and
        source; any other is a held row ``base + slab * rows + row``."""
        loc = self._loc[ids]
        if (loc[:, 0] < 0).any():
            raise AssertionError("host tier: a load reads a host id this store does not hold")
        src = base + loc[:, 0] * rows + loc[:, 1]
        row = src.copy()
        if len(new):
            fresh = loc[:, 0] >= new[0]
            if fresh.any():
                pos = (loc[fresh, 0] - new[0]) * rows + loc[fresh, 1]
                src[fresh], row[fresh] = spill[pos], -1 - pos
        return src, row

    def _load(self, plan: _Plan) -> list:
        """The held slabs the log's loads read, on the device: one batched transfer (``[]`` if none)."""
        ids = [*plan.reads[0].tolist(), *plan.reads[1].tolist()]
        if not ids:
            return []
        moved = jax.device_put([self.slabs[s] for s in ids], self._device)
        self.stats.calls += 1
        self.stats.bytes_in += sum(x.nbytes for x in moved)
        return moved

    def _args(self, caches: ModelCaches, plan: _Plan, moved: list) -> tuple:
        """:func:`copy_program`'s arguments for ``plan`` (``moved``: :meth:`_load`'s slabs)."""
        m = len(plan.reads[0])
        pages_in, states_in = moved[:m], moved[m:]  # padded by repeating a slab: the program reads only the first
        pages_in += pages_in[:1] * (plan.loaded[0] - len(pages_in))
        states_in += states_in[:1] * (plan.loaded[1] - len(states_in))
        states = {"conv": caches.gdn.conv, "ssm": caches.gdn.ssm} if caches.gdn is not None else None
        return caches.pages, states, pages_in, states_in, plan.idx, plan.sizes, plan.sources

    def _run(self, caches: ModelCaches, plan: _Plan, moved: list) -> ModelCaches:
        """Issue the log's :func:`copy_program` (one jitted call, the caches donated); keep the spilled slabs."""
        pool = caches.gdn
        (pages, states), out_p, out_c = self._copy(*self._args(caches, plan, moved))
        self.stats.calls += 1
        caches = dataclasses.replace(caches, pages=pages,
                                     gdn=dataclasses.replace(pool, **states) if pool is not None else None)
        for ids, out in zip(plan.spilled, (out_p, out_c)):
            if out:  # every output crosses to the host, the padding ones too; the real ones are kept
                self.stats.bytes_out += len(out) * out[0].nbytes
                self.slabs.update(zip(ids.tolist(), out))
        self.stats.pages_out, self.stats.ckpts_out, self.stats.pages_in, self.stats.ckpts_in = (
            a + b for a, b in zip((self.stats.pages_out, self.stats.ckpts_out, self.stats.pages_in,
                                   self.stats.ckpts_in), plan.counts))
        return caches

    def _place(self, ids: np.ndarray, rows_per_slab: int) -> np.ndarray:
        """Map host ids ``ids`` (i64[k]) to fresh slabs of ``rows_per_slab`` rows, in order; returns the slab ids."""
        k = len(ids)
        n = -(-k // rows_per_slab)
        top = int(ids.max()) + 1 if k else 0
        if top > len(self._loc):
            grown = np.full((max(top, 2 * len(self._loc)), 2), -1, np.int64)
            grown[: len(self._loc)] = self._loc
            self._loc = grown
        slab = self._next + np.arange(k) // rows_per_slab
        self._loc[ids, 0], self._loc[ids, 1] = slab, np.arange(k) % rows_per_slab
        for s, count in zip(range(self._next, self._next + n), np.bincount(slab - self._next, minlength=n).tolist()):
            self.live[s] = count
        self._next += n
        return np.arange(self._next - n, self._next)

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
