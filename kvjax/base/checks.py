"""Host-side (trace-time) argument validation shared by the ops. Raises ValueError naming the argument."""

from __future__ import annotations

from typing import Iterable

import jax.numpy as jnp
import numpy as np


def check_array(
    name: str,
    x,
    *,
    rank: int | None = None,
    dtypes: Iterable | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> None:
    """Check rank, dtype family and (``None`` = any) dimensions of ``x``; raise ``ValueError`` otherwise."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if rank is not None and x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    if dtypes is not None:
        allowed = [jnp.dtype(d) for d in dtypes]
        if jnp.dtype(x.dtype) not in allowed:
            raise ValueError(f"{name} must have dtype in {[str(d) for d in allowed]}, got {x.dtype}")
    if shape is not None:
        if len(shape) != x.ndim or any(s is not None and s != d for s, d in zip(shape, x.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def check_int32(name: str, x, *, rank: int | None = None, shape: tuple[int | None, ...] | None = None) -> None:
    """Index arrays (block tables, slot ids, cu_seqlens, slot mappings) must be int32."""
    check_array(name, x, rank=rank, dtypes=[jnp.int32], shape=shape)


def check_float(name: str, x, *, rank: int | None = None, shape: tuple[int | None, ...] | None = None) -> None:
    """Activations: float16, bfloat16, float32 (float64 allowed for oracles)."""
    check_array(name, x, rank=rank, dtypes=[jnp.float16, jnp.bfloat16, jnp.float32, np.float64], shape=shape)


def check_cu_seqlens(cu_seqlens, num_tokens: int) -> None:
    """Ragged-batch offsets ``i32[N+1]`` with ``N >= 1``; host (``np.ndarray``) values must also be
    non-decreasing within ``[0, num_tokens]`` (device values are not checked: that would cost a sync)."""
    check_int32("cu_seqlens", cu_seqlens, rank=1)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if isinstance(cu_seqlens, np.ndarray):
        if np.any(np.diff(cu_seqlens) < 0) or cu_seqlens[0] < 0 or cu_seqlens[-1] > num_tokens:
            raise ValueError(f"cu_seqlens must be non-decreasing within [0, T={num_tokens}], got {cu_seqlens}")
