"""GDN slot allocator and head-wise block allocator: ids, exhaustion, double free, pools, atomicity, integrity."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.errors import DoubleFreeError, OutOfPagesError, RequestTooLongError, SlotExhaustedError
from kvjax.sched import BlockAllocator, SlotAllocator


def test_sched_never_imports_jax():
    code = "import sys, kvjax.sched, kvjax.sched.simulate; assert 'jax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- slots -----------------------------------------------------------------------------------------------------
def test_slots_hand_out_1_to_max_never_pad(rng):
    n = int(rng.integers(2, 9))
    slots = SlotAllocator(n)
    got = [slots.allocate() for _ in range(n)]
    assert sorted(got) == list(range(1, n + 1)) and got[0] == 1
    with pytest.raises(SlotExhaustedError, match=f"max_seqs={n}"):
        slots.allocate()
    victim = int(rng.choice(got))
    slots.free(victim)
    assert slots.allocate() == victim
    slots.check_integrity()


def test_slot_free_errors_change_nothing():
    slots = SlotAllocator(3)
    a = slots.allocate()
    for bad in (0, a + 1, 4, -1):
        with pytest.raises(DoubleFreeError):
            slots.free(bad)
    slots.free(a)
    with pytest.raises(DoubleFreeError, match="not allocated"):
        slots.free(a)
    assert slots.num_free == 3
    slots.check_integrity()
    with pytest.raises(ValueError, match="max_seqs"):
        SlotAllocator(0)


# ---- blocks ----------------------------------------------------------------------------------------------------
def make(pool: str, num_pages: int = 12, h_kv: int = 3, page_size: int = 4, max_seqs: int = 4, max_blocks: int = 8):
    cache = CacheConfig(page_size=page_size, num_pages=num_pages, max_seqs=max_seqs, max_blocks_per_seq=max_blocks)
    return BlockAllocator(cache, AttentionConfig(h_kv, h_kv, 8, window=(2,) + (0,) * (h_kv - 1)), pool)


def snapshot(b: BlockAllocator):
    return (b.tables.copy(), list(b.num_blocks), [list(f) for f in b._free], b.owner_row.copy(), b.owner_head.copy())


def same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) if not isinstance(x, list) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("pool", ["shared", "partitioned"])
def test_allocate_covers_every_head_and_frees_everything(pool, rng):
    b = make(pool, num_pages=24)
    b.allocate(2, 5)  # 2 blocks per head
    b.allocate(1, int(rng.integers(1, 9)))
    assert b.num_blocks[2] == 2 and (b.tables[2, :, :2] >= 0).all() and (b.tables[2, :, 2:] == -1).all()
    if pool == "partitioned":
        assert (b.tables[2, :, :2] // 8 == np.arange(3)[:, None]).all()  # head h owns pages [8h, 8h+8)
    b.check_integrity()
    assert b.available() == pytest.approx(1 - (6 + 3 * b.num_blocks[1]) / 24)
    n1 = b.num_blocks[1]
    assert b.free_row(2) == 6 and b.free_row(1) == 3 * n1
    assert b.available() == 1.0 and (b.tables == -1).all()
    b.check_integrity()


def test_available_is_a_float_fraction():
    b = make("shared", num_pages=7, h_kv=1)
    b.allocate(1, 4)  # one page
    assert b.available() == 6 / 7 and isinstance(b.available(), float)


def test_partitioned_free_page_serves_only_its_head():
    shared, part = make("shared", num_pages=8, h_kv=2), make("partitioned", num_pages=8, h_kv=2)  # 4 pages/head
    for b in (shared, part):
        b.allocate(1, 12)  # 3 blocks x 2 heads
        b.recycled = set(b.tables[1, 0, :2].tolist())
        b.free_ranges(np.array([1]), np.array([0]), np.array([0]), np.array([2]))  # SWA head 0 recycles 2
        assert b.free_pages() == ([4] if b is shared else [3, 1])
    assert shared.can_fit(2) and not part.can_fit(2) and part.can_fit(1)
    shared.allocate(2, 4)  # one block per head: the free list hands back head 0's recycled pages first
    assert shared.tables[2, 1, 0] in shared.recycled  # ... and one of them now serves head 1
    shared.check_integrity()
    part.check_integrity()
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        make("partitioned", num_pages=7)
    with pytest.raises(ValueError, match="pool must be one of"):
        make("striped")


def test_out_of_pages_and_too_long_change_nothing():
    b = make("shared", num_pages=9, max_blocks=3)
    b.allocate(1, 4)
    before = snapshot(b)
    with pytest.raises(OutOfPagesError, match="pages needed"):
        b.allocate(2, 12)  # 3 blocks x 3 heads > 6 free
    with pytest.raises(RequestTooLongError, match="max_blocks_per_seq=3"):
        b.allocate(1, 13)
    with pytest.raises(ValueError, match="GDN slot in 1..4"):
        b.allocate(0, 4)  # row 0 is the PAD row
    assert same(before, snapshot(b))
    b.check_integrity()


def test_freeing_foreign_pages_raises():
    b = make("shared", num_pages=12)
    b.allocate(1, 4)
    b.allocate(2, 4)
    page = int(b.tables[1, 0, 0])
    b.tables[2, 0, 0] = page  # corrupt: row 2 claims row 1's page
    with pytest.raises(AssertionError):
        b.check_integrity()
    with pytest.raises(DoubleFreeError, match="not owned"):
        b.free_ranges(np.array([2]), np.array([0]), np.array([0]), np.array([1]))


def test_overlapping_free_ranges_raise_and_change_nothing(rng):
    """Two ranges covering the same (row, head, block), e.g. a policy listing a head twice, must not put the
    page on the free list twice (two rows would later share it)."""
    b = make("shared", num_pages=12)
    b.allocate(1, int(rng.integers(5, 13)))  # 2..3 blocks per head
    before = snapshot(b)
    with pytest.raises(DoubleFreeError, match="freed twice"):
        b.free_ranges(np.array([1, 1]), np.array([0, 0]), np.array([0, 1]), np.array([2, 2]))
    assert same(before, snapshot(b))
    b.check_integrity()


def test_check_integrity_catches_leaks_and_pad_row_writes():
    b = make("shared")
    b.allocate(1, 4)
    b._free[0].pop()  # a page vanishes
    with pytest.raises(AssertionError, match="free .* != total"):
        b.check_integrity()
    b = make("shared")
    b.tables[0, 0, 0] = 3
    with pytest.raises(AssertionError, match="PAD row"):
        b.check_integrity()
