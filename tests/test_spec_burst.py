"""Verification bursts (issue 36): an engine drafting with the MTP layer (or by prompt lookup, ``"ngram"``: sub-step 0's
drafts the host's, later ones the device's lookup) and ``decode_burst = S`` runs, where every
running row decodes and no request could be admitted, ``S`` verification sub-steps in one dispatch
(:func:`kvjax.engine.verify.verify_burst`; host: :func:`kvjax.sched.burst.schedule_verify_burst`,
:func:`kvjax.sched.spec.resolve`).

Exactness: greedy tokens identical to uncached greedy decoding (``greedy_oracle``) for K in {1, 2, 4}, with a
hybrid GDN / attention model and an MTP layer trained on :class:`~helpers.spec.Successors` (drafts mostly accepted:
GDN states committed after accepted drafts inside the burst), with timely recycling on a pool small enough to
preempt, with prefix caching, an abort and a fault inside a burst; a burst's step record counts the positions and
rows of every sub-step (as ``resolve`` applied them); a burst's loop ends when no row is live; an eos in a later
sub-step ends its request. The rule drafting nothing gives plain decode bursts with the MTP layer skipped. Sampling: the burst engine's tokens have the plain engine's distribution
(chi-square, as ``test_spec_sampling.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from scipy import stats

from kvjax.config import CacheConfig
from kvjax.engine import sampling
from kvjax.engine import verify as verify_lib
from kvjax.engine.engine import Engine
from kvjax.models.qwen3_5 import mtp as mtp_lib
from kvjax.sched import spec
from kvjax.sched.drafter import PacedDrafter, SpeculativeConfig, StepDrafter
from kvjax.state import gdn_spec
from helpers.engine import BUDGET, assert_idle, fault_midway, greedy_oracle, stream_aborting, truncate_at
from helpers.models import VOCAB, random_model, tiny_config
from helpers.spec import successor_model

NEW = 14
BURST = 4
# four rows, pages of 4: the pool holds about three rows' prompts and outputs (preemption)
CACHE = CacheConfig(page_size=4, num_pages=26, max_seqs=4, max_blocks_per_seq=8)
ONE_BUCKET = dict(token_buckets=(BUDGET,), row_buckets=(CACHE.max_seqs,), block_buckets=(CACHE.max_blocks_per_seq,),
                  use_decode_path=False)
ALPHA = 1e-3
verify_path = gdn_spec.verify


@pytest.fixture(scope="module")
def trained():
    """A hybrid (GDN, then SWA attention) tiny model and its MTP layer trained on :class:`Successors`; prompts that
    share prefixes (chains from the same starts) and their greedy continuations."""
    pytest.importorskip("optax")
    rng = np.random.default_rng(3)
    model, task = successor_model(rng)
    starts = rng.integers(1, VOCAB, 3)
    chains = task.chains(np.repeat(starts, 2), 13)
    lens = (9, 13, 5, 11, 7, 6)
    prompts = [list(map(int, c[:n])) for c, n in zip(chains, lens)]
    return model, prompts, greedy_oracle(model, prompts, NEW)


def burst_engine(model, K: int, cache: CacheConfig = CACHE, method: str = "mtp", **kw) -> Engine:
    kw = {"flat_tokens": None, **kw}
    flat = kw.pop("flat_tokens")
    return Engine(model, cache, recycle="timely", max_num_batched_tokens=BUDGET, decode_burst=BURST,
                  speculative=SpeculativeConfig(method=method, num_draft_tokens=K, flat_tokens=flat,
                                                disable_by_batch_size=None),
                  **dict(ONE_BUCKET, block_buckets=(cache.max_blocks_per_seq,)), **kw)


def verify_bursts(eng: Engine) -> list:
    """The step records of the verification bursts the engine ran."""
    return [r for r in eng.metrics.records if r.burst > 1 and r.verify_rows > 0]


def applied_counts(monkeypatch) -> dict[int, list[int]]:
    """Spy on :func:`kvjax.sched.spec.resolve`'s counting: ``{step: [positions, rows]}`` it applied, summed over the
    (sub-)steps of each plan (``1 + k`` positions for each row that ran with ``k`` drafts)."""
    seen: dict[int, list[int]] = {}
    real = spec._record

    def record(sched, plan, k, a, **kw):
        got = seen.setdefault(plan.step, [0, 0])
        got[0] += int(k.size + k.sum())
        got[1] += int(k.size)
        real(sched, plan, k, a, **kw)

    monkeypatch.setattr(spec, "_record", record)
    return seen


@pytest.mark.parametrize("K", [1, 2, 4])
def test_greedy_equals_oracle_in_verification_bursts(trained, K, monkeypatch):
    model, prompts, expect = trained
    bursts = []
    applied = applied_counts(monkeypatch)
    few = []  # a burst's sub-step takes the GDN layers' few-token path (every row continues, <= K + 1 tokens)
    monkeypatch.setattr(gdn_spec, "verify", lambda *a, **k: few.append(a[1]) or verify_path(*a, **k))
    for prefix in (False, True):
        applied.clear()
        few.clear()
        eng = burst_engine(model, K, prefix_caching=prefix, debug=K == 2)
        assert eng.generate(prompts, NEW) == expect
        assert few, "no verification burst traced the few-token GDN path"
        recs = verify_bursts(eng)
        # a burst's record counts every sub-step's verified positions and rows (as resolve applied them)
        for r in recs:
            assert [r.computed, r.row_steps] == applied[r.step], r
            assert r.computed == r.row_steps + r.drafts_proposed and r.generated <= r.computed, r
        assert recs and sum(r.drafts_accepted for r in recs) > 0
        bursts += recs
        s = eng.metrics.summary()
        assert s["preemptions"] > 0
        assert s["acceptance_rate"] > 0.5, s
        assert s["running_mean"] <= CACHE.max_seqs, s  # per sub-step: a burst's rows, not its verified positions
        assert s["drafts_proposed"] == eng.scheduler.spec_stats.proposed
        assert s["drafts_accepted"] == eng.scheduler.spec_stats.accepted
        if prefix:
            assert s["prefix_hit_tokens"] > 0
            eng.clear_prefix_cache()
        assert eng.num_traces <= 4  # ordinary, verification, verification burst (+ the prefix copies' variant)
        assert_idle(eng)
    # rows run several sub-steps: a burst verifies more rows' drafts than it has rows
    assert any(r.verify_rows > r.num_seqs for r in bursts)


NGRAM_NEW = 30  # the chains' period shows up in the prompts and outputs: prompt lookup finds drafts every sub-step
NGRAM_CACHE = dataclasses.replace(CACHE, num_pages=30, max_blocks_per_seq=12)  # ~2.5 rows of 43 tokens: preemption


@pytest.fixture(scope="module")
def ngram_case(trained):
    """Prompts from the chains of short cycles (their continuations repeat within a few tokens: prompt lookup finds
    drafts) and their greedy continuations."""
    model, prompts, _ = trained
    prompts = prompts[:4] + [prompts[1][3:10], prompts[3][1:7]]
    return prompts, greedy_oracle(model, prompts, NGRAM_NEW)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_ngram_drafts_verify_in_bursts(trained, ngram_case, K, monkeypatch):
    """``speculative="ngram"`` verifies in bursts: sub-step 0's drafts the host lookup's, the later sub-steps' the
    same lookup on the device over the rows' histories grown inside the burst (:mod:`kvjax.engine.ngram`). Greedy
    tokens equal the oracle with timely recycling on a pool that preempts; at K = 2 with prefix caching, two aborts
    and a fault inside a burst; later sub-steps verify drafts (only the device made those), mostly accepted."""
    model = trained[0]
    prompts, ngram_expect = ngram_case
    applied = applied_counts(monkeypatch)
    later = []  # drafts verified by a burst's sub-steps after the first
    real_verified = spec.verified

    def verified(plan, result):
        out = real_verified(plan, result)
        if plan.spec_steps:
            later.append(int(out[1][1:].sum()))  # k: i64[S, n]
        return out

    monkeypatch.setattr(spec, "verified", verified)
    eng = burst_engine(model, K, NGRAM_CACHE, method="ngram", prefix_caching=K == 2, debug=K == 2)
    assert eng.decode_burst == BURST and eng.runner.ngram == (3, 1) and eng.runner.head is None
    if K == 2:
        stream_aborting(eng, prompts, NGRAM_NEW, ngram_expect)
        assert eng.metrics.summary()["prefix_hit_tokens"] > 0
    else:
        assert eng.generate(prompts, NGRAM_NEW) == ngram_expect
    recs = verify_bursts(eng)
    assert recs and sum(later) > 0, later
    for r in recs:
        assert [r.computed, r.row_steps] == applied[r.step], r
        assert r.computed == r.row_steps + r.drafts_proposed and r.generated <= r.computed, r
    s = eng.metrics.summary()
    assert s["preemptions"] > 0 and s["acceptance_rate"] > 0.5, s
    assert eng.num_traces <= 4
    if K == 2:
        eng.clear_prefix_cache()
    assert_idle(eng)
    if K == 2:
        n = len(verify_bursts(eng))  # up to a new burst: the next step faults
        fault_midway(monkeypatch, eng, prompts[:3], NGRAM_NEW, ngram_expect[:3],
                     lambda: len(verify_bursts(eng)) > n and eng.metrics.records[-1].burst > 1)
        eng.clear_prefix_cache()
        assert_idle(eng)


def test_a_stop_id_inside_a_burst_ends_the_request(trained, ngram_case, monkeypatch):
    """An eos accepted in a burst's later sub-step ends its request there (the tokens after it, and its row's later
    sub-steps, dropped) while the other row runs on; with prefix caching the second pass, whose prompts hit the first
    pass's cached blocks, gives the same tokens."""
    model = trained[0]
    prompts, expect = ngram_case
    prompts, expect = [prompts[0], prompts[2]], [expect[0], expect[2]]  # cycles of 8 and 4 tokens
    eos = max(set(expect[0]), key=expect[0].index)  # the token the first output reaches last (its cycle's last)
    want = [truncate_at(e, eos) for e in expect]
    assert len(want[0]) < NGRAM_NEW and len(want[1]) == NGRAM_NEW
    later = []  # per burst: an eos taken in a sub-step after the first
    real_verified = spec.verified

    def verified(plan, result):
        toks, k, a, ran = out = real_verified(plan, result)
        if plan.spec_steps:
            taken = ran[..., None] & (np.arange(toks.shape[2]) <= a[..., None]) & (toks == eos)  # bool[S, n, J]
            later.append(bool(taken[1:].any()))
        return out

    monkeypatch.setattr(spec, "verified", verified)
    eng = burst_engine(model, 2, NGRAM_CACHE, method="ngram", prefix_caching=True, eos_token_id=eos)
    for _ in range(2):
        assert eng.generate(prompts, NGRAM_NEW) == want
    assert any(later) and eng.metrics.summary()["prefix_hit_tokens"] > 0
    eng.clear_prefix_cache()
    assert_idle(eng)


