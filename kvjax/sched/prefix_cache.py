"""Host prefix cache for hybrid models: full prompt blocks shared between requests through the page pool.

Records. Prompt blocks are keyed by a hash chain and held as entries with one page per KV head and maybe a GDN
checkpoint (:mod:`kvjax.sched.prefix_index`: :func:`~kvjax.sched.prefix_index.block_key`,
:class:`~kvjax.sched.prefix_index.Entry`, :class:`~kvjax.sched.prefix_index.PrefixMatch`, the config).

Head-wise match. Resuming at ``L = m * ps`` tokens, a full head needs every block ``[0, m)``; a SWA head needs
its sink blocks and the blocks ``[recycle_stop(L), m)`` still in its window — its other entries become holes,
exactly as recycling would have left them. With GDN layers the match must also end at a block with a checkpoint.
:meth:`PrefixCache.match` returns the longest ``m <= (prompt_len - 1) // ps`` (one token is always computed) for
which every head (the layout is shared by all layers) has what it needs.

Pages. Cached pages are shared pages of the :class:`~kvjax.sched.blocks.BlockAllocator` (reference-counted,
never copied). A cached page no table holds is idle and counts as available: when the allocator needs it, the
cache evicts least-recently-used leaf entries first, then idle pages of inner entries. Anchors are the blocks
where matches are expected to end: the last reusable block of a published prompt, and branch points (where a
new prompt leaves a cached chain). Checkpoints are taken at anchors only: :meth:`PrefixCache.next_stop` tells the
scheduler where a prefill chunk must end so that the engine can copy the row's state there.

Recycling with caching (the ``recycle`` option; the scheduler uses :meth:`PrefixCache.recycle_policy`, timely
recycling plus this rule for recycled pages that are cached):

- ``eager``: the cache lets go of the page at once (memory as without caching; a later match that needs the
  page for that SWA head fails);
- ``keep_tail``: the cache keeps it if it lies in the window tail of an anchor below it (the SWA pages a match
  ending at that anchor needs), and lets go of the rest.

Host tier (``PrefixCacheConfig.host_bytes > 0``): eviction spills to host memory instead of dropping, and a match
may load blocks back (:mod:`kvjax.sched.prefix_host`, the budget in :mod:`kvjax.sched.host_tier`).

Scheduler integration (one row = one GDN slot; :class:`~kvjax.sched.scheduler.Scheduler` does this): at admission
``m = cache.match(prompt)`` then ``ckpt = cache.attach(row, m, prompt)`` (the scheduler sets ``num_computed =
m.num_tokens`` and allocates only the blocks after the match; the engine copies checkpoint ``ckpt`` into the row's
slot, ``-1``: none); cap each prefill chunk at ``cache.next_stop(row, num_computed)``; once a step's plan computes
prompt blocks, ``slot = cache.publish(row, num_computed)`` (``slot >= 0``: the engine copies the row's state into
it after that step); ``cache.release(row)`` before freeing the row; recycle with ``cache.recycle_policy()``.
``BlockAllocator.can_fit``/``allocate`` evict by themselves.
"""

from __future__ import annotations

import collections
import heapq
import operator

import numpy as np

from kvjax.sched import prefix_host
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.host_tier import HostTier
from kvjax.sched.prefix_index import (NO_ANCHOR, RECYCLE_MODES, ROOT, Entry, PrefixCacheConfig, PrefixMatch, Row,
                                      block_key, block_key_bytes)
from kvjax.sched.recycle import first_recyclable_block, recyclable_ranges, recycle_stop

_last_use = operator.attrgetter("used")

__all__ = ["RECYCLE_MODES", "CachedRecycle", "PrefixCache", "PrefixCacheConfig", "PrefixMatch", "block_key"]


