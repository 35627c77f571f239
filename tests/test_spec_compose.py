"""Speculative decoding with the engine's other features: prefix caching (GDN checkpoints never taken from a rejected
state), timely recycling and preemption, aborts, stop ids inside accepted drafts, faults mid-step; what it turns
off (overlap; bursts for a drafter other than "ngram" / "mtp") and refuses (the MTP drafter without MTP layers);
its metrics; the command line's flags.

Oracle: uncached greedy decoding (``greedy_oracle``), truncated after the first stop id where one is set. Model:
the tiny f32 Qwen3.5 with an SWA head. Drafts: the true continuation with a corrupted token half of the time
(:class:`OracleDrafter`), so rows accept every count from 0 to K.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.cli.main import main
from kvjax.engine.engine import Engine
from kvjax.sched.drafter import SpeculativeConfig
from helpers.engine import (BUDGET, SMALL, assert_idle, greedy_oracle, prefix_sharing_prompts, step_events,
                            stream_aborting, truncate_at)
from helpers.faults import Injected, arm
from helpers.models import qwen_swa_model
from helpers.spec import OracleDrafter

NEW = 12
K = 3


@pytest.fixture(scope="module")
def qwen():
    return qwen_swa_model()


@pytest.fixture(scope="module")
def shared(qwen):
    """Prompts sharing long prefixes (prefix-cache hits) and their greedy continuations."""
    rng = np.random.default_rng(7)
    prompts = prefix_sharing_prompts(rng)
    return prompts, greedy_oracle(qwen, prompts, NEW)


def engine(model, drafter, **kw) -> Engine:
    return Engine(model, SMALL, recycle="timely", max_num_batched_tokens=BUDGET, speculative=drafter, **kw)


@pytest.mark.parametrize("recycle", ["none", "timely"])
def test_prefix_caching_greedy_equals_oracle(qwen, shared, recycle):
    """Cache hits restore GDN checkpoints taken at prompt blocks (never from a verification's state); cached blocks
    hold prompt tokens only."""
    prompts, expect = shared
    eng = Engine(qwen, SMALL, recycle=recycle, max_num_batched_tokens=BUDGET, prefix_caching=True,
                 speculative=OracleDrafter(prompts, expect, K, seed=1), debug=True)
    assert eng.generate(prompts, NEW) == expect
    s = eng.metrics.summary()
    assert s["prefix_hit_tokens"] > 0 and 0 < s["acceptance_rate"] < 1
    eng.clear_prefix_cache()
    assert_idle(eng)


def test_stop_id_inside_accepted_drafts_ends_the_request(qwen, shared):
    """An eos that the target accepts among a row's drafts ends the request there: the drafts after it are dropped."""
    prompts, expect = shared
    eos = expect[0][4]
    want = [truncate_at(e, eos) for e in expect]
    drafter = OracleDrafter(prompts, expect, K, seed=2)
    eng = engine(qwen, drafter, eos_token_id=eos)
    assert eng.generate(prompts, NEW) == want
    assert_idle(eng)


def test_aborts_between_verification_steps(qwen, shared):
    prompts, expect = shared
    eng = engine(qwen, OracleDrafter(prompts, expect, K, seed=3))
    stream_aborting(eng, prompts, NEW, expect)
    assert_idle(eng)


@pytest.mark.parametrize("point", ["before device", "inside device", "after device"])
def test_fault_mid_step_recovers(qwen, shared, monkeypatch, point):
    """A fault at a point of a verification step: the engine recovers from the requests' resolved tokens (drafts
    were never among them) and the outputs equal an uninterrupted run."""
    prompts, expect = shared[0][:3], shared[1][:3]
    eng = engine(qwen, OracleDrafter(prompts, expect, K, seed=4))
    ids = [eng.add_request(p, NEW, index=i) for i, p in enumerate(prompts)]
    got = {rid: [] for rid in ids}

    def collect(events):
        for ev in events:
            got[ev.request_id].append(ev.token)
            assert ev.position == len(got[ev.request_id]) - 1

    while eng.scheduler.spec_stats.steps < 2:
        collect(step_events(eng))
    with monkeypatch.context() as m:
        arm(m, eng, point, Injected)
        with pytest.raises(Injected):
            while True:
                collect(step_events(eng))
    assert eng.num_recoveries == 1
    while eng.has_unfinished():
        collect(step_events(eng))
        eng.check_integrity()
    assert [got[rid] for rid in ids] == expect
    assert_idle(eng)


def test_speculation_runs_synchronously_bursts_with_ngram_and_mtp_only(qwen, shared):
    """No overlap; prompt lookup verifies in bursts (its device lookup, kvjax.engine.ngram), a drafter object of
    another kind in single steps."""
    eng = Engine(qwen, SMALL, speculative="ngram", overlap=True, decode_burst=8)
    assert (eng.overlap, eng.decode_burst) == (False, 8) and eng.runner.ngram == (3, 1)
    assert eng.options.speculative == SpeculativeConfig()
    prompts, expect = shared
    eng = Engine(qwen, SMALL, speculative=OracleDrafter(prompts, expect, K), overlap=True, decode_burst=8)
    assert (eng.overlap, eng.decode_burst) == (False, 1) and eng.runner.ngram is None
    with pytest.raises(ValueError, match="speculative"):
        Engine(qwen, SMALL, speculative="mtp")


def test_metrics_count_drafts_by_position(qwen, shared):
    prompts, expect = shared
    eng = engine(qwen, OracleDrafter(prompts, expect, K, seed=5))
    eng.generate(prompts, NEW)
    recs = eng.metrics.records
    st = eng.scheduler.spec_stats
    s = eng.metrics.summary()
    assert s["drafts_proposed"] == st.proposed == sum(r.drafts_proposed for r in recs)
    assert s["drafts_accepted"] == st.accepted == sum(r.drafts_accepted for r in recs)
    assert s["verify_steps"] == st.steps and sum(r.verify_rows for r in recs) == st.rows
    assert s["acceptance_rate"] == pytest.approx(st.accepted / st.proposed)
    assert s["acceptance_rate_per_position"] == pytest.approx((st.accepted_at / st.proposed_at).tolist())
    assert s["tokens_per_verify_row"] == pytest.approx((st.rows + st.accepted) / st.rows)
    verify = [r for r in recs if r.verify_rows]
    assert s["tokens_per_verify_step"] == pytest.approx(np.mean([r.generated for r in verify]))
    # a row gains 1 + its accepted drafts: the verification steps' tokens are at least their rows (some rows sample
    # without drafts in the same step)
    assert sum(r.generated for r in verify) >= st.rows + st.accepted


@pytest.mark.parametrize("argv, message", [
    (["run", "--num-draft-tokens", "2"], "--num-draft-tokens needs --speculative"),
    (["run", "--speculative", "mtp", "--mtp", "--devices", "1", "--preset", "tp"], "drawn on the host"),
    (["run", "--speculative", "ngram", "--num-draft-tokens", "0"], "num-draft-tokens"),
    (["run", "--speculative", "mtp"], "add --mtp"),
    (["run", "--mtp"], "--speculative mtp only"),
    (["run", "--flat-tokens", "64"], "--flat-tokens needs --speculative"),
    (["run", "--speculative", "ngram", "--flat-tokens", "0"], "flat-tokens"),
    (["run", "--disable-by-batch-size", "4"], "--disable-by-batch-size needs --speculative"),
    (["run", "--speculative", "ngram", "--disable-by-batch-size", "0"], "disable-by-batch-size"),
])
def test_run_flags_refused_up_front(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        raise SystemExit(main(argv))
    assert err.value.code == 2
    assert message in capsys.readouterr().err