def test_a_burst_ends_when_no_row_is_live(trained, monkeypatch):
    """Bursts of 16 sub-steps for rows that need a few (K = 4, drafts mostly accepted, 14 new tokens): each burst's
    loop runs only the sub-steps in which some row runs (counted on the device by a callback inside each
    sub-step), which the step record keeps as ``sub_steps`` and the summary weighs; the tokens are unchanged."""
    model, prompts, expect = trained
    ran = []
    real = verify_lib._verify

    def counted(*args, keep=False, **kw):
        if keep:  # a burst's sub-step (a single verification step passes keep=False)
            jax.debug.callback(lambda: ran.append(1))
        return real(*args, keep=keep, **kw)

    monkeypatch.setattr(verify_lib, "_verify", counted)
    eng = Engine(model, CACHE, recycle="timely", max_num_batched_tokens=BUDGET, decode_burst=16,
                 speculative=SpeculativeConfig(method="mtp", num_draft_tokens=4, flat_tokens=None,
                                               disable_by_batch_size=None), **ONE_BUCKET)
    assert eng.generate(prompts, NEW) == expect
    jax.effects_barrier()
    bursts = [r for r in eng.metrics.records if r.burst == 16 and r.verify_rows]
    assert bursts and all(1 <= r.sub_steps < r.burst for r in bursts), [(r.burst, r.sub_steps) for r in bursts]
    assert len(ran) == sum(r.sub_steps for r in bursts)
    recs = eng.metrics.records
    assert eng.metrics.summary()["sub_steps"] == sum(r.sub_steps if r.sub_steps >= 0 else r.burst for r in recs)
    assert_idle(eng)


