"""The one timing module of the benchmarks: device time, wall clock, interleaved rounds, copy ceilings, errors.

Usage: ``from timing import wall_ms, device_ms`` (``benchmarks/`` on ``sys.path``; a module, not a script:
``runner.py`` and the subject modules import it). jax and torch are imported inside the functions, so the
torch-only anchor process (``runner.py --anchors-only``) imports it without jax and the jax process without torch.

Timers (every one warms up with two calls first, except where said):

- :func:`device_ms`: the profiler's kernel records (CUPTI via ``jax.profiler``): the sum of the durations of
  every kernel and device copy ``n`` calls ran, / n, as a CUDA-event or ``do_bench`` timing of one kernel sees
  it, without the launch gaps between back-to-back calls. ``None`` where the profiler has no device records
  (the CPU backend: the runner falls back to wall clock there).
- :func:`wall_ms`: wall clock over ``n`` back-to-back calls, waited on once at the end (launch gaps and host
  dispatch included), median over ``rounds``.
- :func:`torch_device_ms` / :func:`torch_wall_ms`: the same two timers on the torch side.
- :func:`interleaved`: several runners timed round-robin, so drifts (clocks, temperature) hit all of them
  alike; the median of the rounds.

Copy ceilings of the same run: :func:`xla_copy` (an XLA elementwise copy of exactly ``nbytes`` read + written)
and :func:`torch_copy` (a torch device-to-device copy, torch process). Bytes = read + written.
"""

from __future__ import annotations

import glob
import statistics
import tempfile
import time
from typing import Any, Callable

COPY_BYTES = 1 << 30  # the reference ceiling: 1 GiB read + written


def block(out: Any) -> None:
    """Wait until every array of ``out`` (a pytree) is computed."""
    import jax

    jax.block_until_ready(out)


def wall_ms(fn: Callable[[], Any], *, n: int = 20, rounds: int = 5, warmup: bool = True) -> float:
    """Median over ``rounds`` of the mean wall time (ms) of ``n`` back-to-back calls of ``fn()`` (which returns
    an array or pytree, waited on at the end of each round)."""
    if warmup:
        block(fn())
        block(fn())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn()
        block(out)
        times.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(times)


def has_device_records() -> bool:
    """Whether ``jax.profiler`` traces of this backend hold device kernel records (CUDA GPUs: CUPTI)."""
    import jax

    return jax.default_backend() == "gpu"


def device_ms(fn: Callable[[], Any], *, n: int = 20, warmup: bool = True) -> dict | None:
    """Device time per call of ``fn`` from the profiler's kernel records, or ``None`` without device records.

    Returns ``kernel_ms`` (sum of every kernel's and device copy's duration / n), ``span_ms`` (first start to
    last end / n: kernels plus the gaps between them) and ``kernels`` (record name -> count)."""
    if not has_device_records():
        return None
    if warmup:
        block(fn())
        block(fn())

    def calls():
        out = None
        for _ in range(n):
            out = fn()
        block(out)

    recs = kernel_records(calls)
    if not recs["names"]:
        return None
    return {"kernel_ms": recs["kernel_ns"] / n / 1e6, "span_ms": recs["span_ns"] / n / 1e6,
            "kernels": {name: c for name, (c, _) in recs["names"].items()}}


def kernel_records(run: Callable[[], Any]) -> dict:
    """The device records of whatever ``run()`` puts on the GPU, under ``jax.profiler`` (``run`` waits for its
    own work). Returns ``kernel_ns`` (sum of every kernel's and device copy's duration), ``span_ns`` (first
    start to last end) and ``names``: record name -> (count, total ns). Empty without device records."""
    import jax

    if not has_device_records():
        run()
        return {"kernel_ns": 0, "span_ns": 0, "names": {}}
    opts = jax.profiler.ProfileOptions()
    opts.enable_hlo_proto = False  # kernel records need no HLO (with it a trace passed 2 GB, HISTORY run 223)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, profiler_options=opts)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    total, starts, ends, names = 0, [], [], {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):  # per-stream activity; "XLA Ops"/"XLA Modules" restate it
                continue
            for ev in line.events:
                total += ev.duration_ns
                starts.append(ev.start_ns)
                ends.append(ev.start_ns + ev.duration_ns)
                c, t = names.get(ev.name, (0, 0))
                names[ev.name] = (c + 1, t + ev.duration_ns)
    return {"kernel_ns": total, "span_ns": (max(ends) - min(starts)) if ends else 0, "names": names}


