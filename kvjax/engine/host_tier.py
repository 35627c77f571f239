"""The device side of the prefix cache's host tier: spilled blocks in pinned host memory, and the jitted copies.

The scheduler's prefix cache (:mod:`kvjax.sched.prefix_cache`, :mod:`kvjax.sched.host_tier`) decides what moves
and logs it as :class:`~kvjax.sched.host_tier.CopyOp` groups with host ids; :class:`HostStore` executes a plan's
log before the engine dispatches the plan's step, in log order:

- ``out`` (spill): one jitted gather of the named device pages (every paged role of every layer) and GDN
  checkpoint slots, whose outputs are placed in ``pinned_host`` memory (``out_shardings``): *chunks* of
  ``chunk`` pages ``{name: [chunk, page_size, ...]}`` and one ``{"conv", "ssm": [L, 1, ...]}`` per checkpoint;
  each host id maps to (chunk, row).
- ``in`` (load): the source chunks go to the device in one ``jax.device_put`` and one jitted scatter with the
  caches donated writes the named rows into their device pages; the checkpoints likewise (one transfer, one
  scatter into their GDN slots). Issuing a call per chunk cost more host time than the bytes took to move.
- ``drop``: host ids forgotten; a chunk no id maps to any more is released.

Ordering and overlap. Every copy takes the caches the previous dispatch returned and the step takes what the
copies return, so on the device the copies run after the step in flight (step N) and before the step that needs
them (N + 1): a spill reads a page before anything reuses it, a load lands before the step reads it. The
device -> host and host -> device transfers themselves are asynchronous DMA: the spilled chunks leave the device
while step N + 1 computes, and a load's chunks cross to the device while step N (which does not need it) still
runs, because the engine plans and issues step N + 1 -- its copies included -- before it waits for step N. What
stays on the device's critical path is the gather / scatter of the pages concerned (a device-memory copy of
their bytes) and the host time spent issuing the copies (the engine's ``t_copy``).

Shapes: a spill's chunk and checkpoint counts are padded to powers of two (padding gathers page / slot 0), a
load's chunk and checkpoint counts too (padding repeats the first and scatters nowhere), so each copy compiles a
handful of times. One device only (a mesh engine refuses a host tier).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from kvjax.engine.sizing import cache_bytes_model
from kvjax.models.interface import CausalLM, ModelCaches
from kvjax.sched.host_tier import CopyOp
from kvjax.sched.prefix_cache import PrefixCacheConfig
from kvjax.state.gdn_pool import GDNStatePool
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


def gather(caches: ModelCaches, pages: jax.Array, ckpts: jax.Array, chunk: int) -> tuple[list, list]:
    """Device pages ``pages`` (i32[n * chunk]) of every paged role as ``n`` chunks ``{name: [chunk, page_size,
    ...]}``, and GDN slots ``ckpts`` (i32[c]) of every GDN layer as ``c`` arrays ``{"conv", "ssm": [L, 1, ...]}``
    (traceable; ``chunk`` static)."""
    n = pages.shape[0] // chunk
    chunks = [{name: x[pages[i * chunk: (i + 1) * chunk]] for name, x in caches.pages.items()} for i in range(n)]
    states = [] if caches.gdn is None else [{"conv": caches.gdn.conv[:, ckpts[j: j + 1]],
                                             "ssm": caches.gdn.ssm[:, ckpts[j: j + 1]]} for j in range(ckpts.shape[0])]
    return chunks, states


def scatter_pages(caches: ModelCaches, chunks: list[dict], src: jax.Array, dst: jax.Array) -> ModelCaches:
    """``caches`` with rows ``src`` (i32[n]: row ``k * chunk + i`` is row ``i`` of ``chunks[k]``) of the page chunks
    written to device pages ``dst`` (i32[n]); an out-of-range destination writes nothing (traceable)."""
    pages = {name: x.at[dst].set(jnp.concatenate([c[name] for c in chunks])[src], mode="drop")
             for name, x in caches.pages.items()}
    return dataclasses.replace(caches, pages=pages)


def scatter_states(caches: ModelCaches, states: list[dict], slots: jax.Array) -> ModelCaches:
    """``caches`` with GDN states ``{"conv", "ssm": [L, 1, ...]}`` written to slots ``slots`` (i32[len(states)]) of
    every GDN layer; an out-of-range slot writes nothing (traceable)."""
    pool = caches.gdn
    conv = jnp.concatenate([x["conv"] for x in states], axis=1)
    ssm = jnp.concatenate([x["ssm"] for x in states], axis=1)
    return dataclasses.replace(caches, gdn=GDNStatePool(conv=pool.conv.at[:, slots].set(conv, mode="drop"),
                                                        ssm=pool.ssm.at[:, slots].set(ssm, mode="drop")))


@dataclasses.dataclass
class CopyStats:
    """What a :class:`HostStore` moved (cumulative): bytes each way (chunk padding included), pages and
    checkpoints each way, copy calls, and ``t_sync``: seconds of copies waited for to the end
    (:attr:`HostStore.sync`)."""

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
    :attr:`bytes_held` is the host memory the chunks hold. ``chunk``: pages per host chunk (a spill's pages are
    gathered in chunks of this many, a load scatters one chunk per call: every copy has one of a few shapes).
    ``sync = True`` (a measurement, not for serving): each :meth:`apply` first waits for the device, then for its
    own copies, and adds that time to ``stats.t_sync``."""

    def __init__(self, device: jax.Device | None = None, chunk: int = 16) -> None:
        device = device or jax.local_devices()[0]
        self._host = host_sharding(device)  # ValueError where the platform has no pinned_host memory
        self._device = SingleDeviceSharding(device, memory_kind="device")
        self.chunk = chunk
        self.traces = 0  # compilations of the copies (each jitted function traces once per shape)
        self._gather = jax.jit(self._counted(gather), static_argnums=(3,), out_shardings=self._host)
        self._scatter_pages = jax.jit(self._counted(scatter_pages), donate_argnums=(0,))
        self._scatter_states = jax.jit(self._counted(scatter_states), donate_argnums=(0,))
        self.chunks: dict[int, dict] = {}  # chunk id -> host arrays (a page chunk or one GDN state)
        self.live: collections.Counter = collections.Counter()  # chunk id -> host ids mapping into it
        self.where: dict[tuple[str, int], tuple[int, int]] = {}  # ("p" | "c", host id) -> (chunk id, row)
        self._next = 0
        self.stats = CopyStats()
        self.sync = False

    def on_device(self, caches: ModelCaches) -> ModelCaches:
        """``caches`` committed to the device (no copy): the copies' outputs are (their inputs include committed
        chunks), and a jitted step compiles again for committed arguments after uncommitted ones."""
        return jax.device_put(caches, self._device)

    def _counted(self, fn):
        def traced(*args):
            self.traces += 1
            return fn(*args)
        return traced

    @property
    def bytes_held(self) -> int:
        return sum(x.nbytes for c in self.chunks.values() for x in jax.tree.leaves(c))

    def apply(self, caches: ModelCaches, ops: Sequence[CopyOp]) -> ModelCaches:
        """Execute ``ops`` (a plan's copy log, in order) and return the caches to dispatch the plan's step with
        (``caches`` is donated when a load writes it; use only the returned ones)."""
        if self.sync and ops:
            jax.block_until_ready(caches)
            t0 = time.perf_counter()
            caches = self._apply(caches, ops)
            jax.block_until_ready((caches, list(self.chunks.values())))
            self.stats.t_sync += time.perf_counter() - t0
            return caches
        return self._apply(caches, ops)

    def _apply(self, caches: ModelCaches, ops: Sequence[CopyOp]) -> ModelCaches:
        for op in ops:
            if op.kind == "out":
                self._out(caches, op)
            elif op.kind == "in":
                caches = self._in(caches, op)
            else:
                for kind, ids in (("p", op.pages_host), ("c", op.ckpts_host)):
                    for h in ids.tolist():
                        self._release(self.where.pop((kind, h))[0])
        return caches

    def _new_chunk(self, arrays: dict) -> int:
        c = self._next
        self._next += 1
        self.chunks[c] = arrays
        self.stats.bytes_out += sum(x.nbytes for x in jax.tree.leaves(arrays))
        return c

    def _out(self, caches: ModelCaches, op: CopyOp) -> None:
        n = -(-op.num_pages // self.chunk)
        pages = _pad(op.pages_dev, _bucket(n) * self.chunk if n else 0, 0)
        ckpts = _pad(op.ckpts_dev, _bucket(op.num_ckpts) if op.num_ckpts else 0, 0)
        chunks, states = self._gather(caches, pages, ckpts, self.chunk)
        for i, h in enumerate(op.pages_host.tolist()):
            if i % self.chunk == 0:
                c = self._new_chunk(chunks[i // self.chunk])
            self.where[("p", h)] = (c, i % self.chunk)
            self.live[c] += 1
        for j, h in enumerate(op.ckpts_host.tolist()):
            c = self._new_chunk(states[j])
            self.where[("c", h)] = (c, 0)
            self.live[c] += 1
        self.stats.pages_out += op.num_pages
        self.stats.ckpts_out += op.num_ckpts
        self.stats.calls += 1

    def _in(self, caches: ModelCaches, op: CopyOp) -> ModelCaches:
        num_pages = next(iter(caches.pages.values())).shape[0]
        rows: dict[int, tuple[list, list]] = collections.defaultdict(lambda: ([], []))
        for h, d in zip(op.pages_host.tolist(), op.pages_dev.tolist()):
            c, i = self.where.pop(("p", h))
            rows[c][0].append(i)
            rows[c][1].append(d)
        if rows:  # every chunk of the load in one transfer and one scatter (chunk count padded to a power of two)
            ids = list(rows)
            chunks = self._to_device(ids)
            n = _bucket(len(ids))
            src = np.concatenate([k * self.chunk + np.asarray(rows[c][0], np.int32) for k, c in enumerate(ids)])
            dst = np.concatenate([np.asarray(rows[c][1], np.int32) for c in ids])
            caches = self._scatter_pages(caches, chunks + [chunks[0]] * (n - len(ids)),
                                         _pad(src, n * self.chunk, 0), _pad(dst, n * self.chunk, num_pages))
            for c in ids:
                self._release(c, len(rows[c][0]))
        if op.num_ckpts:  # every checkpoint of the load in one transfer and one scatter
            ids = [self.where.pop(("c", h))[0] for h in op.ckpts_host.tolist()]
            states = self._to_device(ids)
            n = _bucket(len(ids))
            num_slots = caches.gdn.ssm.shape[1]
            caches = self._scatter_states(caches, states + [states[0]] * (n - len(ids)),
                                          _pad(op.ckpts_dev, n, num_slots))
            for c in ids:
                self._release(c)
        self.stats.pages_in += op.num_pages
        self.stats.ckpts_in += op.num_ckpts
        return caches

    def _to_device(self, ids: list[int]) -> list[dict]:
        """Host chunks ``ids`` on the device: one asynchronous host -> device transfer of all of them."""
        self.stats.bytes_in += sum(x.nbytes for c in ids for x in jax.tree.leaves(self.chunks[c]))
        self.stats.calls += 1
        return jax.device_put([self.chunks[c] for c in ids], self._device)

    def _release(self, c: int, n: int = 1) -> None:
        self.live[c] -= n
        if self.live[c] <= 0:
            del self.live[c], self.chunks[c]