def test_an_abort_and_a_fault_inside_a_burst(trained, monkeypatch):
    model, prompts, expect = trained
    eng = burst_engine(model, 2)
    stream_aborting(eng, prompts, NEW, expect)
    assert verify_bursts(eng)
    assert_idle(eng)

    n = len(verify_bursts(eng))  # up to a new burst: the next step faults
    fault_midway(monkeypatch, eng, prompts[:3], NEW, expect[:3],
                 lambda: len(verify_bursts(eng)) > n and eng.metrics.records[-1].burst > 1)
    assert_idle(eng)


def test_a_rule_drafting_nothing_runs_plain_bursts_without_the_mtp_layer(trained):
    """``flat_tokens=1`` and drafts measured as never accepted: no draft pays (the rule's ``k = 0``): the engine
    runs plain decode bursts, and no step runs the MTP layer (no layout with ``draft``); tokens stay exact."""
    model, prompts, expect = trained
    eng = burst_engine(model, 2, flat_tokens=1)
    eng.scheduler.spec_stats.proposed_at = np.array([5, 5])
    eng.scheduler.spec_stats.accepted_at = np.array([0, 0])
    seen = []
    pack = eng.runner.pack

    def spy(*args, **kw):
        buf, layout = pack(*args, **kw)
        seen.append(layout)
        return buf, layout

    eng.runner.pack = spy
    assert eng.generate(prompts, NEW) == expect
    plain = [lay for lay in seen if lay.burst > 1 and not lay.spec]
    assert plain and not any(lay.draft or lay.spec for lay in seen)
    assert eng.scheduler.spec_stats.proposed == 0
    assert_idle(eng)


