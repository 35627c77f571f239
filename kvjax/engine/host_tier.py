"""The device side of the prefix cache's host tier: spilled blocks in pinned host memory, and the jitted copies.

The scheduler's prefix cache (:mod:`kvjax.sched.prefix_cache`, :mod:`kvjax.sched.host_tier`) decides what moves
and logs it as :class:`~kvjax.sched.host_tier.CopyOp` groups with host ids; :class:`HostStore` executes the plans'
logs (one per data shard) before the engine dispatches their step, in log order up to :func:`coalesce` (the same
copies in fewer groups: every page and checkpoint slot still read and written in log order). The host data is held
in *slabs* in ``pinned_host`` memory, one row per page (the page of every paged role of every layer, bit for bit)
or per GDN checkpoint (every GDN layer's conv and SSM state); packing (:mod:`kvjax.engine.host_copies`) makes a
copy's cost in host calls independent of the model's layer and role count.

- ``out`` (spill): the named device pages and checkpoint slots are gathered, packed and placed in ``pinned_host``
  memory by a jitted call per power of two in the binary form of the spill's slab counts (a spill of 13 page
  slabs: calls of 8, 4 and 1; the checkpoints ride along), so each count compiles once and only the last page slab
  of a spill is padded (its missing rows gather page 0).
- ``in`` (load): one jitted call with the caches donated takes every slab the load reads (``pinned_host``
  arguments), moves them to the device inside its program, unpacks the named rows and writes them into their device
  pages and checkpoint slots (slab counts padded to powers of two by repeating a slab, destinations padded out of
  range: dropped).
- ``drop``: host ids forgotten; a slab no id maps to any more is released.

**On a mesh** (``D x M`` devices) a slab is ``word[D, M, rows, row]``, part ``(d, m)`` in device ``(d, m)``'s pinned
host memory holding rows of that device's pages and checkpoint channels; each device packs and unpacks its own
(:class:`~kvjax.engine.host_copies.CopyPrograms`), so no copy crosses devices. Each data shard's scheduler logs its
own copies with its own host ids; the logs run in *rounds* (round ``r``: every shard's ``r``-th group after
coalescing), a round's spills in one call and its loads in one call. A page of a pool split over ``"model"`` (KV
heads per device) is one device's: a global page id names its model part, and a load writes it back to the part it
was spilled from (the allocator keeps a head's pages on its device). A pool not split over ``"model"`` (DeepSeek's
latent pages, replicated) and the GDN checkpoints (channels split) are spilled by every model device of the shard:
their slab parts together hold one copy per device. Padding: a round's slab holds ``chunk`` rows for every device
whether or not that device spilled as many pages (one shard's spill of 3 pages on a ``2 x 2`` mesh takes a slab
of ``4 x chunk`` rows).

The bookkeeping is numpy: per data shard, host id -> (slab, model part, row) in one array indexed by id (ids are
never reused), live rows per slab; no per-page Python loop. Nothing waits for the device: the spill's bytes land
in host memory whenever the device gets there, and nothing reads them on the host.

Ordering and overlap. Every copy takes the caches the previous dispatch returned and the step takes what the
copies return, so on the device the copies run after the step in flight (step N) and before the step that needs
them (N + 1): a spill reads a page before anything reuses it, a load lands before the step reads it. The engine
plans and issues step N + 1 -- its copies included -- before it waits for step N. On the device's critical path:
the gather / scatter of the pages concerned with the transfers inside their programs (a spill's device -> host, a
load's host -> device); on the host's, the time spent issuing the copies (the engine's ``t_copy``). The load's
transfer was a separate batched ``jax.device_put`` that overlapped step N until HISTORY run 128 (H200, the
multi-turn host-tier workload): inside the scatter's program the host issues one call where it issued two, and the
copy issue fell from 12.1% to 9.2% of the step, tok/s 1.07x, the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import numpy as np

from kvjax.engine.host_copies import CopyPrograms
from kvjax.engine.sizing import cache_bytes_model
from kvjax.models.interface import CausalLM, ModelCaches
from kvjax.models.sharding import ShardedModel
from kvjax.sched.host_tier import CopyOp
from kvjax.sched.prefix_cache import PrefixCacheConfig


def host_tier_config(prefix: PrefixCacheConfig | None, host_cache_bytes: int, model: CausalLM, *, page_size: int,
                     dtype, cache_options: dict | None, sharded: ShardedModel | None) -> PrefixCacheConfig | None:
    """``prefix`` with a host tier of ``host_cache_bytes`` (checked by ``EngineOptions``; 0: unchanged; on a mesh,
    each data shard's prefix cache has a tier of this size), its page and checkpoint bytes read from ``model``'s
    caches (one device's, on a mesh): a page held once per model device where its pool is not split over
    ``"model"``, a checkpoint once per model device (each holds its channels). ``ValueError`` (nothing built yet)
    for a host tier too small for a page."""
    if not host_cache_bytes or prefix is None:
        return prefix
    page_bytes, slot_bytes, _ = cache_bytes_model(model, page_size=page_size, dtype=dtype,
                                                  cache_options=cache_options)
    if sharded is not None:
        copies = sharded.model_size
        page_bytes *= 1 if sharded.plan.pages_over_model else copies
        slot_bytes *= copies
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
    """Spilled prefix-cache blocks in ``pinned_host`` memory and the copies between tiers (see the module
    docstring), on one device (``device``, default the first local one) or on every device of a mesh
    (``sharded``; a global page id of a pool split over ``"model"`` names its device by the pool size the caches
    show). :meth:`apply` executes the plans' copy logs (one per data shard) on the caches;
    :attr:`stats` counts what moved; :attr:`bytes_held` is the host memory the slabs hold. ``chunk``: page rows per
    slab part (a power of two; a spill packs its pages in slabs of this many rows per device, a load moves every
    slab it reads whole). ``sync = True`` (a measurement, not for serving): each :meth:`apply` first waits for the
    device, then for its own copies, and adds that time to ``stats.t_sync``."""

    def __init__(self, device: jax.Device | None = None, chunk: int = 16, *,
                 sharded: ShardedModel | None = None) -> None:
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"HostStore.chunk must be a power of two >= 1, got {chunk!r}")
        self.traces = 0  # compilations of the copies (each jitted function traces once per shape)
        self.programs = CopyPrograms(self._traced, sharded=sharded, device=device)
        self.grid = self.programs.grid  # (D, M): data shards, model shards
        self._lead = 0 if sharded is None else 2 if sharded.plan.pages_over_model else 1  # leading axes of a role
        self._split = sharded is not None and sharded.plan.pages_over_model and sharded.model_size > 1
        self.chunk = chunk
        self.slabs: dict[int, jax.Array] = {}  # slab id -> word[D, M, rows, row] in pinned_host memory
        self.live: dict[int, int] = {}  # slab id -> host ids (of every data shard) mapping into it
        # per data shard: i64[ids, 3], host id -> (slab, model part, row); -1: not held
        self._loc = [np.full((0, 3), -1, np.int64) for _ in range(self.grid[0])]
        self._next = 0
        self.stats = CopyStats()
        self.sync = False

    def on_device(self, tree):
        """``tree`` committed to the device (no copy) on one device: the copies' outputs are (their inputs include
        committed slabs), and a jitted step compiles again for committed arguments after uncommitted ones. A
        mesh's arrays are placed already: unchanged."""
        return self.programs.on_device(tree)

    def _traced(self) -> None:
        self.traces += 1

    @property
    def bytes_held(self) -> int:
        return sum(x.nbytes for x in self.slabs.values())

    def held(self, shard: int = 0) -> np.ndarray:
        """``i64[k]``: the host ids of data shard ``shard`` this store holds data for."""
        return np.nonzero(self._loc[shard][:, 0] >= 0)[0]

    def apply(self, caches: ModelCaches, logs: Sequence[Sequence[CopyOp]],
              probe: Callable[[], None] | None = None) -> ModelCaches:
        """Execute ``logs`` (the plans' copy logs, one per data shard, each in order) and return the caches to
        dispatch the plans' step with (``caches`` is donated when a load writes it; use only the returned ones).
        ``probe`` is called after each group of copies is issued (the engine looks there whether the device has
        gone idle)."""
        if len(logs) != self.grid[0]:
            raise ValueError(f"HostStore.apply takes one copy log per data shard ({self.grid[0]}), got {len(logs)}")
        if self.sync and any(logs):
            jax.block_until_ready(caches)
            t0 = time.perf_counter()
            caches = self._apply(caches, logs, probe)
            jax.block_until_ready((caches, list(self.slabs.values())))
            self.stats.t_sync += time.perf_counter() - t0
            return caches
        return self._apply(caches, logs, probe)

    def _apply(self, caches: ModelCaches, logs: Sequence[Sequence[CopyOp]],
               probe: Callable[[], None] | None) -> ModelCaches:
        """Each shard's log coalesced, then executed in rounds: round ``r`` takes every shard's ``r``-th group; its
        spills go in one call, its loads in one call (shards touch disjoint devices, so only each shard's own order
        matters)."""
        groups = [coalesce(ops) for ops in logs]
        for r in range(max(map(len, groups), default=0)):
            ops = [(d, g[r]) for d, g in enumerate(groups) if r < len(g)]
            for kind in ("out", "in"):
                now = {d: op for d, op in ops if op.kind == kind}
                if now:
                    if kind == "out":
                        self._out(caches, now)
                    else:
                        caches = self._in(caches, now)
                    if probe is not None:
                        probe()
            for d, op in ops:
                if op.kind == "drop":
                    self._release(d, np.concatenate([op.pages_host, op.ckpts_host]))
        return caches

    def _part(self, pages_dev: np.ndarray, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """Global page ids ``pages_dev`` (i64[k]) as (model part, page id in that device's pool): ``divmod`` by the
        pool size ``num_pages`` where the pages are split over ``"model"``, else part 0 (one pool per data shard, on
        every model device alike)."""
        if self._split:
            return np.divmod(pages_dev, num_pages)
        return np.zeros(len(pages_dev), np.int64), pages_dev

    def _locate(self, d: int, ids: np.ndarray, slab: np.ndarray, part: np.ndarray, row: np.ndarray) -> None:
        """Record host ids ``ids`` (i64[k]) of shard ``d`` at ``(slab, part, row)`` (each i64[k] or a scalar)."""
        if not len(ids):
            return
        top = int(ids.max()) + 1
        loc = self._loc[d]
        if top > len(loc):
            grown = np.full((max(top, 2 * len(loc)), 3), -1, np.int64)
            grown[: len(loc)] = loc
            self._loc[d] = loc = grown
        loc[ids, 0], loc[ids, 1], loc[ids, 2] = slab, part, row
        for s, k in zip(*np.unique(np.broadcast_to(slab, ids.shape), return_counts=True)):
            self.live[int(s)] = self.live.get(int(s), 0) + int(k)

    def _grid(self, per_shard: np.ndarray) -> np.ndarray:
        """``[D, parts, n]`` index arrays as ``[D, M, n]``: a pool not split over ``"model"`` is every model
        device's alike."""
        d, m = self.grid
        return per_shard if per_shard.shape[1] == m else np.ascontiguousarray(
            np.broadcast_to(per_shard, (d, m, per_shard.shape[2])))

    def _out(self, caches: ModelCaches, outs: dict[int, CopyOp]) -> None:
        """One spill round: each shard's pages packed into rows of fresh slabs (per model part, in order), its
        checkpoints one slab each; one jitted gather per power of two of the slab counts."""
        c, (D, M) = self.chunk, self.grid
        parts = M if self._split else 1
        num_pages, _ = self._pools(caches)
        placed = {}
        for d, op in outs.items():
            part, local = self._part(op.pages_dev, num_pages)
            pos = np.empty(len(part), np.int64)  # each page's row among its part's pages, in log order
            for p in np.unique(part).tolist():
                sel = part == p
                pos[sel] = np.arange(int(sel.sum()))
            placed[d] = part, local, pos
        n = max((int(pos.max()) // c + 1) if len(pos) else 0 for _, _, pos in placed.values())  # slabs
        cmax = max(op.num_ckpts for op in outs.values())
        base = self._next
        page_ids, state_ids = np.arange(base, base + n), np.arange(base + n, base + n + cmax)
        self._next += n + cmax
        rows = np.zeros((D, parts, n * c), np.int32)  # rows no page fills gather page 0
        slots = np.zeros((D, 1, cmax), np.int32)
        for d, op in outs.items():
            part, local, pos = placed[d]
            rows[d, part, pos] = local
            self._locate(d, op.pages_host, base + pos // c, part, pos % c)
            slots[d, 0, : op.num_ckpts] = op.ckpts_dev
            self._locate(d, op.ckpts_host, state_ids[: op.num_ckpts], 0, 0)
        rows, slots = self._grid(rows), self._grid(slots)
        pages: list = []
        states: list = []
        calls_p, calls_c = _powers(n), _powers(cmax)
        at_p = at_c = 0
        for i in range(max(len(calls_p), len(calls_c))):  # one call per power of two of each count
            k = calls_p[i] if i < len(calls_p) else 0
            m = calls_c[i] if i < len(calls_c) else 0
            p, s = self.programs.gather(caches, rows[..., at_p * c: (at_p + k) * c], slots[..., at_c: at_c + m], c)
            pages += p
            states += s
            at_p, at_c = at_p + k, at_c + m
            self.stats.calls += 1
        self.slabs.update(zip([*page_ids.tolist(), *state_ids.tolist()], pages + states))
        self.stats.bytes_out += _slab_bytes(pages, states)
        self.stats.pages_out += sum(op.num_pages for op in outs.values())
        self.stats.ckpts_out += sum(op.num_ckpts for op in outs.values())

    def _pools(self, caches: ModelCaches) -> tuple[int, int]:
        """One device's pool sizes: pages per role, GDN slots (0 without GDN layers)."""
        num_pages = next(iter(caches.pages.values())).shape[self._lead]
        gdn = caches.gdn
        return num_pages, 0 if gdn is None else gdn.ssm.shape[1 if self._lead == 0 else 2]

    def _in(self, caches: ModelCaches, ins: dict[int, CopyOp]) -> ModelCaches:
        """One load round: every slab the shards read, in one jitted call with the caches donated; each device
        writes its own rows (counts padded to powers of two by repeating a slab, destinations padded out of
        range)."""
        c, (D, M) = self.chunk, self.grid
        parts = M if self._split else 1
        num_pages, num_slots = self._pools(caches)
        found = {}
        for d, op in ins.items():
            loc, cloc = self._loc[d][op.pages_host], self._loc[d][op.ckpts_host]
            if (loc[:, 0] < 0).any() or (cloc[:, 0] < 0).any():
                raise AssertionError(f"host tier: a load of data shard {d} reads a host id this store does not hold")
            part, local = self._part(op.pages_dev, num_pages)
            if (part != loc[:, 1]).any():
                raise AssertionError(f"host tier: a load of data shard {d} writes a page to another model device "
                                     "than the one it was spilled from")
            found[d] = loc, cloc, local
        ids = np.unique(np.concatenate([loc[:, 0] for loc, _, _ in found.values()]))  # the page slabs read
        sids = np.unique(np.concatenate([cloc[:, 0] for _, cloc, _ in found.values()]))  # the checkpoint slabs
        n, m = (_bucket(len(ids)) if len(ids) else 0), (_bucket(len(sids)) if len(sids) else 0)
        src = np.zeros((D, parts, n * c), np.int32)
        dst = np.full((D, parts, n * c), num_pages, np.int32)  # padding writes nowhere
        state_src = np.zeros((D, 1, m), np.int32)
        slots = np.full((D, 1, m), num_slots, np.int32)
        for d, op in ins.items():
            loc, cloc, local = found[d]
            for p in np.unique(loc[:, 1]).tolist():
                sel = loc[:, 1] == p
                k = int(sel.sum())
                src[d, p, :k] = np.searchsorted(ids, loc[sel, 0]) * c + loc[sel, 2]
                dst[d, p, :k] = local[sel]
            state_src[d, 0, : op.num_ckpts] = np.searchsorted(sids, cloc[:, 0])
            slots[d, 0, : op.num_ckpts] = op.ckpts_dev
        pages = [self.slabs[s] for s in ids.tolist()]  # pinned_host
        states = [self.slabs[s] for s in sids.tolist()]
        self.stats.bytes_in += _slab_bytes(pages, states)
        caches = self.programs.load(caches, pages + pages[:1] * (n - len(pages)), self._grid(src), self._grid(dst),
                                    states + states[:1] * (m - len(states)), self._grid(state_src),
                                    self._grid(slots))
        self.stats.calls += 1
        for d, op in ins.items():
            self._release(d, np.concatenate([op.pages_host, op.ckpts_host]))
            self.stats.pages_in += op.num_pages
            self.stats.ckpts_in += op.num_ckpts
        return caches

    def _release(self, d: int, ids: np.ndarray) -> None:
        """Forget host ids ``ids`` (i64[k]) of shard ``d``; release the slabs no id maps to any more."""
        if not len(ids):
            return
        loc = self._loc[d]
        slabs, counts = np.unique(loc[ids, 0], return_counts=True)
        if (slabs < 0).any():
            raise AssertionError(f"host tier: releasing a host id data shard {d}'s store does not hold")
        loc[ids] = -1
        for s, k in zip(slabs.tolist(), counts.tolist()):
            self.live[s] -= k
            if self.live[s] <= 0:
                del self.live[s], self.slabs[s]
