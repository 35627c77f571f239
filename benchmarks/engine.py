"""Engine benchmark cases (issue #18): the per-step profile and the end-to-end gpu-preset run, each with the
synchronous (``overlap=False``), the overlapped and the overlapped engine with decode bursts (``decode_burst=8``
and ``16``: up to that many decode sub-steps per dispatch) side by side.

Usage: ``python benchmarks/runner.py engine`` (one accelerator; kernels ``impl="auto"``); ``--cases "engine steps"``
or ``--cases "engine gpu"`` for one of the two.

``engine steps`` (:func:`step_rows`): the gpu preset's toy Qwen3.5 (8 layers, 6 GDN + 2 attention, bf16),
``recycle="timely"``, steady decode at 16 / 64 / 256 rows (every row decoding, 512-token prompts) and chunked-prefill
steps (16 prompts of 4096, 2048 tokens per step). Per row: wall per step, the engine's host phases (schedule,
inputs, dispatch, update; total host = step minus the wait for tokens), the exposed host time (the device had
nothing queued), and, from the profiler over as many further steps, the GPU kernel time per step, kernels per
step and the kernels by name (``top_kernels``); GPU busy = kernel time / wall; the decode bytes floor (every
parameter once, each row's GDN state read and written, the K/V its heads attend) at the run's copy rate. A
burst row's figures are per engine step (``burst`` sub-steps); ``*_per_substep`` and ``kernel_vs_floor`` are per
sub-step.

``engine gpu preset`` (:func:`measure`): the ``python -m kvjax run --preset gpu`` workload served with
``recycle="none"`` and ``"timely"``, each synchronous, overlapped and with bursts (same model, same page memory):
generated tokens/s in the steady state (compile steps left out), median step, exposed and total host shares,
whether the tokens equal the anchor run's (``identical``; anchor ``recycle=none overlap=off``) and the same
policy's synchronous run's (``identical_to_sync``). Each run stops at its deadline (``truncated``); ``ok`` = the
cache passed its integrity check after the run.
"""

from __future__ import annotations

import dataclasses
import gc
import time

from case import RunCase

BUDGET_S = 280.0  # all runs together, an equal share each
MODES = ((False, 1), (True, 1), (True, 8), (True, 16))  # (overlap, decode burst) of each steps row
E2E_MODES = ((False, 1), (True, 1), (True, "auto"), (True, 16))  # ... of each gpu-preset row ("auto": the default)
SETTLE = 4  # untimed steps between the garbage collection and a timed window


def mode_name(overlap: bool, burst: int | str) -> str:
    """A row's engine mode in its name: ``overlap=on|off``, `` burst=K`` (or ``auto``) for decode bursts."""
    return f"overlap={'on' if overlap else 'off'}" + (f" burst={burst}" if burst != 1 else "")


def divergence(a: list[list[int]], b: list[list[int]]) -> dict:
    """How two runs' outputs differ: identical requests, and where the first differing token sits."""
    import numpy as np

    firsts = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
    diverged = [f for f in firsts if f is not None]
    return dict(requests=len(a), identical_requests=len(a) - len(diverged),
                first_divergence_min=min(diverged, default=None),
                first_divergence_median=float(np.median(diverged)) if diverged else None)


def serve(model, workload, cache, p, recycle: str, deadline: float, overlap: bool = True,
          burst: int | str = 1) -> tuple[list, dict]:
    """Serve ``workload`` once; returns (generated tokens per request, the engine's metrics summary)."""
    from kvjax.engine.engine import Engine

    eng = Engine(model, cache, recycle=recycle, overlap=overlap, max_num_batched_tokens=p.max_tokens,
                 token_buckets=p.token_buckets, row_buckets=p.row_buckets, block_buckets=(cache.max_blocks_per_seq,),
                 decode_burst=burst)
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