def test_a_verification_burst_plan_reserves_its_positions(trained):
    """The host side: pages for ``min(S (K + 1), tokens left)`` positions per row, sub-step 0's drafts the device's,
    the rule's ``k`` as the later sub-steps' cap, one token bucket of ``K + 1`` per row; ``resolve`` applies the
    sub-steps in order (a row ending early takes no later tokens)."""
    model, prompts, _ = trained
    K = 2
    eng = burst_engine(model, K)
    sched = eng.scheduler
    drafter = eng.drafter
    assert isinstance(drafter, StepDrafter)
    rid = eng.add_request(prompts[0], 5)  # 5 tokens: the burst's span is the 4 positions left after the first
    sched.update(plan := sched.schedule(BURST, drafter), np.full(plan.seq_lens.shape[0], 3, np.int32))
    slot = sched.running[0].slot
    drafter.record(sched.rows, np.array([slot]), np.array([rid]), np.array([[7, 8]]))
    plan = sched.schedule(BURST, drafter)
    B = plan.seq_lens.shape[0]
    assert plan.spec_steps == BURST and plan.spec_k == K and plan.draft_len[0] == K
    assert plan.spec_span[0] == 4 and plan.token_ids.shape[0] == BUDGET  # the bucket of min(B (K + 1), budget)
    assert plan.token_ids[1:3].tolist() == [7, 8]
    assert sched.blocks.num_blocks[slot] * CACHE.page_size >= len(prompts[0]) + 4
    sched.advance(plan)
    # sub-step 0: both drafts accepted, then 9; sub-step 1: the row verified 0 drafts and sampled 4: done (5 tokens)
    result = np.full((BURST, B, K + 2), -1, np.int32)
    result[0, 0] = [7, 8, 9, 2]
    result[1, 0] = [4, -1, -1, 0]
    result[2, 0] = [5, -1, -1, 0]  # past max_new_tokens: never applied
    done = sched.resolve(plan, result.reshape(-1))
    assert [r.request_id for r in done] == [rid] and done[0].output_ids.tolist()[1:] == [7, 8, 9, 4]
    assert sched.spec_stats.proposed == 2 and sched.spec_stats.accepted == 2


