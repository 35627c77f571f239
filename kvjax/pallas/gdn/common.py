"""What the GDN kernels share: the state-pool row convention, padded head-dim blocks, the f32-accumulating dot.

The chunked and recurrent kernels read and write states in a *pool* ``f32[R, Hv, K, V]`` at a per-row index
``rows[n]``, with per-row ``flags[n]``: bit 0 (:data:`FLAG_HAS_INITIAL`) = read the initial state (else start
from zeros), bit 1 (:data:`FLAG_LIVE`) = the row is live (else it is padding: nothing read, computed or
written, and its tokens' outputs are zero). For the public ops the pool is ``initial_state``
(:func:`state_as_pool`, :func:`on_initial_state`); for the slot-addressed GDN pool ``f32[L, S+1, Hv, K, V]`` it
is the flattened ``[L * (S + 1)]`` slots (:func:`on_slot_pool`).

Head dims. Triton blocks are powers of two; a kernel takes any K and V (like fla's) by loading a head dim as a
block of ``next_pow2(K)`` lanes (:func:`head_cols`) or value columns in blocks that may overrun V
(:func:`col_block`), with masked loads (0 past the end) and stores. Zero lanes of q, k, v and of the state stay
zero through the delta rule, so they never reach a stored value. Where the dim is a power of two (or the blocks
divide it) the index is the plain one and there is no mask: the same code as without padding. Nothing is padded
in HBM: the pool keeps its true K, V.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.base.device import next_pow2

L2NORM_EPS = 1e-6  # Hugging Face / fla l2norm epsilon (added to the squared norm)
FLAG_HAS_INITIAL = 1
FLAG_LIVE = 2


def f32_precision(interpret: bool):
    """Precision of the products of float32 inputs in the chunked kernels: three TF32 passes on the GPU (tensor
    cores, relative error ~1e-6), full f32 in interpret mode (no TF32 there). Triton's full-f32 (ieee, FMA)
    products of ``[64, 128]`` and wider tiles compile far too slowly to use."""
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def dot(a, b, *, precision, contract_a: int = 1):
    """``a @ b`` (or ``a.T @ b`` with ``contract_a=0``) with float32 accumulation (``pl.dot`` left jax 0.11)."""
    dims = (((contract_a,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def head_cols(dim: int) -> tuple[Any, jax.Array | None]:
    """Index and lane mask of a whole head dim of size ``dim`` as a power-of-two block (call inside a kernel):
    ``(slice(None), None)`` for a power of two, else ``(pl.ds(0, next_pow2(dim)), bool[next_pow2(dim)])``."""
    padded = next_pow2(dim)
    if padded == dim:
        return slice(None), None
    return pl.ds(0, padded), jnp.arange(padded, dtype=jnp.int32) < dim


def col_block(index, block: int, dim: int) -> tuple[Any, jax.Array | None]:
    """Index and lane mask of block ``index`` of ``block`` columns of a dim of size ``dim`` (call inside a
    kernel); the mask is ``None`` when the blocks divide ``dim`` (no block overruns it)."""
    cols = pl.ds(pl.multiple_of(index * block, block), block)
    if dim % block == 0:
        return cols, None
    return cols, index * block + jnp.arange(block, dtype=jnp.int32) < dim


def tile_mask(
    shape: tuple[int, int],
    rows: jax.Array | None,  # bool[shape[0]] | None
    cols: jax.Array | None,  # bool[shape[1]] | None
    base: jax.Array | None = None,  # bool[shape] | None
) -> jax.Array | None:  # bool[shape] | None (None: every lane)
    """``base & rows[:, None] & cols[None, :]`` broadcast to ``shape`` (``None`` entries are all-true); ``base``
    unchanged (or ``None``) when both lane masks are ``None``."""
    mask = base
    for m in (None if rows is None else rows[:, None], None if cols is None else cols[None, :]):
        if m is not None:
            m = jnp.broadcast_to(m, shape)
            mask = m if mask is None else mask & m
    return mask


def load(ref, idx: tuple, mask: jax.Array | None, **kwargs) -> jax.Array:
    """``ref[idx]`` (no mask), else a masked load with 0 where ``mask`` is false."""
    if mask is None:
        return ref[idx] if not kwargs else plt.load(ref.at[idx], **kwargs)
    return plt.load(ref.at[idx], mask=mask, other=0.0, **kwargs)


def store(ref, idx: tuple, value: jax.Array, mask: jax.Array | None, **kwargs) -> None:
    """``ref[idx] = value`` (no mask), else a store of the lanes where ``mask`` is true."""
    if mask is None and not kwargs:
        ref[idx] = value
    else:
        plt.store(ref.at[idx], value, mask=mask, **kwargs)


def on_initial_state(pool_kernel: Callable, doc: str) -> Callable:
    """The backend-table entry ``entry(call, initial_state, *, interpret)`` of a public gated-delta-rule op
    (``kvjax.ops.gdn``'s call form: ``call`` a ``DeltaRuleCall``, ``initial_state`` f32[N, Hv, K, V] or ``None`` =
    zeros) running ``pool_kernel`` (``(q, k, v, g, beta, pool, *, cu_seqlens, rows, flags, scale, use_qk_l2norm,
    interpret)``) on :func:`state_as_pool`'s pool: the final states are the pool it returns."""

    def entry(call: Any, initial_state: jax.Array | None, *, interpret: bool = False
              ) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V], final f32[N, Hv, K, V])
        q, v, cu_seqlens = call.q, call.v, call.cu_seqlens
        pool, rows, flags = state_as_pool(initial_state, cu_seqlens.shape[0] - 1, v.shape[1], q.shape[2], v.shape[2])
        return pool_kernel(q, call.k, v, call.g, call.beta, pool, cu_seqlens=cu_seqlens, rows=rows, flags=flags,
                           scale=call.scale, use_qk_l2norm=call.use_qk_l2norm, interpret=interpret)

    entry.__doc__ = doc
    return entry


