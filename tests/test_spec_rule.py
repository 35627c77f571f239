"""The rule that shortens or turns off speculation where it does not pay (``sched/spec.draft_length``, applied to a
:class:`PacedDrafter`, the engine's default).

Step-cost model: a step of ``T`` tokens costs ``max(T, F)``; a gained token is worth ``c``, decoding's cost per token at
its best draft length. Checked against break-even rows derived by hand (K = 1, decoding alone: drafting pays while
``2 R <= (1 + p) F``; beside a compute-bound prompt chunk while ``p c >= 1``), the flat and compute-bound limits, the
measured acceptance rates it reads, and through the engine: with ``F = 1`` (every token costs) speculation stops as
soon as a rejection was measured; with a large ``F`` every decoding step drafts; greedy tokens equal the oracle either
way.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.engine.engine import Engine
from kvjax.sched.drafter import DISABLE_BY_BATCH_SIZE, NgramDrafter, PacedDrafter, SpeculativeConfig, make_drafter
from kvjax.sched.spec import SpecStats, draft_length
from helpers.engine import BUDGET, SMALL, assert_idle, greedy_oracle, random_prompts
from helpers.models import qwen_swa_model
from helpers.spec import OracleDrafter

NEW = 12


def stats(proposed, accepted) -> SpecStats:
    return SpecStats(proposed_at=np.asarray(proposed, np.int64), accepted_at=np.asarray(accepted, np.int64))


@pytest.mark.parametrize("p_num, p_den", [(0, 5), (1, 4), (3, 5), (7, 8)])
@pytest.mark.parametrize("flat", [16, 64, 256])
def test_one_draft_pays_below_the_break_even_rows(p_num, p_den, flat):
    """K = 1. Decoding alone (T0 = R): one draft costs max(2R, F) for (1 + p) R tokens against max(R, F) for R, so it
    pays while 2 R <= (1 + p) F. Beside a prompt chunk that fills the step past F: it adds R cost units and gains p R
    tokens worth c = min(max(R, F), max(2R, F) / (1 + p)) / R each, so it pays while p c >= 1 (ties draft)."""
    s = stats([p_den], [p_num])
    p = p_num / p_den
    rows = np.arange(1, 2 * flat + 1)
    got = np.array([draft_length(int(r), int(r), s, 1, flat) for r in rows])
    want = (2 * rows * p_den <= (p_den + p_num) * flat).astype(int)
    np.testing.assert_array_equal(got, want)
    got = np.array([draft_length(int(r), int(r) + 2 * flat, s, 1, flat) for r in rows])
    c = np.minimum(np.maximum(rows, flat), np.maximum(2 * rows, flat) / (1 + p)) / rows
    np.testing.assert_array_equal(got, (p * c >= 1 - 1e-12).astype(int))


def random_stats(rng, K: int) -> SpecStats:
    """Counts of verification rows with random draft lengths ``1..K`` and accepted counts ``0..k``."""
    k = rng.integers(1, K + 1, int(rng.integers(1, 40)))
    a = np.minimum(k, rng.integers(0, K + 1, k.size) * (rng.random(k.size) < 0.8) + (rng.random() < 0.3) * K)
    j = np.arange(K)
    return stats((j[None] < k[:, None]).sum(0), (j[None] < a[:, None]).sum(0))


def test_flat_region_drafts_everything_and_compute_bound_steps_only_sure_drafts():
    rng = np.random.default_rng(3)
    for _ in range(200):
        K = int(rng.integers(1, 9))
        s = random_stats(rng, K)
        rows = int(rng.integers(1, 64))
        base = rows + int(rng.integers(0, 50))  # decoding rows and some prompt chunk tokens
        flat = base + rows * K + int(rng.integers(0, 100))
        assert draft_length(rows, base, s, K, flat) == K  # K drafts a row still fit the flat region: free
        # decoding itself compute-bound (R >= F): each draft costs a token and saves p_j < 1 unless always accepted
        flat = int(rng.integers(1, rows + 1))
        base = rows + int(rng.integers(0, 100))
        sure = (s.accepted_at == s.proposed_at) | (s.proposed_at == 0)
        want = K if sure.all() else int(np.argmin(sure))
        assert draft_length(rows, base, s, K, flat) == want, (s, rows, base, flat)


def _vectorised_draft_length(rows, base_tokens, stats, K, flat_tokens):
    """The rule's formula as arrays over k = 0..K (the module docstring's), the reference for the scalar code."""
    prop, acc = np.zeros(K), np.zeros(K)
    m = min(K, stats.proposed_at.size)
    prop[:m], acc[:m] = stats.proposed_at[:m], stats.accepted_at[:m]
    p = np.where(prop > 0, acc / np.maximum(prop, 1), 1.0)
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(p)])
    k = np.arange(K + 1)
    per_token = float((np.maximum(rows * (k + 1), flat_tokens) / (rows * gain)).min())
    extra = np.maximum(base_tokens + rows * k, flat_tokens) - max(base_tokens, flat_tokens)
    saving = rows * (gain - 1.0) * per_token - extra
    return int(np.flatnonzero(saving >= saving.max() - 1e-9 * max(rows, flat_tokens))[-1])


def test_draft_length_is_the_vectorised_formula(rng):
    """Random acceptance counts (some positions never measured, ties at full acceptance), rows, base tokens, K and
    flat regions: the scheduler's scalar rule picks what the formula over arrays picks."""
    for _ in range(3000):
        K = int(rng.integers(1, 9))
        m = int(rng.integers(0, K + 2))
        prop = rng.integers(0, 50, m) * (rng.random(m) < 0.8)
        acc = np.where(rng.random(m) < 0.3, prop, (prop * rng.random(m)).astype(np.int64))
        s = stats(prop.tolist(), acc.tolist())
        rows = int(rng.integers(1, 300))
        base = rows + int(rng.integers(0, 3)) * int(rng.integers(0, 600))
        flat = int(rng.choice([1, 16, 64, 256, 1024]))
        assert draft_length(rows, base, s, K, flat) == _vectorised_draft_length(rows, base, s, K, flat), \
            (rows, base, prop, acc, K, flat)


