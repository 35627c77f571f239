"""What the GDN kernels share: the state-pool row convention, the shape check, the f32-accumulating dot.

The chunked and recurrent kernels read and write states in a *pool* ``f32[R, Hv, K, V]`` at a per-row index
``rows[n]``, with per-row ``flags[n]``: bit 0 (:data:`FLAG_HAS_INITIAL`) = read the initial state (else start
from zeros), bit 1 (:data:`FLAG_LIVE`) = the row is live (else it is padding: nothing read, computed or
written, and its tokens' outputs are zero). For the public ops the pool is ``initial_state``
(:func:`state_as_pool`); for the slot-addressed GDN pool ``f32[L, S+1, Hv, K, V]`` it is the flattened
``[L * (S + 1)]`` slots (:func:`run_on_slot_pool`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.base.device import is_pow2

L2NORM_EPS = 1e-6  # Hugging Face / fla l2norm epsilon (added to the squared norm)
FLAG_HAS_INITIAL = 1
FLAG_LIVE = 2


def dot(a, b, *, precision, contract_a: int = 1):
    """``a @ b`` (or ``a.T @ b`` with ``contract_a=0``) with float32 accumulation (``pl.dot`` left jax 0.11)."""
    dims = (((contract_a,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def unsupported(
    q,  # [T, Hk, K]
    k,  # [T, Hk, K]
    v,  # [T, Hv, V]
    *args,
    **kwargs,
) -> str | None:
    """Backend-table check shared by every Pallas GDN kernel (the public ops' and the pool ops' normalised
    calls): why it cannot take these head dims (it needs powers of two), or ``None``."""
    del k, args, kwargs
    kd, vd = q.shape[-1], v.shape[-1]
    if not (is_pow2(kd) and is_pow2(vd)):
        return f"the Pallas GDN kernels need power-of-two K and V, got K={kd}, V={vd}"
    return None


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


def run_on_slot_pool(
    kernel: Callable,  # a pool kernel: (q, k, v, g, beta, pool, *, cu_seqlens, rows, flags, scale, ...)
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    *,
    layer: int | jax.Array,  # i32[]
    slot_ids: jax.Array,  # i32[N]
    has_initial_state: jax.Array | None,  # bool[N]
    cu_seqlens: jax.Array | None,  # i32[N+1]; None = one token per row
    scale: float,
    use_qk_l2norm: bool,
    interpret: bool,
    **static,
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V], new ssm f32[L, S+1, Hv, K, V])
    """Run a pool kernel on the slot-addressed GDN pool: flatten ``[L, S+1]`` to pool rows, run, reshape."""
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    rows, flags = slot_rows_and_flags(ssm, layer, slot_ids, has_initial_state)
    flat = ssm.reshape(ssm.shape[0] * ssm.shape[1], *ssm.shape[2:])
    o, flat = kernel(q, k, v, g, beta, flat, cu_seqlens=cu_seqlens, rows=rows, flags=flags, scale=scale,
                     use_qk_l2norm=use_qk_l2norm, interpret=interpret, **static)
    return o, flat.reshape(ssm.shape)