class PrefixCache:
    """Prefix cache over the pages of ``blocks`` (it becomes the allocator's reclaimer). See the module doc."""

    def __init__(self, blocks: BlockAllocator, config: PrefixCacheConfig) -> None:
        if not isinstance(blocks, BlockAllocator) or not isinstance(config, PrefixCacheConfig):
            raise ValueError(f"need a BlockAllocator and a PrefixCacheConfig, got {type(blocks).__name__}, "
                             f"{type(config).__name__}")
        if blocks.reclaimer is not None:
            raise ValueError("this BlockAllocator already has a prefix cache")
        blocks.reclaimer = self
        self.blocks, self.config, self.ps = blocks, config, blocks.page_size
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # oldest first
        self.page_entry: dict[int, int] = {}  # cached page -> key of its entry
        first = blocks.cache.max_seqs + 1
        self.checkpoint_slots = range(first, first + config.num_checkpoints)
        self.ckpt_free = list(reversed(self.checkpoint_slots))  # pop() -> lowest
        self.ckpt_entry: dict[int, Entry] = {}  # held checkpoint slot -> the entry holding it
        self.rows: dict[int, Row] = {}
        self.first_kept = first_recyclable_block(blocks.sinks, self.ps)  # i64[H]: sink blocks below
        self.host = HostTier(config.host_bytes, config.page_bytes, config.ckpt_bytes) if config.host_bytes else None
        self.busy: set[int] = set()  # host tier: checkpoint slots this plan restores or saves (not evicted)
        self.pinned: set[int] = set()  # keys of the chain being attached (never deleted or evicted from the host)
        self.hit_tokens_device = 0  # matched tokens attached from device pages only, all attaches
        self.hit_tokens_host = 0  # matched tokens of blocks that needed a load from the host tier
        self._fresh: dict[int, tuple[int, int]] = {}  # rows attached in this plan -> (device, host) hit tokens
        self._clock = 0  # the latest Entry.used stamp (entries' order = their stamps' order)
        self._new_leaves: list[Entry] | None = None  # during reclaim's first pass: entries deletions made leaves

    # ---- lookup --------------------------------------------------------------------------------------------
    def match(self, prompt: np.ndarray) -> PrefixMatch:
        """The longest usable cached prefix of ``prompt`` (``int[P]``); changes nothing."""
        prompt = np.asarray(prompt)
        limit = (prompt.size - 1) // self.ps
        data, nb = np.ascontiguousarray(prompt, np.int32).tobytes(), 4 * self.ps  # the blocks' int32 bytes
        chain, parent = [], ROOT
        for b in range(limit):
            tok = data[b * nb: (b + 1) * nb]
            e = self.entries.get(block_key_bytes(parent, tok))
            if e is None or e.parent != parent or e.tokens.tobytes() != tok:
                break
            chain.append(e)
            parent = e.key
        k, H = len(chain), self.blocks.num_heads
        m = self._longest(chain, self.host is not None)
        if m and self.host is not None and not prefix_host.loads_fit(self, chain, m):
            m = self._longest(chain, False)
        pages = np.stack([e.pages for e in chain[:m]], 1) if m else np.zeros((H, 0), np.int64)
        host = np.stack([e.host for e in chain[:m]], 1) if m else np.zeros((H, 0), np.int64)
        need = self.needed(m)  # bool[H, m]
        stops = [s * self.ps for s in sorted({limit, k if m < k < limit else limit}) if s > m] \
            if self.config.gdn else []
        cursor = np.where(self.blocks.window > 0, np.maximum(recycle_stop(m * self.ps, self.blocks.window, self.ps),
                                                             self.first_kept), 0) if m else np.zeros(H, np.int64)
        ckpt = chain[m - 1].ckpt if m and self.config.gdn else -1
        ckpt_host = chain[m - 1].hckpt if m and self.config.gdn and ckpt < 0 else -1
        return PrefixMatch(m * self.ps, np.where(need, pages, -1), cursor.astype(np.int64), ckpt, k, tuple(stops),
                           tuple(e.key for e in chain), np.where(need & (pages < 0), host, -1), ckpt_host)

    def needed(self, m: int) -> np.ndarray:
        """bool[H, m]: the blocks each head needs when resuming at ``m`` blocks."""
        return self.needed_at(np.array([m]), m)[0]

    def needed_at(self, ms: np.ndarray, k: int) -> np.ndarray:
        """bool[M, H, k]: block ``b`` of head ``h`` is needed when resuming at ``ms[i]`` blocks (``b < ms[i]``;
        ``ms``: i64[M])."""
        b = np.arange(k)
        stop = recycle_stop(ms[:, None] * self.ps, self.blocks.window[None, :], self.ps)  # i64[M, H]
        full = (self.blocks.window == 0)[:, None] | (b[None, :] < self.first_kept[:, None])  # bool[H, k]
        return (full[None] | (b[None, None, :] >= stop[:, :, None])) & (b < ms[:, None])[:, None, :]

    def _longest(self, chain: list[Entry], host: bool) -> int:
        """The longest usable match over ``chain``; ``host``: blocks and checkpoints on the host tier count."""
        k = len(chain)
        if k == 0:
            return 0
        pages = np.stack([e.pages for e in chain], 1)  # i64[H, k]
        missing = pages < 0
        if host:
            missing &= np.stack([e.host for e in chain], 1) < 0
        m = np.arange(1, k + 1)  # i64[k]: candidate match lengths
        if self.config.gdn:
            loadable = host and prefix_host.checkpoint_loadable(self)
            m = m[[e.ckpt >= 0 or (loadable and e.hckpt >= 0) for e in chain]]
        if len(m) == 0:
            return 0
        bad = missing[None] & self.needed_at(m, k)  # bool[M, H, k]: missing and needed when resuming at m blocks
        ok = m[~bad.any(axis=(1, 2))]
        return int(ok[-1]) if len(ok) else 0

    # ---- a request's life ----------------------------------------------------------------------------------
    def attach(self, row: int, match: PrefixMatch, prompt: np.ndarray) -> int:
        """Give the empty ``row`` the matched blocks (no copy) and start tracking the request whose prompt is
        ``prompt`` (``int[P]``, the one matched). Returns the checkpoint slot the engine copies into the row's GDN
        slot (-1: none, start from zeros). Call on a miss too."""
        if row in self.rows:
            raise ValueError(f"row {row} is already attached")
        m = match.num_tokens // self.ps
        self.blocks.attach(row, match.pages, match.cursor)
        for key in reversed(match.keys):  # most recent: the root (a leaf is evicted before its ancestors)
            self._use(self.entries[key])
        limit = (np.asarray(prompt).size - 1) // self.ps
        if m < match.chain_blocks < limit:  # the prompt leaves the chain here: a branch point
            self._mark_anchor(self.entries[match.keys[-1]])
        self.rows[row] = Row(np.asarray(prompt), m, match.keys[m - 1] if m else ROOT, limit, list(match.stops))
        ckpt, loaded = match.checkpoint, 0
        if self.host is not None and m:
            ckpt, loaded = prefix_host.load(self, row, match)
            if ckpt >= 0:
                self.busy.add(ckpt)
        hits = (match.num_tokens - loaded * self.ps, loaded * self.ps)
        self.hit_tokens_device += hits[0]
        self.hit_tokens_host += hits[1]
        self._fresh[row] = hits
        return ckpt

    def begin_plan(self) -> None:
        """A new plan starts (the scheduler calls this first in ``schedule``): checkpoint slots the previous plan
        restores or saves may be evicted again (its copies have been logged before its step)."""
        self.busy.clear()
        self._fresh.clear()

    def next_stop(self, row: int, num_computed: int) -> int | None:
        """The token count where this row's next prefill chunk must end (a checkpoint), or None."""
        return next((s for s in self.rows[row].stops if s > num_computed), None)

    def publish(self, row: int, num_computed: int) -> int:
        """Insert the row's prompt blocks that ``num_computed`` tokens completed. Returns a checkpoint slot the
        engine fills with the row's GDN state after this step (``num_computed`` is a stop), else -1."""
        r = self.rows[row]
        upto = min(num_computed // self.ps, r.end)
        while not r.dead and r.published < upto:
            b = r.published
            tok = r.prompt[b * self.ps: (b + 1) * self.ps]
            data = r.data[4 * b * self.ps: 4 * (b + 1) * self.ps]
            key = block_key_bytes(r.parent, data)
            e = self.entries.get(key)
            if e is not None and (e.parent != r.parent or e.tokens.tobytes() != data):
                r.dead = True  # hash collision: leave the other chain alone
                break
            if e is None and r.parent != ROOT and r.parent not in self.entries:
                r.dead = True  # the parent was evicted: never create an entry no chain reaches
                break
            if e is None:
                heads = np.arange(self.blocks.num_heads)
                e = Entry(key, r.parent, b, tok.astype(np.int32), self.blocks.share(row, heads, heads * 0 + b))
                self.entries[key] = e
                self._use(e)
                parent = self.entries.get(r.parent)
                if parent is not None:
                    parent.children += 1
                    if parent.children == 2:
                        self._mark_anchor(parent)
            else:
                self._fill_holes(row, e)
                self._use(e)
            self.page_entry.update((p, key) for p in e.pages[e.pages >= 0].tolist())
            r.parent, r.published = key, b + 1
            if b + 1 == r.end:
                self._mark_anchor(e)
        slot = -1
        if self.config.gdn and num_computed in r.stops and num_computed // self.ps == r.published and not r.dead:
            e = self.entries[r.parent]
            if e.ckpt < 0:
                e.ckpt = slot = self.take_checkpoint()
                if slot >= 0:
                    self.ckpt_entry[slot] = e
                if slot >= 0 and e.hckpt >= 0:  # the fresh state replaces the host copy
                    self.host.drop(np.zeros(0, np.int64), np.array([e.hckpt], np.int64))
                    e.hckpt = -1
                    prefix_host.touch(self, e)
        r.stops = [s for s in r.stops if s > num_computed]
        return slot

    def release(self, row: int) -> None:
        """Stop tracking the row (finished, aborted or preempted; or not admitted after all, in the plan that
        attached it: its hits are not counted); call before ``blocks.free_row``."""
        self.rows.pop(row, None)
        device, host = self._fresh.pop(row, (0, 0))
        self.hit_tokens_device -= device
        self.hit_tokens_host -= host

    def _use(self, e: Entry) -> None:
        """``e`` was just used: last in the LRU order of ``entries``, its ``used`` stamp the latest."""
        self.entries.move_to_end(e.key)
        self._clock += 1
        e.used = self._clock

    def _fill_holes(self, row: int, e: Entry) -> None:
        pages = self.blocks.tables[row, :, e.depth]
        heads = np.flatnonzero((e.pages < 0) & (pages >= 0) & (self.blocks.owner_row[np.maximum(pages, 0)] == row))
        if len(heads):
            e.pages[heads] = self.blocks.share(row, heads, np.full(len(heads), e.depth))
            e.resident += len(heads)
            spilled = heads[e.host[heads] >= 0]
            if len(spilled):  # the row recomputed blocks the host tier holds: the device copy replaces them
                self.host.drop(e.host[spilled], np.zeros(0, np.int64))
                e.host[spilled] = -1
                prefix_host.touch(self, e)

    def _mark_anchor(self, e: Entry) -> None:
        e.anchor = True
        x = e
        while x is not None and x.near > e.depth:
            x.near = e.depth
            x = self.entries.get(x.parent)

    def take_checkpoint(self) -> int:
        """A free checkpoint slot, evicting (with a host tier: spilling) the least recently used one if none is
        free; -1 when every held slot is busy in this plan (host tier only)."""
        if not self.ckpt_free:  # evict the least recently used checkpoint; first those with one child (a
            held = sorted((e for c, e in self.ckpt_entry.items()  # prompt went on past it: a past turn)
                           if c not in self.busy), key=_last_use)
            if not held:
                return -1
            victim = next((e for e in held if e.children == 1), held[0])
            if self.host is not None and prefix_host.make_room(self, self.host.cost(0, 1), victim.key):
                _, (victim.hckpt,) = self.host.spill(np.zeros(0, np.int64), np.array([victim.ckpt], np.int64))
                self.host.touch(victim.key)
            self.ckpt_free.append(victim.ckpt)
            del self.ckpt_entry[victim.ckpt]
            victim.ckpt = -1
        slot = self.ckpt_free.pop()
        if self.host is not None:
            self.busy.add(slot)
        return slot

    # ---- the plan's hits and copies ------------------------------------------------------------------------
    def plan_hits(self) -> tuple[int, int]:
        """``(device, host)`` prompt tokens the admissions of the plan being built took from the cache (host: the
        blocks loaded from the host tier)."""
        return sum(d for d, _ in self._fresh.values()), sum(h for _, h in self._fresh.values())

    def take_copies(self) -> tuple:
        """The host tier's copies logged since the last call (:meth:`HostTier.take`), in order; ``()`` without
        a host tier. The engine executes them before dispatching the plan just scheduled; the plan's cache
        calls are over (its admissions' hits count from now on, whatever happens to the rows)."""
        self._fresh.clear()
        return self.host.take() if self.host is not None else ()

    # ---- memory --------------------------------------------------------------------------------------------
    def reclaim(self, need: list[int]) -> None:
        """Let go of idle pages until ``need[pool]`` have gone back to each pool's free list: least recently
        used leaf entries first, each chain from its leaf up (an entry left with no page is deleted), then idle
        pages of any entry.

        As if each pass visited every entry holding a page when it began, in LRU order (a visit of an entry with
        no idle page of a pool still short, or in the first pass one with children, changes nothing): a pass
        visits only the entries holding such a page when it began (:meth:`_holding_idle`), in the first pass
        those that are leaves by their turn (a heap by last use, fed as deletions make leaves). The pages go back
        to the free lists at the end, in the order they were let go of (nothing in between reads the lists)."""
        need = list(need)
        released: list[int] = []  # pages let go of, in order (each entry's sorted)
        entries = self.entries
        for leaves_only in (True, False):
            if not any(n > 0 for n in need):
                break
            held = self._holding_idle(need)  # list[Entry], LRU order
            emptied: set[int] = set()  # keys of entries this pass left with no page
            if leaves_only:
                keys = {e.key for e in held}
                heap = [(e.used, e.key) for e in held if not e.children]
                self._new_leaves = []
            else:
                heap = [(e.used, e.key) for e in held]
            heapq.heapify(heap)
            now = 0  # last-use stamp of the entry visited last
            while heap and any(n > 0 for n in need):
                now, key = heapq.heappop(heap)
                e = entries.get(key)
                if e is None or (leaves_only and e.children) or not (e.resident or key in emptied):
                    continue
                self._drop(e, need, released, emptied)
                while leaves_only and any(n > 0 for n in need):
                    gone = e.key not in entries  # deleted, or (host tier) left with host copies only
                    if not gone and not (self.host is not None and e.resident == 0):
                        break
                    e = entries.get(e.parent)  # its parent became a leaf: same last use, one block up
                    if e is None or e.children > (0 if gone else 1):
                        break
                    self._drop(e, need, released, emptied)
                if leaves_only and self._new_leaves:  # leaves made by deletions: visited at their turn if later
                    for x in self._new_leaves:
                        if x.key in keys and x.used > now:
                            heapq.heappush(heap, (x.used, x.key))
                    self._new_leaves = []
            self._new_leaves = None
        if released:
            self.blocks.uncache(np.array(released, np.int64), keep_order=True)
        if any(n > 0 for n in need):
            raise AssertionError(f"prefix cache: {need} idle pages not found")

    def _holding_idle(self, need: list[int]) -> list[Entry]:
        """The entries holding an idle page of a pool with ``need > 0``."""
        b = self.blocks
        idle = np.flatnonzero(b.cached & (b.refs == 0))  # i64[n]
        if len(need) > 1:
            idle = idle[np.asarray(need)[b.pool_of_head[b.owner_head[idle]]] > 0]
        page_entry, entries = self.page_entry, self.entries  # pages let go of in this reclaim have no entry
        return [entries[k] for k in {page_entry.get(p) for p in idle.tolist()} if k is not None]

    def _drop(self, e: Entry, need: list[int], released: list[int], emptied: set[int]) -> None:
        """Let go of the idle pages of ``e`` in pools with ``need > 0`` (counting down; with a host tier spilling
        them), appending them to ``released`` (sorted; the caller uncaches them) and ``e``'s key to ``emptied`` if
        it holds no page any more; delete ``e`` then if it holds nothing."""
        if not e.resident:  # nothing on the device (a host-tier entry): nothing to drop, nothing to delete
            return
        b = self.blocks
        refs = b.refs
        pages = e.pages.tolist()
        idle = [h for h, p in enumerate(pages) if p >= 0 and refs[p] == 0]
        if not idle:
            return
        if len(need) > 1:
            kept = []
            for h in idle:
                p = int(b.pool_of_head[h])
                if need[p] > 0:
                    need[p] -= 1
                    kept.append(h)
            idle = kept
            if not idle:
                return
        elif need[0] < len(idle):
            idle = idle[: max(need[0], 0)]
            if not idle:
                return
        if len(need) == 1:
            need[0] -= len(idle)
        idle_pages = [pages[h] for h in idle]
        host = self.host
        if host is not None:
            nbytes = len(idle) * host.page_bytes
            if host.capacity_bytes - host.used_bytes >= nbytes or prefix_host.make_room(self, nbytes, e.key):
                for h, i in zip(idle, host.spill_pages(idle_pages)):
                    e.host[h] = i
                host.touch(e.key)
        released += sorted(idle_pages)
        page_entry, e_pages = self.page_entry, e.pages
        for h, p in zip(idle, idle_pages):
            del page_entry[p]
            e_pages[h] = -1
        e.resident -= len(idle)
        if not e.resident:
            emptied.add(e.key)
            self.delete_if_empty(e)

    def delete_if_empty(self, e: Entry) -> None:
        """Delete ``e`` if it holds no page and has no children, then its parent likewise (an inner entry with
        no page stays: it keeps its descendants reachable)."""
        while e is not None and not e.children and (e.pages < 0).all() and (e.host < 0).all() \
                and self.entries.get(e.key) is e and e.key not in self.pinned:
            del self.entries[e.key]
            if e.ckpt >= 0:
                self.ckpt_free.append(e.ckpt)
                del self.ckpt_entry[e.ckpt]
            if e.hckpt >= 0:
                self.host.drop(np.zeros(0, np.int64), np.array([e.hckpt], np.int64))
            if self.host is not None:
                self.host.forget(e.key)
            e = self.entries.get(e.parent)
            if e is not None:
                e.children -= 1
                if not e.children and self._new_leaves is not None:
                    self._new_leaves.append(e)

    def clear(self) -> int:
        """Let go of every cached page and checkpoint (pages that rows still hold are freed with their rows).
        Returns pages freed."""
        pages = np.fromiter(self.page_entry, np.int64, len(self.page_entry))
        freed = self.blocks.uncache(pages) if len(pages) else 0
        if self.host is not None:
            for e in self.entries.values():
                if (e.host >= 0).any() or e.hckpt >= 0:
                    self.host.drop(e.host[e.host >= 0], np.array([e.hckpt] if e.hckpt >= 0 else [], np.int64))
            self.host.lru.clear()
        self.entries.clear()
        self.page_entry.clear()
        self.ckpt_free = list(reversed(self.checkpoint_slots))
        self.ckpt_entry.clear()
        self.busy.clear()
        return freed

    def cached_pages(self) -> int:
        return len(self.page_entry)

    def checkpoints_used(self) -> int:
        return len(self.checkpoint_slots) - len(self.ckpt_free)

    # ---- recycling -----------------------------------------------------------------------------------------
    def recycle_policy(self) -> CachedRecycle:
        """Timely recycling, then this cache's ``recycle`` option for the pages it holds (:class:`CachedRecycle`)."""
        return CachedRecycle(self)

    def on_recycled(self, heads: np.ndarray, pages: np.ndarray) -> int:
        """Apply the ``recycle`` option to ``pages`` (i64[K], on ``heads``) that rows just recycled; returns
        pages freed."""
        b = self.blocks
        pages, first = np.unique(pages, return_index=True)  # rows sharing a page recycle it in one call
        heads = heads[first]
        sel = b.cached[pages] & (b.refs[pages] == 0)
        drop = []
        keep_tail, ps, window = self.config.recycle == "keep_tail", self.ps, b.window.tolist()
        for h, p in zip(heads[sel].tolist(), pages[sel].tolist()):
            e = self.entries[self.page_entry[p]]
            if keep_tail and e.near != NO_ANCHOR:
                end, w = (e.near + 1) * ps, window[h]  # recycle_stop(end, w, ps), in Python ints
                if e.depth >= (min(max((end - w + 1) // ps, 0), end // ps) if w > 0 else 0):
                    continue
            e.pages[h] = -1
            e.resident -= 1
            del self.page_entry[p]
            drop.append((e, p))
        freed = b.uncache(np.array([p for _, p in drop], np.int64)) if drop else 0
        for e, _ in drop:
            self.delete_if_empty(e)
        return freed

    # ---- invariants ----------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless every cached page is in exactly one entry on its head, entries and
        children counts agree, and checkpoint slots are each free or held by one entry."""
        b = self.blocks
        seen = {}
        children = collections.Counter(e.parent for e in self.entries.values())
        for key, e in self.entries.items():
            for h, p in enumerate(e.pages.tolist()):
                if p >= 0:
                    if p in seen or self.page_entry.get(p) != key or not b.cached[p] or b.owner_head[p] != h:
                        raise AssertionError(f"entry at depth {e.depth}: page {p} of head {h} is not its own")
                    seen[p] = key
            if e.resident != int((e.pages >= 0).sum()):
                raise AssertionError(f"entry at depth {e.depth}: resident {e.resident} != its "
                                     f"{(e.pages >= 0).sum()} pages")
            if e.children != children.get(key, 0) or ((e.pages < 0).all() and (e.host < 0).all() and not e.children):
                raise AssertionError(f"entry at depth {e.depth}: children {e.children} != {children.get(key, 0)}, "
                                     f"or no page")
            if ((e.pages >= 0) & (e.host >= 0)).any() or (e.ckpt >= 0 and e.hckpt >= 0):
                raise AssertionError(f"entry at depth {e.depth}: a block or checkpoint both on device and on host")
        used = [e.used for e in self.entries.values()]
        if any(a >= b for a, b in zip(used, used[1:])):
            raise AssertionError("the entries' last-use stamps do not increase along their LRU order")
        if len(seen) != len(self.page_entry) or int(b.cached.sum()) != len(seen):
            raise AssertionError("a cached page belongs to no entry")
        ckpts = [e.ckpt for e in self.entries.values() if e.ckpt >= 0] + self.ckpt_free
        if sorted(ckpts) != list(self.checkpoint_slots):
            raise AssertionError(f"checkpoint slots held + free {sorted(ckpts)} != {list(self.checkpoint_slots)}")
        if self.ckpt_entry != {e.ckpt: e for e in self.entries.values() if e.ckpt >= 0}:
            raise AssertionError("ckpt_entry differs from the entries holding checkpoint slots")
        if self.host is not None:
            prefix_host.check(self)


class CachedRecycle:
    """Timely recycling of SWA blocks, then the cache's ``recycle`` option for recycled pages it holds."""

    frees_swa_blocks = True

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.name = f"timely+{cache.config.recycle}"

    def recycle(self, blocks: BlockAllocator, rows: np.ndarray, num_computed: np.ndarray) -> int:
        swa = blocks.swa_heads
        if len(swa) == 0 or len(rows) == 0:
            return 0
        rr, hh, start, stop = recyclable_ranges(blocks, rows, swa, num_computed, blocks.window[swa],
                                                blocks.sinks[swa])
        if len(rr) == 0:
            return 0
        counts = stop - start
        bb = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - start, counts)
        heads = np.repeat(hh, counts)
        pages = blocks.tables[np.repeat(rr, counts), heads, bb].astype(np.int64)
        freed = blocks.free_ranges(rr, hh, start, stop)
        blocks.recycled_upto[rr, hh] = stop
        held = pages >= 0
        return freed + self.cache.on_recycled(heads[held], pages[held])