def test_rule_length_is_the_rule_with_every_running_row_decoding(trained):
    model, prompts, _ = trained
    eng = burst_engine(model, 4, flat_tokens=8)
    sched = eng.scheduler
    assert isinstance(eng.drafter, PacedDrafter)
    for p in prompts[:4]:
        eng.add_request(p, NEW)
    sched.schedule(1, eng.drafter)
    R = len(sched.running)
    sched.spec_stats.proposed_at = np.array([10, 10, 10, 10])
    sched.spec_stats.accepted_at = np.array([9, 6, 2, 1])
    assert spec.rule_length(sched, eng.drafter) == spec.draft_length(R, R, sched.spec_stats, 4, 8)
    # disable_by_batch_size: no drafts (plain decode bursts) above the limit, the rule (or K) at and below it
    for flat, limit, want in ((8, R - 1, 0), (8, R, spec.draft_length(R, R, sched.spec_stats, 4, 8)), (None, R - 1, 0),
                              (None, R, 4)):
        paced = PacedDrafter(eng.drafter.drafter, flat, limit)
        assert spec.rule_length(sched, paced) == want, (flat, limit)


VOCAB_SMALL = 7


def test_verification_bursts_sample_the_plain_engines_distribution():
    """Temperature 1 on a 7-token vocabulary: the burst engine's (random MTP layer: drafts kept and rejected) tokens
    at each generated position have the plain engine's distribution (two-sample chi-square)."""
    cfg = dataclasses.replace(tiny_config(window=(6, 0), sinks=(2, 0),
                                          layer_types=("linear_attention", "full_attention")), vocab_size=VOCAB_SMALL)
    model = random_model(cfg, seed=3)
    mtp_lib.attach(model, mtp_lib.init(model.config, seed=5))
    prompt = [1, 4, 2, 6, 0, 3]
    N, new, K = 640, 5, 2
    cache = CacheConfig(page_size=4, num_pages=64, max_seqs=16, max_blocks_per_seq=4)
    buckets = dict(token_buckets=(64,), row_buckets=(16,), block_buckets=(4,), use_decode_path=False)
    outs = {}
    for name, sp in (("plain", None), ("burst", SpeculativeConfig(method="mtp", num_draft_tokens=K,
                                                                  flat_tokens=None))):
        eng = Engine(model, cache, max_num_batched_tokens=64, speculative=sp, eos_token_id=None, decode_burst=BURST,
                     **buckets)
        params = [sampling.SamplingParams(temperature=1.0, seed=11, max_tokens=new)] * N
        outs[name] = np.asarray(eng.generate([prompt] * N, params))  # i64[N, new]
        if sp is not None:
            s = eng.metrics.summary()
            assert verify_bursts(eng)
            assert 50 < s["drafts_accepted"] < s["drafts_proposed"] - 50, s  # drafts both kept and rejected
    np.testing.assert_array_equal(outs["burst"][:, 0], outs["plain"][:, 0])  # sampled before any draft, same keys
    for j in range(1, new):
        table = np.stack([np.bincount(outs[n][:, j], minlength=VOCAB_SMALL) for n in ("plain", "burst")])
        table = table[:, table.sum(0) > 0]
        assert stats.chi2_contingency(table).pvalue > ALPHA, (j, table)
