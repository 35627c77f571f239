"""Bad input on the host side (issue #17): configs, allocators and the scheduler reject bad values with a
``ValueError`` naming them, before anything changes, and no other request is affected."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig, GDNConfig
from kvjax.errors import DoubleFreeError, RequestTooLongError
from kvjax.sched import BlockAllocator, Scheduler, SlotAllocator, Status

I32_MAX = 2**31 - 1
ATT = AttentionConfig(4, 2, 8, window=(6, 0), sinks=(2, 0))


def sched_with(num_pages=64, page_size=4, max_seqs=4, max_blocks=16, budget=16, **kw) -> Scheduler:
    cache = CacheConfig(page_size=page_size, num_pages=num_pages, max_seqs=max_seqs, max_blocks_per_seq=max_blocks)
    return Scheduler(cache, kw.pop("att", ATT), max_num_batched_tokens=budget, **kw)


def requests_state(sched: Scheduler):
    reqs = sorted(sched.requests.values(), key=lambda r: r.request_id)
    return ([(r.request_id, r.status, r.slot, r.num_computed, r.num_tokens, r.token_ids.tobytes()) for r in reqs],
            sched.blocks.tables.tobytes(), sched.slots.num_free, sched.step)


def finish(sched: Scheduler, rng, max_steps=1000) -> list:
    plans = []
    while sched.has_unfinished() and len(plans) < max_steps:
        plans.append(sched.schedule())
        p = plans[-1]
        assert (p.query_lens[: p.num_seqs] > 0).all()
        assert ((p.logits_indices >= 0) & (p.logits_indices < p.token_ids.shape[0])).all()
        sched.update(p, rng.integers(1, 40, p.seq_lens.shape[0]))
        sched.check_integrity()
    assert not sched.has_unfinished()
    return plans


# ---- item 4: Scheduler.update is atomic; check_integrity sees a running request with nothing to compute ----------
@pytest.mark.parametrize("bad, why", [
    (lambda b: np.ones((b, 2), np.int32), "2-d"),
    (lambda b: np.array(3), "0-d"),
    (lambda b: np.full(b, 1.5), "float"),
    (lambda b: np.full(b, 2**40), "past int32"),
    (lambda b: np.full(b, -1), "negative"),
    (lambda b: np.ones(b - 1, np.int32), "short"),
])
def test_update_with_bad_sampled_changes_nothing(bad, why, rng):
    sched = sched_with(budget=16)
    for n in (3, 5, 20):  # the 20-token prompt is mid-prefill after the first step
        sched.add_request(rng.integers(1, 40, n), 4)
    plan = sched.schedule()
    assert plan.num_seqs == 3
    before = requests_state(sched)
    with pytest.raises(ValueError, match="sampled"):
        sched.update(plan, bad(plan.num_seqs))
    assert requests_state(sched) == before, why
    sched.check_integrity()
    sched.update(plan, rng.integers(1, 40, plan.num_seqs))  # the same plan is still the one to apply
    finish(sched, rng)


def test_check_integrity_catches_a_running_request_with_nothing_to_compute(rng):
    sched = sched_with()
    req = sched.add_request(rng.integers(1, 40, 5), 4)
    plan = sched.schedule()
    sched.update(plan, rng.integers(1, 40, plan.num_seqs))
    sched.check_integrity()
    req.num_computed = req.num_tokens  # what a half-applied update used to leave behind
    with pytest.raises(AssertionError, match="nothing to compute"):
        sched.check_integrity()


# ---- item 5 (config half): window / sinks must fit int32 -------------------------------------------------------
@pytest.mark.parametrize("field", ["window", "sinks"])
def test_attention_window_and_sinks_must_fit_int32(field):
    kw = {"window": (I32_MAX + 1, 0)} if field == "window" else {"window": (I32_MAX, 0), "sinks": (I32_MAX + 1, 0)}
    with pytest.raises(ValueError, match=rf"{field}\[0\] must be an int in \[0, {I32_MAX}\], got {I32_MAX + 1}"):
        AttentionConfig(4, 2, 8, **kw)
    with pytest.raises(ValueError, match=rf"window\[0\] must be an int in \[0, {I32_MAX}\], got {10**12}"):
        AttentionConfig(4, 2, 8, window=(10**12, 0))
    cfg = AttentionConfig(4, 2, 8, window=(I32_MAX, 0), sinks=(I32_MAX, 0))  # the largest value still fits
    assert cfg.window == (I32_MAX, 0)


def test_cache_geometry_must_fit_int32_slot_mapping_and_positions():
    with pytest.raises(ValueError, match=r"num_pages \* page_size"):
        CacheConfig(page_size=2**16, num_pages=2**15, max_seqs=1, max_blocks_per_seq=1)
    with pytest.raises(ValueError, match=r"max_seq_len"):
        CacheConfig(page_size=2**16, num_pages=1, max_seqs=1, max_blocks_per_seq=2**15)
    CacheConfig(page_size=2**16, num_pages=2**15 - 1, max_seqs=1, max_blocks_per_seq=2**15 - 1)


# ---- item 7: internal allocator calls --------------------------------------------------------------------------
def allocated_blocks(pool="shared") -> BlockAllocator:
    blocks = BlockAllocator(CacheConfig(page_size=4, num_pages=16, max_seqs=2, max_blocks_per_seq=4), ATT, pool)
    blocks.allocate(1, 16)  # all 4 blocks on both heads
    blocks.allocate(2, 5)
    return blocks


@pytest.mark.parametrize("rows, heads, starts, stops, match", [
    ([1], [0], [-1], [0], r"starts"),  # used to wrap and free the row's last block
    ([1], [0], [-2], [1], r"starts"),
    ([1], [2], [0], [1], r"heads"),
    ([1], [-1], [0], [1], r"heads"),
    ([3], [0], [0], [1], r"rows"),
    ([0], [0], [0], [1], r"rows"),
    ([-1], [0], [0], [1], r"rows"),
    ([1], [0], [0], [5], r"stops"),
    ([1, 2], [0], [0], [1], r"same length"),
    ([1.0], [0], [0], [1], r"integer"),
    ([[1]], [[0]], [[0]], [[1]], r"1-d"),
])
def test_free_ranges_rejects_out_of_range_entries_and_changes_nothing(rows, heads, starts, stops, match):
    blocks = allocated_blocks()
    before = (blocks.tables.copy(), blocks.free_pages(), blocks.owner_row.copy())
    with pytest.raises(ValueError, match=match):
        blocks.free_ranges(np.asarray(rows), np.asarray(heads), np.asarray(starts), np.asarray(stops))
    np.testing.assert_array_equal(blocks.tables, before[0])
    assert blocks.free_pages() == before[1]
    np.testing.assert_array_equal(blocks.owner_row, before[2])
    blocks.check_integrity()
    assert blocks.free_ranges(np.array([1]), np.array([0]), np.array([3]), np.array([1])) == 0  # empty range: ok
    assert blocks.free_ranges(np.array([1]), np.array([0]), np.array([0]), np.array([4])) == 4
    blocks.check_integrity()


@pytest.mark.parametrize("row, tokens, match", [(1.0, 4, "row"), (True, 4, "row"), (1, 4.0, "num_tokens"),
                                                (1, -1, "num_tokens"), (np.int64(3), 4, "row")])
def test_allocate_and_free_row_reject_bad_arguments(row, tokens, match):
    blocks = allocated_blocks()
    blocks.free_row(2)
    before = (blocks.tables.copy(), blocks.free_pages())
    with pytest.raises(ValueError, match=match):
        blocks.allocate(row, tokens)
    if match == "row":
        with pytest.raises(ValueError, match="row"):
            blocks.free_row(row)
    np.testing.assert_array_equal(blocks.tables, before[0])
    assert blocks.free_pages() == before[1]
    blocks.allocate(np.int64(2), np.int64(4))  # numpy ints are ints
    assert blocks.num_blocks[2] == 1
    blocks.check_integrity()


@pytest.mark.parametrize("bad", [True, 1.0, "1", None, np.float64(1.0), np.bool_(True)])
def test_slot_free_rejects_non_ints_and_changes_nothing(bad):
    slots = SlotAllocator(3)
    assert slots.allocate() == 1
    with pytest.raises((ValueError, DoubleFreeError), match="slot"):
        slots.free(bad)
    assert slots.allocated == {1} and slots.num_free == 2
    slots.check_integrity()
    got = slots.allocate()
    assert got == 2 and type(got) is int


def test_slot_allocator_takes_numpy_ints():
    slots = SlotAllocator(np.int64(2))
    assert slots.max_seqs == 2 and type(slots.max_seqs) is int
    slots.free(np.int64(slots.allocate()))
    got = slots.allocate()
    assert got == 1 and type(got) is int
    slots.check_integrity()


# ---- item 11: smaller ones ------------------------------------------------------------------------------------
def test_configs_take_numpy_ints_and_store_python_ints():
    cfg = CacheConfig(np.int64(4), np.int64(8), np.int32(2), np.uint16(4))
    assert cfg == CacheConfig(4, 8, 2, 4) and hash(cfg) == hash(CacheConfig(4, 8, 2, 4))
    assert all(type(getattr(cfg, f)) is int for f in ("page_size", "num_pages", "max_seqs", "max_blocks_per_seq"))
    gdn = GDNConfig(np.int64(1), np.int64(2), np.int64(8), np.int64(8))
    assert type(gdn.num_v_heads) is int and gdn.conv_dim == 2 * 8 + 2 * 8
    att = AttentionConfig(np.int64(4), np.int64(2), np.int64(8), window=np.array([6, 0]), sinks=(np.int32(2), 0))
    assert att == ATT and all(type(v) is int for v in att.window + att.sinks)
    with pytest.raises(ValueError, match=r"page_size must be an int, got .*4\.0"):
        CacheConfig(np.float64(4.0), 8, 2, 4)
    with pytest.raises(ValueError, match=r"window\[0\] must be an int"):
        AttentionConfig(4, 2, 8, window=(6.0, 0))


@pytest.mark.parametrize("watermark", ["0.1", None, float("nan"), -0.1, 1.0, True, [0.1]])
def test_watermark_must_be_a_number_in_0_1(watermark):
    with pytest.raises(ValueError, match=r"watermark must be a number in \[0, 1\)"):
        sched_with(watermark=watermark)


def test_scheduler_takes_numpy_ints():
    sched = sched_with(budget=np.int64(16))
    assert sched.max_num_batched_tokens == 16 and type(sched.max_num_batched_tokens) is int
    req = sched.add_request(np.arange(1, 4), np.int64(2), request_id=np.int64(7), eos_token_id=np.int64(3))
    assert req.request_id == 7 and type(req.request_id) is int and 7 in sched.requests
    assert type(req.eos_token_id) is int


def test_prompt_of_max_seq_len_plus_one_new_token_fits(rng):
    # only prompt + max_new - 1 positions are ever cached: the last sampled token is never fed
    sched = sched_with(num_pages=8, page_size=4, max_seqs=1, max_blocks=4, budget=8)  # max_seq_len = 16
    req = sched.add_request(rng.integers(1, 40, 16), 1)
    plans = finish(sched, rng)
    assert req.status is Status.FINISHED and req.num_output == 1 and len(plans) == 2  # 8 + 8 prompt tokens
    assert plans[-1].seq_lens[0] == 16
    req = sched.add_request(rng.integers(1, 40, 14), 3)  # 14 + 3 - 1 = 16 positions
    finish(sched, rng)
    assert req.num_output == 3
    before = requests_state(sched)
    with pytest.raises(RequestTooLongError, match="17 positions"):
        sched.add_request(rng.integers(1, 40, 16), 2)
    with pytest.raises(RequestTooLongError, match="max_seq_len=16"):
        sched.add_request(rng.integers(1, 40, 17), 1)
    assert requests_state(sched) == before


def test_huge_max_new_tokens_is_too_long_not_a_memory_error(rng):
    sched = sched_with()
    with pytest.raises(RequestTooLongError, match="max_seq_len"):
        sched.add_request(rng.integers(1, 40, 5), 10**15)
    assert not sched.requests and not sched.waiting


@pytest.mark.parametrize("prompt, eos, match", [
    (np.array([1, 2, -3]), None, "token ids"),
    (np.array([1, 2**40]), None, "token ids"),
    (np.array([1, 2]), "2", "eos_token_id"),
    (np.array([1, 2]), 2.0, "eos_token_id"),
    (np.array([1, 2]), -1, "eos_token_id"),
    (np.array([1, 2]), 2**40, "eos_token_id"),
])
def test_bad_token_ids_are_rejected_and_change_nothing(prompt, eos, match, rng):
    sched = sched_with()
    sched.add_request(rng.integers(1, 40, 5), 2)
    before = requests_state(sched)
    with pytest.raises(ValueError, match=match):
        sched.add_request(prompt, 2, eos_token_id=eos)
    assert requests_state(sched) == before
    finish(sched, rng)


def test_check_integrity_catches_an_empty_row_in_the_pending_plan(rng):
    import dataclasses

    sched = sched_with()
    sched.add_request(rng.integers(1, 40, 5), 4)
    sched.schedule()
    sched.check_integrity()
    plan = sched.ledger.planned
    sched.ledger.planned = dataclasses.replace(plan, query_lens=np.zeros_like(plan.query_lens),
                                           logits_indices=plan.logits_indices - 1)
    with pytest.raises(AssertionError, match="row without tokens"):
        sched.check_integrity()


@pytest.mark.parametrize("rows", [[3], [0], [-1]])
def test_recycle_rows_out_of_range_raise_and_change_nothing(rows):
    from kvjax.sched.recycle import free_blocks_before

    blocks = allocated_blocks()
    before = (blocks.tables.copy(), blocks.recycled_upto.copy())
    with pytest.raises(ValueError, match="rows"):
        free_blocks_before(blocks, np.array(rows), np.array([0]), np.array([16]), 4, 0)
    np.testing.assert_array_equal(blocks.tables, before[0])
    np.testing.assert_array_equal(blocks.recycled_upto, before[1])
    with pytest.raises(ValueError, match="row"):
        blocks.pages_needed(rows[0], 8)


def test_as_tuple_and_swa_fraction_name_bad_values():
    from kvjax.config import as_tuple

    assert as_tuple(np.int64(3), 2, "w") == (3, 3) and type(as_tuple(np.int64(3), 2, "w")[0]) is int
    with pytest.raises(ValueError, match=r"w must be an int or a sequence of 2 ints, got 2\.5"):
        as_tuple(2.5, 2, "w")
    with pytest.raises(ValueError, match="swa_fraction must be a number in"):
        AttentionConfig.with_swa_fraction(4, 2, 8, swa_fraction="0.5", window=8)
    with pytest.raises(ValueError, match="window and sinks must be ints"):
        AttentionConfig.with_swa_fraction(4, 2, 8, swa_fraction=0.5, window=8.0)
    with pytest.raises(ValueError, match="window must be a sequence"):
        AttentionConfig(4, 2, 8, window=8)
