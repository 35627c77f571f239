"""The prefix cache's test rig: a block allocator, a :class:`~kvjax.sched.prefix_cache.PrefixCache` and shadow
pages recording which (token, position) each page offset holds, driven the way a scheduler drives them."""

from __future__ import annotations

import numpy as np

from kvjax.config import CacheConfig
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.prefix_cache import PrefixCache, PrefixCacheConfig


def needed(window: int, sinks: int, ps: int, m: int) -> np.ndarray:
    """bool[m]: blocks a head still reads when queries start at position m*ps (the mask rule, per position)."""
    L = m * ps
    keys = np.arange(L)
    attended = (L - keys < window) | (keys < sinks) if window else np.ones(L, bool)
    return np.array([attended[b * ps: (b + 1) * ps].any() for b in range(m)], bool)


class Rig:
    """Allocator + cache + shadow pages; ``run`` computes a prompt in chunks the way a scheduler would."""

    def __init__(self, att, *, ps=4, pages=80, max_seqs=4, blocks=24, **cfg):
        self.cache_cfg = CacheConfig(page_size=ps, num_pages=pages, max_seqs=max_seqs, max_blocks_per_seq=blocks)
        self.b = BlockAllocator(self.cache_cfg, att)
        self.pc = PrefixCache(self.b, PrefixCacheConfig(**cfg))
        self.policy = self.pc.recycle_policy()
        self.ps, self.att = ps, att
        self.shadow = np.full((pages, ps), -1, np.int64)  # token id * 10**6 + position held at each offset
        self.progress: dict[int, int] = {}
        self.prompts: dict[int, np.ndarray] = {}

    def start(self, row: int, prompt: np.ndarray):
        m = self.pc.match(prompt)
        self.pc.attach(row, m, prompt)
        self.check_attached(row, prompt, m.num_tokens // self.ps)
        self.progress[row], self.prompts[row] = m.num_tokens, prompt
        return m

    def check_attached(self, row: int, prompt: np.ndarray, m: int) -> None:
        for h, (w, s) in enumerate(zip(self.att.window, self.att.sinks)):
            need = needed(w, s, self.ps, m)
            pages = self.b.tables[row, h, :m]
            assert ((pages >= 0) == need).all(), (h, pages, need)  # holes exactly where recycling leaves them
            for blk in np.flatnonzero(need):
                pos = np.arange(blk * self.ps, (blk + 1) * self.ps)
                np.testing.assert_array_equal(self.shadow[pages[blk]], prompt[pos] * 10**6 + pos)

    def step(self, row: int, n: int) -> int:
        """Compute up to ``n`` more tokens of the row (capped at the next checkpoint stop); returns tokens."""
        done, prompt = self.progress[row], self.prompts[row]
        stop = self.pc.next_stop(row, done)
        n = min(n, len(prompt) - done, (stop - done) if stop else n)
        self.b.allocate(row, done + n)
        pos = np.arange(done, done + n)
        for h in range(self.b.num_heads):
            pages = self.b.tables[row, h, pos // self.ps]
            assert (self.b.owner_row[pages] == row).all(), "a row writes a page it does not own alone"
            self.shadow[pages, pos % self.ps] = prompt[pos] * 10**6 + pos
        self.progress[row] = done + n
        self.pc.publish(row, done + n)
        self.policy.recycle(self.b, np.array([row]), np.array([done + n]))
        return n

    def finish(self, row: int) -> None:
        self.pc.release(row)
        self.b.free_row(row)
        del self.progress[row], self.prompts[row]

    def run(self, row: int, prompt: np.ndarray, chunk: int = 5):
        m = self.start(row, prompt)
        while self.progress[row] < len(prompt):
            self.step(row, chunk)
        self.check()
        return m

    def check(self) -> None:
        self.b.check_integrity()
        self.pc.check_integrity()
