"""Speculative decoding (``Engine(speculative=...)``): greedy tokens identical to non-speculative decoding.

Oracles: uncached greedy decoding (``greedy_oracle``) and the plain engine. Models: the tiny f32 Qwen3.5 with an SWA
head (GDN + conv state rollback; timely recycling on a pool small enough to preempt) and the tiny DeepSeek-V3.2 (MLA
+ DSA). Drafters: prompt lookup (n-gram; on random models most drafts are rejected) and an oracle drafter that
proposes the true greedy continuation with one token corrupted at a random position, so that rows accept every
number of drafts from 0 to K (the rollback to each position is exercised). Prompt lookup in single steps (the host
drafter) on Qwen3.5; on DeepSeek at K = 2 in verification bursts (later sub-steps drafted by the device's lookup).
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from kvjax.config import CacheConfig
from kvjax.engine.engine import Engine
from kvjax.sched.drafter import SpeculativeConfig
from helpers.engine import BUDGET, SMALL, assert_idle, greedy_oracle, random_prompts
from helpers.models import qwen_swa_model, tiny_deepseek_config
from helpers.spec import OracleDrafter

NEW = 13


@pytest.fixture(scope="module")
def qwen():
    return qwen_swa_model()


@pytest.fixture(scope="module")
def case(qwen):
    prompts = random_prompts(np.random.default_rng(33), (23, 9, 37, 3, 18, 30, 12))
    return prompts, greedy_oracle(qwen, prompts, NEW)


def spec_engine(model, speculative, **kw) -> Engine:
    return Engine(model, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, speculative=speculative, **kw)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_greedy_ngram_equals_oracle_qwen(qwen, case, K):
    prompts, expect = case
    eng = spec_engine(qwen, SpeculativeConfig(num_draft_tokens=K), debug=True, decode_burst=1)  # the host lookup
    assert not eng.overlap and eng.decode_burst == 1
    assert eng.generate(prompts, NEW) == expect
    s = eng.metrics.summary()
    assert s["drafts_proposed"] > 0 and s["preemptions"] > 0
    assert_idle(eng)


def test_disable_by_batch_size_drafts_only_at_few_rows(qwen, case):
    """``disable_by_batch_size``: no step drafts while more requests run than the limit when its drafts are chosen
    (before it admits new ones), so a decode-only step of more rows verifies nothing and no step verifies more
    rows than the limit; steps at or below it draft; the tokens stay the oracle's."""
    prompts, expect = case
    limit = 2
    drafter = OracleDrafter(prompts, expect, 2, seed=5)
    eng = spec_engine(qwen, SpeculativeConfig(num_draft_tokens=2, drafter=drafter, disable_by_batch_size=limit),
                      debug=True)
    assert eng.generate(prompts, NEW) == expect
    recs = eng.metrics.records
    busy = [r for r in recs if r.running > limit and r.prefill_tokens == 0]  # decode-only steps, nothing admitted
    assert busy and all(r.verify_rows == 0 for r in busy)
    assert all(r.verify_rows <= limit for r in recs) and any(r.verify_rows > 0 for r in recs)
    assert_idle(eng)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=0)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=2.0)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_greedy_partial_acceptance_equals_oracle_qwen(qwen, case, K):
    """Rows accept 0..K drafts: the GDN and conv states after exactly the accepted tokens (a wrong rollback shows
    in the next tokens)."""
    prompts, expect = case
    drafter = OracleDrafter(prompts, expect, K, seed=K)
    eng = spec_engine(qwen, drafter, debug=True)
    assert eng.generate(prompts, NEW) == expect
    s = eng.metrics.summary()
    assert 0 < s["drafts_proposed"] <= drafter.proposed  # the budget trims some
    assert 0.3 < s["acceptance_rate"] < 1.0
    per = s["acceptance_rate_per_position"]
    assert len(per) == K and all(0 <= r <= 1 for r in per)
    assert s["tokens_per_verify_row"] > 1.0
    assert sum(r.generated for r in eng.metrics.records) == len(prompts) * NEW
    # every acceptance count 0..K happened, so every rollback position was taken
    assert eng.scheduler.spec_stats.accepted_at[K - 1] > 0
    assert eng.scheduler.spec_stats.proposed_at[0] > eng.scheduler.spec_stats.accepted_at[0]
    assert_idle(eng)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_greedy_equals_oracle_deepseek(K):
    from kvjax.models.deepseek import DeepseekV32

    model = nnx.jit(lambda: DeepseekV32(tiny_deepseek_config(), rngs=nnx.Rngs(5)))()
    prompts = random_prompts(np.random.default_rng(6), (21, 4, 13, 26, 8))
    expect = greedy_oracle(model, prompts, 7)
    cache = CacheConfig(page_size=4, num_pages=20, max_seqs=4, max_blocks_per_seq=8)
    for drafter in (SpeculativeConfig(num_draft_tokens=K), OracleDrafter(prompts, expect, K, seed=K)):
        # prompt lookup verifies in bursts (later sub-steps' drafts the device's lookup); at K = 2 only (compile time)
        lookup = isinstance(drafter, SpeculativeConfig) and K == 2
        eng = Engine(model, cache, recycle="timely", max_num_batched_tokens=BUDGET, decode_burst=8 if lookup else 1,
                     cache_options={"indexer_fp8": False}, speculative=drafter, debug=True)
        assert eng.generate(prompts, 7) == expect
        assert eng.metrics.summary()["drafts_proposed"] > 0
        if lookup:
            assert any(r.burst > 1 and r.verify_rows for r in eng.metrics.records)
        assert_idle(eng)
