"""The all-reduce of tensor parallelism: the sum of every device's partial over one mesh axis, on every device.

Normalised call (the table's functions)::

    all_reduce: fn(x, axis, size)   # x [...] float; axis: a mesh axis bound by shard_map; size: its devices

Runs only inside ``shard_map`` with ``axis`` bound (the row-parallel projections of a local model,
:func:`kvjax.models.common.parallel.reduce`). Reference = ``jax.lax.psum`` (XLA's all-reduce, in x's dtype: what
the models ran before this op). Backends:

- ``"xla"``: the same ``psum`` on a GPU (``auto``'s choice there: highest priority);
- ``"mosaic"``: :func:`kvjax.pallas.allreduce_mgpu.all_reduce_mgpu`, a one-shot all-reduce by NVLink peer stores
  (Hopper, one process driving the axis's GPUs, bf16 / f16 / f32, element count a multiple of 128 x 16 bytes,
  at most ``MAX_BYTES`` (4 MB) per partial, an axis of >= 2 devices). By name only (``impl="mosaic"``,
  ``TensorParallel.all_reduce``): ``auto`` does not take it until it is measured faster than XLA's on a GPU
  (``benchmarks/allreduce.py``; unmeasured so far).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.ops.backends import Backend, BackendTable, on_gpu, on_hopper
from kvjax.pallas.allreduce_mgpu import all_reduce_mgpu, allreduce_unsupported

ALL_REDUCE_OP = "all_reduce"


def all_reduce_reference(
    x: jax.Array,  # [...] float: this device's partial
    axis: str,
    size: int,
) -> jax.Array:  # [...] like x: the sum over ``axis``
    """``jax.lax.psum(x, axis)`` (XLA's all-reduce; ``size`` unused)."""
    del size
    return jax.lax.psum(x, axis)


def _xla(x: jax.Array, axis: str, size: int, *, interpret: bool = False) -> jax.Array:
    del interpret
    return all_reduce_reference(x, axis, size)


def axis_size(axis) -> int:
    """Devices along ``axis``; ``ValueError`` if it is not a string naming an axis bound here (inside
    ``shard_map``)."""
    if not isinstance(axis, str) or not axis:
        raise ValueError(f"axis must be a mesh axis name (a non-empty string), got {axis!r}")
    try:
        return int(jax.lax.axis_size(axis))
    except NameError as e:
        raise ValueError(f"axis {axis!r} is not a mesh axis bound here: all_reduce runs inside shard_map over "
                         f"it ({e})") from None


def validate_all_reduce_args(x, axis, impl) -> int:
    """Host-side check: ``x`` a float array, ``axis`` bound (:func:`axis_size`), ``impl`` a string; returns the
    axis size. ``ValueError`` names the argument."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"x must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must have a float dtype, got {x.dtype}")
    if not isinstance(impl, str):
        raise ValueError(f"impl must be a string, got {impl!r}")
    return axis_size(axis)


def all_reduce(
    x: jax.Array,  # [...] float: this device's partial
    axis: str,
    *,
    impl: str = "auto",
    fallback: bool = False,
) -> jax.Array:  # [...] like x: the sum over ``axis``, on every device of it
    """Sum of ``x`` over the mesh axis ``axis`` (inside ``shard_map``). Errors: :func:`validate_all_reduce_args`;
    ``UnknownImplError`` for an ``impl`` that cannot run here or cannot take this call (the reason).

    ``fallback``: a named backend that cannot take this call's shape / dtype / size (a prefill-sized sum past the
    kernel's cap) gives way to ``"auto"`` instead of raising; one that cannot run on this device still raises."""
    size = validate_all_reduce_args(x, axis, impl)
    call = (x, axis, size)
    if fallback and impl not in ("auto", "reference"):
        name, _, _ = impl.partition(":")
        ALL_REDUCE_TABLE.validate_impl(impl)
        if ALL_REDUCE_TABLE.backend(name).shape_reason(call, {}) is not None:
            impl = "auto"
    _, fn = ALL_REDUCE_TABLE.choose(impl, call, {})
    return fn(x, axis, size)


def _example(rows: int, hidden: int, size: int, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((rows, hidden), dtype), "model", size), {}


ALL_REDUCE_TABLE = BackendTable(
    ALL_REDUCE_OP,
    all_reduce_reference,
    (
        Backend("xla", _xla, priority=10, device=on_gpu, interpretable=False,
                note="XLA's all-reduce (psum): auto's choice on a GPU"),
        Backend("mosaic", all_reduce_mgpu, priority=0, device=on_hopper, unsupported=allreduce_unsupported,
                interpretable=False,
                note="one-shot NVLink peer stores, by name only: unmeasured against XLA's on a GPU"),
    ),
    examples={
        "tp decode rows=64 H=4096 bf16 over 4": lambda: _example(64, 4096, 4),
        "tp decode rows=64 H=4096 bf16 over 2": lambda: _example(64, 4096, 2),
        "prefill rows=2048 H=4096 bf16 over 4": lambda: _example(2048, 4096, 4),
        "rows=3 H=100 f32 over 2": lambda: _example(3, 100, 2, jnp.float32),
    },
)
