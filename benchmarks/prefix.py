"""Prefix caching on the engine (issue #19): a multi-turn workload served under every policy of
:data:`kvjax.experiments.prefix_runs.POLICIES` at fixed memory, on the gpu-preset toy Qwen3.5 in float32.

Usage: ``python benchmarks/runner.py prefix`` (one accelerator; ``--small``: a CPU smoke run of a few seconds).

Workload (:func:`kvjax.sched.workload.multi_turn_workload`): ``CONVERSATIONS`` conversations of ``TURNS`` turns;
turn ``t + 1``'s prompt = turn ``t``'s prompt + the answer the model generated + a new message, arriving when
turn ``t`` finishes. Prompts dominate (a long first prompt, short answers), as in chat serving with a long
history. Fixed memory (:class:`~kvjax.experiments.prefix_runs.PrefixSetup`): every policy has the same cache
bytes; a policy with caching pays its GDN checkpoint slots out of the pages.

Per policy (one row each, ``impl`` = the policy; anchor ``none``): ``median_ms`` = the run's wall time per
generated token; prompt tokens submitted / computed / served from the cache, hit rate; generated tokens/s and
prompt + generated tokens/s over the run's wall clock after a warm-up run of the same engine (compilation
excluded; two token buckets, ``max_seqs`` for decode steps and the step budget); ``identical``: the policy
generated the same tokens as ``none`` (float32; ``divergence`` says where they first differ otherwise). Ratios
vs ``none``: ``computed_ratio`` (prompt tokens computed by ``none`` / by this policy) and ``speedup``
(tokens/s).
"""

from __future__ import annotations

import dataclasses
import time

from case import RunCase

CONVERSATIONS, TURNS = 8, 5
FIRST_LEN, MESSAGE_LEN, OUTPUT_LEN = 2048, 128, 4
MEMORY_REQUESTS = 6.0  # pages for this many mean-length requests on every KV head (without recycling)


def _serve_timed(engine, workload) -> tuple[list, list, float]:
    from kvjax.experiments.prefix_runs import serve

    t0 = time.perf_counter()
    prompts, outputs = serve(engine, workload)
    return prompts, outputs, time.perf_counter() - t0


def measure(p, conversations: int, turns: int, first_len: int, message_len: int, output_len: int,
            memory_requests: float) -> list[dict]:
    """One row per policy; see the module docstring."""
    from engine import divergence

    from kvjax.cli_run import build_model
    from kvjax.experiments.prefix_runs import POLICIES, _row, make_setup, policy_engine
    from kvjax.sched.workload import multi_turn_workload

    model = build_model(dataclasses.replace(p, dtype="float32"))
    workload = multi_turn_workload(conversations, turns=turns, first_len=first_len, message_len=message_len,
                                   output_len=output_len, vocab=p.vocab, seed=0)
    setup = make_setup(model, {"multi-turn": workload}, page_size=p.page_size, memory_requests=memory_requests,
                       max_seqs=min(p.max_seqs, conversations), max_tokens=p.max_tokens)
    rows, base = [], None
    for policy in POLICIES:
        engine = policy_engine(model, setup, policy, token_buckets=(setup.max_seqs, setup.max_tokens))
        _serve_timed(engine, workload[:turns])  # warm-up: compiles every shape the run uses
        engine.clear_prefix_cache()
        before = len(engine.metrics)
        prompts, outputs, wall = _serve_timed(engine, workload)
        engine.check_integrity()
        engine.clear_prefix_cache()
        s = engine.metrics.summary(skip=before, num_pages=engine.cache_config.num_pages)
        row = _row("multi-turn", policy, setup, prompts, steps=s["steps"], generated=s["generated_tokens"],
                   served=s["prefix_hit_tokens"], computed=s["prefill_tokens"], preemptions=s["preemptions"],
                   cached_pages_mean=s["cached_pages_mean"], page_util_peak=s["page_util_peak"],
                   tokens_per_s=s["generated_tokens"] / wall)
        row.update(impl=policy, ok=engine.is_idle(), wall_s=wall, median_ms=1e3 * wall / max(s["generated_tokens"], 1),
                   total_tokens_per_s=(row["prompt_tokens"] + s["generated_tokens"]) / wall,
                   compiled_in_run=s["compile_steps"])
        if base is None:
            base = dict(row, outputs=outputs)
        row.update(identical=outputs == base["outputs"], divergence=divergence(base["outputs"], outputs),
                   computed_ratio=base["computed"] / max(row["computed"], 1),
                   speedup=row["tokens_per_s"] / base["tokens_per_s"])
        rows.append(row)
        print(f"{policy:18s} pages {row['num_pages']:5d} ckpts {row['num_checkpoints']:3d}"
              f"  prompt {row['prompt_tokens']:6d}  computed {row['computed']:6d} ({row['computed_ratio']:.2f}x fewer)"
              f"  hit {row['hit_rate']:.2f}  gen tok/s {row['tokens_per_s']:8.1f} ({row['speedup']:.2f}x)"
              f"  all tok/s {row['total_tokens_per_s']:9.1f}  preempt {row['preemptions']}"
              f"  identical {row['identical']}", flush=True)
    return rows


def cases(small: bool = False) -> list[RunCase]:
    """The multi-turn comparison on the gpu preset's model (``small``: the cpu preset, 2 conversations of 3 short
    turns)."""
    from kvjax.cli_run import PRESETS

    if small:
        p, args = PRESETS["cpu"], (2, 3, 40, 8, 4, 10.0)
    else:
        p, args = PRESETS["gpu"], (CONVERSATIONS, TURNS, FIRST_LEN, MESSAGE_LEN, OUTPUT_LEN, MEMORY_REQUESTS)
    shapes = dict(preset="small" if small else "gpu", dtype="float32", conversations=args[0], turns=args[1],
                  first_len=args[2], message_len=args[3], output_len=args[4], memory_requests=args[5])
    return [RunCase(f"prefix multi-turn {shapes['preset']} preset", "kvjax.engine.engine.Engine(prefix_caching=True)",
                    shapes, lambda: measure(p, *args), anchor="none")]
