"""Head-wise page allocator and block tables for a group of attention layers that share one table layout.

Every KV head of every sequence has its own row of logical blocks: position ``p`` of head ``h`` of the request in
table row ``r`` lives in page ``tables[r, h, p // page_size]``; ``-1`` is a hole (never allocated, or recycled).
The table row of a request is its GDN slot id, so ``tables`` has ``max_seqs + 1`` rows and row 0 (PAD) stays all
``-1``: gathering ``tables[gdn_slots]`` gives a batch's block tables, and a padding row gets only holes.

Pool policies (how heads share the ``num_pages`` single-head pages of a layer):

- ``shared``: one free list; a page freed by a SWA head can serve any head.
- ``partitioned``: the seed's per-head free lists. Head ``h`` owns pages ``[h * P, (h + 1) * P)`` with
  ``P = num_pages // H_kv`` (``num_pages`` must be a multiple of ``H_kv``), so a page recycled by a SWA head only
  ever serves that head again.

Pages per model shard (``shards=M``, the engine on a mesh whose ``"model"`` axis splits the KV heads; see
:mod:`kvjax.models.sharding`): ``cache.num_pages`` is the page count of *one device's* pool and heads
``[m * H_kv / M, (m + 1) * H_kv / M)`` of the given layout live on model shard ``m`` (a mesh model's layout is
placed, see below). The allocator holds ``M * num_pages`` pages with
global ids: shard ``m`` owns ``[m * num_pages, (m + 1) * num_pages)``, ``shared`` keeps one free list per shard
(its heads only), ``partitioned`` one per head inside its shard's range. :attr:`BlockAllocator.page_base`
(``i64[H_kv]``, ``m * num_pages`` for head ``h`` on shard ``m``) turns a table's global ids into the device-local
ids of each head's pool (``local = global - page_base[h]``) with one vectorised subtraction. ``shards=1``: one
device, global ids are local ids, nothing changes.

Head placement (:func:`head_placement`). With SWA heads a contiguous split can give one shard more full heads
than another (4 KV heads, 2 SWA then 2 full, over 2 shards: shard 1 holds both full heads), so that shard's pool
fills first and caps the running requests while the other's sits half used. A model on a mesh therefore presents
its KV heads already *placed* (``ShardedModel.attention_layout()``: the same heads in device-major order, chosen by
:func:`head_placement` so that every shard holds the same mix of SWA and full heads where the counts allow), and
this allocator splits whatever layout it is given contiguously. :func:`placed_layout` is that layout for a bare
:class:`AttentionConfig` (the simulator's ``--model-shards``), so the simulator and the engine see the same pools.

Every head writes every position, so all heads of a row always cover the same number of logical blocks
(``num_blocks[r]``); they differ only in which blocks were recycled (or attached as holes from a prefix cache).

Shared pages (the prefix cache, :mod:`kvjax.sched.prefix_cache`). A page is free, private (``owner_row`` = its
one row) or shared (``owner_row == SHARED``): a shared page sits in ``refs[p]`` table entries, all on head
``owner_head[p]``, and may also be held by the cache (``cached[p]``). It goes back to the free list when neither
holds it. A cached page no table holds is *idle*: ``can_fit`` counts idle pages as available and ``allocate``
asks the ``reclaimer`` (the cache) to evict that many. With no cache attached nothing is ever shared, and every
method behaves exactly as before.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

from kvjax.config import AttentionConfig, CacheConfig, is_int
from kvjax.errors import DoubleFreeError, OutOfPagesError, RequestTooLongError

POOLS = ("shared", "partitioned")
SHARED = -2  # owner_row of a page held through the reference count


def head_placement(window: Sequence[int], sinks: Sequence[int], shards: int) -> np.ndarray:
    """i64[H_kv]: the KV heads in device-major order for ``shards`` model shards (shard ``m`` holds heads
    ``order[m * H_kv / shards : (m + 1) * H_kv / shards]``, in increasing head id).

    ``window`` / ``sinks``: the heads' ``i64[H_kv]`` windows (0 = full head) and sinks. Rule: heads of one kind
    (equal ``(window, sinks)``) fill pages at the same rate, so each kind is dealt out evenly. The heads sorted by
    kind -- full heads first, then SWA heads by decreasing window (the heaviest first), ties by head id -- go to
    shards ``0, 1, .., M-1, 0, 1, ..`` in turn. Every shard gets ``H_kv / M`` heads and every kind's count on two
    shards differs by at most one: where each kind's count is a multiple of ``M`` every shard holds the same mix
    (4 KV heads ``(w, w, 0, 0)`` on 2 shards: ``{0, 2}`` and ``{1, 3}``), otherwise no split can do better (3 SWA +
    1 full on 2 shards: one shard holds the full head whatever the order). When the contiguous split already holds
    the same multiset of mixes as that deal (all heads alike, or already placed), the order is the identity, so
    placing a placed layout changes nothing. ``ValueError`` unless ``shards`` is an int >= 1 dividing ``H_kv``.
    """
    window, sinks = np.asarray(window, np.int64), np.asarray(sinks, np.int64)
    h_kv = window.shape[0]
    if not is_int(shards) or shards < 1 or h_kv % shards or sinks.shape != window.shape:
        raise ValueError(f"head_placement: shards must be an int >= 1 dividing num_kv_heads={h_kv} (window "
                         f"{window.tolist()}, sinks {sinks.tolist()}), got {shards!r}")
    per = h_kv // int(shards)
    key = np.where(window == 0, np.iinfo(np.int64).max, window)  # full heads are the heaviest kind
    by_kind = np.lexsort((np.arange(h_kv), -sinks, -key))  # i64[H_kv]: kinds heaviest first, ties by head id
    dealt = np.empty(h_kv, np.int64)
    dealt[by_kind] = np.arange(h_kv) % shards  # i64[H_kv]: shard of each head

    def mixes(shard_of_head: np.ndarray) -> list:
        return sorted(sorted(zip(window[shard_of_head == m].tolist(), sinks[shard_of_head == m].tolist()))
                      for m in range(shards))

    if mixes(np.arange(h_kv) // per) == mixes(dealt):
        return np.arange(h_kv, dtype=np.int64)
    return np.argsort(dealt, kind="stable").astype(np.int64)


def placed_layout(attention: AttentionConfig, shards: int) -> tuple[AttentionConfig, np.ndarray]:
    """``(layout, order)``: ``attention``'s KV heads in the device-major order of :func:`head_placement`
    (``layout.window[j] == attention.window[order[j]]``, sinks alike) for an allocator with ``shards`` model
    shards, and ``order`` (``i64[H_kv]``). What ``ShardedModel.attention_layout()`` returns for the model."""
    order = head_placement(attention.window, attention.sinks, shards)
    window, sinks = np.asarray(attention.window)[order], np.asarray(attention.sinks)[order]
    return dataclasses.replace(attention, window=tuple(window.tolist()), sinks=tuple(sinks.tolist())), order


class Reclaimer(Protocol):
    """What the allocator asks for idle cached pages (the prefix cache implements it)."""

    def reclaim(self, need: list[int]) -> None:
        """Give back (``uncache``) at least ``need[pool]`` idle pages of each pool (never more than are idle)."""


class BlockAllocator:
    """Pages and head-wise block tables. Rows are GDN slot ids ``1..max_seqs``; row 0 is the all-hole PAD row."""

    def __init__(self, cache: CacheConfig, attention: AttentionConfig, pool: str = "shared", shards: int = 1) -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        h_kv = attention.num_kv_heads
        if not is_int(shards) or shards < 1 or h_kv % shards:
            raise ValueError(f"shards must be an int >= 1 dividing num_kv_heads={h_kv}, got {shards!r}")
        self.cache, self.attention, self.pool = cache, attention, pool
        self.page_size = cache.page_size
        self.num_heads = h_kv
        self.shards = int(shards)
        self.num_pages = cache.num_pages * self.shards  # all shards' pages (global ids)
        self.window = np.asarray(attention.window, np.int64)  # i64[H_kv]; 0 = full head
        self.sinks = np.asarray(attention.sinks, np.int64)  # i64[H_kv]
        self.swa_heads = np.flatnonzero(self.window > 0)  # i64[n_swa]
        shard_of_head = np.arange(h_kv) // (h_kv // self.shards)  # i64[H_kv]: model shard holding each head
        self.page_base = shard_of_head * cache.num_pages  # i64[H_kv]: first global page id of the head's shard
        if pool == "partitioned":
            if self.num_pages % h_kv:
                raise ValueError(
                    f"partitioned pool: num_pages={cache.num_pages} must be a multiple of num_kv_heads={h_kv}"
                    + (f" / {self.shards} shards" if self.shards > 1 else "")
                    + " (each head gets num_pages // num_kv_heads pages)"
                )
            per = self.num_pages // h_kv
            self.pool_of_head = np.arange(h_kv)  # i64[H_kv]: free list serving each head
            ranges = [range(h * per, (h + 1) * per) for h in range(h_kv)]
        else:
            self.pool_of_head = shard_of_head  # i64[H_kv]
            ranges = [range(m * cache.num_pages, (m + 1) * cache.num_pages) for m in range(self.shards)]
        self.heads_in_pool = np.bincount(self.pool_of_head, minlength=len(ranges)).tolist()  # heads of each pool
        self.pool_pages = [len(r) for r in ranges]
        self._free: list[list[int]] = [list(reversed(r)) for r in ranges]  # pop() -> lowest page id
        rows = cache.max_seqs + 1
        self.tables = np.full((rows, h_kv, cache.max_blocks_per_seq), -1, np.int32)  # i32[max_seqs+1, H_kv, max_blocks]
        self.num_blocks = np.zeros(rows, np.int64)  # i64[max_seqs+1]: blocks covered by each row
        self.recycled_upto = np.zeros((rows, h_kv), np.int64)  # i64[max_seqs+1, H_kv]: recycle cursor (blocks)
        # i64[max_seqs+1]: no SWA block of the row is out of the window before it has this many computed tokens
        # (a lower bound kept by recycle.recycle_out_of_window; 0 = check at the next step)
        self.recycle_due = np.zeros(rows, np.int64)
        self.owner_row = np.full(self.num_pages, -1, np.int32)  # i32[num_pages]: row holding each page, -1 free
        self.owner_head = np.full(self.num_pages, -1, np.int32)  # i32[num_pages]: head holding each page
        self.refs = np.zeros(self.num_pages, np.int32)  # i32[num_pages]: table entries holding a shared page
        self.cached = np.zeros(self.num_pages, bool)  # bool[num_pages]: the prefix cache holds the page
        self.idle = [0] * len(ranges)  # cached pages that no table holds, per pool (reclaimable)
        self.num_shared = 0  # pages with owner_row == SHARED (0: the fast path of free_ranges)
        self.reclaimer: Reclaimer | None = None  # set by a prefix cache

    # ---- queries -------------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Logical blocks that cover positions ``[0, num_tokens)``."""
        return -(-num_tokens // self.page_size)

    def free_pages(self) -> list[int]:
        """Free pages per pool (``shared``: one entry per model shard; ``partitioned``: ``H_kv``)."""
        return [len(f) for f in self._free]

    def available(self) -> float:
        """Fraction of all pages that are free, as a float in [0, 1] (no integer truncation)."""
        return sum(self.free_pages()) / float(self.num_pages)

    def used_pages(self) -> int:
        return self.num_pages - sum(self.free_pages())

    def pages_needed(self, row: int, num_tokens: int) -> np.ndarray:
        """i64[num_pools]: pages each pool must give so ``row`` covers ``[0, num_tokens)`` on every head."""
        new_blocks = max(0, self.blocks_for(num_tokens) - self.num_blocks[self._check_row(row)])
        return np.asarray(self.heads_in_pool, np.int64) * new_blocks

    def can_fit(self, new_blocks: int, reserve: float = 0.0) -> bool:
        """Whether ``new_blocks`` more blocks on every head fit, leaving ``reserve`` of each pool free."""
        if new_blocks <= 0:
            return True
        need = [new_blocks * k for k in self.heads_in_pool]
        return all(n + reserve * size <= len(f) + i
                   for n, size, f, i in zip(need, self.pool_pages, self._free, self.idle))

    def reclaimable_pages(self) -> list[int]:
        """Idle cached pages per pool: held by the prefix cache only, given back on demand."""
        return list(self.idle)

    # ---- updates -------------------------------------------------------------------------------------------
    def allocate(self, row: int, num_tokens: int) -> None:
        """Give ``row`` pages on every head for the blocks that ``[0, num_tokens)`` adds; all or nothing.

        Raises :class:`RequestTooLongError` past ``max_blocks_per_seq`` and :class:`OutOfPagesError` when a pool
        is short; in both cases nothing changes.
        """
        row = self._check_row(row)
        if not is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        start, stop = self.num_blocks[row], self.blocks_for(int(num_tokens))
        if stop > self.cache.max_blocks_per_seq:
            raise RequestTooLongError(
                f"{num_tokens} tokens need {stop} blocks > max_blocks_per_seq={self.cache.max_blocks_per_seq}"
            )
        if stop <= start:
            return
        need = self.pages_needed(row, num_tokens)
        short = [(p, int(n), len(self._free[p])) for p, n in enumerate(need) if n > len(self._free[p])]
        if short and self.reclaimer is not None and all(n <= f + self.idle[p] for p, n, f in short):
            self.reclaimer.reclaim([max(0, int(n) - len(f)) for n, f in zip(need, self._free)])
            short = [(p, int(n), len(self._free[p])) for p, n in enumerate(need) if n > len(self._free[p])]
        if short:
            raise OutOfPagesError(f"row {row}: (pool, pages needed, free) = {short}")
        for h in range(self.num_heads):
            free = self._free[int(self.pool_of_head[h])]
            pages = [free.pop() for _ in range(stop - start)]
            self.tables[row, h, start:stop] = pages
            self.owner_row[pages] = row
            self.owner_head[pages] = h
        self.num_blocks[row] = stop

    def _growth(self, rows: np.ndarray, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(start, stop)`` (``i64[K]`` each: the rows' block counts now and after covering ``num_tokens``) when
        every pool's free list holds the new blocks of all ``rows`` at once and no row passes
        ``max_blocks_per_seq``; else None. Nothing changes."""
        start = self.num_blocks[rows]  # i64[K]
        stop = np.maximum(-(-num_tokens // self.page_size), start)  # i64[K]
        if (stop > self.cache.max_blocks_per_seq).any():
            return None
        total = int((stop - start).sum())
        if any(total * k > len(f) for k, f in zip(self.heads_in_pool, self._free)):
            return None
        return start, stop

    def rows_fit(self, rows: np.ndarray, num_tokens: np.ndarray) -> bool:
        """Whether :meth:`allocate_rows` ``(rows, num_tokens)`` would succeed now (nothing changes)."""
        return self._growth(np.asarray(rows, np.int64), np.asarray(num_tokens, np.int64)) is not None

    def allocate_rows(self, rows: np.ndarray, num_tokens: np.ndarray) -> bool:
        """``allocate(rows[k], num_tokens[k])`` for every ``k`` in order (``i64[K]`` each, distinct rows 1..max_seqs,
        the same pages as those calls), at once, if every pool's free list holds them all; otherwise (also when
        cached pages would have to be reclaimed, or a row would pass ``max_blocks_per_seq``) returns False and
        changes nothing, so that the caller can go row by row."""
        rows, num_tokens = np.asarray(rows, np.int64), np.asarray(num_tokens, np.int64)
        growth = self._growth(rows, num_tokens)
        if growth is None:
            return False
        start, stop = growth
        count = stop - start  # i64[K]: new blocks of each row, on every head
        total = int(count.sum())
        need = [total * k for k in self.heads_in_pool]  # pages each pool gives
        if total == 0:
            return True
        # allocate() fills row by row, head by head, block by block, each head popping from its pool's free list
        H = self.num_heads
        per_row = H * count  # i64[K]
        local = np.arange(H * total) - np.repeat(np.cumsum(per_row) - per_row, per_row)  # index inside the row
        c = np.repeat(count, per_row)
        rr, hh, bb = np.repeat(rows, per_row), local // c, np.repeat(start, per_row) + local % c  # i64[H * total]
        taken: list[int] = []  # each pool's pages in pop order, pools in order
        for f, n in zip(self._free, need):
            if n:
                taken += f[len(f) - n:][::-1]
                del f[len(f) - n:]
        pages = np.empty(H * total, np.int64)
        if len(self._free) == 1:
            pages[:] = taken
        else:
            pages[np.argsort(self.pool_of_head[hh], kind="stable")] = taken
        self.tables[rr, hh, bb] = pages
        self.owner_row[pages] = rr
        self.owner_head[pages] = hh
        self.num_blocks[rows] = stop
        return True

    def free_ranges(self, rows: np.ndarray, heads: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> int:
        """Return the pages of blocks ``[starts[k], stops[k])`` of ``(rows[k], heads[k])`` for every ``k``
        (``i64[K]`` each; holes are skipped; ``starts[k] >= stops[k]`` is an empty range) and set those entries
        to -1. Vectorised; returns pages freed. Raises :class:`DoubleFreeError` for a page its (row, head) does
        not own or that two ranges cover, and ``ValueError`` for a row outside ``1..max_seqs``, a head outside
        ``0..H_kv-1``, a block outside ``0..max_blocks_per_seq`` or arrays of different lengths (numpy would
        wrap a negative index); in every case nothing changes."""
        rows, heads, starts, stops = self._as_ranges(rows, heads, starts, stops)
        counts = np.maximum(stops - starts, 0)
        total = int(counts.sum())
        if total == 0:
            return 0
        offsets = np.cumsum(counts) - counts
        rr, hh = np.repeat(rows, counts), np.repeat(heads, counts)
        bb = np.arange(total) - np.repeat(offsets - starts, counts)
        if rr.min() < 1 or hh.min() < 0 or bb.min() < 0:  # numpy would wrap a negative index (or use PAD row 0)
            raise ValueError(self._range_error(rows, heads, starts, stops, counts > 0))
        try:
            pages = self.tables[rr, hh, bb]
        except IndexError:  # past max_seqs, H_kv - 1 or max_blocks_per_seq - 1
            raise ValueError(self._range_error(rows, heads, starts, stops, counts > 0)) from None
        held = pages >= 0
        rr, hh, bb, pages = rr[held], hh[held], bb[held], pages[held]
        if not self.num_shared:
            return self._free_private(rr, hh, bb, pages)
        owner = self.owner_row[pages]
        shared = owner == SHARED
        if ((~shared & (owner != rr)) | (self.owner_head[pages] != hh)).any():
            raise DoubleFreeError(f"pages {pages.tolist()} are not owned by the (row, head) freeing them")
        sp, counts = np.unique(pages[shared], return_counts=True)
        private = ~shared
        if (self.refs[sp] < counts).any() or len(np.unique(pages[private])) != int(private.sum()):
            raise DoubleFreeError(f"pages {pages.tolist()} are freed more often than tables hold them")
        freed = self._free_private(rr[private], hh[private], bb[private], pages[private]) if private.any() else 0
        self.tables[rr[shared], hh[shared], bb[shared]] = -1
        self.refs[sp] -= counts.astype(np.int32)
        gone = sp[self.refs[sp] == 0]
        cached = self.cached[gone]
        if cached.any():
            idle = np.bincount(self.pool_of_head[self.owner_head[gone[cached]]], minlength=len(self.idle))
            for p, n in enumerate(idle.tolist()):
                self.idle[p] += n
        return freed + self._release(gone[~cached])

    def _free_private(self, rr: np.ndarray, hh: np.ndarray, bb: np.ndarray, pages: np.ndarray) -> int:
        if ((self.owner_row[pages] != rr) | (self.owner_head[pages] != hh)).any():
            raise DoubleFreeError(f"pages {pages.tolist()} are not owned by the (row, head) freeing them")
        ordered = np.sort(pages)
        if (ordered[1:] == ordered[:-1]).any():
            raise DoubleFreeError(f"pages {pages.tolist()} are freed twice in one call (overlapping ranges)")
        self.tables[rr, hh, bb] = -1
        return self._release(pages)

    def _release(self, pages: np.ndarray) -> int:
        """Put ``pages`` (i64[K], no table or cache holds them) back on their free lists."""
        pools = self.pool_of_head[self.owner_head[pages]]
        if self.num_shared:
            self.num_shared -= int((self.owner_row[pages] == SHARED).sum())
        self.owner_row[pages] = -1
        self.owner_head[pages] = -1
        if len(self._free) == 1:
            self._free[0].extend(pages.tolist())
        else:  # one pass over the pages (a few per step), each onto its pool's list in order
            free = self._free
            for p, page in zip(pools.tolist(), pages.tolist()):
                free[p].append(page)
        return len(pages)

    # ---- shared pages (prefix cache) ------------------------------------------------------------------------
    def share(self, row: int, heads: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Hand the private pages of ``(row, heads[k], blocks[k])`` (``i64[K]`` each) to the cache: they become
        shared (the row's entry is one reference) and cached. Returns ``i64[K]`` pages, -1 where the entry is a
        hole (nothing shared). ``DoubleFreeError`` if a page is not the row's own; nothing changes then."""
        row = self._check_row(row)
        heads, blocks = np.asarray(heads, np.int64), np.asarray(blocks, np.int64)
        pages = self.tables[row, heads, blocks].astype(np.int64)
        held = pages[pages >= 0]
        if (self.owner_row[held] != row).any():
            raise DoubleFreeError(f"row {row}: pages {held.tolist()} are not private pages of the row")
        self.owner_row[held] = SHARED
        self.refs[held] = 1
        self.cached[held] = True
        self.num_shared += len(held)
        return pages

    def attach(self, row: int, pages: np.ndarray, cursor: np.ndarray) -> None:
        """Give the empty ``row`` the cached pages ``pages: i64[H_kv, m]`` (-1 holes) as its blocks ``[0, m)``
        without copying (one more reference each); ``cursor: i64[H_kv]`` is the recycle cursor of each head
        (blocks below it are handled). ``ValueError`` if the row holds blocks or a page is not cached on its head."""
        row = self._check_row(row)
        pages = np.asarray(pages, np.int64)
        if self.num_blocks[row] or pages.ndim != 2 or pages.shape[0] != self.num_heads \
                or pages.shape[1] > self.cache.max_blocks_per_seq:
            raise ValueError(f"attach: row {row} must be empty and pages i64[{self.num_heads}, <= max_blocks], got "
                             f"{self.num_blocks[row]} blocks, shape {pages.shape}")
        h, b = np.nonzero(pages >= 0)
        held = pages[h, b]
        if not self.cached[held].all() or (self.owner_head[held] != h).any() or len(np.unique(held)) != len(held):
            raise ValueError(f"attach: pages {held.tolist()} are not cached pages of their heads")
        for p in self.pool_of_head[h[self.refs[held] == 0]].tolist():
            self.idle[p] -= 1
        self.refs[held] += 1
        self.tables[row, :, : pages.shape[1]] = pages
        self.num_blocks[row] = pages.shape[1]
        self.recycled_upto[row] = cursor

    def attach_new(self, row: int, heads: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Fill the holes ``(row, heads[k], blocks[k])`` (``i64[K]``, blocks below the row's ``num_blocks``) with
        fresh cached pages (shared, one reference: the row's) that the caller will fill (the prefix cache's host
        tier loads them); returns their ``i64[K]`` pages. Idle cached pages are reclaimed when a pool is short.
        ``ValueError`` (nothing changes) for an entry that is not a hole or a pool that cannot give them."""
        row = self._check_row(row)
        heads, blocks = np.asarray(heads, np.int64), np.asarray(blocks, np.int64)
        if len(heads) == 0:
            return np.zeros(0, np.int64)
        if (blocks >= self.num_blocks[row]).any() or (self.tables[row, heads, blocks] >= 0).any():
            raise ValueError(f"attach_new: row {row} (heads, blocks) {list(zip(heads.tolist(), blocks.tolist()))} "
                             "must be holes below the row's blocks")
        need = np.bincount(self.pool_of_head[heads], minlength=len(self._free))
        if any(n > len(f) + i for n, f, i in zip(need.tolist(), self._free, self.idle)):
            raise ValueError(f"attach_new: pools need {need.tolist()} pages, free {self.free_pages()} + idle "
                             f"{self.idle}")
        if any(n > len(f) for n, f in zip(need.tolist(), self._free)):
            self.reclaimer.reclaim([max(0, n - len(f)) for n, f in zip(need.tolist(), self._free)])
        pages = np.array([self._free[int(self.pool_of_head[h])].pop() for h in heads.tolist()], np.int64)
        self.tables[row, heads, blocks] = pages
        self.owner_row[pages] = SHARED
        self.owner_head[pages] = heads
        self.refs[pages] = 1
        self.cached[pages] = True
        self.num_shared += len(pages)
        return pages

    def uncache(self, pages: np.ndarray, keep_order: bool = False) -> int:
        """The cache lets go of ``pages`` (i64[K], cached); those no table holds go back to the free list, in
        increasing page id or, with ``keep_order``, in the given order (the pages must then be distinct).
        Returns pages freed."""
        pages = np.asarray(pages, np.int64)
        if not keep_order:
            pages = np.unique(pages)
        elif len(np.unique(pages)) != len(pages):
            raise DoubleFreeError(f"uncache: pages {pages.tolist()} are given twice")
        if not self.cached[pages].all():
            raise DoubleFreeError(f"uncache: pages {pages[~self.cached[pages]].tolist()} are not cached")
        self.cached[pages] = False
        gone = pages[self.refs[pages] == 0]
        for p, n in enumerate(np.bincount(self.pool_of_head[self.owner_head[gone]], minlength=len(self.idle)).tolist()):
            self.idle[p] -= n
        return self._release(gone)

    def free_row(self, row: int) -> int:
        """Return every page of ``row`` (all heads) and reset it to holes; returns the number of pages freed."""
        return self.free_rows([row])

    def free_rows(self, rows: Sequence[int]) -> int:
        """:meth:`free_row` of each of ``rows`` (distinct) in one vectorised pass; returns pages freed. The private
        pages return to the free lists row by row, as the calls one after another return them; shared pages whose
        last reference goes return after them, in page order. ``ValueError`` for a bad or repeated row, nothing
        changed."""
        rr = np.asarray([self._check_row(r) for r in rows], np.int64)  # i64[N]
        if np.unique(rr).size != rr.size:
            raise ValueError(f"free_rows: rows must be distinct, got {rr.tolist()}")
        h = self.num_heads
        freed = self.free_ranges(np.repeat(rr, h), np.tile(np.arange(h), rr.size), np.zeros(rr.size * h, np.int64),
                                 np.repeat(self.num_blocks[rr], h))
        self.num_blocks[rr] = 0
        self.recycled_upto[rr] = 0
        self.recycle_due[rr] = 0
        return freed

    def _check_row(self, row: int) -> int:
        if not is_int(row) or not 1 <= row <= self.cache.max_seqs:
            raise ValueError(f"block-table row must be a GDN slot in 1..{self.cache.max_seqs}, got {row!r}")
        return int(row)

    @staticmethod
    def _as_ranges(*arrays) -> list[np.ndarray]:
        """``free_ranges``' arguments as ``i64[K]`` arrays; ``ValueError`` unless 1-d integer arrays of one length."""
        out = [np.asarray(a) for a in arrays]
        for a in out:
            if a.ndim != 1 or (a.dtype.kind not in "iu" and a.size):
                raise ValueError(f"free_ranges: rows, heads, starts, stops must be 1-d integer arrays, got "
                                 f"{[f'{a.dtype}{list(a.shape)}' for a in out]}")
            if a.shape != out[0].shape:
                raise ValueError(f"free_ranges: rows, heads, starts, stops must have the same length, got "
                                 f"{[a.shape[0] for a in out]}")
        return [a if a.dtype == np.int64 else a.astype(np.int64) for a in out]

    def _range_error(self, rows, heads, starts, stops, nonempty: np.ndarray) -> str:
        """The message naming the out-of-range entries among the non-empty ranges ``nonempty: bool[K]``."""
        limits = (("rows", rows, 1, self.cache.max_seqs), ("heads", heads, 0, self.num_heads - 1),
                  ("starts", starts, 0, self.cache.max_blocks_per_seq),
                  ("stops", stops, 0, self.cache.max_blocks_per_seq))
        bad = [f"{name} must lie in {lo}..{hi}, got {a[nonempty & ((a < lo) | (a > hi))].tolist()}"
               for name, a, lo, hi in limits if (nonempty & ((a < lo) | (a > hi))).any()]
        return "free_ranges: " + "; ".join(bad)

    # ---- invariants ----------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless: a private page sits in one table entry of its owner, a shared page in
        exactly ``refs`` entries of its head, free + private + shared == total per pool, idle counts match, no
        page is both free and held, partitioned heads only hold their own pages, and row 0 is all holes."""
        t = self.tables
        if (t[0] != -1).any():
            raise AssertionError("PAD row 0 of the block tables holds pages")
        rows, heads, blocks = np.nonzero(t >= 0)
        pages = t[rows, heads, blocks]
        shared = self.owner_row[pages] == SHARED
        if len(np.unique(pages[~shared])) != int((~shared).sum()):
            raise AssertionError("a private page appears twice in the block tables")
        if (self.owner_row[pages[~shared]] != rows[~shared]).any() or (self.owner_head[pages] != heads).any():
            raise AssertionError("block tables disagree with page ownership")
        is_shared = self.owner_row == SHARED
        if (np.bincount(pages[shared], minlength=self.num_pages) != np.where(is_shared, self.refs, 0)).any():
            raise AssertionError("a shared page's reference count differs from the table entries holding it")
        if (self.refs[~is_shared] != 0).any() or (self.cached & ~is_shared).any() or (is_shared & ~self.cached
                                                                                      & (self.refs == 0)).any():
            raise AssertionError("a reference count or cache flag on a page that is not shared, or a shared page "
                                 "that nothing holds")
        if int(is_shared.sum()) != self.num_shared:
            raise AssertionError(f"num_shared={self.num_shared} but {int(is_shared.sum())} pages are shared")
        idle = np.flatnonzero(self.cached & (self.refs == 0))
        if np.bincount(self.pool_of_head[self.owner_head[idle]], minlength=len(self._free)).tolist() != self.idle:
            raise AssertionError(f"idle counts {self.idle} disagree with the cached pages no table holds")
        free = [p for f in self._free for p in f]
        if len(set(free)) != len(free) or (self.owner_row[free] != -1).any():
            raise AssertionError("a page is free twice, or both free and held")
        used = int((self.owner_row >= 0).sum()) + self.num_shared
        if len(free) + used != self.num_pages:
            raise AssertionError(f"free {len(free)} + used {used} (shared {self.num_shared}) != total "
                                 f"{self.num_pages}")
        if (self.owner_row >= 0).sum() != int((~shared).sum()):
            raise AssertionError("ownership array marks pages that no table holds")
        if (blocks >= np.asarray(self.num_blocks)[rows]).any():
            raise AssertionError("a table entry lies past its row's num_blocks")
        if self.pool == "partitioned":
            per = self.pool_pages[0]
            if (pages // per != heads).any():
                raise AssertionError("partitioned pool: a head holds another head's page")
            for h, f in enumerate(self._free):
                if any(p // per != h for p in f):
                    raise AssertionError(f"partitioned pool: head {h}'s free list holds a foreign page")
