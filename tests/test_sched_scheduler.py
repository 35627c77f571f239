"""Scheduler: plan layout and buckets, reused rows, slots on every path, preemption by recompute, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.errors import RequestTooLongError, SlotExhaustedError
from kvjax.sched import Scheduler, Status
from kvjax.sched.plan import bucket, seq_buckets, token_buckets

from helpers.sched import ATT, sched_with



def fake_sample(plan) -> np.ndarray:
    return (plan.seq_lens * 5 + 1) % 41  # a function of the new token's position only


def run(sched: Scheduler, max_steps: int = 10_000) -> list:
    plans = []
    while sched.has_unfinished() and len(plans) < max_steps:
        plans.append(sched.schedule())
        sched.update(plans[-1], fake_sample(plans[-1]))
        sched.check_integrity()
    assert not sched.has_unfinished()
    return plans


def state(sched: Scheduler):
    return (len(sched.waiting), len(sched.running), len(sched.requests), sched.slots.num_free,
            sched.blocks.available(), sched.blocks.tables.copy().tobytes())


def test_buckets_are_documented_sets():
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert token_buckets(100) == (16, 32, 64, 100) and seq_buckets(256)[-1] == 256 and seq_buckets(5) == (5,)
    assert bucket(17, token_buckets(100)) == 32 and bucket(100, token_buckets(100)) == 100
    with pytest.raises(ValueError, match="largest bucket"):
        bucket(101, token_buckets(100))


def test_plan_layout_and_padding(rng):
    sched = sched_with(budget=32, max_seqs=8)
    prompts = [rng.integers(1, 40, n) for n in (9, 5, 3)]
    reqs = [sched.add_request(p, 4) for p in prompts]
    plan = sched.schedule()  # 9 + 5 + 3 = 17 tokens, 3 rows -> T=32, B=8
    assert plan.token_ids.shape == (32,) and plan.seq_lens.shape == (8,) and plan.cu_seqlens.shape == (9,)
    assert plan.block_tables.shape == (8, 2, 8) and plan.slot_mapping.shape == (32, 2)
    np.testing.assert_array_equal(plan.cu_seqlens, [0, 9, 14, 17, 17, 17, 17, 17, 17])
    np.testing.assert_array_equal(plan.token_ids[:17], np.concatenate(prompts))
    np.testing.assert_array_equal(plan.positions[:17], np.r_[0:9, 0:5, 0:3])
    np.testing.assert_array_equal(plan.gdn_slots, [1, 2, 3, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(plan.seq_lens, [9, 5, 3, 0, 0, 0, 0, 0])
    assert not plan.has_initial_state.any() and plan.sample_mask[:3].all() and not plan.sample_mask[3:].any()
    np.testing.assert_array_equal(plan.logits_indices, [8, 13, 16, 0, 0, 0, 0, 0])
    assert (plan.slot_mapping[17:] == -1).all() and (plan.block_tables[3:] == -1).all()
    ps = 4
    for b, r in enumerate(reqs):  # slot mapping = page of (row, head, pos // ps) * ps + pos % ps
        lo, hi = plan.cu_seqlens[b], plan.cu_seqlens[b + 1]
        pos = plan.positions[lo:hi]
        for h in range(2):
            np.testing.assert_array_equal(plan.slot_mapping[lo:hi, h], plan.block_tables[b, h, pos // ps] * ps + pos % ps)
    sched.update(plan, fake_sample(plan))
    plan = sched.schedule()  # three decodes
    assert plan.num_tokens == 3 and plan.token_ids.shape == (16,) and plan.has_initial_state[:3].all()
    np.testing.assert_array_equal(plan.positions[:3], [9, 5, 3])
    np.testing.assert_array_equal(plan.token_ids[:3], [(9 * 5 + 1) % 41, (5 * 5 + 1) % 41, (3 * 5 + 1) % 41])
    assert all(a.dtype == (bool if k == "has_initial_state" else np.int32) for k, a in plan.device_arrays().items())
    assert set(plan.device_arrays()) == {"token_ids", "positions", "cu_seqlens", "seq_lens", "gdn_slots",
                                         "has_initial_state", "block_tables", "slot_mapping", "logits_indices"}


def test_chunked_prefill_samples_only_at_the_end():
    sched = sched_with(budget=4)
    req = sched.add_request(np.arange(1, 11), 2)
    plans = [sched.schedule()]
    sched.update(plans[0], fake_sample(plans[0]))
    plans.append(sched.schedule())
    sched.update(plans[1], fake_sample(plans[1]))
    plans.append(sched.schedule())
    assert [p.num_tokens for p in plans] == [4, 4, 2] and [bool(p.sample_mask[0]) for p in plans] == [False, False, True]
    assert [bool(p.has_initial_state[0]) for p in plans] == [False, True, True]
    assert req.num_output == 0
    sched.update(plans[2], fake_sample(plans[2]))
    assert req.output_ids.tolist() == [(10 * 5 + 1) % 41]


def test_reused_batch_row_carries_nothing_of_the_previous_request(rng):
    sched = sched_with(budget=32, max_seqs=2)
    a = sched.add_request(rng.integers(1, 40, 8), 1)  # finishes after its prefill
    b = sched.add_request(rng.integers(1, 40, 6), 5)
    plan = sched.schedule()
    a_slot, a_pages = a.slot, set(plan.block_tables[0][plan.block_tables[0] >= 0].tolist())
    sched.update(plan, fake_sample(plan))
    assert a.status is Status.FINISHED and a.slot == 0
    c = sched.add_request(rng.integers(1, 40, 3), 3)
    plan = sched.schedule()  # row 0: b (decode), row 1: c in a's old slot
    assert plan.request_ids == (b.request_id, c.request_id) and c.slot == a_slot
    assert plan.gdn_slots[1] == c.slot and not plan.has_initial_state[1]
    row = plan.block_tables[1]
    assert (row[:, 1:] == -1).all(), "c holds one block per head; the rest of a's row must be holes"
    assert (sched.blocks.owner_row[row[row >= 0]] == c.slot).all()
    sched.update(plan, fake_sample(plan))
    # b finishes later; then an empty step layout has only PAD rows
    run(sched)
    assert sched.blocks.available() == 1.0 and sched.slots.num_free == 2
    assert a_pages  # a really held pages that were given back


def test_preempt_and_resume_gives_same_positions_and_tokens(rng):
    prompts = [rng.integers(1, 40, int(n)) for n in rng.integers(8, 20, 5)]
    outs = {}
    for num_pages in (200, 14):  # ample memory vs. preemption pressure (7 pages per head)
        sched = sched_with(num_pages=num_pages, budget=8, max_seqs=4, pool="partitioned")
        reqs = [sched.add_request(p, 10) for p in prompts]
        fed = {r.request_id: {} for r in reqs}
        for plan in run(sched):
            for b, rid in enumerate(plan.request_ids):
                lo, hi = plan.cu_seqlens[b], plan.cu_seqlens[b + 1]
                for pos, tok in zip(plan.positions[lo:hi].tolist(), plan.token_ids[lo:hi].tolist()):
                    assert fed[rid].setdefault(pos, tok) == tok  # a re-fed position carries the same token
        outs[num_pages] = [r.output_ids.tolist() for r in reqs]
        for r, p in zip(reqs, prompts):
            assert sorted(fed[r.request_id]) == list(range(len(p) + 9))
        preempted = sum(r.num_preemptions for r in reqs)
        assert (preempted > 0) == (num_pages == 14) and sched.num_preemptions == preempted
    assert outs[200] == outs[14]


def test_preemption_frees_slot_and_requeues_at_front():
    sched = sched_with(num_pages=8, page_size=2, budget=8, max_seqs=3, att=AttentionConfig(2, 2, 8), watermark=0.0)
    r1 = sched.add_request(np.arange(1, 5), 2)  # 2 blocks per head now; its decode at position 4 needs a third
    r2 = sched.add_request(np.arange(1, 4), 2)  # 2 blocks per head; its decode at position 3 needs none
    plan = sched.schedule()
    assert [r.slot for r in (r1, r2)] == [1, 2] and sched.blocks.available() == 0.0
    sched.update(plan, fake_sample(plan))
    plan = sched.schedule()  # r1 needs a third block: r2 (last admitted) is preempted
    assert r2.status is Status.PREEMPTED and r2.slot == 0 and r2.num_computed == 0
    assert list(sched.preempted) == [r2] and sched.slots.num_free == 2 and r2.num_output == 1
    assert plan.request_ids == (r1.request_id,) and r1.slot == 1
    sched.check_integrity()
    sched.update(plan, fake_sample(plan))
    assert r1.status is Status.FINISHED
    plan = sched.schedule()  # r2 resumes: re-prefills prompt + its one output in a fresh slot
    assert plan.request_ids == (r2.request_id,) and plan.num_tokens == 4 and not plan.has_initial_state[0]
    np.testing.assert_array_equal(plan.token_ids[:4], [1, 2, 3, (3 * 5 + 1) % 41])


def test_watermark_holds_back_admission_only_while_others_run():
    att = AttentionConfig(2, 2, 8)
    for watermark, admitted in ((0.0, 2), (0.2, 1)):
        sched = sched_with(num_pages=8, page_size=2, budget=8, max_seqs=3, att=att, watermark=watermark)
        sched.add_request(np.arange(1, 5), 1)  # 4 pages
        sched.add_request(np.arange(1, 5), 1)  # 4 more would leave 0 < 20% of 8 free
        assert sched.schedule().num_seqs == admitted
    sched = sched_with(num_pages=8, page_size=2, budget=8, max_seqs=3, att=att, watermark=0.5)
    sched.add_request(np.arange(1, 9), 1)  # alone it may take every page
    assert sched.schedule().num_seqs == 1 and sched.blocks.available() == 0.0


def test_every_path_into_running_takes_a_slot_and_every_way_out_frees_it(rng):
    sched = sched_with(max_seqs=2)
    direct = sched.add_request(rng.integers(1, 40, 5), 3, running=True)
    assert direct.status is Status.RUNNING and direct.slot == 1
    queued = sched.add_request(rng.integers(1, 40, 5), 3)
    second = sched.add_request(rng.integers(1, 40, 5), 3, running=True)
    assert second.slot == 2
    before = state(sched)
    with pytest.raises(SlotExhaustedError):
        sched.add_request(rng.integers(1, 40, 5), 3, running=True)
    assert state(sched) == before and len(sched.requests) == 3
    plan = sched.schedule()
    assert plan.num_seqs == 2 and queued.status is Status.WAITING  # no slot left for the queued one
    sched.update(plan, fake_sample(plan))
    sched.abort(second.request_id)
    assert second.status is Status.ABORTED and sched.slots.num_free == 1
    sched.abort(queued.request_id)
    with pytest.raises(ValueError, match="unknown request id"):
        sched.abort(queued.request_id)
    run(sched)
    assert sched.slots.num_free == 2 and sched.blocks.available() == 1.0


def test_stale_plan_is_rejected():
    sched = sched_with()
    sched.add_request(np.arange(1, 6), 3)
    old = sched.schedule()
    sched.update(old, fake_sample(old))
    sched.schedule()
    with pytest.raises(ValueError, match="latest schedule"):
        sched.update(old, fake_sample(old))


def test_bad_configs_raise():
    cache = CacheConfig(page_size=4, num_pages=9, max_seqs=2, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        CacheConfig(page_size=4, num_pages=0, max_seqs=2, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Scheduler(cache, ATT, max_num_batched_tokens=8, pool="partitioned")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(cache, ATT, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="must be >= max_seqs=2"):
        Scheduler(cache, ATT, max_num_batched_tokens=1)
    with pytest.raises(ValueError, match="watermark"):
        Scheduler(cache, ATT, max_num_batched_tokens=8, watermark=1.0)
    with pytest.raises(ValueError, match="recycle policy must be one of"):
        Scheduler(cache, ATT, max_num_batched_tokens=8, recycle="eager")
    with pytest.raises(ValueError, match="needs a recycle"):
        Scheduler(cache, ATT, max_num_batched_tokens=8, recycle=object())


def test_bad_requests_raise_and_change_nothing(rng):
    sched = sched_with(num_pages=20, page_size=4, max_blocks=16, budget=8)  # 10 pages per head's worth
    sched.add_request(rng.integers(1, 40, 5), 3)
    before = state(sched)
    with pytest.raises(RequestTooLongError, match="max_seq_len=64"):
        sched.add_request(rng.integers(1, 40, 61), 5)  # caches 61 + 5 - 1 = 65 positions (the last is never fed)
    with pytest.raises(RequestTooLongError, match="pages"):
        sched.add_request(rng.integers(1, 40, 40), 5)  # fits a table row, not the pool (full head 1 needs 11)
    with pytest.raises(ValueError, match="non-empty"):
        sched.add_request(np.zeros(0, np.int32), 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.add_request(rng.integers(1, 40, 5), 0)
    with pytest.raises(ValueError, match="already known"):
        sched.add_request(rng.integers(1, 40, 5), 2, request_id=next(iter(sched.requests)))
    with pytest.raises(ValueError, match="request_id must be an int"):
        sched.add_request(rng.integers(1, 40, 5), 2, request_id="a")
    assert state(sched) == before


def test_too_long_check_follows_the_recycle_policy(rng):
    att = AttentionConfig(1, 1, 8, window=(4,), sinks=(1,))  # one SWA head
    kw = dict(num_pages=6, page_size=4, max_blocks=32, budget=4, att=att)
    prompt = rng.integers(1, 40, 60)
    with pytest.raises(RequestTooLongError):
        sched_with(recycle="none", **kw).add_request(prompt, 20)  # 80 tokens = 20 pages without recycling
    sched = sched_with(recycle="timely", **kw)
    req = sched.add_request(prompt, 20)  # sink block + window + chunk fit in 6 pages
    run(sched)
    assert req.status is Status.FINISHED and req.num_output == 20


# ---- overlapped stepping: advance now, resolve one step later ------------------------------------------------


def run_overlapped(sched: Scheduler, max_steps: int = 10_000) -> list:
    """Plan step N+1 before step N's tokens are applied (the engine's overlap mode)."""
    plans, prev = [], None
    while (sched.has_unfinished() or prev is not None) and len(plans) < max_steps:
        plan = sched.schedule() if sched.has_unfinished() else None
        if plan is not None:
            sched.advance(plan)
            plans.append(plan)
        if prev is not None:
            sched.resolve(prev, fake_sample(prev))
        sched.check_integrity()
        prev = plan
    assert not sched.has_unfinished() and not sched.has_unresolved()
    return plans


EOS = int((12 * 5 + 1) % 41)  # fake_sample's token at seq_len 12


@pytest.mark.parametrize("num_pages", [64, 14])  # 14: preemption
def test_overlapped_stepping_equals_update_stepping(rng, num_pages):
    prompts = [rng.integers(1, 40, n) for n in (9, 5, 3, 11, 7, 2)]
    news = [8, 3, 12, 6, 9, 1]
    outs, all_plans = [], []
    for runner in (run, run_overlapped):
        sched = sched_with(num_pages=num_pages)
        reqs = [sched.add_request(p, m, eos_token_id=EOS) for p, m in zip(prompts, news)]
        all_plans.append(runner(sched))
        outs.append([r.output_ids.tolist() for r in reqs])
        assert sched.slots.num_free == 4 and sched.blocks.used_pages() == 0 and not sched.requests
    assert outs[0] == outs[1]
    assert any(EOS in o and len(o) < m for o, m in zip(outs[0], news))  # some stopped at eos
    assert all(EOS not in o[:-1] for o in outs[0])
    if num_pages == 14:
        assert sched.num_preemptions > 0
    # every token fed from the previous step is that step's sample of the same request at that position
    plans = all_plans[1]
    fed = 0
    for prev, plan in zip(plans, plans[1:]):
        for t in np.flatnonzero(plan.prev_index >= 0):
            r = plan.prev_index[t]
            row = np.searchsorted(plan.cu_seqlens[1:], t, side="right")
            assert plan.request_ids[row] == prev.request_ids[r] and prev.sample_mask[r]
            assert prev.seq_lens[r] == plan.positions[t] and plan.token_ids[t] == 0
            fed += 1
    assert fed > 10
    assert all((p.prev_index == -1).all() for p in all_plans[0])


def test_reserved_token_is_fed_by_row_and_resolved_later():
    sched = sched_with()
    req = sched.add_request(np.arange(1, 6), 4)
    p0 = sched.schedule()
    assert sched.advance(p0) == []
    assert req.num_tokens == 6 and req.output_ids.tolist() == [] and req.pending == [(0, 0)]
    p1 = sched.schedule()  # decode of the token step 0 samples: fed from its row 0
    assert p1.num_tokens == 1 and p1.prev_index[0] == 0 and p1.token_ids[0] == 0 and p1.positions[0] == 5
    with pytest.raises(ValueError, match="oldest"):
        sched.resolve(p1, np.array([7]))
    with pytest.raises(ValueError, match="previous step"):  # p1 not advanced: step 2 would feed step 0's token
        sched.schedule()
    sched.advance(p1)
    sched.resolve(p0, np.array([11]))
    assert req.output_ids.tolist() == [11] and req.pending == [(1, 0)]
    p2 = sched.schedule()
    assert p2.prev_index[0] == 0 and p2.positions[0] == 6
    sched.advance(p2)
    sched.resolve(p1, np.array([12]))
    sched.resolve(p2, np.array([13]))
    assert req.output_ids.tolist() == [11, 12, 13] and not req.pending
    sched.check_integrity()


def test_eos_is_applied_one_step_late_and_the_extra_token_dropped():
    sched = sched_with()
    eos = 30
    req = sched.add_request(np.array([1, 2, 3]), 5, eos_token_id=eos)
    p0 = sched.schedule()
    sched.advance(p0)
    p1 = sched.schedule()  # runs the request once more: its eos is not known yet
    sched.advance(p1)
    assert req.num_tokens == 5 and len(req.pending) == 2
    with pytest.raises(ValueError, match="advanced and not resolved"):
        sched.update(sched.schedule(), np.array([1]))
    sched.ledger.planned = None  # drop that probe plan (never advanced)
    assert sched.resolve(p0, np.array([eos])) == [req]
    assert req.status is Status.FINISHED and req.output_ids.tolist() == [eos] and req.num_tokens == 4
    assert sched.slots.num_free == 4 and sched.blocks.used_pages() == 0 and not sched.requests
    assert sched.resolve(p1, np.array([9])) == []  # the extra row's token is dropped
    assert req.output_ids.tolist() == [eos] and not sched.has_unresolved()
    sched.check_integrity()


def test_max_new_tokens_finishes_at_advance_and_frees_at_once():
    sched = sched_with()
    a = sched.add_request(np.array([1, 2, 3]), 1)
    b = sched.add_request(np.array([4, 5]), 1)
    p0 = sched.schedule()
    assert sched.advance(p0) == [a, b]
    assert sched.slots.num_free == 4 and sched.blocks.used_pages() == 0 and not sched.has_unfinished()
    assert a.status is Status.FINISHED and a.request_id in sched.requests  # until its token is known
    sched.abort(b.request_id)  # a finished request whose token is still in flight can be aborted
    sched.resolve(p0, np.array([7, 8]))
    assert a.output_ids.tolist() == [7] and b.output_ids.tolist() == [] and b.status is Status.ABORTED
    assert not sched.requests
    sched.check_integrity()


def test_rollback_forgets_reserved_tokens_and_the_run_still_ends_the_same(rng):
    prompts = [rng.integers(1, 40, n) for n in (9, 5, 3, 7)]
    news = [6, 1, 9, 4]
    ref = sched_with(num_pages=20)
    ref_reqs = [ref.add_request(p, m) for p, m in zip(prompts, news)]
    run(ref)
    sched = sched_with(num_pages=20)
    reqs = [sched.add_request(p, m) for p, m in zip(prompts, news)]
    prev = None
    for _ in range(4):
        plan = sched.schedule()
        sched.advance(plan)
        if prev is not None:
            sched.resolve(prev, fake_sample(prev))
        prev = plan
    sched.schedule()  # scheduled, never advanced
    assert sched.has_unresolved()
    sched.rollback()  # the steps in flight are lost
    assert not sched.has_unresolved() and all(not r.pending for r in reqs)
    assert not sched.running and all(r.status is Status.PREEMPTED for r in reqs if r.request_id in sched.requests)
    sched.check_integrity()
    run(sched)
    assert [r.output_ids.tolist() for r in reqs] == [r.output_ids.tolist() for r in ref_reqs]
