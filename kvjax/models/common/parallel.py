"""Tensor parallelism inside one device's share of a model: the pieces a *local* model runs under ``shard_map``.

A model sharded over a mesh axis (:mod:`kvjax.models.sharding`) runs per device as a *local* model: the same
module class built from a local config (head counts, MLP width and padded vocabulary divided by the axis size),
holding the device's shards of the parameters. The local model differs from a plain one only by static
attributes, so the collectives are part of its graph (no hidden context):

- ``Linear.reduce_axis`` / ``MoE.reduce_axis``: a row-parallel projection sums its partial products over the axis
  (the op :func:`kvjax.ops.collective.all_reduce`, implementation ``reduce_impl``; bias added once after the sum);
- ``model.tp``: a :class:`TensorParallel`: the embedding lookup of a vocabulary-sharded table (:func:`embed`),
  the all-gather of the vocabulary-sharded logits sliced to the true vocabulary (:func:`gather_vocab`: padded
  entries never reach a sampler), and the global per-KV-head attention masks each device takes its share of
  (:meth:`TensorParallel.local`).

These functions run only inside ``shard_map`` with the axis bound; a plain model (``tp=None``) never calls them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.ops.collective import all_reduce


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Static description of the tensor-parallel axis a local model runs over (part of its graph)."""

    axis: str  # mesh axis name ("model")
    size: int  # devices along it
    vocab_size: int  # the global model's true vocabulary (logits are sliced to it)
    kv_window: tuple[int, ...] = ()  # global per-KV-head windows (Qwen3.5 SWA heads; () = all full)
    kv_sinks: tuple[int, ...] = ()  # global per-KV-head sinks
    all_reduce: str = "auto"  # impl of the sums over the axis (kvjax.ops.collective.all_reduce)

    def __post_init__(self) -> None:
        for name in ("size", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TensorParallel.{name} must be an int >= 1, got {v!r}")

    def local(self, x: jax.Array) -> jax.Array:  # [N * size, ...] -> [N, ...]: this device's contiguous share
        """This device's contiguous ``1/size`` share of ``x``'s leading axis (by ``axis_index``)."""
        n = x.shape[0] // self.size
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.axis) * n, n, axis=0)


def embed(
    table: jax.Array,  # [V_local, H]: this device's rows of the (padded) vocabulary, or the whole table
    ids: jax.Array,  # i32[...]: global token ids
    tp: TensorParallel | None,
) -> jax.Array:  # [..., H]
    """Embedding lookup; with ``tp`` the table holds rows ``[i * V_local, (i + 1) * V_local)`` of device ``i``:
    each device looks up the ids it owns (zeros elsewhere) and the partial rows are summed over the axis."""
    if tp is None:
        return table[ids]
    n = table.shape[0]
    local = ids - jax.lax.axis_index(tp.axis) * n
    mine = (local >= 0) & (local < n)
    rows = jnp.where(mine[..., None], table[jnp.clip(local, 0, n - 1)], jnp.zeros((), table.dtype))
    return all_reduce(rows, tp.axis, impl=tp.all_reduce)


def gather_vocab(
    logits: jax.Array,  # f32[..., V_local]: this device's vocabulary columns
    tp: TensorParallel | None,
) -> jax.Array:  # f32[..., vocab_size]
    """All vocabulary columns on every device, the padding columns sliced off (identity without ``tp``)."""
    if tp is None:
        return logits
    full = jax.lax.all_gather(logits, tp.axis, axis=logits.ndim - 1, tiled=True)
    return full[..., : tp.vocab_size]



@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How a model family splits over the tensor-parallel axis (from ``model.shard_plan(axis, size)``).

    ``local_config``: the config of one device's local model (heads, widths and padded vocabulary divided by
    the axis size). ``perms``: parameter path suffix -> ``(array axis, permutation)`` applied before the
    contiguous split (fused ``[q | k | v]`` channels, ``[gate | up]`` expert rows: each device takes its share of
    every block); caches holding such channels use the same order. ``pages_over_model``: paged caches are split
    over the axis (one pool per device holding only its KV heads' pages) rather than replicated. ``kv_order``: the
    global KV heads in device-major order (:func:`kvjax.sched.blocks.head_placement`; device ``m`` holds
    ``kv_order[m * Hkv / size : (m + 1) * Hkv / size]``), ``()`` for the identity; the sharded model's KV head
    ``j`` (its block-table column, cache pool and window) is the model's head ``kv_order[j]``.
    """

    local_config: Any
    vocab_padded: int  # vocabulary rounded up to a multiple of the axis size (zero rows / columns added)
    tp: TensorParallel
    perms: dict[tuple[str, ...], tuple[int, np.ndarray]] = dataclasses.field(default_factory=dict)
    pages_over_model: bool = True
    kv_order: tuple[int, ...] = ()  # global KV heads in device-major order; () = identity


def check_divisible(counts: dict[str, int], size: int, axis: str) -> None:
    """``ValueError`` naming the first count (head count, width) that the axis size does not divide."""
    for name, n in counts.items():
        if n % size:
            raise ValueError(f"{name}={n} is not divisible by the {axis!r} mesh axis size {size}: each device "
                             f"must hold the same number of them")