def state_as_pool(
    initial_state: jax.Array | None,  # f32[N, Hv, K, V]
    num_seqs: int,
    hv: int,
    kd: int,
    vd: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (pool f32[N, Hv, K, V], rows i32[N], flags i32[N])
    """Adapt the public ops' ``initial_state`` (or ``None`` = zeros) to the pool kernels' arguments: a fresh
    copy of ``initial_state`` (the pool kernels alias it to their output) or zeros, ``rows = arange(N)``,
    every row live, reading its initial state only when one was given."""
    if initial_state is None:
        pool = jnp.zeros((num_seqs, hv, kd, vd), jnp.float32)
        flags = jnp.full((num_seqs,), FLAG_LIVE, jnp.int32)
    else:
        pool = jnp.array(initial_state, jnp.float32, copy=True)
        flags = jnp.full((num_seqs,), FLAG_LIVE | FLAG_HAS_INITIAL, jnp.int32)
    return pool, jnp.arange(num_seqs, dtype=jnp.int32), flags


def slot_rows_and_flags(
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    layer: int | jax.Array,  # i32[]
    slot_ids: jax.Array,  # i32[N]  outside 1..S = padding row
    has_initial_state: jax.Array | None,  # bool[N]; None = every live row reads its slot
) -> tuple[jax.Array, jax.Array]:  # (rows i32[N] into the flattened [L * (S+1)] pool, flags i32[N])
    """Flattened pool row of each batch row and its flags (padding rows point at the layer's PAD slot 0 and
    are not live, so nothing is read or written there)."""
    num_slots = ssm.shape[1]
    live = (slot_ids >= 1) & (slot_ids < num_slots)
    rows = jnp.asarray(layer, jnp.int32) * num_slots + jnp.where(live, slot_ids, 0)
    read = live if has_initial_state is None else live & has_initial_state
    flags = jnp.where(live, FLAG_LIVE, 0) | jnp.where(read, FLAG_HAS_INITIAL, 0)
    return rows.astype(jnp.int32), flags.astype(jnp.int32)


def on_slot_pool(pool_kernel: Callable, doc: str, *, one_token_flag: bool = False) -> Callable:
    """The backend-table entry ``entry(call, ssm, *, interpret)`` of a slot-pool GDN op (``kvjax.ops.gdn_on_pool``'s
    call form: ``call`` a ``DeltaRuleCall`` with ``slot_ids``, ``layer``, ``has_initial_state``; ``ssm`` f32[L, S+1,
    Hv, K, V]) running ``pool_kernel`` on the slot-addressed GDN pool: ``[L, S+1]`` flattened to pool rows
    (:func:`slot_rows_and_flags`), run, reshaped back. ``call.cu_seqlens=None`` is one token per row; with
    ``one_token_flag`` the kernel is also told so (``one_token_per_row=``)."""

    def entry(call: Any, ssm: jax.Array, *, interpret: bool = False
              ) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V], new ssm f32[L, S+1, Hv, K, V])
        cu_seqlens = call.cu_seqlens
        static = dict(one_token_per_row=cu_seqlens is None) if one_token_flag else {}
        if cu_seqlens is None:
            cu_seqlens = jnp.arange(call.q.shape[0] + 1, dtype=jnp.int32)
        rows, flags = slot_rows_and_flags(ssm, call.layer, call.slot_ids, call.has_initial_state)
        flat = ssm.reshape(ssm.shape[0] * ssm.shape[1], *ssm.shape[2:])
        o, flat = pool_kernel(call.q, call.k, call.v, call.g, call.beta, flat, cu_seqlens=cu_seqlens, rows=rows,
                              flags=flags, scale=call.scale, use_qk_l2norm=call.use_qk_l2norm, interpret=interpret,
                              **static)
        return o, flat.reshape(ssm.shape)

    entry.__doc__ = doc
    return entry
