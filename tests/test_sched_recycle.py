"""The SWA recycle rule against a brute-force mask oracle, its edges, and recycle policies in the scheduler."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.sched import Scheduler, recycle_out_of_window
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.recycle import (first_recyclable_block, free_blocks_before, live_blocks, peak_live_blocks,
                                 peak_total_blocks, recycle_stop)


def attends(i: int, j: int, window: int, sinks: int) -> bool:
    return j <= i and (i - j < window or j < sinks)


def oracle_recyclable(L: int, window: int, sinks: int, ps: int) -> set[int]:
    """Blocks of [0, L) no query at i >= L attends (queries past L + window + ps see nothing new), that hold no
    sink, and that do not hold position L."""
    out = set()
    for b in range(-(-L // ps)):
        pos = range(b * ps, min((b + 1) * ps, L))
        needed = any(attends(i, j, window, sinks) for i in range(L, L + window + ps + 1) for j in pos)
        if not needed and all(j >= sinks for j in pos) and b != L // ps:
            out.add(b)
    return out


def test_rule_matches_mask_oracle():
    for L, window, sinks, ps in itertools.product(range(0, 30), range(1, 10), range(0, 7), (1, 2, 3, 4)):
        stop = int(recycle_stop(L, window, ps))
        first = int(first_recyclable_block(sinks, ps))
        assert set(range(first, stop)) == oracle_recyclable(L, window, sinks, ps), (L, window, sinks, ps)


def test_window_edges_off_by_one_both_sides():
    # window 4, page 1: the query at L=10 attends 7..10, so position 6 is free and 7 is not.
    assert recycle_stop(10, 4, 1) == 7
    assert recycle_stop(9, 4, 1) == 6 and recycle_stop(11, 4, 1) == 8
    # page 2: block 3 holds 6, 7 (7 still attended) -> kept; block 2 (4, 5) -> recyclable.
    assert recycle_stop(10, 4, 2) == 3
    assert recycle_stop(11, 4, 2) == 4  # now 7 is out too (11 - 7 = 4 is not < 4)
    assert recycle_stop(3, 4, 1) == 0 and recycle_stop(4, 4, 1) == 1  # nothing until L >= window
    assert recycle_stop(100, 0, 4) == 0  # full-attention heads never recycle


def test_block_boundary_rule_keeps_the_block_being_written():
    # window 1: each query only sees itself, so at L = 2*ps every earlier block is out of the window, but the
    # block holding position L (written this step) is never recycled.
    for ps in (1, 2, 4, 8):
        for L in range(0, 5 * ps):
            assert recycle_stop(L, 1, ps) <= L // ps
            assert recycle_stop(L, 1, ps) == L // ps  # everything strictly before L's block goes


def test_sinks_never_recycled_in_a_long_run():
    att = AttentionConfig(2, 2, 8, window=(3, 0), sinks=(3, 0))
    cache = CacheConfig(page_size=2, num_pages=40, max_seqs=2, max_blocks_per_seq=32)
    sched = Scheduler(cache, att, max_num_batched_tokens=4, recycle="timely")
    req = sched.add_request(np.arange(1, 12), 40)
    seen_holes = set()
    while sched.has_unfinished():
        plan = sched.schedule()
        row = sched.blocks.tables[req.slot]
        assert (row[0, :2] >= 0).all(), "blocks holding sink positions 0..2 were recycled"
        assert (row[1, : sched.blocks.num_blocks[req.slot]] >= 0).all(), "a full head lost a block"
        L = req.num_computed
        expect = set(range(2, int(recycle_stop(L, 3, 2))))
        holes = set(np.flatnonzero(row[0, : sched.blocks.num_blocks[req.slot]] < 0).tolist())
        assert holes == expect
        seen_holes |= holes
        sched.update(plan, np.full(plan.gdn_slots.shape[0], 5))
    assert len(seen_holes) > 10


def test_free_blocks_before_rejects_heads_out_of_range():
    """A negative head must not wrap to the last head (numpy indexing); nothing is freed."""
    cache = CacheConfig(page_size=4, num_pages=12, max_seqs=2, max_blocks_per_seq=3)
    b = BlockAllocator(cache, AttentionConfig(4, 2, 8))
    b.allocate(1, 12)
    for bad in ([-1], [0, 2]):
        with pytest.raises(ValueError, match=r"heads .* must lie in 0\.\.1"):
            free_blocks_before(b, np.array([1]), np.array(bad), np.array([12]), 1, 0)
    assert (b.tables[1] >= 0).all()
    b.check_integrity()


def test_peak_blocks_without_recycling_is_every_step_maximum(rng):
    """Without recycling the admission check's peak (a closed form) is the maximum over every step of a request
    running alone in chunks, computed step by step with live_blocks."""
    for _ in range(300):
        total, ps, chunk, h = int(rng.integers(1, 400)), int(rng.choice([1, 4, 16])), int(rng.integers(1, 300)), 4
        window, sinks = rng.integers(0, 64, h), rng.integers(0, 4, h)
        fed = max(total - 1, 1)
        L = np.arange(fed)
        steps = live_blocks(L, np.minimum(chunk, fed - L), window, sinks, ps, recycle=False)  # i64[fed, H]
        np.testing.assert_array_equal(peak_live_blocks(total, window, sinks, ps, chunk, recycle=False),
                                      steps.max(0))
        assert peak_total_blocks(total, window, sinks, ps, chunk, recycle=False) == steps.sum(1).max()


def test_live_blocks_counts_what_the_allocator_holds():
    att = AttentionConfig(3, 3, 8, window=(5, 2, 0), sinks=(1, 0, 0))
    cache = CacheConfig(page_size=3, num_pages=90, max_seqs=1, max_blocks_per_seq=30)
    sched = Scheduler(cache, att, max_num_batched_tokens=7, recycle="timely")
    req = sched.add_request(np.arange(1, 30), 20)
    while sched.has_unfinished():
        L = req.num_computed
        plan = sched.schedule()
        held = (sched.blocks.tables[req.slot] >= 0).sum(axis=1)
        expect = live_blocks(np.array([L]), np.array([plan.num_tokens]), np.array(att.window), np.array(att.sinks), 3)
        np.testing.assert_array_equal(held, expect[0])
        sched.update(plan, np.full(plan.gdn_slots.shape[0], 4))


class LazyRecycle:  # a new policy in a few lines: recycle only under memory pressure
    name, frees_swa_blocks = "lazy", True

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def recycle(self, blocks, rows, num_computed):
        return recycle_out_of_window(blocks, rows, num_computed) if blocks.available() < self.threshold else 0


@pytest.mark.parametrize("policy", ["none", "timely", "lazy"])
def test_policies_give_identical_outputs_and_lazy_waits_for_pressure(policy, rng):
    att = AttentionConfig(4, 2, 8, window=(4, 0), sinks=(1, 0))
    cache = CacheConfig(page_size=2, num_pages=60, max_seqs=3, max_blocks_per_seq=20)
    lazy = LazyRecycle(0.5)
    sched = Scheduler(cache, att, max_num_batched_tokens=6, recycle=lazy if policy == "lazy" else policy)
    prompts = [rng.integers(1, 50, int(rng.integers(5, 15))) for _ in range(4)]
    reqs = [sched.add_request(p, 12) for p in prompts]
    recycled = {True: 0, False: 0}  # pages recycled in steps that started with >= 50% / < 50% free
    while sched.has_unfinished():
        roomy = sched.blocks.available() >= 0.5
        before = {r.request_id: sched.blocks.tables[r.slot].copy() for r in sched.running}
        plan = sched.schedule()
        for r in sched.running:
            if r.request_id in before:
                recycled[roomy] += int(((before[r.request_id] >= 0) & (sched.blocks.tables[r.slot] < 0)).sum())
        sched.update(plan, (plan.seq_lens * 7 + 3) % 50)
        sched.check_integrity()
    if policy == "none":
        assert recycled == {True: 0, False: 0}
    elif policy == "lazy":
        assert recycled[True] == 0 and recycled[False] > 0
    else:
        assert recycled[True] > 0
    outs = [r.output_ids.tolist() for r in reqs]
    assert outs == [[((len(p) + k) * 7 + 3) % 50 for k in range(12)] for p in prompts]
