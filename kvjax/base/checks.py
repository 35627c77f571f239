"""Host-side (trace-time) argument validation shared by the ops. Raises ValueError naming the argument."""

from __future__ import annotations

from typing import Iterable

import jax
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


INT32_MAX = int(np.iinfo(np.int32).max)


def host_values(x, *, device: bool = False) -> np.ndarray | None:
    """The values of ``x`` where reading them costs nothing: a host ``np.ndarray`` (or Python list / tuple), or
    with ``device=True`` also a concrete (non-traced) ``jax.Array`` (a device-to-host copy). ``None`` for traced
    values (they cannot be checked) and, by default, device arrays (checking them would cost a sync)."""
    if isinstance(x, (np.ndarray, list, tuple)):
        return np.asarray(x)
    if device and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return np.asarray(x)
    return None


def check_static_int(name: str, value, *, low: int = 0, high: int = INT32_MAX) -> int:
    """A static Python / numpy integer in ``[low, high]`` (by default ``[0, 2**31 - 1]``: kernels and the
    references index with int32, so a larger value would wrap to a negative one); returns it as an ``int``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def check_cu_seqlens(cu_seqlens, num_tokens: int) -> None:
    """Ragged-batch offsets ``i32[N+1]`` with ``N >= 1``; host (``np.ndarray``) values must also be
    non-decreasing within ``[0, num_tokens]`` (device values are not checked: that would cost a sync)."""
    check_int32("cu_seqlens", cu_seqlens, rank=1)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    cu = host_values(cu_seqlens)
    if cu is not None:
        if np.any(np.diff(cu) < 0) or cu[0] < 0 or cu[-1] > num_tokens:
            raise ValueError(f"cu_seqlens must be non-decreasing within [0, T={num_tokens}], got {cu.tolist()}")


def check_seq_lens(seq_lens, capacity: int, *, device: bool = False) -> None:
    """Context lengths ``i32[B]`` against what the block table covers: host values (:func:`host_values`;
    ``device=True`` also reads concrete device arrays) must be in ``[0, capacity]`` (``capacity = max_blocks *
    page_size``: a longer row would attend positions no page holds). Raises ``ValueError`` naming the rows."""
    lens = host_values(seq_lens, device=device)
    if lens is None:
        return
    bad = np.flatnonzero((lens < 0) | (lens > capacity))
    if bad.size:
        raise ValueError(
            f"seq_lens must be in [0, max_blocks * page_size = {capacity}]; rows {bad.tolist()} have "
            f"{lens[bad].tolist()}"
        )
