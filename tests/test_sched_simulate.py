"""Capacity simulator: the bound really bounds, recycling helps where the layout allows, CLI table and JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.cli.simulate import main
from kvjax.sched.simulate import simulate, throughput_bound
from kvjax.sched.workload import SEED_OUTPUT_MEAN, SEED_PROMPT_MEAN, RequestSpec, cache_for, seed_workload, swa_layout


def test_seed_workload_shape():
    w = seed_workload(400, scale=0.1, spread=0.25, seed=3)
    p = np.array([x.prompt.size for x in w])
    o = np.array([x.max_new_tokens for x in w])
    assert abs(p.mean() / (0.1 * SEED_PROMPT_MEAN) - 1) < 0.03 and abs(o.mean() / (0.1 * SEED_OUTPUT_MEAN) - 1) < 0.03
    assert p.min() >= 0.1 * SEED_PROMPT_MEAN * 0.75 - 1 and p.max() <= 0.1 * SEED_PROMPT_MEAN * 1.25 + 1
    with pytest.raises(ValueError, match="scale > 0"):
        seed_workload(4, scale=0.0)


def test_bound_is_exact_for_a_lone_request():
    # one request, one row: 1 prefill step (4 <= budget) + 2 decode steps generate 3 tokens -> exactly 1/step
    w = [RequestSpec(np.arange(1, 5, dtype=np.int32), 3)]
    cache = CacheConfig(page_size=1, num_pages=64, max_seqs=1, max_blocks_per_seq=16)
    att = AttentionConfig(1, 1, 8)
    r = simulate(w, cache, att, max_num_batched_tokens=8, pool="shared", recycle="none")
    assert (r.steps, r.generated, r.bound_by) == (3, 3, "rows")
    assert throughput_bound(w, cache, att, max_num_batched_tokens=8, pool="shared", recycle=False) == 1.0


@pytest.mark.parametrize("frac", [0.5, 1.0])
def test_measured_never_beats_the_bound_and_timely_wins(frac):
    w = seed_workload(12, scale=0.02, seed=1)  # ~212 prompt / ~81 output tokens
    att = swa_layout(4, frac, window=24, sinks=2)
    cache = cache_for(w, num_kv_heads=4, page_size=4, full_requests=3, max_seqs=12)
    res = {(pool, rec): simulate(w, cache, att, max_num_batched_tokens=64, pool=pool, recycle=rec, check_every=7)
           for pool in ("shared", "partitioned") for rec in ("none", "timely")}
    for r in res.values():
        assert r.generated == sum(x.max_new_tokens for x in w)
        assert r.tokens_per_step <= r.bound_tokens_per_step + 1e-9
        assert 0 < r.page_util_mean <= r.page_util_peak <= 1.0
    assert res["shared", "timely"].tokens_per_step > 1.3 * res["shared", "none"].tokens_per_step
    assert res["shared", "timely"].peak_concurrency > res["shared", "none"].peak_concurrency
    if frac < 1:  # partitioned: full heads' own pages still bind, so SWA recycling cannot raise concurrency
        assert res["partitioned", "timely"].tokens_per_step <= res["shared", "timely"].tokens_per_step


def test_cli_table_and_json(capsys):
    args = ["--requests", "6", "--scale", "0.01", "--window", "16", "--page-size", "4", "--max-tokens", "64",
            "--memory-requests", "2", "--swa-fraction", "0.5,1.0", "--max-seqs", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tok/step" in out and "bound gain" in out and len(out.strip().splitlines()) == 2 + 1 + 8
    assert main(args + ["--json", "-", "--pool", "shared"]) == 0
    doc = json.loads(capsys.readouterr().out)  # '-': the JSON alone on stdout
    assert doc["config"]["num_pages"] > 0 and len(doc["results"]) == 4
    assert doc["meta"]["seed"] == 0 and doc["meta"]["command"][3:5] == ["simulate", "--requests"]
    assert {r["recycle"] for r in doc["results"]} == {"none", "timely"}
    assert main(["--scale", "0", "--requests", "2"]) == 2
    assert "scale > 0" in capsys.readouterr().err


def test_prefix_cache_simulation_hits_and_keep_tail_beats_eager():
    from kvjax.sched.prefix_cache import PrefixCacheConfig
    from kvjax.sched.simulate import simulate_prefix, split_memory
    from kvjax.sched.workload import few_shot_workload, multi_turn_workload, system_prompt_workload

    att = swa_layout(4, 0.5, window=32, sinks=2)
    loads = [system_prompt_workload(12, system_len=200, user_len=30, output_len=16, seed=2),
             multi_turn_workload(4, turns=3, first_len=100, message_len=20, output_len=16, seed=3),
             few_shot_workload(12, tasks=2, shots=3, shot_len=40, question_len=20, output_len=8, seed=4)]
    for w in loads:
        longest = max(x.prompt.size + x.max_new_tokens for x in w)
        res = {}
        for mode in ("off", "eager", "keep_tail"):
            ck = 0 if mode == "off" else 8
            pages = split_memory(2400, page_bytes=1, slot_bytes=20, num_checkpoints=ck)
            cache = CacheConfig(page_size=8, num_pages=pages, max_seqs=6, max_blocks_per_seq=-(-longest // 8))
            res[mode] = simulate_prefix(w, cache, att, max_num_batched_tokens=128, check_every=3,
                                        prefix=None if mode == "off" else PrefixCacheConfig(8, recycle=mode))
        assert len({r.generated for r in res.values()}) == 1 and res["off"].generated == sum(x.max_new_tokens for x in w)
        assert res["off"].hit_rate == 0 and res["off"].preemptions == 0
        assert res["off"].computed_tokens == sum(x.prompt.size + x.max_new_tokens - 1 for x in w)
        for r in res.values():
            assert r.computed_tokens + r.cached_tokens >= res["off"].computed_tokens - 1e-9
        assert res["keep_tail"].hit_rate > 0.3 and res["keep_tail"].hit_rate > res["eager"].hit_rate
        assert res["keep_tail"].computed_tokens < res["off"].computed_tokens
    with pytest.raises(ValueError, match="leave no page"):
        split_memory(100, page_bytes=1, slot_bytes=50, num_checkpoints=2)


def test_simulate_progress_hook_counts_every_generated_token():
    w = seed_workload(5, scale=0.01, seed=1)
    cache = cache_for(w, num_kv_heads=2, page_size=4, full_requests=2, max_seqs=4)
    att = swa_layout(2, 0.5, 16, 2)
    seen = []
    hooked = simulate(w, cache, att, max_num_batched_tokens=64, pool="shared", recycle="timely", progress=seen.append)
    plain = simulate(w, cache, att, max_num_batched_tokens=64, pool="shared", recycle="timely")
    assert hooked == plain and len(seen) == plain.steps and sum(seen) == plain.generated == sum(x.max_new_tokens for x in w)


def test_fp8_pages_fit_twice_the_pages_and_run_more_requests(capsys):
    """``--kv-cache-dtype fp8``: the same page memory holds ``bf16 bytes / fp8 bytes`` times the pages (K and V of
    ``--head-dim`` values (default 256), 2 bytes each against 1 plus one f32 scale per page), and with pages the binding limit
    (no recycling, 2 full requests of memory) more requests run at once and more tokens come per step."""
    args = ["--requests", "8", "--scale", "0.01", "--window", "16", "--page-size", "4", "--max-tokens", "64",
            "--memory-requests", "2", "--swa-fraction", "0.5", "--max-seqs", "8", "--pool", "shared", "--json", "-"]
    docs = {}
    for kind in ("auto", "fp8"):
        assert main(args + ["--kv-cache-dtype", kind]) == 0
        docs[kind] = json.loads(capsys.readouterr().out)
    auto, fp8 = docs["auto"]["config"]["num_pages"], docs["fp8"]["config"]["num_pages"]
    fit = auto * (2 * 4 * 256 * 2) // (2 * (4 * 256 + 4))
    assert fp8 == fit - fit % 4  # rounded down to a multiple of the 4 KV heads (the partitioned pool's shares)
    assert fp8 > 1.9 * auto
    for r8, r16 in zip(docs["fp8"]["results"], docs["auto"]["results"]):
        assert r8["recycle"] == r16["recycle"]
        if r8["recycle"] == "none":
            assert r8["peak_concurrency"] > r16["peak_concurrency"]
            assert r8["tokens_per_step"] > r16["tokens_per_step"]
    assert main(args[:-2] + ["--head-dim", "64"]) == 2  # --head-dim alone would change nothing: refused
    assert "--head-dim sizes fp8 pages" in capsys.readouterr().err
    pools = [a for i, a in enumerate(args) if a != "--pool" and (i == 0 or args[i - 1] != "--pool")]
    for memory in ("2", "3"):  # every pool policy (the default) at page counts whose fp8 fit is not a multiple of 4
        assert main(pools[:pools.index("--memory-requests") + 1] + [memory] +
                    pools[pools.index("--memory-requests") + 2:] + ["--kv-cache-dtype", "fp8", "--head-dim", "100"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["config"]["num_pages"] % 4 == 0 and {r["pool"] for r in doc["results"]} == {"shared", "partitioned"}
