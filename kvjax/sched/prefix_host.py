"""The prefix cache's host tier: spilling what the device evicts, loading it back on a hit, and its checks.

Host tier (``PrefixCacheConfig.host_bytes > 0``; :mod:`kvjax.sched.host_tier`). Eviction spills instead of
dropping: a reclaimed idle page becomes a host copy of that head's block (``Entry.host``), an evicted checkpoint a
host checkpoint (``Entry.hckpt``); the tier's budget evicts its least recently used entries' copies. A match
counts host copies as present when fresh device pages (and, for the final checkpoint, a slot) can be had;
:meth:`PrefixCache.attach` then fills the row's holes with fresh pages and logs the loads. Each head of a block is
on the device, on the host or in flight (logged, not yet executed by the engine), never two at once. Checkpoint
slots that the plan being built restores or saves are *busy*: not evicted before :meth:`PrefixCache.begin_plan`
(the copies of a plan run before its step, so evicting one would overwrite or spill it too early).
:meth:`PrefixCache.take_copies` hands the plan's copy log to the engine.

These functions are the :class:`~kvjax.sched.prefix_cache.PrefixCache`'s own (``cache`` is one, with a host tier):
they read and change its entries, pages and checkpoint slots (``cache.pinned``: the chain being attached;
``cache.busy``: checkpoint slots of the plan being built) and log copies in ``cache.host``
(:class:`~kvjax.sched.host_tier.HostTier`).
"""

from __future__ import annotations

import numpy as np

from kvjax.sched.prefix_index import Entry, PrefixMatch


def checkpoint_loadable(cache: PrefixCache) -> bool:
    """A device checkpoint slot can be had for a load now (free, or held and not busy in this plan)."""
    return bool(cache.ckpt_free) or any(c not in cache.busy for c in cache.ckpt_entry)


def loads_fit(cache: PrefixCache, chain: list[Entry], m: int) -> bool:
    """The device pages of the host blocks a match of ``m`` blocks loads fit in every pool, with the idle
    pages the match attaches no longer reclaimable."""
    b = cache.blocks
    pages = np.stack([e.pages for e in chain[:m]], 1)  # i64[H, m]
    need = cache.needed(m)
    heads = np.nonzero(need & (pages < 0))[0]  # i64[K]: head of each page to load
    if len(heads) == 0:
        return True
    held = pages[need & (pages >= 0)]
    pinned = held[b.refs[held] == 0]  # idle pages the attach takes
    n = len(b.free_pages())
    load = np.bincount(b.pool_of_head[heads], minlength=n)
    taken = np.bincount(b.pool_of_head[b.owner_head[pinned]], minlength=n)
    return all(l <= f + i - t for l, f, i, t in zip(load.tolist(), b.free_pages(), b.idle, taken.tolist()))


def load(cache: PrefixCache, row: int, match: PrefixMatch) -> tuple[int, int]:
    """Bring the match's host blocks (and checkpoint) back into fresh device pages (a checkpoint slot) of
    ``row``'s table, logging the loads after any spill the allocation causes. Returns (checkpoint slot, blocks
    loaded)."""
    m = match.num_tokens // cache.ps
    chain = [cache.entries[key] for key in match.keys[:m]]
    heads, blks = np.nonzero(match.host >= 0)
    if len(heads) == 0 and match.ckpt_host < 0:
        return match.checkpoint, 0
    cache.pinned = set(match.keys[:m])
    ids = match.host[heads, blks]
    for h, b in zip(heads.tolist(), blks.tolist()):
        chain[b].host[h] = -1  # the host copy is consumed by the load
    pages = cache.blocks.attach_new(row, heads, blks)
    for h, b, p in zip(heads.tolist(), blks.tolist(), pages.tolist()):
        chain[b].pages[h] = p
        chain[b].resident += 1
        cache.page_entry[p] = chain[b].key
    ckpt, ck_dev, ck_host = match.checkpoint, [], []
    if match.ckpt_host >= 0:
        chain[-1].hckpt = -1
        ckpt = cache.take_checkpoint()
        if ckpt < 0:
            raise AssertionError("prefix cache: no checkpoint slot for a load that match found loadable")
        chain[-1].ckpt, ck_dev, ck_host = ckpt, [ckpt], [match.ckpt_host]
        cache.ckpt_entry[ckpt] = chain[-1]
    cache.host.load(ids, pages, np.array(ck_host, np.int64), np.array(ck_dev, np.int64))
    for e in chain:
        touch(cache, e)
    cache.pinned = set()
    return ckpt, max(len(np.unique(blks)), int(match.ckpt_host >= 0))


def touch(cache: PrefixCache, e: Entry) -> None:
    """Keep ``e``'s place in the host LRU order right: most recent if it holds host data, absent if not."""
    if (e.host >= 0).any() or e.hckpt >= 0:
        cache.host.touch(e.key)
    else:
        cache.host.forget(e.key)


def make_room(cache: PrefixCache, nbytes: int, keep: int) -> bool:
    """Evict host data of least recently used entries (not ``keep``, not pinned) until ``nbytes`` fit;
    False (nothing evicted beyond what was needed so far) if they cannot."""
    if nbytes > cache.host.capacity_bytes:
        return False
    while cache.host.free_bytes() < nbytes:
        key = next((k for k in cache.host.lru if k != keep and k not in cache.pinned), None)
        if key is None:
            return False
        evict(cache, cache.entries[key])
    return True


def evict(cache: PrefixCache, e: Entry) -> None:
    """Forget ``e``'s host copies (log a drop); delete ``e`` if it holds nothing any more."""
    held = e.host >= 0
    cache.host.drop(e.host[held], np.array([e.hckpt] if e.hckpt >= 0 else [], np.int64))
    e.host[held] = -1
    e.hckpt = -1
    cache.host.forget(e.key)
    cache.host.evictions += 1
    cache.delete_if_empty(e)


def check(cache: PrefixCache) -> None:
    """Host tier: every host id held once, the budget equals what the entries hold and fits, the LRU order
    lists exactly the entries with host data, and every logged load writes a page / slot its entry holds."""
    hp = [h for e in cache.entries.values() for h in e.host[e.host >= 0].tolist()]
    hc = [e.hckpt for e in cache.entries.values() if e.hckpt >= 0]
    if len(set(hp + hc)) != len(hp) + len(hc):
        raise AssertionError("a host id is held twice")
    used = cache.host.cost(len(hp), len(hc))
    if used != cache.host.used_bytes or used > cache.host.capacity_bytes:
        raise AssertionError(f"host tier: entries hold {used} bytes, budget says {cache.host.used_bytes} of "
                             f"{cache.host.capacity_bytes}")
    holders = {k for k, e in cache.entries.items() if (e.host >= 0).any() or e.hckpt >= 0}
    if set(cache.host.lru) != holders:
        raise AssertionError("host LRU order differs from the entries holding host data")
    pages, ckpts = cache.host.pending()
    held = {e.ckpt for e in cache.entries.values()}
    if any(p not in cache.page_entry for p in pages) or not ckpts <= held:
        raise AssertionError("a logged load writes a page or checkpoint slot no entry holds")
