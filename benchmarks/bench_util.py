"""Timing and error helpers shared by the benchmark scripts (run as ``python benchmarks/<name>.py``, which puts
this folder on ``sys.path``). jax is imported inside the functions: the torch-only halves of the scripts import
this module too."""

from __future__ import annotations

import statistics
import time


def time_ms(fn, *, n: int = 20, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean time (ms) of ``n`` back-to-back async calls; ``fn()`` returns an array
    (or pytree) that is waited on at the end of each round. Two warm-up calls first."""
    import jax

    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(times)


def rel_err(a, b) -> float:
    """Relative L2 error ``|a - b| / |b|`` in float64."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def jax_copy_ceiling() -> dict:
    """Copy-bandwidth ceiling as JAX sees it on 1 GiB of f32 (bytes = read + written): XLA elementwise ``x + 1``
    and a Pallas (Triton) block copy kernel, both timed with :func:`time_ms`. Keys: ``bytes``,
    ``xla_add_ms`` / ``_gbps``, ``pallas_copy_ms`` / ``_gbps``, ``pallas_copy_ok`` (the copy equals its input)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    n = 256 * 1024 * 1024
    x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), jnp.float32)
    add = jax.jit(lambda a: a + 1.0)
    ms_xla = time_ms(lambda: add(x))

    def copy_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    rows = 8
    pcopy = jax.jit(lambda a: pl.pallas_call(
        copy_kernel, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), grid=(a.shape[0] // rows,),
        in_specs=[pl.BlockSpec((rows, 4096), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows, 4096), lambda i: (i, 0)),
        compiler_params=plt.CompilerParams(num_warps=8, num_stages=1))(a))
    ms_pl = time_ms(lambda: pcopy(x))
    ok = bool(jnp.array_equal(pcopy(x), x))
    nbytes = 2 * n * 4
    return {"bytes": nbytes, "xla_add_ms": ms_xla, "xla_add_gbps": nbytes / ms_xla / 1e6,
            "pallas_copy_ms": ms_pl, "pallas_copy_gbps": nbytes / ms_pl / 1e6, "pallas_copy_ok": ok}


def device_ms(fn, *, n: int = 20) -> dict:
    """Device time per call of ``fn`` from the profiler's (CUPTI) kernel records, the way a CUDA-event or
    ``do_bench`` timing of a single kernel sees it, without the launch gaps between back-to-back calls.

    Two warm-up calls, then ``n`` calls under ``jax.profiler``. Returns ``kernel_ms`` (sum of the durations of
    every kernel and device copy the calls ran, / n), ``span_ms`` (first start to last end, / n: kernels plus
    the gaps between them) and ``kernels`` (name -> count)."""
    import glob
    import tempfile

    import jax

    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(n):
            out = fn()
        jax.block_until_ready(out)
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
                names[ev.name] = names.get(ev.name, 0) + 1
    if not names:
        raise RuntimeError("no GPU kernel records in the profile (is this a GPU backend?)")
    return {"kernel_ms": total / n / 1e6, "span_ms": (max(ends) - min(starts)) / n / 1e6, "kernels": names}


def torch_device_ms(fn, *, n: int = 20) -> dict:
    """The torch side of :func:`device_ms`: ``fn()`` (torch CUDA work) called ``n`` times under
    ``torch.profiler``; ``kernel_ms`` = sum of the CUDA records' durations (kernels and device copies) / n,
    ``kernels`` = their names. The caller warms up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    recs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernel_ms": sum(e.time_range.elapsed_us() for e in recs) / n / 1e3,
            "kernels": sorted({e.name for e in recs})}
