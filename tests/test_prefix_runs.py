"""kvjax.experiments.prefix_runs: the fixed-memory prefix-reuse runs behind notebooks/prefix_reuse.ipynb.

Properties: every policy generates the same tokens, equal to full-sequence greedy decoding of the prompts as
served (``greedy_oracle``, no cache; multi-turn prompts include the model's own earlier answers); prompt tokens
add up (served + computed = prompt tokens when nothing was preempted, >= otherwise); every policy gets the same
cache bytes to within one page; caching off never serves a token; on multi-turn conversations ``keep_tail``
keeps the SWA tail windows that ``eager`` recycling gives up, so it hits more.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.experiments import engine_runs as er
from kvjax.experiments import prefix_runs as pr
from kvjax.experiments.size import Size
from kvjax.sched.workload import multi_turn_workload, system_prompt_workload
from helpers.engine import greedy_oracle

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    return er.toy_qwen(vocab=VOCAB, swa_fraction=0.5, window=16, sinks=4)


def check_counts(rows):
    for r in rows:
        assert r["recomputed"] >= 0, r
        if r["preemptions"] == 0:
            assert r["served"] + r["computed"] == r["prompt_tokens"], r
        if r["cache"] == "off":
            assert r["served"] == 0 and r["num_checkpoints"] == 0 and r["cached_pages_mean"] == 0
        assert 0 <= r["hit_rate"] <= 1


def check_fixed_memory(setup, rows):
    for r in rows:
        assert setup.budget_bytes - setup.page_bytes < r["memory_bytes"] <= setup.budget_bytes, r


def test_scheduler_sweep(model):
    wl = pr.prefix_workloads(Size("small"), vocab=VOCAB, engine=False, seed=1)
    att = model.attention_layout()
    for memory, pressure in ((40.0, False), (4.0, True)):
        setup = pr.make_setup(model, wl, page_size=8, memory_requests=memory, max_seqs=8, max_tokens=128)
        rows = pr.scheduler_sweep(setup, att)
        assert len(rows) == len(pr.POLICIES) * 3
        check_counts(rows)
        check_fixed_memory(setup, rows)
        assert any(r["preemptions"] > 0 for r in rows) == pressure
        for r in rows:  # the fixed answers make every prompt as in the workload; every output token sampled
            ws = wl[r["workload"]]
            assert r["prompt_tokens"] == sum(w.prompt.size for w in ws)
            assert r["generated"] == sum(w.max_new_tokens for w in ws)
        by = {(r["workload"], r["policy"]): r for r in rows}
        assert by["multi-turn", "timely+keep_tail"]["hit_rate"] > by["multi-turn", "timely+eager"]["hit_rate"]
        for w in wl:
            assert by[w, "prefix"]["served"] > 0


def test_multi_turn_prompts_chain_answers(model):
    """Turn t + 1's prompt = turn t's prompt (as served) + the engine's answer + the workload's new message."""
    wl = multi_turn_workload(2, turns=3, first_len=11, message_len=5, output_len=4, vocab=VOCAB, seed=3)
    setup = pr.make_setup(model, {"multi-turn": wl}, page_size=4, memory_requests=3.0, max_seqs=2, max_tokens=16)
    engine = pr.policy_engine(model, setup, "timely+keep_tail")
    prompts, outputs = pr.serve(engine, wl)
    for i, w in enumerate(wl):
        if w.after >= 0:
            p = prompts[w.after]
            np.testing.assert_array_equal(prompts[i], np.concatenate([p, outputs[w.after], w.prompt[p.size + 4:]]))
        else:
            np.testing.assert_array_equal(prompts[i], w.prompt)
    assert outputs == greedy_oracle(model, [p.tolist() for p in prompts], 4)
    assert engine.metrics.summary()["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("memory", [40.0, 2.0], ids=["roomy", "tight"])
def test_engine_runs_identical_tokens_and_counts(model, memory):
    wl = {"system-prompt": system_prompt_workload(6, system_len=29, user_len=6, output_len=5, vocab=VOCAB, seed=2),
          "multi-turn": multi_turn_workload(2, turns=3, first_len=13, message_len=5, output_len=5, vocab=VOCAB,
                                            seed=2)}
    setup = pr.make_setup(model, wl, page_size=4, memory_requests=memory, max_seqs=3, max_tokens=16)
    rows = pr.engine_runs(model, setup)  # raises unless every policy generated the same tokens
    check_counts(rows)
    check_fixed_memory(setup, rows)
    assert any(r["preemptions"] > 0 for r in rows) == (memory < 10)
    for name in wl:
        same = [r for r in rows if r["workload"] == name]
        assert all(r["outputs"] == same[0]["outputs"] and r["prompts"] == same[0]["prompts"] for r in same)
        assert same[0]["outputs"] == greedy_oracle(model, same[0]["prompts"], 5)
        assert all(r["served"] > 0 for r in same if r["cache"] == "keep_tail")
        assert all(r["generated"] == sum(w.max_new_tokens for w in wl[name]) for r in same)
    by = {(r["workload"], r["policy"]): r for r in rows}
    assert by["multi-turn", "timely+keep_tail"]["hit_rate"] > by["multi-turn", "timely+eager"]["hit_rate"]
    assert "multi-turn" in pr.format_rows(rows)


def test_setup_validates():
    with pytest.raises(ValueError, match="workloads"):
        pr.PrefixSetup({"chat": []}, 4, 10, 2, 16, 2, 64, 32)
    with pytest.raises(ValueError, match="memory_pages"):
        pr.PrefixSetup({"multi-turn": []}, 4, 0, 2, 16, 2, 64, 32)
