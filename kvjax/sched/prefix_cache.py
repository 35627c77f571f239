"""Host prefix cache for hybrid models: full prompt blocks shared between requests through the page pool.

Keys. Block ``b`` of a prompt (tokens ``[b*ps, (b+1)*ps)``) is keyed by a 64-bit hash of (key of block ``b-1``,
its tokens), so a key covers every token before it; an entry stores its parent key and tokens, and a lookup that
finds a key with other contents (a hash collision) stops there. An entry holds one page per KV head (``-1`` where
that head's page was given up) and, for models with GDN layers, maybe a checkpoint slot: the recurrent state
after its block, in a GDN-pool slot ``max_seqs + 1 .. max_seqs + num_checkpoints`` (beside the running requests'
slots ``1..max_seqs``; the device copies are the engine's).

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

Host tier (``PrefixCacheConfig.host_bytes > 0``; :mod:`kvjax.sched.host_tier`). Eviction spills instead of
dropping: a reclaimed idle page becomes a host copy of that head's block (``_Entry.host``), an evicted checkpoint a
host checkpoint (``_Entry.hckpt``); the tier's budget evicts its least recently used entries' copies. A match
counts host copies as present when fresh device pages (and, for the final checkpoint, a slot) can be had;
:meth:`PrefixCache.attach` then fills the row's holes with fresh pages and logs the loads. Each head of a block is
on the device, on the host or in flight (logged, not yet executed by the engine), never two at once. Checkpoint
slots that the plan being built restores or saves are *busy*: not evicted before :meth:`PrefixCache.begin_plan`
(the copies of a plan run before its step, so evicting one would overwrite or spill it too early).
:meth:`PrefixCache.take_copies` hands the plan's copy log to the engine.

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
import dataclasses
import hashlib

import numpy as np

from kvjax.config import is_int
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.host_tier import HostTier
from kvjax.sched.recycle import first_recyclable_block, recyclable_ranges, recycle_stop

RECYCLE_MODES = ("eager", "keep_tail")
ROOT = 0  # parent key of block 0
NO_ANCHOR = 1 << 62


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
    """``num_checkpoints``: GDN checkpoint slots (must be >= 1 when ``gdn`` is True, 0 otherwise is fine);
    ``gdn``: the model has recurrent (GDN) layers, so a match ends only at a checkpoint; ``recycle``: what
    happens to a cached page a request recycles (``eager`` | ``keep_tail``); ``host_bytes``: the host tier's
    budget (0: no host tier; see "Host tier" in the module docstring), with ``page_bytes`` (one page of one KV head
    over every layer and role) and ``ckpt_bytes`` (one GDN checkpoint slot) to count it."""

    num_checkpoints: int = 0
    gdn: bool = True
    recycle: str = "keep_tail"
    host_bytes: int = 0
    page_bytes: int = 0
    ckpt_bytes: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.num_checkpoints) or self.num_checkpoints < 0:
            raise ValueError(f"PrefixCacheConfig.num_checkpoints must be an int >= 0, got {self.num_checkpoints!r}")
        if not isinstance(self.gdn, bool):
            raise ValueError(f"PrefixCacheConfig.gdn must be a bool, got {self.gdn!r}")
        if self.gdn and self.num_checkpoints < 1:
            raise ValueError("PrefixCacheConfig: a model with GDN layers resumes only from a checkpoint of its "
                             "recurrent state, so num_checkpoints must be >= 1 (0 would never hit)")
        if self.recycle not in RECYCLE_MODES:
            raise ValueError(f"PrefixCacheConfig.recycle must be one of {RECYCLE_MODES}, got {self.recycle!r}")
        for name in ("host_bytes", "page_bytes", "ckpt_bytes"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"PrefixCacheConfig.{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.host_bytes and (self.page_bytes < 1 or (self.gdn and self.ckpt_bytes < 1)):
            raise ValueError(f"PrefixCacheConfig: a host tier (host_bytes={self.host_bytes}) needs page_bytes >= 1 "
                             f"and, with GDN layers, ckpt_bytes >= 1; got {self.page_bytes}, {self.ckpt_bytes}")


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """What :meth:`PrefixCache.match` found for a prompt."""

    num_tokens: int  # m * page_size tokens served from the cache (0: a miss)
    pages: np.ndarray  # i64[H_kv, m]: pages of the matched blocks, -1 holes (blocks a SWA head no longer needs)
    cursor: np.ndarray  # i64[H_kv]: recycle cursor of each head after attaching (first block not yet handled)
    checkpoint: int  # GDN slot holding the state after m blocks; -1 without GDN layers or on a miss
    chain_blocks: int  # leading prompt blocks whose keys are cached (>= m)
    stops: tuple  # token counts (> num_tokens) where the request's state should be checkpointed
    keys: tuple  # keys of the chain_blocks cached blocks
    host: np.ndarray | None = None  # i64[H_kv, m]: host ids of needed blocks that attach loads (-1: none)
    ckpt_host: int = -1  # host id of the checkpoint attach loads into a device slot (checkpoint is then -1)


class _Entry:
    __slots__ = ("key", "parent", "depth", "tokens", "pages", "ckpt", "children", "anchor", "near", "host", "hckpt")

    def __init__(self, key: int, parent: int, depth: int, tokens: np.ndarray, pages: np.ndarray) -> None:
        self.key, self.parent, self.depth = key, parent, depth
        self.tokens = tokens  # i32[page_size]
        self.pages = pages  # i64[H_kv]; -1 where the cache holds no page for that head
        self.ckpt = -1  # GDN checkpoint slot, -1 none
        self.host = np.full_like(pages, -1)  # i64[H_kv]: host id of a head's spilled page (host tier), -1 none
        self.hckpt = -1  # host id of the spilled checkpoint, -1 none
        self.children = 0  # cached entries whose parent is this one
        self.anchor = False
        self.near = NO_ANCHOR  # depth of the nearest anchor in this entry's subtree (itself included)


class _Row:
    __slots__ = ("prompt", "published", "parent", "end", "stops", "dead")

    def __init__(self, prompt: np.ndarray, published: int, parent: int, end: int, stops: list[int]) -> None:
        self.prompt, self.published, self.parent, self.end, self.stops = prompt, published, parent, end, stops
        self.dead = False  # a hash collision stopped publishing


def block_key(parent: int, tokens: np.ndarray) -> int:
    """64-bit key of a block: hash of (parent key, the block's tokens as int32)."""
    h = hashlib.blake2b(int(parent).to_bytes(8, "little"), digest_size=8)
    h.update(np.ascontiguousarray(tokens, np.int32).tobytes())
    return int.from_bytes(h.digest(), "little") or 1


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
        self.entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # oldest first
        self.page_entry: dict[int, int] = {}  # cached page -> key of its entry
        first = blocks.cache.max_seqs + 1
        self.checkpoint_slots = range(first, first + config.num_checkpoints)
        self._ckpt_free = list(reversed(self.checkpoint_slots))  # pop() -> lowest
        self.rows: dict[int, _Row] = {}
        self.first_kept = first_recyclable_block(blocks.sinks, self.ps)  # i64[H]: sink blocks below
        self.host = HostTier(config.host_bytes, config.page_bytes, config.ckpt_bytes) if config.host_bytes else None
        self._busy: set[int] = set()  # host tier: checkpoint slots this plan restores or saves (not evicted)
        self._pinned: set[int] = set()  # keys of the chain being attached (never deleted or evicted from the host)
        self.hit_tokens_device = 0  # matched tokens attached from device pages only, all attaches
        self.hit_tokens_host = 0  # matched tokens of blocks that needed a load from the host tier
        self._fresh: dict[int, tuple[int, int]] = {}  # rows attached in this plan -> (device, host) hit tokens

    # ---- lookup --------------------------------------------------------------------------------------------
    def match(self, prompt: np.ndarray) -> PrefixMatch:
        """The longest usable cached prefix of ``prompt`` (``int[P]``); changes nothing."""
        prompt = np.asarray(prompt)
        limit = (prompt.size - 1) // self.ps
        chain, parent = [], ROOT
        for b in range(limit):
            tok = prompt[b * self.ps: (b + 1) * self.ps]
            e = self.entries.get(block_key(parent, tok))
            if e is None or e.parent != parent or not np.array_equal(e.tokens, tok):
                break
            chain.append(e)
            parent = e.key
        k, H = len(chain), self.blocks.num_heads
        m = self._longest(chain, self.host is not None)
        if m and self.host is not None and not self._loads_fit(chain, m):
            m = self._longest(chain, False)
        pages = np.stack([e.pages for e in chain[:m]], 1) if m else np.zeros((H, 0), np.int64)
        host = np.stack([e.host for e in chain[:m]], 1) if m else np.zeros((H, 0), np.int64)
        need = self._needed(m)  # bool[H, m]
        stops = [s * self.ps for s in sorted({limit, k if m < k < limit else limit}) if s > m] \
            if self.config.gdn else []
        cursor = np.where(self.blocks.window > 0, np.maximum(recycle_stop(m * self.ps, self.blocks.window, self.ps),
                                                             self.first_kept), 0) if m else np.zeros(H, np.int64)
        ckpt = chain[m - 1].ckpt if m and self.config.gdn else -1
        ckpt_host = chain[m - 1].hckpt if m and self.config.gdn and ckpt < 0 else -1
        return PrefixMatch(m * self.ps, np.where(need, pages, -1), cursor.astype(np.int64), ckpt, k, tuple(stops),
                           tuple(e.key for e in chain), np.where(need & (pages < 0), host, -1), ckpt_host)

    def _needed(self, m: int) -> np.ndarray:
        """bool[H, m]: the blocks each head needs when resuming at ``m`` blocks."""
        b = np.arange(m)[None, :]
        stop = recycle_stop(m * self.ps, self.blocks.window, self.ps)[:, None]
        return (self.blocks.window[:, None] == 0) | (b < self.first_kept[:, None]) | (b >= stop)

    def _longest(self, chain: list[_Entry], host: bool) -> int:
        """The longest usable match over ``chain``; ``host``: blocks and checkpoints on the host tier count."""
        k = len(chain)
        if k == 0:
            return 0
        missing = np.stack([(e.pages < 0) & ~(host & (e.host >= 0)) for e in chain], 1)  # bool[H, k]
        loadable = host and self._checkpoint_loadable()
        for m in range(k, 0, -1):
            if self.config.gdn and chain[m - 1].ckpt < 0 and not (loadable and chain[m - 1].hckpt >= 0):
                continue
            if not (missing[:, :m] & self._needed(m)).any():
                return m
        return 0

    def _checkpoint_loadable(self) -> bool:
        """A device checkpoint slot can be had for a load now (free, or held and not busy in this plan)."""
        return bool(self._ckpt_free) or any(e.ckpt >= 0 and e.ckpt not in self._busy for e in self.entries.values())

    def _loads_fit(self, chain: list[_Entry], m: int) -> bool:
        """The device pages of the host blocks a match of ``m`` blocks loads fit in every pool, with the idle
        pages the match attaches no longer reclaimable."""
        b = self.blocks
        pages = np.stack([e.pages for e in chain[:m]], 1)  # i64[H, m]
        need = self._needed(m)
        heads = np.nonzero(need & (pages < 0))[0]  # i64[K]: head of each page to load
        if len(heads) == 0:
            return True
        held = pages[need & (pages >= 0)]
        pinned = held[b.refs[held] == 0]  # idle pages the attach takes
        n = len(b.free_pages())
        load = np.bincount(b.pool_of_head[heads], minlength=n)
        taken = np.bincount(b.pool_of_head[b.owner_head[pinned]], minlength=n)
        return all(l <= f + i - t for l, f, i, t in zip(load.tolist(), b.free_pages(), b.idle, taken.tolist()))

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
            self.entries.move_to_end(key)
        limit = (np.asarray(prompt).size - 1) // self.ps
        if m < match.chain_blocks < limit:  # the prompt leaves the chain here: a branch point
            self._mark_anchor(self.entries[match.keys[-1]])
        self.rows[row] = _Row(np.asarray(prompt), m, match.keys[m - 1] if m else ROOT, limit, list(match.stops))
        ckpt, loaded = match.checkpoint, 0
        if self.host is not None and m:
            ckpt, loaded = self._load(row, match)
            if ckpt >= 0:
                self._busy.add(ckpt)
        hits = (match.num_tokens - loaded * self.ps, loaded * self.ps)
        self.hit_tokens_device += hits[0]
        self.hit_tokens_host += hits[1]
        self._fresh[row] = hits
        return ckpt

    def _load(self, row: int, match: PrefixMatch) -> tuple[int, int]:
        """Bring the match's host blocks (and checkpoint) back into fresh device pages (a checkpoint slot) of
        ``row``'s table, logging the loads after any spill the allocation causes. Returns (checkpoint slot, blocks
        loaded)."""
        m = match.num_tokens // self.ps
        chain = [self.entries[key] for key in match.keys[:m]]
        heads, blks = np.nonzero(match.host >= 0)
        if len(heads) == 0 and match.ckpt_host < 0:
            return match.checkpoint, 0
        self._pinned = set(match.keys[:m])
        ids = match.host[heads, blks]
        for h, b in zip(heads.tolist(), blks.tolist()):
            chain[b].host[h] = -1  # the host copy is consumed by the load
        pages = self.blocks.attach_new(row, heads, blks)
        for h, b, p in zip(heads.tolist(), blks.tolist(), pages.tolist()):
            chain[b].pages[h] = p
            self.page_entry[p] = chain[b].key
        ckpt, ck_dev, ck_host = match.checkpoint, [], []
        if match.ckpt_host >= 0:
            chain[-1].hckpt = -1
            ckpt = self._take_checkpoint()
            if ckpt < 0:
                raise AssertionError("prefix cache: no checkpoint slot for a load that match found loadable")
            chain[-1].ckpt, ck_dev, ck_host = ckpt, [ckpt], [match.ckpt_host]
        self.host.load(ids, pages, np.array(ck_host, np.int64), np.array(ck_dev, np.int64))
        for e in chain:
            self._touch_host(e)
        self._pinned = set()
        return ckpt, max(len(np.unique(blks)), int(match.ckpt_host >= 0))

    def begin_plan(self) -> None:
        """A new plan starts (the scheduler calls this first in ``schedule``): checkpoint slots the previous plan
        restores or saves may be evicted again (its copies have been logged before its step)."""
        self._busy.clear()
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
            key = block_key(r.parent, tok)
            e = self.entries.get(key)
            if e is not None and (e.parent != r.parent or not np.array_equal(e.tokens, tok)):
                r.dead = True  # hash collision: leave the other chain alone
                break
            if e is None and r.parent != ROOT and r.parent not in self.entries:
                r.dead = True  # the parent was evicted: never create an entry no chain reaches
                break
            if e is None:
                heads = np.arange(self.blocks.num_heads)
                e = _Entry(key, r.parent, b, tok.astype(np.int32), self.blocks.share(row, heads, heads * 0 + b))
                self.entries[key] = e
                parent = self.entries.get(r.parent)
                if parent is not None:
                    parent.children += 1
                    if parent.children == 2:
                        self._mark_anchor(parent)
            else:
                self._fill_holes(row, e)
                self.entries.move_to_end(key)
            self.page_entry.update((p, key) for p in e.pages[e.pages >= 0].tolist())
            r.parent, r.published = key, b + 1
            if b + 1 == r.end:
                self._mark_anchor(e)
        slot = -1
        if self.config.gdn and num_computed in r.stops and num_computed // self.ps == r.published and not r.dead:
            e = self.entries[r.parent]
            if e.ckpt < 0:
                e.ckpt = slot = self._take_checkpoint()
                if slot >= 0 and e.hckpt >= 0:  # the fresh state replaces the host copy
                    self.host.drop(np.zeros(0, np.int64), np.array([e.hckpt], np.int64))
                    e.hckpt = -1
                    self._touch_host(e)
        r.stops = [s for s in r.stops if s > num_computed]
        return slot

    def release(self, row: int) -> None:
        """Stop tracking the row (finished, aborted or preempted; or not admitted after all, in the plan that
        attached it: its hits are not counted); call before ``blocks.free_row``."""
        self.rows.pop(row, None)
        device, host = self._fresh.pop(row, (0, 0))
        self.hit_tokens_device -= device
        self.hit_tokens_host -= host

    def _fill_holes(self, row: int, e: _Entry) -> None:
        pages = self.blocks.tables[row, :, e.depth]
        heads = np.flatnonzero((e.pages < 0) & (pages >= 0) & (self.blocks.owner_row[np.maximum(pages, 0)] == row))
        if len(heads):
            e.pages[heads] = self.blocks.share(row, heads, np.full(len(heads), e.depth))
            spilled = heads[e.host[heads] >= 0]
            if len(spilled):  # the row recomputed blocks the host tier holds: the device copy replaces them
                self.host.drop(e.host[spilled], np.zeros(0, np.int64))
                e.host[spilled] = -1
                self._touch_host(e)

    def _mark_anchor(self, e: _Entry) -> None:
        e.anchor = True
        x = e
        while x is not None and x.near > e.depth:
            x.near = e.depth
            x = self.entries.get(x.parent)

    def _take_checkpoint(self) -> int:
        """A free checkpoint slot, evicting (with a host tier: spilling) the least recently used one if none is
        free; -1 when every held slot is busy in this plan (host tier only)."""
        if not self._ckpt_free:  # evict the least recently used checkpoint; first those with one child (a
            held = [e for e in self.entries.values()  # prompt went on past it: a past turn)
                    if e.ckpt >= 0 and e.ckpt not in self._busy]
            if not held:
                return -1
            victim = next((e for e in held if e.children == 1), held[0])
            if self.host is not None and self._make_room(self.host.cost(0, 1), victim.key):
                _, (victim.hckpt,) = self.host.spill(np.zeros(0, np.int64), np.array([victim.ckpt], np.int64))
                self.host.touch(victim.key)
            self._ckpt_free.append(victim.ckpt)
            victim.ckpt = -1
        slot = self._ckpt_free.pop()
        if self.host is not None:
            self._busy.add(slot)
        return slot

    # ---- host tier -----------------------------------------------------------------------------------------
    def _touch_host(self, e: _Entry) -> None:
        """Keep ``e``'s place in the host LRU order right: most recent if it holds host data, absent if not."""
        if (e.host >= 0).any() or e.hckpt >= 0:
            self.host.touch(e.key)
        else:
            self.host.forget(e.key)

    def _make_room(self, nbytes: int, keep: int) -> bool:
        """Evict host data of least recently used entries (not ``keep``, not pinned) until ``nbytes`` fit;
        False (nothing evicted beyond what was needed so far) if they cannot."""
        if nbytes > self.host.capacity_bytes:
            return False
        while self.host.free_bytes() < nbytes:
            key = next((k for k in self.host.lru if k != keep and k not in self._pinned), None)
            if key is None:
                return False
            self._evict_host(self.entries[key])
        return True

    def _evict_host(self, e: _Entry) -> None:
        """Forget ``e``'s host copies (log a drop); delete ``e`` if it holds nothing any more."""
        held = e.host >= 0
        self.host.drop(e.host[held], np.array([e.hckpt] if e.hckpt >= 0 else [], np.int64))
        e.host[held] = -1
        e.hckpt = -1
        self.host.forget(e.key)
        self.host.evictions += 1
        self._delete_if_empty(e)

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
        pages of any entry."""
        need = list(need)
        for leaves_only in (True, False):
            for e in list(self.entries.values()):
                if not any(n > 0 for n in need):
                    return
                if (leaves_only and e.children) or self.entries.get(e.key) is not e:
                    continue
                self._drop(e, need)
                while leaves_only and any(n > 0 for n in need):
                    gone = e.key not in self.entries  # deleted, or (host tier) left with host copies only
                    if not gone and not (self.host is not None and (e.pages < 0).all()):
                        break
                    e = self.entries.get(e.parent)  # its parent became a leaf: same last use, one block up
                    if e is None or e.children > (0 if gone else 1):
                        break
                    self._drop(e, need)
        if any(n > 0 for n in need):
            raise AssertionError(f"prefix cache: {need} idle pages not found")

    def _drop(self, e: _Entry, need: list[int] | None = None) -> int:
        """Uncache the idle pages of ``e`` (only in pools with ``need > 0``, counting down); delete ``e`` when
        it holds no page any more. Returns pages freed."""
        b = self.blocks
        h = np.flatnonzero(e.pages >= 0)
        idle = h[b.refs[e.pages[h]] == 0]
        if need is not None:
            pools = b.pool_of_head[idle]
            keep = np.zeros(len(idle), bool)
            for i, p in enumerate(pools.tolist()):
                keep[i] = need[p] > 0
                need[p] -= int(keep[i])
            idle = idle[keep]
        if self.host is not None and len(idle) and self._make_room(self.host.cost(len(idle), 0), e.key):
            e.host[idle], _ = self.host.spill(e.pages[idle], np.zeros(0, np.int64))
            self.host.touch(e.key)
        freed = b.uncache(e.pages[idle]) if len(idle) else 0
        for p in e.pages[idle].tolist():
            del self.page_entry[p]
        e.pages[idle] = -1
        self._delete_if_empty(e)
        return freed

    def _delete_if_empty(self, e: _Entry) -> None:
        """Delete ``e`` if it holds no page and has no children, then its parent likewise (an inner entry with
        no page stays: it keeps its descendants reachable)."""
        while e is not None and not e.children and (e.pages < 0).all() and (e.host < 0).all() \
                and self.entries.get(e.key) is e and e.key not in self._pinned:
            del self.entries[e.key]
            if e.ckpt >= 0:
                self._ckpt_free.append(e.ckpt)
            if e.hckpt >= 0:
                self.host.drop(np.zeros(0, np.int64), np.array([e.hckpt], np.int64))
            if self.host is not None:
                self.host.forget(e.key)
            e = self.entries.get(e.parent)
            if e is not None:
                e.children -= 1

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
        self._ckpt_free = list(reversed(self.checkpoint_slots))
        self._busy.clear()
        return freed

    def cached_pages(self) -> int:
        return len(self.page_entry)

    def checkpoints_used(self) -> int:
        return len(self.checkpoint_slots) - len(self._ckpt_free)

    # ---- recycling -----------------------------------------------------------------------------------------
    def recycle_policy(self) -> "CachedRecycle":
        return CachedRecycle(self)

    def on_recycled(self, heads: np.ndarray, pages: np.ndarray) -> int:
        """Apply the ``recycle`` option to ``pages`` (i64[K], on ``heads``) that rows just recycled; returns
        pages freed."""
        b = self.blocks
        pages, first = np.unique(pages, return_index=True)  # rows sharing a page recycle it in one call
        heads = heads[first]
        sel = b.cached[pages] & (b.refs[pages] == 0)
        drop = []
        for h, p in zip(heads[sel].tolist(), pages[sel].tolist()):
            e = self.entries[self.page_entry[p]]
            if self.config.recycle == "keep_tail" and e.near != NO_ANCHOR and \
                    e.depth >= recycle_stop((e.near + 1) * self.ps, int(b.window[h]), self.ps):
                continue
            e.pages[h] = -1
            del self.page_entry[p]
            drop.append((e, p))
        freed = b.uncache(np.array([p for _, p in drop], np.int64)) if drop else 0
        for e, _ in drop:
            self._delete_if_empty(e)
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
            if e.children != children.get(key, 0) or ((e.pages < 0).all() and (e.host < 0).all() and not e.children):
                raise AssertionError(f"entry at depth {e.depth}: children {e.children} != {children.get(key, 0)}, "
                                     f"or no page")
            if ((e.pages >= 0) & (e.host >= 0)).any() or (e.ckpt >= 0 and e.hckpt >= 0):
                raise AssertionError(f"entry at depth {e.depth}: a block or checkpoint both on device and on host")
        if len(seen) != len(self.page_entry) or int(b.cached.sum()) != len(seen):
            raise AssertionError("a cached page belongs to no entry")
        ckpts = [e.ckpt for e in self.entries.values() if e.ckpt >= 0] + self._ckpt_free
        if sorted(ckpts) != list(self.checkpoint_slots):
            raise AssertionError(f"checkpoint slots held + free {sorted(ckpts)} != {list(self.checkpoint_slots)}")
        if self.host is not None:
            self._check_host()

    def _check_host(self) -> None:
        """Host tier: every host id held once, the budget equals what the entries hold and fits, the LRU order
        lists exactly the entries with host data, and every logged load writes a page / slot its entry holds."""
        hp = [h for e in self.entries.values() for h in e.host[e.host >= 0].tolist()]
        hc = [e.hckpt for e in self.entries.values() if e.hckpt >= 0]
        if len(set(hp + hc)) != len(hp) + len(hc):
            raise AssertionError("a host id is held twice")
        used = self.host.cost(len(hp), len(hc))
        if used != self.host.used_bytes or used > self.host.capacity_bytes:
            raise AssertionError(f"host tier: entries hold {used} bytes, budget says {self.host.used_bytes} of "
                                 f"{self.host.capacity_bytes}")
        holders = {k for k, e in self.entries.items() if (e.host >= 0).any() or e.hckpt >= 0}
        if set(self.host.lru) != holders:
            raise AssertionError("host LRU order differs from the entries holding host data")
        pages, ckpts = self.host.pending()
        held = {e.ckpt for e in self.entries.values()}
        if any(p not in self.page_entry for p in pages) or not ckpts <= held:
            raise AssertionError("a logged load writes a page or checkpoint slot no entry holds")


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
