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
