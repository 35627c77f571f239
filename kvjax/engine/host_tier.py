"""The device side of the prefix cache's host tier: spilled blocks in pinned host memory, and the jitted copies.

The scheduler's prefix cache (:mod:`kvjax.sched.prefix_cache`, :mod:`kvjax.sched.host_tier`) decides what moves
and logs it as :class:`~kvjax.sched.host_tier.CopyOp` groups with host ids; :class:`HostStore` executes a plan's
log before the engine dispatches the plan's step, in log order:

- ``out`` (spill): one jitted gather of the named device pages (every paged role of every layer) and GDN
  checkpoint slots, whose outputs are placed in ``pinned_host`` memory (``out_shardings``): one *batch* of host
  arrays ``{name: [k, page_size, ...]}`` and ``conv`` / ``ssm`` ``[L, c, ...]``; each host id maps to (batch,
  index).
- ``in`` (load): per source batch, the batch goes to the device (``jax.device_put``) and one jitted scatter with
  the caches donated writes the named rows into their device pages / checkpoint slots.
- ``drop``: host ids forgotten; a batch no id maps to any more is released.

Ordering and overlap. Every copy takes the caches the previous dispatch returned and the step takes what the
copies return, so on the device the copies run after the step in flight (step N) and before the step that needs
them (N + 1): a spill reads a page before anything reuses it, a load lands before the step reads it. The
device -> host and host -> device transfers themselves are asynchronous DMA: the spilled batch leaves the device
while step N + 1 computes, and a load's batch crosses to the device while step N (which does not need it) still
runs, because the engine plans and issues step N + 1 -- its copies included -- before it waits for step N. What
stays on the device's critical path is the gather / scatter of the pages concerned (a device-memory copy of
their bytes) and the host time spent issuing the copies (the engine's ``t_copy``).

Shapes are padded to powers of two (pages and slots; padding gathers page 0 and scatters nowhere), so the copies
compile a handful of times. One device only (a mesh engine refuses a host tier).
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


def _pad(x: np.ndarray, n: int, value: int) -> jax.Array:
    out = np.full(n, value, np.int32)
    out[: x.size] = x
    return out


def gather(caches: ModelCaches, pages: jax.Array, ckpts: jax.Array) -> dict:
    """``{"pages": {name: [k, page_size, ...]}, "gdn": {"conv", "ssm"}: [L, c, ...] | None}``: device pages
    ``pages`` (i32[k]) of every paged role and GDN slots ``ckpts`` (i32[c]) of every GDN layer (traceable)."""
    gdn = None if caches.gdn is None else {"conv": caches.gdn.conv[:, ckpts], "ssm": caches.gdn.ssm[:, ckpts]}
    return {"pages": {name: x[pages] for name, x in caches.pages.items()}, "gdn": gdn}


def scatter(caches: ModelCaches, pages: dict | None, gdn: dict | None, src: jax.Array, dst: jax.Array,
            src_c: jax.Array, dst_c: jax.Array) -> ModelCaches:
    """``caches`` with rows ``src`` (i32[k]) of a batch's ``pages`` written to device pages ``dst`` (i32[k]) and
    rows ``src_c`` (i32[c]) of its ``gdn`` states to GDN slots ``dst_c`` (i32[c]); ``None`` parts and
    out-of-range destinations write nothing (traceable)."""
    new = caches.pages
    if pages is not None:
        new = {name: x.at[dst].set(pages[name][src], mode="drop") for name, x in caches.pages.items()}
    pool = caches.gdn
    if pool is not None and gdn is not None:
        pool = GDNStatePool(conv=pool.conv.at[:, dst_c].set(gdn["conv"][:, src_c], mode="drop"),
                            ssm=pool.ssm.at[:, dst_c].set(gdn["ssm"][:, src_c], mode="drop"))
    return dataclasses.replace(caches, pages=new, gdn=pool)


@dataclasses.dataclass
class CopyStats:
    """What a :class:`HostStore` moved (cumulative): bytes each way (padding included), pages and checkpoints
    each way, copy calls, and ``t_sync``: seconds of copies waited for to the end (:attr:`HostStore.sync`)."""

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
    :attr:`bytes_held` is the host memory the batches hold. ``sync = True`` (a measurement, not for serving): each
    :meth:`apply` first waits for the device, then for its own copies, and adds that time to ``stats.t_sync``."""

    def __init__(self, device: jax.Device | None = None) -> None:
        device = device or jax.devices()[0]
        self._host = host_sharding(device)  # ValueError where the platform has no pinned_host memory
        self._device = SingleDeviceSharding(device, memory_kind="device")
        self._gather = jax.jit(gather, out_shardings=self._host)
        self._scatter = jax.jit(scatter, donate_argnums=(0,))
        self.batches: dict[int, dict] = {}  # batch id -> host arrays (the gather's output)
        self.live: collections.Counter = collections.Counter()  # batch id -> host ids mapping into it
        self.where: dict[tuple[str, int], tuple[int, int]] = {}  # ("p" | "c", host id) -> (batch id, row)
        self._next = 0
        self.stats = CopyStats()
        self.sync = False

    @property
    def bytes_held(self) -> int:
        return sum(x.nbytes for b in self.batches.values() for x in jax.tree.leaves(b))

    def apply(self, caches: ModelCaches, ops: Sequence[CopyOp]) -> ModelCaches:
        """Execute ``ops`` (a plan's copy log, in order) and return the caches to dispatch the plan's step with
        (``caches`` is donated when a load writes it; use only the returned ones)."""
        if self.sync and ops:
            jax.block_until_ready(caches)
            t0 = time.perf_counter()
            caches = self._apply(caches, ops)
            jax.block_until_ready((caches, list(self.batches.values())))
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

    def _out(self, caches: ModelCaches, op: CopyOp) -> None:
        k, c = (_bucket(n) if n else 0 for n in (op.num_pages, op.num_ckpts))
        batch = self._gather(caches, _pad(op.pages_dev, k, 0), _pad(op.ckpts_dev, c, 0))
        b = self._next
        self._next += 1
        self.batches[b] = batch
        for kind, ids in (("p", op.pages_host), ("c", op.ckpts_host)):
            for i, h in enumerate(ids.tolist()):
                self.where[(kind, h)] = (b, i)
                self.live[b] += 1
        self.stats.bytes_out += sum(x.nbytes for x in jax.tree.leaves(batch))
        self.stats.pages_out += op.num_pages
        self.stats.ckpts_out += op.num_ckpts
        self.stats.calls += 1
        if not self.live[b]:
            self._release(b, 0)

    def _in(self, caches: ModelCaches, op: CopyOp) -> ModelCaches:
        num_pages, num_slots = next(iter(caches.pages.values())).shape[0], \
            (caches.gdn.conv.shape[1] if caches.gdn is not None else 0)
        by_batch: dict[int, list] = collections.defaultdict(lambda: [[], [], [], []])
        for kind, ids, dst in (("p", op.pages_host, op.pages_dev), ("c", op.ckpts_host, op.ckpts_dev)):
            for h, d in zip(ids.tolist(), dst.tolist()):
                b, i = self.where.pop((kind, h))
                parts = by_batch[b]
                parts[0 if kind == "p" else 2].append(i)
                parts[1 if kind == "p" else 3].append(d)
        for b, (src, dst, src_c, dst_c) in by_batch.items():
            parts = [self.batches[b]["pages"] if src else None, self.batches[b]["gdn"] if src_c else None]
            pages, gdn = jax.device_put(parts, self._device)  # asynchronous host -> device transfers
            k, c = _bucket(len(src)), _bucket(len(src_c))
            caches = self._scatter(caches, pages, gdn, _pad(np.asarray(src, np.int32), k, 0),
                                   _pad(np.asarray(dst, np.int32), k, num_pages),
                                   _pad(np.asarray(src_c, np.int32), c, 0),
                                   _pad(np.asarray(dst_c, np.int32), c, num_slots))
            self.stats.bytes_in += sum(x.nbytes for x in jax.tree.leaves(parts))
            self.stats.calls += 1
            self._release(b, len(src) + len(src_c))
        self.stats.pages_in += op.num_pages
        self.stats.ckpts_in += op.num_ckpts
        return caches

    def _release(self, b: int, n: int = 1) -> None:
        self.live[b] -= n
        if self.live[b] <= 0:
            del self.live[b], self.batches[b]
