"""The prefix cache's test rig: a block allocator, a :class:`~kvjax.sched.prefix_cache.PrefixCache` and shadow
pages recording which (token, position) each page offset holds, driven the way a scheduler drives them; and the
stateful property test's rules over a rig (:class:`PrefixMachine`)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.errors import OutOfPagesError
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

    def land(self) -> None:
        """Execute the cache's logged host-tier copies (none without a host tier)."""


class PrefixMachine(RuleBasedStateMachine):
    """Random requests over a few shared prefixes, chunked compute, recycling, eviction, finishes and clears, on
    the rig :meth:`make_rig` builds (:class:`Rig`; a subclass may build another, e.g. one with a host tier)."""

    PAGES = (12, 40)  # pages per KV head, drawn
    BASES = 3  # shared prefixes

    def __init__(self):
        super().__init__()
        self.rig = None

    def make_rig(self, data, att, **kw) -> Rig:
        return Rig(att, **kw)

    @initialize(data=st.data())
    def setup(self, data):
        h = data.draw(st.integers(1, 3))
        window = [data.draw(st.sampled_from([0, 0, 3, 6, 11])) for _ in range(h)]
        sinks = [data.draw(st.integers(0, 4)) if w else 0 for w in window]
        gdn = data.draw(st.booleans())
        self.rig = self.make_rig(data, AttentionConfig(h, h, 8, window=tuple(window), sinks=tuple(sinks)),
                                 ps=data.draw(st.sampled_from([1, 2, 4])), pages=h * data.draw(st.integers(*self.PAGES)),
                                 max_seqs=3, blocks=40, gdn=gdn,
                                 num_checkpoints=data.draw(st.integers(1, 4)) if gdn else 0,
                                 recycle=data.draw(st.sampled_from(["eager", "keep_tail"])))
        rng = np.random.default_rng(data.draw(st.integers(0, 99)))
        self.bases = [rng.integers(1, 9, 30) for _ in range(self.BASES)]

    @rule(data=st.data())
    @precondition(lambda self: self.rig is not None and len(self.rig.progress) < 3)
    def start(self, data):
        base = data.draw(st.sampled_from(self.bases))
        # at most 40 tokens: a row has 40 blocks, and pages may hold one token
        cut, tail = data.draw(st.integers(1, 30)), data.draw(st.lists(st.integers(1, 9), max_size=10))
        prompt = np.concatenate([base[:cut], np.array(tail, np.int64)])
        self.rig.start(min(set(range(1, 4)) - set(self.rig.progress)), prompt)

    @rule(data=st.data())
    @precondition(lambda self: self.rig is not None and self.rig.progress)
    def compute(self, data):
        row = data.draw(st.sampled_from(sorted(self.rig.progress)))
        if self.rig.progress[row] == len(self.rig.prompts[row]):
            return self.rig.finish(row)
        try:
            self.rig.step(row, data.draw(st.integers(1, 9)))
        except OutOfPagesError:  # preempt by recompute (the allocator changed nothing)
            self.rig.land()
            self.rig.finish(row)

    @rule()
    @precondition(lambda self: self.rig is not None and not self.rig.progress)
    def clear(self):
        self.rig.pc.clear()
        self.rig.land()
        assert self.rig.b.free_pages() == [self.rig.cache_cfg.num_pages]
        assert self.rig.pc.host is None or self.rig.pc.host.used_bytes == 0

    @invariant()
    def consistent(self):
        if self.rig is not None:
            self.rig.check()

    def teardown(self):
        if self.rig is None:
            return
        for row in list(self.rig.progress):
            self.rig.finish(row)
        self.rig.pc.clear()
        self.rig.land()
        self.rig.check()
        assert self.rig.b.free_pages() == [self.rig.cache_cfg.num_pages] and (self.rig.b.tables == -1).all()
        assert self.rig.pc.checkpoints_used() == 0 and not self.rig.pc.entries
