"""The scheduler's host cost per step on the host tier case of :mod:`prefix` (issue #37), with no model.

Drives :class:`~kvjax.sched.scheduler.Scheduler` as the engine's overlapped loop does (schedule, take the copy log,
advance; then resolve the step before) on ``benchmarks/prefix.py``'s host tier workload at the gpu preset's sizes
(``--small``: the cpu preset's), every sampled token drawn from a fixed seed, once device-only
(``timely+keep_tail``) and once with the host tier (``timely+keep_tail+host``). Prints per policy: steps, the
scheduler's host time per step (``schedule`` in wall-clock and this thread's CPU time, and ``advance`` +
``resolve``; the fastest of ``--repeats`` runs, the least disturbed on a busy machine), copies logged, and a digest
of every plan and copy log (equal digests: the same decisions). ``--profile``: the top functions of one more host
tier run under cProfile. JAX only builds the model (for its page bytes), on the CPU.

Usage: ``python benchmarks/tier_sched.py [--small] [--repeats N] [--profile]``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import os
import sys
import time

import numpy as np


def _setup(small: bool):
    """(workload, setup, attention) of the host tier case, as :func:`prefix._build` builds them (f32 sizes)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    import prefix

    from kvjax.cli.run import PRESETS, attention_layout

    p = PRESETS["cpu" if small else "gpu"]
    args = (32, 3, 40, 8, 4, 8.0, 8.0) if small else (round(prefix.TIER_FACTOR * prefix.MEMORY_REQUESTS), prefix.TURNS,
                                                       prefix.FIRST_LEN, prefix.MESSAGE_LEN, prefix.OUTPUT_LEN,
                                                       prefix.MEMORY_REQUESTS, prefix.HOST_MEMORY)
    _, workload, setup = prefix._build(p, *args)
    return workload, setup, attention_layout(p), p.vocab


def _digest(h, plan, ops) -> None:
    for f in dataclasses.fields(plan):  # fields at their default left out: a field added later changes nothing
        v = getattr(plan, f.name)
        if f.default is not dataclasses.MISSING and (v is None or isinstance(v, int) and v == f.default):
            continue
        h.update(f.name.encode())
        h.update(np.ascontiguousarray(v).tobytes() if isinstance(v, np.ndarray) else repr(v).encode())
    for op in ops:
        h.update(op.kind.encode())
        for a in (op.pages_dev, op.pages_host, op.ckpts_dev, op.ckpts_host):
            h.update(np.ascontiguousarray(a, np.int64).tobytes())


def run(workload, setup, attention, vocab: int, policy: str, burst: int = 8, seed: int = 0, **options) -> dict:
    """One overlapped serve of ``workload`` by the scheduler alone (``options``: more :class:`Scheduler` arguments,
    e.g. ``pool``, ``page_shards``); times and the digest of its decisions."""
    from kvjax.experiments.prefix_runs import _arrivals, policy_modes
    from kvjax.sched.request import Status
    from kvjax.sched.scheduler import Scheduler

    recycle = policy_modes(policy)[0]
    sched = Scheduler(setup.cache(policy), attention, max_num_batched_tokens=setup.max_tokens, recycle=recycle,
                      prefix_cache=setup.prefix_config(policy), **options)
    rng = np.random.default_rng(seed)
    index: dict[int, int] = {}  # request id -> workload index
    live: dict = {}  # request id -> Request, until its answer is complete

    def add(i: int, prompt: np.ndarray) -> None:
        req = sched.add_request(prompt, workload[i].max_new_tokens)
        index[req.request_id], live[req.request_id] = i, req

    _, finished = _arrivals(workload, add)
    h = hashlib.sha256()
    inflight: collections.deque = collections.deque()
    t_sched = t_apply = c_sched = 0.0  # wall seconds; c_sched: this thread's CPU seconds in schedule
    steps = copies = 0
    while sched.has_unfinished() or inflight:
        dispatched = False
        if sched.has_unfinished():
            c0, t0 = time.thread_time(), time.perf_counter()
            plan = sched.schedule(burst)
            t1, c1 = time.perf_counter(), time.thread_time()
            c_sched += c1 - c0
            ops = sched.prefix.take_copies() if sched.prefix is not None else ()
            sched.advance(plan)
            t_sched += t1 - t0
            t_apply += time.perf_counter() - t1
            _digest(h, plan, ops)
            copies += sum(op.num_pages + op.num_ckpts for op in ops)
            inflight.append(plan)
            steps += 1
            dispatched = True
        if dispatched and len(inflight) == 1:
            continue
        plan = inflight.popleft()
        sampled = rng.integers(1, vocab, max(plan.burst * plan.token_stride, plan.gdn_slots.shape[0]))
        t0 = time.perf_counter()
        sched.resolve(plan, sampled)
        t_apply += time.perf_counter() - t0
        for rid in dict.fromkeys(plan.request_ids):
            req = live.get(rid)
            if req is not None and req.status is Status.FINISHED and not req.pending:
                del live[rid]
                finished(index[rid], req.output_ids)
    return dict(steps=steps, t_sched=t_sched, c_sched=c_sched, t_apply=t_apply, copies=copies,
                digest=h.hexdigest()[:16], hits=sched.prefix_hit_tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the cpu preset's sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile one more host tier run: top functions")
    args = ap.parse_args(argv)
    from kvjax.experiments.prefix_runs import HOST_POLICY

    workload, setup, attention, vocab = _setup(args.small)
    for policy in ("timely+keep_tail", HOST_POLICY):
        runs = [run(workload, setup, attention, vocab, policy) for _ in range(args.repeats)]
        if len({r["digest"] for r in runs}) != 1:
            raise AssertionError(f"{policy}: repeats made other decisions")
        r, n = runs[0], runs[0]["steps"]
        ts = min(x["t_sched"] for x in runs)
        ta = min(x["t_apply"] for x in runs)
        tc = min(x["c_sched"] for x in runs)
        print(f"{policy:24s} steps {n:4d}  schedule {1e3 * ts / n:6.2f} ms/step ({ts:.3f} s; CPU {1e3 * tc / n:5.2f})"
              f"  advance+resolve {1e3 * ta / n:5.2f} ms/step  copies {r['copies']}  hits {r['hits']}"
              f"  digest {r['digest']}", flush=True)
    if args.profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        run(workload, setup, attention, vocab, HOST_POLICY)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
