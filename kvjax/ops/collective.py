"""The sum of a tensor-parallel partial product over a mesh axis (the row-parallel projections' all-reduce).

Normalised call (the table's functions), inside ``shard_map`` with ``axis`` bound::

    all_reduce: fn(x, *, axis, size)   # x [...] this device's partial sum; size = the axis's device count
        -> [...] in x's dtype: the sum over the axis on every device

Reference = XLA's ``lax.psum`` (its own collective kernel on GPUs, what the models used before this op). Backend
``"mosaic"`` = :func:`kvjax.pallas.collective.allreduce_mgpu.all_reduce_mgpu`, a one-shot kernel in which each
device reads its peers' partial sums over NVLink and adds them in float32 in device order (the same bits on every
device); compiled only (``interpretable=False``: the Mosaic GPU interpreter of jax 0.10 has no cross-device
semaphores), on Hopper. ``auto`` takes it where it was measured ahead of ``psum`` (:func:`prefer_mosaic`: a mesh
of two devices, up to 32 MiB a device, one process; on four it was level or slower: RESULTS.md, "Many GPUs"), XLA's
``psum`` elsewhere and on every other device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.ops.backends import Backend, BackendTable, on_hopper
from kvjax.pallas.collective import allreduce_mgpu

ALL_REDUCE_OP = "all_reduce"
MOSAIC_MAX_BYTES = 32 << 20  # auto takes the one-shot kernel up to this many bytes a device (the largest measured)


def all_reduce_reference(
    x: jax.Array,  # [...]
    *,
    axis: str,
    size: int,
) -> jax.Array:  # [...] in x's dtype
    """XLA's ``psum`` of ``x`` over ``axis`` (``size`` is the normalised call's; psum reads the bound axis)."""
    del size
    return jax.lax.psum(x, axis)


def prefer_mosaic(x, *, axis: str, size: int) -> str | None:
    """Why ``auto`` keeps XLA's ``psum`` for a call the one-shot kernel can take (``None``: it takes the kernel).
    Measured on two H200s driven by one process (RESULTS.md, "Many GPUs"): ahead of ``psum`` in the tp preset's
    decode step (512 KB sums: 5-9% faster a step), and alone level with it below 1 MiB and 4-18% faster from 2 to
    32 MiB. Declined elsewhere: an axis of more than two devices (on four H200s, where each device reads three
    peers' inputs, level with ``psum`` in the tp step, 2.276 against 2.269 ms a sub-step, and alone 1.4-2.0x slower
    from 2 MiB: it moves 3x a device's bytes over NVLink where ``psum`` moves 1.5x), a mesh of more devices than the
    axis (a ``2x2`` mesh: the sums of two pairs at once), more than :data:`MOSAIC_MAX_BYTES` a device, and several
    processes (the kernel's peer addresses then come another way). The mesh is ``shard_map``'s (none outside it:
    the table's examples)."""
    del axis
    if size != 2:
        return f"an axis of {size} devices: measured ahead of psum on two only (level or slower on four)"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size != size:
        return f"a mesh of {mesh.size} devices ({dict(mesh.shape)}): measured on a mesh of the axis's two only"
    nbytes = x.size * jnp.dtype(x.dtype).itemsize
    if nbytes > MOSAIC_MAX_BYTES:
        return f"{nbytes} bytes a device > {MOSAIC_MAX_BYTES}: not measured (every device reads every peer's input)"
    if jax.process_count() > 1:
        return f"{jax.process_count()} processes: measured with one process driving every GPU only"
    return None


def all_reduce(
    x: jax.Array,  # [...]: this device's partial sum
    axis: str | None,
    *,
    impl: str = "auto",
) -> jax.Array:  # [...] in x's dtype
    """The sum of ``x`` over mesh axis ``axis`` (inside ``shard_map``); the identity for ``axis=None`` or an axis
    of one device. ``impl``: ``"auto"``, ``"reference"`` (``psum``) or ``"mosaic"``; ``UnknownImplError`` for a
    name that cannot run here or cannot take this call."""
    TABLE.validate_impl(impl)
    if axis is None:
        return x
    size = jax.lax.axis_size(axis)
    if size == 1:
        return x
    _, fn = TABLE.choose(impl, (x,), {"axis": axis, "size": size})
    return fn(x, axis=axis, size=size)


def _example(rows: int, hidden: int = 4096, size: int = 2, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((rows, hidden), dtype),), {"axis": "model", "size": size}


TABLE = BackendTable(
    ALL_REDUCE_OP,
    all_reduce_reference,
    (
        Backend("mosaic", allreduce_mgpu.all_reduce_mgpu, priority=10, device=on_hopper,
                unsupported=allreduce_mgpu.unsupported, prefer=prefer_mosaic, interpretable=False,
                note="one-shot peer reads over NVLink: ahead of XLA's psum on 2 GPUs (RESULTS.md, Many GPUs)"),
    ),
    examples={
        "decode T=64 hidden 4096 bf16 over 2": lambda: _example(64),
        "decode T=64 hidden 4096 bf16 over 4": lambda: _example(64, size=4),
        "decode T=16 hidden 1024 f32 over 2": lambda: _example(16, 1024, dtype=jnp.float32),
        "prefill T=2048 hidden 4096 bf16 over 2": lambda: _example(2048),
        "prefill T=8192 hidden 4096 bf16 over 2": lambda: _example(8192),
    },
)
