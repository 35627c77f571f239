"""Scheduler: plan layout and buckets, reused rows, slots on every path, preemption by recompute, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.errors import RequestTooLongError, SlotExhaustedError
from kvjax.sched import Scheduler, Status
from kvjax.sched.plan import bucket, seq_buckets, token_buckets

ATT = AttentionConfig(4, 2, 8, window=(6, 0), sinks=(2, 0))


def sched_with(num_pages=64, page_size=4, max_seqs=4, max_blocks=16, budget=16, **kw) -> Scheduler:
    cache = CacheConfig(page_size=page_size, num_pages=num_pages, max_seqs=max_seqs, max_blocks_per_seq=max_blocks)
    return Scheduler(cache, kw.pop("att", ATT), max_num_batched_tokens=budget, **kw)


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
