"""Ragged-batch index helpers shared by the references, the kernels' launch metadata and the models' steps.

Everything here is a static-shape jnp expression: no host synchronisation, no device while-loop. In
particular no ``jnp.searchsorted`` with its default method: that is a device while-loop whose trip checks
cost host round trips on a GPU (each call as long as a decode kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def count_le(
    sorted_values: jax.Array,  # [N], ascending
    x: jax.Array,  # [M]
) -> jax.Array:  # i32[M]
    """How many of ``sorted_values`` are ``<=`` each ``x`` (= ``searchsorted(side="right")``): one broadcast
    compare and sum, a single fused kernel."""
    return jnp.sum(sorted_values[None, :] <= x[:, None], axis=1, dtype=jnp.int32)


def token_rows(
    cu_seqlens: jax.Array,  # i32[B+1]
    num_tokens: int,
) -> jax.Array:  # i32[T]
    """Row of each of ``num_tokens`` token-major entries, clipped to ``[0, B)`` (tokens outside every row get
    the nearest row; callers mask them)."""
    num_rows = cu_seqlens.shape[0] - 1
    return jnp.clip(count_le(cu_seqlens, jnp.arange(num_tokens, dtype=jnp.int32)) - 1, 0, num_rows - 1)
