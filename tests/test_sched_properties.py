"""Property tests of the scheduler over random workloads, page counts, head layouts and windows.

An independent shadow cache checks every plan end to end: each step's slot mapping "writes" (request, position,
head) into the pages it names, then every key that the mask rule says a query of this step attends must be found
through the row's block table, unrecycled and unclobbered. Sampled tokens are a fixed function of (request,
position), so a request's outputs are known in advance whatever preemptions happen.
"""

from __future__ import annotations

import numpy as np
from hypothesis import event, given, strategies as st

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.errors import RequestTooLongError
from kvjax.sched import Scheduler

EOS = 13


def token_at(rid: int, pos: int) -> int:
    return (rid * 7919 + pos * 31) % 97 + 1  # in [1, 97]; equals EOS for some (rid, pos)


@st.composite
def setups(draw, busy: bool = False):
    """Random layouts and workloads; ``busy`` draws tight memory and many requests (preemption + recycling)."""
    h_kv = draw(st.integers(1, 3))
    window = [draw(st.sampled_from([0, 0, 1, 2, 3, 5, 8, 13, 24])) for _ in range(h_kv)]
    sinks = [draw(st.integers(0, min(w, 6))) if w else 0 for w in window]
    ps = draw(st.sampled_from([1, 2, 4, 8]))
    if busy:
        per_head, max_blocks, min_reqs = draw(st.integers(16 // ps, 40 // ps)), 64 // ps, 4
    else:
        per_head = draw(st.integers(1, 80 // ps) | st.integers(16 // ps, 80 // ps))
        max_blocks, min_reqs = draw(st.integers(1, 64 // ps) | st.integers(24 // ps, 64 // ps)), 1
    cache = CacheConfig(page_size=ps, num_pages=per_head * h_kv, max_seqs=draw(st.integers(2 if busy else 1, 5)),
                        max_blocks_per_seq=max_blocks)
    att = AttentionConfig(h_kv * draw(st.integers(1, 2)), h_kv, 8, window=tuple(window), sinks=tuple(sinks))
    reqs = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 14), st.booleans()),
                         min_size=min_reqs, max_size=7))
    return dict(cache=cache, att=att, budget=draw(st.integers(cache.max_seqs, 40)),
                pool=draw(st.sampled_from(["shared", "partitioned"])), recycle=draw(st.sampled_from(["none", "timely"])),
                reqs=reqs, abort_at=draw(st.lists(st.integers(0, 60), max_size=2)), seed=draw(st.integers(0, 2**16)))


def check_plan(sched: Scheduler, plan, shadow: np.ndarray, expected_tokens: dict) -> None:
    ps, H = sched.cache.page_size, sched.attention.num_kv_heads
    window, sinks = np.array(sched.attention.window), np.array(sched.attention.sinks)
    B, T = plan.seq_lens.shape[0], plan.token_ids.shape[0]
    assert plan.block_tables.shape[:2] == (B, H) and plan.slot_mapping.shape == (T, H)
    assert plan.cu_seqlens[0] == 0 and (np.diff(plan.cu_seqlens) >= 0).all()
    # padding rows and tokens touch nothing
    assert (plan.gdn_slots[plan.num_seqs:] == 0).all() and (plan.block_tables[plan.num_seqs:] == -1).all()
    assert (plan.slot_mapping[plan.num_tokens:] == -1).all() and (plan.seq_lens[plan.num_seqs:] == 0).all()
    assert not plan.sample_mask[plan.num_seqs:].any() and not plan.has_initial_state[plan.num_seqs:].any()
    live = plan.gdn_slots[: plan.num_seqs]
    assert (live > 0).all() and len(set(live.tolist())) == len(live)
    for b, rid in enumerate(plan.request_ids):
        req = sched.requests[rid]
        lo, hi = plan.cu_seqlens[b], plan.cu_seqlens[b + 1]
        L = plan.seq_lens[b] - (hi - lo)
        assert req.slot == plan.gdn_slots[b] and plan.has_initial_state[b] == (L > 0)
        pos = plan.positions[lo:hi]
        np.testing.assert_array_equal(pos, np.arange(L, plan.seq_lens[b]))
        np.testing.assert_array_equal(plan.token_ids[lo:hi], expected_tokens[rid][L: plan.seq_lens[b]])
        # the tables name only pages this request owns, on the right head
        bt = plan.block_tables[b]
        held = bt >= 0
        assert (sched.blocks.owner_row[bt[held]] == req.slot).all()
        assert (sched.blocks.owner_head[bt[held]] == np.nonzero(held)[0]).all()
        # write this step's K/V into the shadow cache
        sm = plan.slot_mapping[lo:hi]
        assert (sm >= 0).all(), "a real token is not written on some head"
        for h in range(H):
            shadow[sm[:, h] // ps, sm[:, h] % ps] = np.stack([np.full(hi - lo, rid), pos, np.full(hi - lo, h)], 1)
    for b, rid in enumerate(plan.request_ids):  # then every attended key must be there
        lo, hi = plan.cu_seqlens[b], plan.cu_seqlens[b + 1]
        L, end = plan.seq_lens[b] - (hi - lo), plan.seq_lens[b]
        for h in range(H):
            j = np.arange(end)
            if window[h]:
                j = j[(j >= L - window[h] + 1) | (j < sinks[h])]
            pages = plan.block_tables[b, h, j // ps]
            assert (pages >= 0).all(), f"row {b} head {h}: an attended key lies in a hole"
            want = np.stack([np.full(len(j), rid), j, np.full(len(j), h)], 1)
            np.testing.assert_array_equal(shadow[pages, j % ps], want)


@given(setups())
def test_scheduler_invariants_hold_every_step(s):
    drive(s)


@given(setups(busy=True))
def test_scheduler_invariants_under_memory_pressure(s):
    drive(s)


def drive(s: dict) -> None:
    sched = Scheduler(s["cache"], s["att"], max_num_batched_tokens=s["budget"], pool=s["pool"], recycle=s["recycle"])
    expected, limits = {}, {}
    for i, (p, o, eos) in enumerate(s["reqs"]):
        prompt = np.random.default_rng(s["seed"] + i).integers(1, 97, p)
        before = (len(sched.waiting), len(sched.requests), sched.blocks.available(), sched.slots.num_free)
        try:
            req = sched.add_request(prompt, o, eos_token_id=EOS if eos else None, request_id=i)
        except RequestTooLongError:
            assert before == (len(sched.waiting), len(sched.requests), sched.blocks.available(), sched.slots.num_free)
            continue
        expected[i] = np.concatenate([prompt, [token_at(i, p + k) for k in range(o)]])
        stop = next((k + 1 for k in range(o) if eos and expected[i][p + k] == EOS), o)
        limits[i] = (p, stop)
    shadow = np.full((s["cache"].num_pages, s["cache"].page_size, 3), -1)
    aborted, done, recycled = set(), {}, False
    for step in range(3000):
        if not sched.has_unfinished():
            break
        if step in s["abort_at"] and sched.requests:
            rid = sorted(sched.requests)[step % len(sched.requests)]
            sched.abort(rid)
            aborted.add(rid)
            sched.check_integrity()
            if not sched.has_unfinished():
                break
        plan = sched.schedule()
        sched.check_integrity()
        assert plan.num_seqs > 0, "stalled: requests remain but nothing was scheduled"
        check_plan(sched, plan, shadow, expected)
        recycled |= bool(((plan.block_tables[:plan.num_seqs] < 0) & (np.arange(plan.block_tables.shape[2])
                          < (plan.seq_lens[:plan.num_seqs, None, None] - 1) // s["cache"].page_size)).any())
        sampled = np.zeros(plan.gdn_slots.shape[0], np.int64)
        for b, rid in enumerate(plan.request_ids):
            sampled[b] = token_at(rid, plan.seq_lens[b])
        for req in sched.update(plan, sampled):
            done[req.request_id] = req
        sched.check_integrity()
    assert not sched.has_unfinished(), "did not finish in 3000 steps"
    event(f"accepted {len(limits)} of {len(s['reqs'])}; preempted: {sched.num_preemptions > 0}; "
          f"recycled: {recycled}")
    assert sched.blocks.available() == 1.0 and sched.slots.num_free == s["cache"].max_seqs
    assert (sched.blocks.tables == -1).all()
    for rid, (p, stop) in limits.items():
        if rid in aborted:
            continue
        req = done[rid]
        np.testing.assert_array_equal(req.output_ids, expected[rid][p: p + stop])