def measure(p, budget_s: float, recycles: tuple[str, ...] = ("none", "timely"),
            modes: tuple[tuple[bool, int | str], ...] = E2E_MODES) -> list[dict]:
    """The runs of preset ``p``: one row per (recycle policy, (overlap, decode burst)), each with its own engine;
    the first run (``recycle=none``, synchronous) is the anchor every row's tokens are compared with."""
    from kvjax.cli.run import build_model
    from kvjax.sched.workload import cache_for, seed_workload

    t_start = time.perf_counter()
    workload = seed_workload(p.requests, scale=p.scale, vocab=p.vocab, seed=0)
    cache = cache_for(workload, num_kv_heads=p.kv_heads, page_size=p.page_size, full_requests=p.memory_requests,
                      max_seqs=p.max_seqs)
    model = build_model(p)
    runs = [(r, o, k) for r in recycles for o, k in modes]
    outs, rows = [], []
    for i, (recycle, overlap, burst) in enumerate(runs):
        deadline = t_start + budget_s * (i + 1) / len(runs)
        out, s = serve(model, workload, cache, p, recycle, deadline, overlap, burst)
        full = not s["truncated"] and (not rows or not rows[0]["metrics"]["truncated"])
        name = f"recycle={recycle} {mode_name(overlap, burst)}"
        sync = next((j for j, (r, o, _) in enumerate(runs[:i]) if r == recycle and not o), None) if overlap else None
        if sync is not None and (s["truncated"] or rows[sync]["metrics"]["truncated"]):
            sync = None  # one of the two runs stopped at its deadline: nothing to compare
        rows.append(dict(impl=name, median_ms=1e3 * s["step_time_median_s"], ok=s["integrity"] is True,
                         error=None if s["integrity"] is True else s["integrity"],
                         tokens_per_s=s["generated_tokens_per_s"], num_pages=cache.num_pages, metrics=s,
                         identical=(out == outs[0]) if outs and full else None,
                         divergence=divergence(outs[0], out) if outs and full else None,
                         identical_to_sync=(out == outs[sync]) if sync is not None else None,
                         gain_tokens_per_s=s["generated_tokens_per_s"] / rows[0]["tokens_per_s"] if rows else 1.0))
        outs.append(out)
        print(name, {k: v for k, v in s.items() if not isinstance(v, (list, dict))}, flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- step profile

STEP_ROWS = (16, 64, 256)  # decoding rows of the steady-decode profile (issue #18)
PROMPT_LEN = 512  # tokens each decoding row has before the profile
PREFILL = dict(rows=16, prompt_len=4096, budget=2048, steps=8)  # chunked-prefill steps: 16 prompts of 4096,
# 2048 tokens a step, 8 steps timed and 8 profiled


def _step_engine(p, rows: int, *, overlap: bool, prompt_len: int, new_tokens: int, budget: int, burst: int = 1):
    """An engine on the preset's model with ``rows`` requests of ``prompt_len`` random tokens queued."""
    import numpy as np

    from kvjax.config import CacheConfig
    from kvjax.engine.engine import Engine

    model = _model(p)
    blocks = -(-(prompt_len + new_tokens) // p.page_size)
    cache = CacheConfig(page_size=p.page_size, num_pages=rows * p.kv_heads * blocks, max_seqs=rows,
                        max_blocks_per_seq=blocks)
    eng = Engine(model, cache, overlap=overlap, recycle="timely", max_num_batched_tokens=budget,
                 token_buckets=sorted({rows, budget}), row_buckets=(rows,), block_buckets=(blocks,),
                 decode_burst=burst)
    rng = np.random.default_rng(0)
    for i in range(rows):
        eng.add_request(rng.integers(0, p.vocab, prompt_len), new_tokens, index=i)
    return model, eng


_MODELS: dict = {}  # preset -> model: the profile's engines share one model (this script's own cache)


def _model(p):
    from kvjax.cli.run import build_model

    if p not in _MODELS:
        _MODELS[p] = build_model(p)
    return _MODELS[p]


def floor_bytes(model, eng) -> dict:
    """Bytes one decode step of ``eng``'s running rows must move: every parameter once, each row's GDN state
    read and written (SSM f32 + conv), and the K/V each row's heads attend (full heads: the whole context; SWA
    heads: window + sinks)."""
    import jax
    import numpy as np
    from flax import nnx

    params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    c = model.config
    g, a = c.gdn, c.attention
    itemsize = np.dtype(eng.caches.gdn.conv.dtype).itemsize
    state = len(c.gdn_layers) * 2 * (g.num_v_heads * g.head_k_dim * g.head_v_dim * 4
                                     + g.conv_dim * (g.conv_kernel_size - 1) * itemsize)
    lens = np.array([r.num_tokens for r in eng.scheduler.running], np.int64)
    kv = 0
    for w, s in zip(a.window, a.sinks):
        seen = lens if w == 0 else np.minimum(lens, w + s)
        kv += int(seen.sum()) * 2 * a.head_dim * itemsize * len(c.attention_layers)
    return dict(params=params, state=state * len(lens), kv=kv, total=params + state * len(lens) + kv)


def _run_steps(eng, n: int) -> list:
    """``n`` engine steps; the metrics records they appended (steps resolved in the window)."""
    k = len(eng.metrics)
    for _ in range(n):
        eng.step()
    return eng.metrics.records[k:]


def profile_steps(eng, n: int, *, want) -> dict:
    """Time ``n`` steps of ``eng`` once the next steps match ``want(record)`` (steady decode / chunked prefill):
    wall per step (mean, median and longest of the ``n`` step calls) and the host phases from the engine's own
    records (no profiler running), then ``n`` more steps under the profiler for the GPU kernel time, kernels per
    step and the kernels by name."""
    import statistics

    import jax
    from timing import kernel_records

    for _ in range(400):  # reach the steady phase and compile its bucket
        recs = _run_steps(eng, 3)
        if len(recs) >= 2 and all(want(r) and not r.compiled for r in recs[-2:]):
            break
    else:
        raise RuntimeError("the engine never reached the profiled phase")
    gc.collect()  # the engines of earlier rows: not collected inside the timed window
    _run_steps(eng, SETTLE)  # the device idled during the collection: the first step after it runs slow
    k, walls = len(eng.metrics), []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    recs = eng.metrics.records[k:]
    wall = sum(walls) / n
    if not all(want(r) for r in recs) or any(r.compiled for r in recs):
        raise RuntimeError(f"steps left the profiled phase or compiled: {[(r.num_tokens, r.compiled) for r in recs]}")
    med = lambda f: statistics.median(getattr(r, f) for r in recs)  # noqa: E731
    host = statistics.median(r.t_step - r.t_wait for r in recs)
    kr = kernel_records(lambda: (_run_steps(eng, n), jax.block_until_ready(eng.caches)))
    names = sorted(((c / n, t / n / 1e6, name) for name, (c, t) in kr["names"].items()), key=lambda x: -x[1])
    return dict(wall_ms=1e3 * wall, wall_median_ms=1e3 * statistics.median(walls), wall_max_ms=1e3 * max(walls),
                walls_ms=[round(1e3 * w, 3) for w in walls],
                host_ms=1e3 * host, exposed_ms=1e3 * med("t_exposed"),
                schedule_ms=1e3 * med("t_schedule"), inputs_ms=1e3 * med("t_inputs"),
                dispatch_ms=1e3 * med("t_dispatch"), update_ms=1e3 * med("t_update"), wait_ms=1e3 * med("t_wait"),
                tokens=statistics.median(r.num_tokens for r in recs), rows=statistics.median(r.num_seqs for r in recs),
                kernel_ms=kr["kernel_ns"] / n / 1e6 if kr["names"] else None,
                kernels_per_step=sum(c for c, _ in kr["names"].values()) / n if kr["names"] else None,
                top_kernels=[dict(name=nm[:120], per_step=round(c, 2), ms=round(t, 5)) for c, t, nm in names[:80]])


def step_rows(p, rows_list=STEP_ROWS, n: int = 30, prefill: dict | None = PREFILL,
              modes: tuple[tuple[bool, int], ...] = MODES) -> list[dict]:
    """The issue-#18 table: steady decode at each of ``rows_list`` and chunked-prefill steps, the synchronous
    engine, the overlapped one and the overlapped one with decode bursts side by side (same model, same
    requests; a burst step's figures are per engine step, ``*_per_substep`` divides by its sub-steps)."""
    from timing import has_device_records, xla_copy

    copy = xla_copy(1 << 30) if has_device_records() else None
    gbps = copy["bytes"] / copy["device_ms"] / 1e6 if copy and copy["device_ms"] else None
    out = []
    for rows in rows_list:
        for overlap, burst in modes:
            model, eng = _step_engine(p, rows, overlap=overlap, prompt_len=PROMPT_LEN,
                                      new_tokens=burst * (4 * n + 100) + 300, budget=max(1024, rows), burst=burst)
            prof = profile_steps(eng, n, want=lambda r, rows=rows, k=burst: r.decode_only and r.num_seqs == rows
                                 and r.burst == k)
            fl = floor_bytes(model, eng)
            name = f"decode rows={rows} {mode_name(overlap, burst)}"
            out.append(_row(name, prof, fl, gbps, burst))
            del eng
    if prefill:
        for overlap in (False, True):
            model, eng = _step_engine(p, prefill["rows"], overlap=overlap, prompt_len=prefill["prompt_len"],
                                      new_tokens=8, budget=prefill["budget"])
            prof = profile_steps(eng, prefill.get("steps", 4),
                                 want=lambda r: not r.decode_only and r.num_tokens == prefill["budget"])
            out.append(_row(f"chunked prefill {prefill['budget']} tokens/step {mode_name(overlap, 1)}",
                            prof, None, gbps))
            del eng
    return out


def _row(impl: str, prof: dict, fl: dict | None, gbps: float | None, burst: int = 1) -> dict:
    floor_ms = fl["total"] / gbps / 1e6 if fl and gbps else None  # one (sub-)step's
    k = prof["kernel_ms"]
    row = dict(impl=impl, median_ms=prof["wall_ms"], ok=True, **prof, floor_bytes=fl, copy_gbps=gbps,
               floor_ms=floor_ms, gpu_busy=k / prof["wall_ms"] if k else None, burst=burst,
               wall_ms_per_substep=prof["wall_ms"] / burst, host_ms_per_substep=prof["host_ms"] / burst,
               kernel_ms_per_substep=k / burst if k else None,
               kernel_vs_floor=k / burst / floor_ms if k and floor_ms else None,
               exposed_share=prof["exposed_ms"] / prof["wall_ms"])
    print(f"{impl:45s} wall {prof['wall_ms']:7.3f} ms (median {prof['wall_median_ms']:.3f}, "
          f"max {prof['wall_max_ms']:.3f})  host {prof['host_ms']:6.3f}  exposed {prof['exposed_ms']:6.3f}"
          f"  kernels {k if k is None else round(k, 3)} ms x {prof['kernels_per_step']}/step"
          f"  busy {row['gpu_busy'] and round(row['gpu_busy'], 3)}  floor {floor_ms and round(floor_ms, 3)} ms",
          flush=True)
    return row


def cases(small: bool = False) -> list[RunCase]:
    """The gpu preset, both policies (``small``: the cpu preset cut to 2 requests of a few tokens and 2 layers,
    ``recycle="none"`` only: a smoke run)."""
    from kvjax.cli.run import PRESETS

    if small:
        p = dataclasses.replace(PRESETS["cpu"], requests=2, scale=0.002, layer_types=("linear_attention",
                                "full_attention"), token_buckets=(16,), max_tokens=16)
    else:
        p = PRESETS["gpu"]
    shapes = dict(preset="small" if small else "gpu", requests=p.requests, dtype=p.dtype, layers=len(p.layer_types))
    recycles = ("none",) if small else ("none", "timely")
    steps = dict(rows_list=(4,), n=3, prefill=dict(rows=2, prompt_len=256, budget=32)) if small else {}
    modes = ((False, 1), (True, 1), (True, 2)) if small else MODES
    e2e = ((False, 1), (True, 1), (True, "auto")) if small else E2E_MODES
    return [RunCase(f"engine steps {shapes['preset']} preset", "kvjax.engine.engine.Engine.step", shapes,
                    lambda: step_rows(p, modes=modes, **steps), anchor=None),
            RunCase(f"engine {shapes['preset']} preset", "kvjax.engine.engine.Engine", shapes,
                    lambda: measure(p, 60.0 if small else BUDGET_S, recycles, e2e),
                    anchor="recycle=none overlap=off")]
