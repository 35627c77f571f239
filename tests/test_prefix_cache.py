"""Host prefix cache: head-wise matches, GDN checkpoints, LRU eviction, recycle options, a stateful property test.

A shadow copy of every page records which (token, position) each offset holds when a row writes it. Every
attached page must still hold exactly the prompt's tokens at those positions on every head that needs it
(no cached page is overwritten or handed out while referenced), and rows only ever write their private pages.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.errors import OutOfPagesError
from kvjax.sched import prefix_cache as pcm
from kvjax.sched.blocks import SHARED, BlockAllocator
from kvjax.sched.prefix_cache import PrefixCache, PrefixCacheConfig

from helpers.prefix import PrefixMachine, Rig


def test_config_errors():
    with pytest.raises(ValueError, match="num_checkpoints must be >= 1"):
        PrefixCacheConfig(num_checkpoints=0, gdn=True)
    with pytest.raises(ValueError, match="recycle must be one of"):
        PrefixCacheConfig(gdn=False, recycle="lazy")
    with pytest.raises(ValueError, match=">= 0"):
        PrefixCacheConfig(num_checkpoints=-1, gdn=False)
    b = BlockAllocator(CacheConfig(4, 8, 2, 4), AttentionConfig(2, 1, 8))
    PrefixCache(b, PrefixCacheConfig(gdn=False))
    with pytest.raises(ValueError, match="already has a prefix cache"):
        PrefixCache(b, PrefixCacheConfig(gdn=False))


@pytest.mark.parametrize("gdn", [False, True])
def test_shared_prefix_hits_head_wise_and_matches_end_at_checkpoints(rng, gdn):
    att = AttentionConfig(6, 3, 8, window=(7, 0, 5), sinks=(3, 0, 0))
    r = Rig(att, gdn=gdn, num_checkpoints=3 if gdn else 0)
    system = rng.integers(1, 50, 22)
    prompts = [np.concatenate([system, rng.integers(50, 99, int(rng.integers(3, 12)))]) for _ in range(4)]
    assert r.run(1, prompts[0]).num_tokens == 0
    r.finish(1)
    m1 = r.run(2, prompts[1])  # leaves A's chain at block 5: a branch point, filled by B
    assert m1.chain_blocks == 5 and 20 in m1.stops if gdn else m1.num_tokens < 20
    r.finish(2)
    for row, p in ((3, prompts[2]), (1, prompts[3])):  # both hit the 5 shared blocks, concurrently
        m = r.start(row, p)
        assert m.num_tokens == 20 and (m.checkpoint in r.pc.checkpoint_slots if gdn else m.checkpoint == -1)
    shared = r.b.tables[[3, 1], :, :5]
    np.testing.assert_array_equal(shared[0], shared[1])  # the same pages, no copy
    assert (r.b.owner_row[shared[0][shared[0] >= 0]] == SHARED).all()
    assert (r.b.refs[shared[0][shared[0] >= 0]] == 2).all()
    r.check()
    for row in (3, 1):
        r.finish(row)
    r.pc.clear()
    r.check()
    assert r.b.free_pages() == [r.cache_cfg.num_pages] and r.pc.checkpoints_used() == 0


def test_gdn_match_needs_a_checkpoint(rng):
    att = AttentionConfig(2, 1, 8)
    r = Rig(att, gdn=True, num_checkpoints=1)
    p = rng.integers(1, 99, 30)
    r.run(1, p)
    r.finish(1)
    assert r.start(2, p).num_tokens == 28  # the end of the reusable prompt: (30 - 1) // 4 blocks
    r.finish(2)
    q = np.concatenate([p[:13], [0] * 20])  # shares 3 blocks, but no checkpoint at block 3
    m = r.pc.match(q)
    assert (m.num_tokens, m.chain_blocks, m.stops) == (0, 3, (12, 32))
    r.run(3, q)  # the only slot goes to its checkpoint at 12 (evicting p's), then to its end at 32
    assert r.pc.match(q).num_tokens == 32 and r.pc.match(p).num_tokens == 0 and r.pc.checkpoints_used() == 1


def test_allocation_evicts_idle_cached_pages_lru_leaves_first(rng):
    att = AttentionConfig(2, 1, 8)
    r = Rig(att, pages=12, gdn=False)
    a, b = rng.integers(1, 99, 17), rng.integers(1, 99, 17)
    r.run(1, a)
    r.finish(1)
    r.run(1, b)
    r.finish(1)
    assert r.b.free_pages() == [4] and r.b.reclaimable_pages() == [8] and r.b.can_fit(12)
    r.start(2, a)  # touches a's chain: b is now least recently used
    assert r.pc.match(a).num_tokens == 16
    r.b.allocate(3, 4 * 7)  # 7 pages: 4 free + 3 of b's, deepest first
    assert r.pc.match(b).num_tokens == 4 and r.pc.match(a).num_tokens == 16
    with pytest.raises(OutOfPagesError):  # a's pages are held by row 2: not reclaimable
        r.b.allocate(3, 4 * 9)
    r.check()


@pytest.mark.parametrize("mode", ["eager", "keep_tail"])
def test_recycle_options(rng, mode):
    att = AttentionConfig(2, 1, 8, window=(6,), sinks=(2,))
    r = Rig(att, gdn=False, recycle=mode)
    p = rng.integers(1, 99, 41)
    r.run(1, p)
    r.prompts[1] = np.concatenate([p, rng.integers(1, 99, 20)])  # it decodes on: its window leaves the prompt
    while r.progress[1] < 60:
        r.step(1, 1)
    r.finish(1)
    r.check()
    hit = r.pc.match(p).num_tokens
    assert hit == (40 if mode == "keep_tail" else 4)  # eager: only a 1-block match, which needs just the sink
    assert r.pc.cached_pages() == (1 + 2 if mode == "keep_tail" else 1)  # sink block (+ the tail window)


def test_hash_collision_is_never_a_hit(rng, monkeypatch):
    monkeypatch.setattr(pcm, "block_key_bytes", lambda parent, data: 7)  # every block collides
    r = Rig(AttentionConfig(2, 1, 8), gdn=False)
    a, b = rng.integers(1, 50, 13), rng.integers(50, 99, 13)
    r.run(1, a)
    r.finish(1)
    assert r.pc.match(b).num_tokens == 0 and r.pc.match(a).num_tokens == 4
    r.run(1, b)
    r.check()


class CacheMachine(PrefixMachine):
    """Random requests over a few shared prefixes, chunked compute, recycling, eviction, finishes and clears."""


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