def test_measured_rates_and_the_optimistic_prior():
    # position 0 always accepted, position 1 never: the second draft gains nothing, costs a token past F
    s = stats([10, 10], [10, 0])
    assert draft_length(8, 8, s, 2, 16) == 1  # cost max(8 + 8k, 16): 16 for 8, 16 for 16, 24 for 16 tokens
    assert draft_length(8, 8, s, 2, 24) == 2  # k = 2 still in the flat region: drafted (the longest among equals)
    # nothing measured yet: every draft is taken to be accepted (speculation starts, then measures)
    assert draft_length(100, 100, SpecStats(), 4, 1) == 4
    # measured positions beyond K are ignored; no rows -> no drafts
    assert draft_length(4, 4, stats([5, 5, 5], [1, 1, 1]), 1, 1) == 0
    assert draft_length(0, 0, SpecStats(), 4, 256) == 0


def test_config_paces_the_drafter():
    d = make_drafter(SpeculativeConfig(num_draft_tokens=3))
    assert isinstance(d, PacedDrafter) and d.num_draft_tokens == 3 and isinstance(d.drafter, NgramDrafter)
    assert d.propose(np.array([9, 1, 2, 9]), 3).tolist() == [1, 2, 9]
    assert isinstance(make_drafter(SpeculativeConfig(flat_tokens=None, disable_by_batch_size=None)), NgramDrafter)
    # the default row limit alone still paces: no drafts while more than DISABLE_BY_BATCH_SIZE requests run
    limited = make_drafter(SpeculativeConfig(flat_tokens=None))
    assert isinstance(limited, PacedDrafter) and limited.flat_tokens is None
    assert limited.disable_by_batch_size == DISABLE_BY_BATCH_SIZE == SpeculativeConfig().disable_by_batch_size == 16
    for bad in (0, -3, 2.5, "256", True):
        with pytest.raises(ValueError, match="flat_tokens"):
            SpeculativeConfig(flat_tokens=bad)


@pytest.fixture(scope="module")
def case():
    model = qwen_swa_model()
    prompts = random_prompts(np.random.default_rng(41), (19, 7, 26, 12, 4))
    return model, prompts, greedy_oracle(model, prompts, NEW)


def test_engine_turns_speculation_off_where_it_does_not_pay(case):
    model, prompts, expect = case
    runs = {}
    for flat in (1, 10**6):
        drafter = OracleDrafter(prompts, expect, 3, seed=5)
        eng = Engine(model, SMALL, recycle="timely", max_num_batched_tokens=BUDGET,
                     speculative=SpeculativeConfig(num_draft_tokens=3, drafter=drafter, flat_tokens=flat))
        assert eng.generate(prompts, NEW) == expect
        assert_idle(eng)
        runs[flat] = [r for r in eng.metrics.records if r.verify_rows]
    # F = 1: a draft costs a token; once a rejection was measured at position 0 no step drafts again
    off = runs[1]
    first_reject = next(i for i, r in enumerate(off) if r.drafts_accepted_at[0] < r.drafts_proposed_at[0])
    assert len(off) == first_reject + 1
    # F large: every step with a decoding row that has room verifies drafts, up to K
    on = runs[10**6]
    assert len(on) > 3 * len(off) and max(len(r.drafts_proposed_at) for r in on) == 3
    assert sum(r.drafts_accepted for r in on) > 0
