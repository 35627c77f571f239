"""Splitting one workload over several engines (:mod:`kvjax.sched.dispatch`, behind ``kvjax simulate --processes``).

- ``shares`` (the static split): every request in one engine, chains kept together, tokens balanced within a chain.
- ``simulate_dispatch``: one engine with the static split is :func:`kvjax.sched.simulate.simulate` step for step;
  over several engines, with either split, every request is served once with all its tokens, and on the gpu
  preset's workload the rounds are the figures RESULTS.md quotes (issue 34).
- ``kvjax simulate --processes 2``: the second table and its JSON, against the one-engine table's steps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvjax.cli.simulate as sim_cli
from kvjax.config import AttentionConfig
from kvjax.sched.dispatch import SHARES, chains, shares, simulate_dispatch
from kvjax.sched.simulate import simulate
from kvjax.sched.workload import RequestSpec, cache_for, multi_turn_workload, seed_workload


def test_shares_cover_the_workload_keep_chains_and_balance_tokens():
    """``shares``: every request in exactly one engine, an ``after`` chain in one engine, the engines' tokens within
    the largest chain of each other (greedy largest-first), better than round-robin on a skewed workload."""
    for workload in (seed_workload(37, scale=0.01, seed=3),
                     multi_turn_workload(9, turns=3, first_len=40, message_len=8, output_len=5, seed=4)):
        for n in (1, 2, 3, 4):
            parts = shares(workload, n)
            assert sorted(i for p in parts for i in p) == list(range(len(workload)))
            where = {i: k for k, p in enumerate(parts) for i in p}
            assert all(where[i] == where[w.after] for i, w in enumerate(workload) if w.after >= 0)
            load = [sum(workload[i].total_len for i in p) for p in parts]
            head = list(range(len(workload)))
            for i, w in enumerate(workload):
                head[i] = head[w.after] if w.after >= 0 else i
            chain = {h: sum(w.total_len for w, g in zip(workload, head) if g == h) for h in set(head)}
            assert max(load) - min(load) <= max(chain.values()), (n, load)
    lengths = [RequestSpec(np.ones(k, np.int32), 1) for k in (90, 10, 10, 10, 10, 10, 10, 10, 10, 10)]
    assert [sorted(p) for p in shares(lengths, 2)] == [[0], list(range(1, 10))]  # round-robin: 140 vs 50 tokens


def test_chains_largest_first_ties_by_index_turns_together():
    ties = [RequestSpec(np.ones(k, np.int32), 1) for k in (5, 9, 5, 9)]
    assert chains(ties) == [[1], [3], [0], [2]]
    turns = multi_turn_workload(5, turns=3, first_len=40, message_len=8, output_len=5, seed=4)
    order = chains(turns)
    assert sorted(i for c in order for i in c) == list(range(len(turns))) and len(order) == 5
    assert all(turns[i].after in c for c in order for i in c if turns[i].after >= 0)
    cost = [sum(turns[i].total_len for i in c) for c in order]
    assert cost == sorted(cost, reverse=True)


def _setup(requests: int = 24, seed: int = 5):
    workload = seed_workload(requests, scale=0.02, seed=seed)
    att = AttentionConfig.with_swa_fraction(8, 4, 16, swa_fraction=0.5, window=32, sinks=4)
    cache = cache_for(workload, num_kv_heads=4, page_size=16, full_requests=3.0, max_seqs=8)
    return workload, att, cache


@pytest.mark.parametrize("recycle", ["none", "timely"])
def test_one_engine_static_is_the_simulator_step_for_step(recycle):
    workload, att, cache = _setup()
    one = simulate(workload, cache, att, max_num_batched_tokens=128, pool="shared", recycle=recycle, seed=3)
    d = simulate_dispatch(workload, cache, att, engines=1, share="static", max_num_batched_tokens=128, pool="shared",
                          recycle=recycle, seed=3)
    assert (d.steps, d.generated, d.preemptions, d.requests) == ((one.steps,), (one.generated,), (one.preemptions,),
                                                               (len(workload),))
    assert (d.swa_fraction, d.pool, d.recycle, d.run_steps) == (0.5, "shared", recycle, one.steps)


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("engines", [2, 3])
def test_every_request_served_once_with_all_its_tokens(share, engines):
    workload, att, cache = _setup()
    seen = []
    d = simulate_dispatch(workload, cache, att, engines=engines, share=share, max_num_batched_tokens=128,
                          pool="shared", recycle="timely", progress=seen.append)
    total = sum(w.max_new_tokens for w in workload)
    assert sum(d.requests) == len(workload) and sum(d.generated) == sum(seen) == total
    assert len(d.steps) == engines and all(s > 0 for s in d.steps) and d.run_steps == max(d.steps)
    assert len(seen) == sum(d.steps)  # one call per engine step
    if share == "static":
        assert list(d.requests) == [len(p) for p in shares(workload, engines)]


def test_gpu_preset_rounds_are_the_quoted_figures():
    # RESULTS.md, "Many GPUs" (issue 34): the gpu preset's workload of 64 requests over two engines
    from kvjax.cli.presets import PRESETS, attention_layout

    p = PRESETS["gpu"]
    workload = seed_workload(64, scale=p.scale, vocab=p.vocab, seed=0)
    cache = cache_for(workload, num_kv_heads=p.kv_heads, page_size=p.page_size, full_requests=p.memory_requests,
                      max_seqs=p.max_seqs)
    got = {(r, s): simulate_dispatch(workload, cache, attention_layout(p), engines=2, share=s,
                                     max_num_batched_tokens=p.max_tokens, pool="shared", recycle=r).steps
           for r in ("none", "timely") for s in SHARES}
    assert got == {("none", "static"): (3390, 3291), ("none", "dynamic"): (3307, 3353),
                   ("timely", "static"): (1419, 1431), ("timely", "dynamic"): (1353, 1371)}


@pytest.mark.parametrize("kwargs, needle", [(dict(engines=0), "engines must be an int >= 1, got 0"),
                                            (dict(engines=True), "engines must be an int >= 1, got True"),
                                            (dict(share="round-robin"), "share must be one of")])
def test_bad_arguments_name_the_value(kwargs, needle):
    workload, att, cache = _setup(4)
    args = dict(engines=2, share="dynamic", max_num_batched_tokens=128, pool="shared", recycle="none") | kwargs
    with pytest.raises(ValueError, match=needle):
        simulate_dispatch(workload, cache, att, **args)


def test_simulate_command_adds_the_split_table(capsys, tmp_path):
    argv = ["--requests", "12", "--scale", "0.02", "--kv-heads", "4", "--swa-fraction", "0.5", "--window", "32",
            "--page-size", "16", "--memory-requests", "3", "--max-seqs", "8", "--max-tokens", "128", "--pool",
            "shared", "--processes", "2", "--json", str(tmp_path / "s.json")]
    assert sim_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "# 2 engines, one per process" in out and "vs one" in out
    doc = json.loads((tmp_path / "s.json").read_text())
    one = {r["recycle"]: r["steps"] for r in doc["results"]}
    assert [(d["recycle"], d["share"]) for d in doc["dispatch"]] == [(r, s) for r in ("none", "timely")
                                                                      for s in ("dynamic", "static")]
    for d in doc["dispatch"]:
        assert d["rounds"] == max(d["steps"]) and d["vs_one"] == pytest.approx(one[d["recycle"]] / d["rounds"])
        assert sum(d["requests"]) == 12
