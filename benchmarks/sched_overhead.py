"""Host overhead of planning one step with 256 running (decoding) requests.

Builds a scheduler whose 256 requests have all finished prefill, then times ``schedule()`` (recycle policy,
page allocation, plan build) and, separately, ``update()``, over many steps; prints medians.
Run: ``python benchmarks/sched_overhead.py [--json]``. Target: schedule() < 2 ms median on the 2-core CI host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.sched.scheduler import Scheduler


def build(num_requests: int, prompt_len: int, recycle: str, pool: str, swa_fraction: float) -> Scheduler:
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


def time_steps(sched: Scheduler, steps: int) -> tuple[list[float], list[float], list[float], int]:
    """Wall and CPU (thread) time of ``schedule()``, wall time of ``update()``, max rows."""
    rng = np.random.default_rng(1)
    t_sched, c_sched, t_update, rows = [], [], [], 0
    for _ in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        plan = sched.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        sampled = rng.integers(1, 32000, plan.gdn_slots.shape[0])
        t2 = time.perf_counter()
        sched.update(plan, sampled)
        t3 = time.perf_counter()
        t_sched.append(t1 - t0)
        c_sched.append(c1 - c0)
        t_update.append(t3 - t2)
        rows = max(rows, plan.num_seqs)
    return t_sched, c_sched, t_update, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for recycle, pool, swa in (("none", "shared", 0.5), ("timely", "shared", 0.5), ("timely", "partitioned", 0.5)):
        sched = build(args.requests, args.prompt_len, recycle, pool, swa)
        time_steps(sched, 20)  # warm-up
        ts, cs, tu, rows = time_steps(sched, args.steps)
        results.append(dict(recycle=recycle, pool=pool, swa_fraction=swa, rows=rows, steps=args.steps,
                            schedule_ms_median=1e3 * float(np.median(ts)), schedule_ms_p90=1e3 * float(np.percentile(ts, 90)),
                            schedule_cpu_ms_median=1e3 * float(np.median(cs)), update_ms_median=1e3 * float(np.median(tu))))
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps(dict(host=platform.machine(), cpus=os.cpu_count(), load_avg_1min=load, results=results),
                         indent=2))
        return
    print(f"# {os.cpu_count()} CPUs, 1-min load average {load:.1f} (wall-clock p90 suffers when the host is shared)")
    print(f"{'recycle':8} {'pool':12} {'rows':>5} {'schedule ms median':>19} {'p90':>7} {'cpu ms median':>14} "
          f"{'update ms':>10}")
    for r in results:
        print(f"{r['recycle']:8} {r['pool']:12} {r['rows']:5d} {r['schedule_ms_median']:19.3f} "
              f"{r['schedule_ms_p90']:7.3f} {r['schedule_cpu_ms_median']:14.3f} {r['update_ms_median']:10.3f}")


if __name__ == "__main__":
    main()
