"""Scheduler host overhead case: the host work of one decode step at 16, 64 and 256 running requests (numpy only,
host CPU).

Usage: ``python benchmarks/runner.py sched_overhead``. Target (issue #18): schedule + update < 0.5 ms per step
at 256 rows.

Builds a scheduler whose requests have all finished prefill (8 KV heads, 50% SWA with window 1024, pages of 64,
~2.1k-token contexts), then times ``schedule()`` (recycle policy, page allocation, plan build) and ``update()``
(advance + resolve) over many steps after 20 warm-up steps. One case per row count, one row per (recycle, pool,
decode burst) variant; ``median_ms`` = the wall-clock median of ``schedule() + update()`` per step, with each
half's median, the schedule p90 and its thread CPU time (the wall p90 suffers on a shared host); the burst row's
figures are per burst of 8 sub-steps (``median_ms_per_sub_step`` divides); the anchor is ``recycle=none`` on the
shared pool. (``Runner.pack``, the host part of the step's inputs, is not timed here.)
"""

from __future__ import annotations

import os
import time

from case import RunCase

VARIANTS = (("none", "shared", 1), ("timely", "shared", 1), ("timely", "partitioned", 1), ("timely", "shared", 8))
# (recycle, pool, decode burst): the last row plans decode bursts of 8 (``schedule(8)``), its times per burst


def build(num_requests: int, prompt_len: int, recycle: str, pool: str, swa_fraction: float = 0.5):
    """A scheduler whose ``num_requests`` requests of ``prompt_len`` tokens have all finished prefill."""
    import numpy as np

    from kvjax.config import AttentionConfig, CacheConfig
    from kvjax.sched.scheduler import Scheduler

    attention = AttentionConfig.with_swa_fraction(32, 8, 128, swa_fraction=swa_fraction, window=1024, sinks=4)
    page_size, max_len = 64, prompt_len + 4096
    blocks = -(-max_len // page_size)
    cache = CacheConfig(page_size=page_size, num_pages=num_requests * attention.num_kv_heads * blocks,
                        max_seqs=num_requests, max_blocks_per_seq=blocks)
    sched = Scheduler(cache, attention, max_num_batched_tokens=8192, pool=pool, recycle=recycle)
    rng = np.random.default_rng(0)
    for _ in range(num_requests):
        sched.add_request(rng.integers(1, 32000, prompt_len), 4096)
    while any(r.num_computed < r.num_tokens - 1 for r in sched.running) or sched.waiting:
        plan = sched.schedule()
        sched.update(plan, rng.integers(1, 32000, plan.gdn_slots.shape[0]))
    return sched


def time_steps(sched, steps: int, burst: int = 1) -> dict:
    """Wall medians (ms) of ``schedule(burst)``, ``update()`` and both per step, the schedule p90 and CPU time;
    rows, and the plans' sub-steps (a burst plan samples ``burst`` tokens per row)."""
    import numpy as np

    rng = np.random.default_rng(1)
    t_sched, c_sched, t_update, t_step, rows, sub = [], [], [], [], 0, 1
    for _ in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        plan = sched.schedule(burst)
        t1, c1 = time.perf_counter(), time.thread_time()
        sampled = rng.integers(1, 32000, plan.gdn_slots.shape[0] * plan.burst)
        t2 = time.perf_counter()
        sched.update(plan, sampled)
        t3 = time.perf_counter()
        t_update.append(t3 - t2)
        t_sched.append(t1 - t0)
        t_step.append(t3 - t2 + t1 - t0)
        c_sched.append(c1 - c0)
        rows, sub = max(rows, plan.num_seqs), max(sub, plan.burst)
    ms = lambda xs, q=50: 1e3 * float(np.percentile(xs, q))  # noqa: E731
    return dict(rows=rows, steps=steps, sub_steps=sub, median_ms=ms(t_step), schedule_ms=ms(t_sched),
                schedule_p90_ms=ms(t_sched, 90), schedule_cpu_ms=ms(c_sched), update_ms=ms(t_update),
                median_ms_per_sub_step=ms(t_step) / sub)


def measure(requests: int, prompt_len: int, steps: int) -> list[dict]:
    """One row per (recycle, pool) variant."""
    out = []
    for recycle, pool, burst in VARIANTS:
        sched = build(requests, prompt_len, recycle, pool)
        time_steps(sched, 20, burst)  # warm-up
        name = f"recycle={recycle} pool={pool}" + (f" burst={burst}" if burst > 1 else "")
        row = dict(impl=name, ok=True, load_avg_1min=os.getloadavg()[0], **time_steps(sched, steps, burst))
        print(row, flush=True)
        out.append(row)
    return out


def cases(small: bool = False) -> list[RunCase]:
    """16, 64 and 256 requests of 2048 tokens over 300 steps each (``small``: 8 requests of 64 tokens, 5 steps)."""
    sizes, prompt_len, steps = ((8,), 64, 5) if small else ((16, 64, 256), 2048, 300)
    return [RunCase(f"scheduler overhead {n} requests", "kvjax.sched.scheduler.Scheduler.schedule",
                    dict(requests=n, prompt_len=prompt_len, kv_heads=8, swa_fraction=0.5, page=64,
                         cpus=os.cpu_count()),
                    lambda n=n: measure(n, prompt_len, steps), anchor="recycle=none pool=shared")
            for n in sizes]
