"""Engine benchmark case: the ``python -m kvjax run --preset gpu`` workload served with ``recycle="none"`` and
``"timely"`` (same model, same page memory, one shared compiled step), with per-step timing.

Usage: ``python benchmarks/runner.py engine`` (one accelerator; kernels ``impl="auto"``).

Per run (one row each, ``impl`` = the recycle policy; the anchor is ``recycle=none``): ``median_ms`` = the
median step time; generated tokens/s in the steady state (steps that compiled are left out), the exposed host
time (host work while the device had nothing queued: ``host_share``) and the total host time
(``host_total_share``, everything but ``t_wait``, the time the host blocks on the device's tokens), and whether
both runs generated identical tokens (``identical``, on the timely row). The engine overlaps host and device
(``overlap=True``, the default). Each run stops at its deadline (``truncated``); ``ok`` = the cache passed its integrity
check after the run.
"""

from __future__ import annotations

import dataclasses
import time

from case import RunCase

BUDGET_S = 270.0  # both runs together; the first gets 55%


def divergence(a: list[list[int]], b: list[list[int]]) -> dict:
    """How two runs' outputs differ: identical requests, and where the first differing token sits."""
    import numpy as np

    firsts = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
    diverged = [f for f in firsts if f is not None]
    return dict(requests=len(a), identical_requests=len(a) - len(diverged),
                first_divergence_min=min(diverged, default=None),
                first_divergence_median=float(np.median(diverged)) if diverged else None)


def serve(model, workload, cache, p, recycle: str, deadline: float) -> tuple[list, dict]:
    """Serve ``workload`` once; returns (generated tokens per request, the engine's metrics summary)."""
    from kvjax.engine.engine import Engine

    eng = Engine(model, cache, recycle=recycle, max_num_batched_tokens=p.max_tokens, token_buckets=p.token_buckets,
                 row_buckets=p.row_buckets, block_buckets=(cache.max_blocks_per_seq,))
    outs = [[] for _ in workload]
    truncated = False
    t0 = time.perf_counter()
    stream = eng.stream([w.prompt for w in workload], [w.max_new_tokens for w in workload], progress=False)
    for ev in stream:
        outs[ev.index].append(ev.token)
        if time.perf_counter() > deadline:
            truncated = True
            stream.close()
            break
    s = eng.metrics.summary(num_pages=cache.num_pages)
    s.update(wall_s=time.perf_counter() - t0, truncated=truncated, idle_after=eng.is_idle())
    try:
        eng.check_integrity()
        s["integrity"] = True
    except Exception as e:  # noqa: BLE001 - reported in the row
        s["integrity"] = f"{type(e).__name__}: {e}"[:300]
    return outs, s


def measure(p, budget_s: float, recycles: tuple[str, ...] = ("none", "timely")) -> list[dict]:
    """The runs of preset ``p``; one row per recycle policy."""
    from kvjax.cli_run import build_model
    from kvjax.sched.workload import cache_for, seed_workload

    t_start = time.perf_counter()
    workload = seed_workload(p.requests, scale=p.scale, vocab=p.vocab, seed=0)
    cache = cache_for(workload, num_kv_heads=p.kv_heads, page_size=p.page_size, full_requests=p.memory_requests,
                      max_seqs=p.max_seqs)
    model = build_model(p)
    outs, rows = {}, []
    for i, recycle in enumerate(recycles):
        deadline = t_start + budget_s * (0.55 if i == 0 else 1.0)
        outs[recycle], s = serve(model, workload, cache, p, recycle, deadline)
        rows.append(dict(impl=f"recycle={recycle}", median_ms=1e3 * s["step_time_median_s"],
                         ok=s["integrity"] is True, error=None if s["integrity"] is True else s["integrity"],
                         tokens_per_s=s["generated_tokens_per_s"], num_pages=cache.num_pages, metrics=s))
        print(recycle, {k: v for k, v in s.items() if not isinstance(v, (list, dict))}, flush=True)
    if len(rows) < 2:
        return rows
    full = not any(r["metrics"]["truncated"] for r in rows)
    rows[1].update(identical=(outs["none"] == outs["timely"]) if full else None,
                   divergence=divergence(outs["none"], outs["timely"]) if full else None,
                   gain_tokens_per_s=rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    return rows


def cases(small: bool = False) -> list[RunCase]:
    """The gpu preset, both policies (``small``: the cpu preset cut to 2 requests of a few tokens and 2 layers,
    ``recycle="none"`` only: a smoke run)."""
    from kvjax.cli_run import PRESETS

    if small:
        p = dataclasses.replace(PRESETS["cpu"], requests=2, scale=0.002, layer_types=("linear_attention",
                                "full_attention"), token_buckets=(16,), max_tokens=16)
    else:
        p = PRESETS["gpu"]
    shapes = dict(preset="small" if small else "gpu", requests=p.requests, dtype=p.dtype, layers=len(p.layer_types))
    recycles = ("none",) if small else ("none", "timely")
    return [RunCase(f"engine {shapes['preset']} preset", "kvjax.engine.engine.Engine", shapes,
                    lambda: measure(p, 60.0 if small else BUDGET_S, recycles), anchor="recycle=none")]
