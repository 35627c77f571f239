"""Prefix caching on the engine (issue #19): a multi-turn workload served under every policy of
:data:`kvjax.experiments.prefix_runs.POLICIES` at fixed memory, on the gpu-preset toy Qwen3.5 in float32.

Usage: ``python benchmarks/runner.py prefix`` or ``python benchmarks/prefix.py [runner options]`` (one accelerator;
``--small``: a CPU smoke run of a few seconds; ``--cases "host tier"``: the host tier case alone).

Workload (:func:`kvjax.sched.workload.multi_turn_workload`): ``CONVERSATIONS`` conversations of ``TURNS`` turns;
turn ``t + 1``'s prompt = turn ``t``'s prompt + the answer the model generated + a new message, arriving when
turn ``t`` finishes. Prompts dominate (a long first prompt, short answers), as in chat serving with a long
history. Fixed memory (:class:`~kvjax.experiments.prefix_runs.PrefixSetup`): every policy has the same cache
bytes; a policy with caching pays its GDN checkpoint slots out of the pages.

Per policy (one row each, ``impl`` = the policy; anchor ``none``; the engine's default decode bursts, and the
caching policies once more with single steps, ``<policy> burst=1``): ``median_ms`` = the run's wall time per
generated token; prompt tokens submitted / computed / served from the cache, hit rate; generated tokens/s and
prompt + generated tokens/s over the median wall clock of 3 runs after a warm-up run of the same engine (compilation
excluded; two token buckets, ``max_seqs`` for decode steps and the step budget; on the accelerator each policy
runs in its own process: the warm-ups compile side by side, the timed runs go one at a time); ``identical``: the policy
generated the same tokens as ``none`` (float32; ``divergence`` says where they first differ otherwise). Ratios
vs ``none``: ``computed_ratio`` (prompt tokens computed by ``none`` / by this policy) and ``speedup``
(tokens/s).

Long answers (``--cases "long answers"``): the same conversations answering :data:`LONG_OUTPUT_LEN` tokens a turn,
so decode is a real share of the work: where the default decode bursts can pay beside prefix caching (the
``burst=1`` rows are the same policies with single steps).

Host tier (issue #37; ``--cases "host tier"``): :data:`TIER_FACTOR` times more conversations than the device cache
holds (``TIER_FACTOR * MEMORY_REQUESTS`` conversations, pages for ``MEMORY_REQUESTS`` mean-length requests), the
device-only cache ``timely+keep_tail`` (anchor) against ``timely+keep_tail+host`` at the same device memory with a
host tier of :data:`HOST_MEMORY` times the device budget. Extra columns: ``served_host`` (prompt tokens loaded from
the host tier), ``bytes_out`` / ``bytes_in`` (moved each way), ``copy_share`` (host time issuing the copies /
``Engine.step`` time, the copies' exposed host part) and ``copy_sync_share`` (one more repeat with every copy
waited for, device included: copy time / that repeat's wall; an upper bound of the copies' exposed device time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

from case import RunCase

CONVERSATIONS, TURNS = 8, 5
FIRST_LEN, MESSAGE_LEN, OUTPUT_LEN = 2048, 128, 4
LONG_OUTPUT_LEN = 128  # the long-answers case: decode a real share of the tokens, where decode bursts pay
MEMORY_REQUESTS = 6.0  # pages for this many mean-length requests on every KV head (without recycling)
REPEATS = 3  # timed runs of the workload per policy (same engine, cache cleared between): the median wall
TIER_FACTOR = 4  # host tier case: conversations per mean-length request the device pages hold
HOST_MEMORY = 8.0  # host tier case: host bytes as a multiple of the device cache budget


def _serve_timed(engine, workload) -> tuple[list, list, float]:
    from kvjax.experiments.prefix_runs import serve

    t0 = time.perf_counter()
    prompts, outputs = serve(engine, workload)
    return prompts, outputs, time.perf_counter() - t0


def _build(p, conversations: int, turns: int, first_len: int, message_len: int, output_len: int,
           memory_requests: float, host_memory: float = 0.0):
    """The float32 model, the workload and the fixed-memory setup every policy shares (``host_memory``: the host
    tier policy's host bytes as a multiple of the device budget)."""
    from kvjax.cli.run import build_model
    from kvjax.experiments.prefix_runs import make_setup
    from kvjax.sched.workload import multi_turn_workload

    model = build_model(dataclasses.replace(p, dtype="float32"))
    workload = multi_turn_workload(conversations, turns=turns, first_len=first_len, message_len=message_len,
                                   output_len=output_len, vocab=p.vocab, seed=0)
    setup = make_setup(model, {"multi-turn": workload}, page_size=p.page_size, memory_requests=memory_requests,
                       max_seqs=min(p.max_seqs, conversations), max_tokens=p.max_tokens, host_memory=host_memory)
    return model, workload, setup


def _split(name: str) -> tuple[str, int | str]:
    """A run's name -> (policy, decode_burst): ``"prefix burst=1"`` is the ``prefix`` policy with single steps."""
    policy, _, burst = name.partition(" burst=")
    return policy, int(burst) if burst else "auto"


def _policy_run(name: str, model, workload, setup, turns: int, turn=contextlib.nullcontext) -> dict:
    """One policy's row (with its ``outputs``): build its engine, warm it up on one conversation (compiles every
    shape the run uses; ``warmup_s``; with a host tier the whole workload, so that the copies compile too), then
    serve the whole workload :data:`REPEATS` times while holding ``turn()`` (counts from the first, the median
    wall; every repeat must generate the same tokens) and, with a host tier, once more with every copy waited
    for (``copy_sync_share``)."""
    from kvjax.experiments.prefix_runs import _row, policy_engine

    policy, burst = _split(name)
    engine = policy_engine(model, setup, policy, token_buckets=(setup.max_seqs, setup.max_tokens), decode_burst=burst)
    # a host tier copies only once the device cache is full: its warm-up serves everything (copies compiled)
    warm = _serve_timed(engine, workload if engine.host_store is not None else workload[:turns])[2]
    engine.clear_prefix_cache()
    before = len(engine.metrics)
    walls = []
    with turn():
        for i in range(REPEATS):
            prompts, got, wall = _serve_timed(engine, workload)
            engine.check_integrity()
            engine.clear_prefix_cache()
            if i == 0:
                outputs, s = got, engine.metrics.summary(skip=before, num_pages=engine.cache_config.num_pages)
            elif got != outputs:
                raise AssertionError(f"{policy}: repeat {i} of the same workload generated other tokens")
            walls.append(wall)
        copy_sync_share = float("nan")
        if engine.host_store is not None:  # one more repeat, every copy waited for: its device time bounded
            engine.host_store.sync = True
            sync_wall = _serve_timed(engine, workload)[2]
            engine.host_store.sync = False
            engine.clear_prefix_cache()
            copy_sync_share = engine.host_store.stats.t_sync / sync_wall
    wall = statistics.median(walls)
    row = _row("multi-turn", policy, setup, prompts, steps=s["steps"], generated=s["generated_tokens"],
               served=s["prefix_hit_tokens"], computed=s["prefill_tokens"], preemptions=s["preemptions"],
               cached_pages_mean=s["cached_pages_mean"], page_util_peak=s["page_util_peak"],
               tokens_per_s=s["generated_tokens"] / wall, served_host=s["prefix_hit_tokens_host"],
               bytes_out=s["host_bytes_out"], bytes_in=s["host_bytes_in"])
    row.update(copy_share=s["copy_share"], copy_sync_share=copy_sync_share)
    row.update(impl=name, ok=engine.is_idle(), wall_s=wall, warmup_s=warm, outputs=outputs,
               median_ms=1e3 * wall / max(s["generated_tokens"], 1),
               total_tokens_per_s=(row["prompt_tokens"] + s["generated_tokens"]) / wall,
               compiled_in_run=s["compile_steps"])
    return row


def _policy_process(policy: str, args: tuple, barrier, lock, results) -> None:
    """A spawned process's part of :func:`measure`: warm up alongside the others, then wait for every policy to
    be warm (``barrier``) and serve timed alone (``lock``), so compilation overlaps but timing never does."""
    import traceback

    @contextlib.contextmanager
    def turn():
        barrier.wait()
        with lock:
            yield

    try:
        model, workload, setup = _build(*args)
        results.put((policy, _policy_run(policy, model, workload, setup, args[2], turn)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        barrier.abort()
        results.put((policy, traceback.format_exc()))


def _parallel_rows(policies: list[str], args: tuple, timeout_s: float) -> dict[str, dict]:
    """:func:`_policy_process` for every policy at once (spawned processes, one per policy)."""
    import multiprocessing
    import os
    import queue

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several processes share the accelerator
    ctx = multiprocessing.get_context("spawn")
    barrier, lock, results = ctx.Barrier(len(policies), timeout=timeout_s), ctx.Lock(), ctx.Queue()
    procs = [ctx.Process(target=_policy_process, args=(policy, args, barrier, lock, results)) for policy in policies]
    for proc in procs:
        proc.start()
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < len(procs):
            try:
                policy, value = results.get(timeout=5)
                got[policy] = value
                continue
            except queue.Empty:
                pass
            dead = {p: proc.exitcode for p, proc in zip(policies, procs) if proc.exitcode is not None and p not in got}
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"prefix benchmark: no result from {sorted(set(policies) - set(got))} "
                                   f"(exit codes of the dead: {dead}, {timeout_s:.0f} s allowed)")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    failed = {k: v for k, v in got.items() if isinstance(v, str)}
    if failed:
        raise RuntimeError("prefix benchmark: " + "\n".join(f"{k}:\n{v}" for k, v in failed.items()))
    return got


def measure(p, conversations: int, turns: int, first_len: int, message_len: int, output_len: int,
            memory_requests: float, parallel: bool = False, timeout_s: float = 900.0, names: list[str] | None = None,
            host_memory: float = 0.0) -> list[dict]:
    """One row per policy of ``names`` (default: every policy of :data:`POLICIES`, and two with single steps; the
    first is the anchor); see the module docstring. ``parallel``: one spawned process per policy, warm-ups
    (compilation) side by side, timed runs one at a time; otherwise every policy in turn in this process."""
    from engine import divergence

    from kvjax.experiments.prefix_runs import POLICIES

    if names is None:
        names = list(POLICIES) + [f"{policy} burst=1" for policy in ("prefix", "timely+keep_tail")]
    args = (p, conversations, turns, first_len, message_len, output_len, memory_requests, host_memory)
    if parallel:
        by_policy = _parallel_rows(names, args, timeout_s)
    else:
        model, workload, setup = _build(*args)
        by_policy = {name: _policy_run(name, model, workload, setup, turns) for name in names}
    outputs = {policy: row.pop("outputs") for policy, row in by_policy.items()}
    anchor = names[0]
    base, base_out = by_policy[anchor], outputs[anchor]
    rows = []
    for policy in names:
        row = by_policy[policy]
        row.update(identical=outputs[policy] == base_out, divergence=divergence(base_out, outputs[policy]),
                   computed_ratio=base["computed"] / max(row["computed"], 1),
                   speedup=row["tokens_per_s"] / base["tokens_per_s"])
        rows.append(row)
        print(f"{policy:26s} pages {row['num_pages']:5d} ckpts {row['num_checkpoints']:3d}"
              f"  prompt {row['prompt_tokens']:6d}  computed {row['computed']:6d} ({row['computed_ratio']:.2f}x fewer)"
              f"  hit {row['hit_rate']:.2f}  gen tok/s {row['tokens_per_s']:8.1f} ({row['speedup']:.2f}x)"
              f"  all tok/s {row['total_tokens_per_s']:9.1f}  preempt {row['preemptions']}"
              f"  identical {row['identical']}  warm-up {row['warmup_s']:.0f} s"
              + (f"  from host {row['served_host']}  GB out {row['bytes_out'] / 1e9:.2f} in {row['bytes_in'] / 1e9:.2f}"
                 f"  copy {row['copy_share']:.1%} (waited {row['copy_sync_share']:.1%})" if row["host_bytes"] else ""),
              flush=True)
    return rows


def cases(small: bool = False) -> list[RunCase]:
    """The multi-turn comparison on the gpu preset's model, one process per policy (``small``: the cpu preset, 2
    conversations of 3 short turns, in this process)."""
    from kvjax.cli.run import PRESETS

    if small:
        p, args = PRESETS["cpu"], (2, 3, 40, 8, 4, 10.0)
    else:
        p, args = PRESETS["gpu"], (CONVERSATIONS, TURNS, FIRST_LEN, MESSAGE_LEN, OUTPUT_LEN, MEMORY_REQUESTS)
    shapes = dict(preset="small" if small else "gpu", dtype="float32", conversations=args[0], turns=args[1],
                  first_len=args[2], message_len=args[3], output_len=args[4], memory_requests=args[5])
    from kvjax.experiments.prefix_runs import HOST_POLICY

    tier_args = (32, 3, 40, 8, 4, 8.0) if small else (round(TIER_FACTOR * args[5]), *args[1:])
    tier = ["timely+keep_tail", HOST_POLICY]
    tier_shapes = dict(shapes, conversations=tier_args[0], host_memory=HOST_MEMORY)
    long_args = (*args[:4], 8 if small else LONG_OUTPUT_LEN, args[5])
    return [RunCase(f"prefix multi-turn {shapes['preset']} preset", "kvjax.engine.engine.Engine(prefix_caching=True)",
                    shapes, lambda: measure(p, *args, parallel=not small), anchor="none"),
            RunCase(f"prefix multi-turn long answers {shapes['preset']} preset",
                    "kvjax.engine.engine.Engine(prefix_caching=True)", dict(shapes, output_len=long_args[4]),
                    lambda: measure(p, *long_args, parallel=not small), anchor="none"),
            RunCase(f"prefix host tier multi-turn {shapes['preset']} preset",
                    "kvjax.engine.engine.Engine(prefix_caching=True, host_cache_bytes=N)", tier_shapes,
                    lambda: measure(p, *tier_args, parallel=not small, names=tier, host_memory=HOST_MEMORY),
                    anchor="timely+keep_tail")]


if __name__ == "__main__":  # python benchmarks/prefix.py [runner options]: these cases through the runner
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import runner

    sys.exit(runner.subject_main("prefix", sys.argv[1:]))