def interleaved(runners: dict[str, Callable[[], Any]], *, rounds: int = 5, n: int = 20,
                device_rounds: int = 3) -> dict[str, dict]:
    """Time every runner round-robin: ``rounds`` rounds of :func:`wall_ms` (``n`` calls), then
    ``device_rounds`` rounds of :func:`device_ms`. Per name: ``wall_ms`` / ``device_ms`` (medians, ``None``
    without device records), ``wall_rounds`` / ``device_rounds`` and ``kernels`` (the device records' names).
    Every runner is warmed up once before the first round."""
    for fn in runners.values():
        block(fn())
        block(fn())
    walls: dict[str, list] = {name: [] for name in runners}
    devs: dict[str, list] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, fn in runners.items():
            walls[name].append(wall_ms(fn, n=n, rounds=1, warmup=False))
    for _ in range(device_rounds if has_device_records() else 0):
        for name, fn in runners.items():
            devs[name].append(device_ms(fn, n=n, warmup=False))
    out = {}
    for name in runners:
        recs = [d for d in devs[name] if d is not None]
        out[name] = {"wall_ms": statistics.median(walls[name]), "wall_rounds": walls[name],
                     "device_ms": statistics.median(d["kernel_ms"] for d in recs) if recs else None,
                     "device_rounds": [d["kernel_ms"] for d in recs],
                     "kernels": recs[0]["kernels"] if recs else {}}
    return out


def xla_copy(nbytes: int, *, n: int = 20) -> dict:
    """An XLA elementwise copy (``x + 1`` on f32) of ``nbytes`` read + written, timed like the kernels:
    ``{"bytes", "wall_ms", "device_ms" (None without device records)}``."""
    import jax
    import jax.numpy as jnp

    elems = max(nbytes // 8, 1024)  # f32: 4 bytes read + 4 written per element
    x = jax.random.normal(jax.random.key(0), (elems,), jnp.float32)
    add = jax.jit(lambda a: a + 1.0)
    times = interleaved({"copy": lambda: add(x)}, rounds=5, n=n)["copy"]
    return {"bytes": elems * 8, "wall_ms": times["wall_ms"], "device_ms": times["device_ms"]}


def torch_wall_ms(fn: Callable[[], Any], *, n: int = 20, rounds: int = 5) -> float:
    """:func:`wall_ms` for torch CUDA work: ``torch.cuda.synchronize`` instead of ``block_until_ready``;
    two warm-up calls."""
    import torch

    fn()
    fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(times)


def torch_device_ms(fn: Callable[[], Any], *, n: int = 20) -> dict:
    """The torch side of :func:`device_ms`: ``n`` calls under ``torch.profiler`` after two warm-up calls;
    ``kernel_ms`` = sum of the CUDA records' durations / n, ``kernels`` = their names."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    recs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernel_ms": sum(e.time_range.elapsed_us() for e in recs) / n / 1e3,
            "kernels": sorted({e.name for e in recs})}


def torch_time(fn: Callable[[], Any], *, n: int = 20) -> dict:
    """Both torch timers of ``fn``: ``{"wall_ms", "device_ms"}`` (the first call also runs any autotune)."""
    return {"wall_ms": torch_wall_ms(fn, n=n), "device_ms": torch_device_ms(fn, n=n)["kernel_ms"]}


def torch_copy(nbytes: int) -> dict:
    """A torch device-to-device copy of ``nbytes`` read + written (f32), both timers: ``{"bytes", "wall_ms",
    "device_ms"}``. Torch process only."""
    import torch

    x = torch.randn(max(nbytes // 8, 1024), device="cuda")
    y = torch.empty_like(x)
    return {"bytes": x.numel() * 8, **torch_time(lambda: y.copy_(x))}


def rel_err(a, b) -> float:
    """Relative L2 error ``|a - b| / |b|`` in float64 (``nan`` if ``a`` holds a non-finite value)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
