"""Pieces shared by the Mosaic GPU kernels: swizzled shared-memory tiling, register layouts that exist only when
compiled, the interpreter's thread requirement, and the producer loop of a shared-memory ring.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE = 128  # bytes: the widest shared-memory swizzle, what TMA copies and wgmma operands use here
INTERPRET_MIN_THREADS = 4  # two consumer warpgroups + the producer + the grid loop's blocked callback


def swizzled(dtype) -> tuple:
    """Shared-memory transforms of a 2-D tile of ``dtype``: ``(8, 128 B)`` tiles, 128-byte swizzle."""
    return plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(SWIZZLE)


def cast(x: jax.Array, layout, interpret: bool) -> jax.Array:
    """``x`` in register ``layout`` when compiled; unchanged in the interpreter (which has no layouts)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(shape: tuple[int, ...], dim: int, interpret: bool) -> jax.Array:
    """i32 iota along ``dim`` in the wgmma accumulator layout (a plain iota in the interpreter)."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def interpret_params():
    """Parameters of the Mosaic GPU interpreter on the CPU; raises if the XLA CPU thread pool is too small.

    The interpreter runs each warpgroup as a computation on XLA's CPU thread pool and blocks those threads in
    barrier waits, so it needs at least ``INTERPRET_MIN_THREADS`` of them (the pool is sized by the ``NPROC``
    environment variable, else the CPU count, when JAX creates its CPU client; with 2 it can deadlock).
    """
    nproc = os.environ.get("NPROC")
    if nproc and nproc.isdigit():
        threads = int(nproc)
    elif hasattr(os, "sched_getaffinity"):
        threads = len(os.sched_getaffinity(0))
    else:
        threads = os.cpu_count() or 1
    if threads < INTERPRET_MIN_THREADS:
        raise RuntimeError(
            f"the Mosaic GPU interpreter needs an XLA CPU thread pool of >= {INTERPRET_MIN_THREADS} threads "
            f"(it blocks one per warpgroup), this process has {threads}: set NPROC={2 * INTERPRET_MIN_THREADS} "
            "in the environment before JAX starts"
        )
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # CPU interpreter only

    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


def produce_ring(n_steps: jax.Array, stages: int, issue, free_barriers: tuple) -> None:
    """A producer warpgroup's walk over ``n_steps`` steps through ``stages`` shared-memory slots.

    ``issue(i, slot)`` fills (or only signals) ``slot`` with step ``i``: the first ``stages`` steps at once, then
    step ``i + stages`` once every barrier of ``free_barriers`` (each ``[stages]``) released step ``i``'s slot.
    The last ``stages`` releases are waited too, so every phase of the free barriers is observed before exit.
    """
    for i in range(stages):
        pl.when(i < n_steps)(functools.partial(issue, jnp.int32(i), i))

    def wait_free(i):
        slot = lax.rem(i, jnp.int32(stages))
        for free in free_barriers:
            plgpu.barrier_wait(free.at[slot])
        return slot

    @pl.loop(0, jnp.maximum(n_steps - stages, 0))
    def _(i):
        issue(i + stages, wait_free(i))

    @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
    def _(i):
        wait_free(i)
