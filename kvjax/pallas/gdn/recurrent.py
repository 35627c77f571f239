"""Recurrent (stepwise) gated delta rule as a Pallas kernel (Triton lowering): decode and verification.

One program per (sequence row ``n``, value head ``h``, block of ``block_v`` value columns). It holds the state
slice ``S: f32[K, block_v]`` in registers, walks the row's tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` and
updates ``S`` with the delta rule. Value columns of the state are independent, so splitting ``V`` costs no
extra state traffic: each program reads and writes its ``K * block_v * 4`` bytes exactly once.

The state lives in a *pool* ``f32[R, Hv, K, V]`` addressed by a per-row index ``rows[n]``: for the public op
the pool is ``initial_state`` (``rows = arange(N)``), for the slot-addressed GDN pool it is the layer's
flattened ``[L * (S + 1)]`` slots. The pool is aliased input -> output (``input_output_aliases``), so under
jit with a donated pool the update happens in place. Per row ``flags[n]``: bit 0 = read the initial state
(else start from zeros), bit 1 = the row is live (else it is padding: nothing read, computed or written,
and its tokens' outputs are zero). Tokens outside every sequence get zero outputs.

The decode step on the GDN pool has its own kernel, ``_slots_kernel`` (one token per row, the slot ids index
``f32[L, S+1, Hv, K, V]`` directly, no XLA op around it), one program per state tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

L2NORM_EPS = 1e-6
FLAG_HAS_INITIAL = 1
FLAG_LIVE = 2


def state_as_pool(
    initial_state: jax.Array | None,  # f32[N, Hv, K, V]
    num_seqs: int,
    hv: int,
    kd: int,
    vd: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adapt the public ops' ``initial_state`` (or ``None`` = zeros) to the pool kernels' arguments.

    Returns ``(pool: f32[N, Hv, K, V], rows: i32[N] = arange(N), flags: i32[N])``: a fresh copy of
    ``initial_state`` (the pool kernels alias it to their output) or zeros, every row live, reading its
    initial state only when one was given.
    """
    if initial_state is None:
        pool = jnp.zeros((num_seqs, hv, kd, vd), jnp.float32)
        flags = jnp.full((num_seqs,), FLAG_LIVE, jnp.int32)
    else:
        pool = jnp.array(initial_state, jnp.float32, copy=True)
        flags = jnp.full((num_seqs,), FLAG_LIVE | FLAG_HAS_INITIAL, jnp.int32)
    return pool, jnp.arange(num_seqs, dtype=jnp.int32), flags


def _l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x) + L2NORM_EPS)


def _zero_tokens(o_ref, h, vs, lo, hi, block_v):
    def body(t, carry):
        o_ref[t, h, vs] = jnp.zeros((block_v,), o_ref.dtype)
        return carry

    lax.fori_loop(lo, hi, body, 0)


def _token_update(s, q_ref, k_ref, v_ref, g_ref, beta_ref, t, h, hk, vs, *, scale, use_qk_l2norm, one_pass):
    """One delta-rule token on the state slice ``s: f32[K, block_v]``; returns ``(new s, o: f32[block_v])``.

    ``one_pass``: ``k^T S`` and ``q^T S`` both on the state as loaded, ``o = decay q^T S + (q . k) delta``
    (equal in exact arithmetic), so the new state's store does not wait for a reduction of the updated state.
    """
    q = q_ref[t, hk, :].astype(jnp.float32)
    k = k_ref[t, hk, :].astype(jnp.float32)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    v = v_ref[t, h, vs].astype(jnp.float32)
    decay = jnp.exp(g_ref[t, h].astype(jnp.float32))
    beta = beta_ref[t, h].astype(jnp.float32)
    if one_pass:
        ks = jnp.sum(s * k[:, None], axis=0)
        qs = jnp.sum(s * q[:, None], axis=0)
        delta = (v - decay * ks) * beta
        return s * decay + k[:, None] * delta[None, :], (decay * qs + jnp.sum(q * k) * delta) * scale
    s = s * decay
    delta = (v - jnp.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    return s, jnp.sum(s * q[:, None], axis=0) * scale


def _slots_kernel(
    slots_ref,  # i32[B]
    q_ref,  # [B, Hk, K]
    k_ref,  # [B, Hk, K]
    v_ref,  # [B, Hv, V]
    g_ref,  # f32[B, Hv]
    beta_ref,  # [B, Hv]
    pool_in_ref,  # f32[L, S+1, Hv, K, V]  (aliased with pool_ref)
    o_ref,  # [B, Hv, V]
    pool_ref,  # f32[L, S+1, Hv, K, V]
    *,
    layer: int,
    group: int,
    scale: float,
    use_qk_l2norm: bool,
    block_v: int,
    one_pass: bool,
    v_major: bool,
):
    """Decode on the GDN pool by slot: one program per state tile ``[K, block_v]`` of one (row, head). Rows
    whose slot is not in ``1..S`` read and write nothing (uniform masks) and output zeros."""
    lay = jnp.asarray(layer, jnp.int32)  # an array index: interpret mode rejects a Python int under pl.when

    def tile(n, h, vb):
        vs = pl.ds(pl.multiple_of(vb * block_v, block_v), block_v)
        slot = slots_ref[n]
        live = (slot >= 1) & (slot < pool_in_ref.shape[1])
        slot = jnp.where(live, slot, 0)
        mask = jnp.full((pool_in_ref.shape[3], block_v), live)
        s = plt.load(pool_in_ref.at[lay, slot, h, :, vs], mask=mask, other=0.0, eviction_policy="evict_first")
        s, o = _token_update(s, q_ref, k_ref, v_ref, g_ref, beta_ref, n, h, h // group, vs, scale=scale,
                             use_qk_l2norm=use_qk_l2norm, one_pass=one_pass)
        o_ref[n, h, vs] = jnp.where(live, o, 0.0).astype(o_ref.dtype)
        plt.store(pool_ref.at[lay, slot, h, :, vs], s, mask=mask, eviction_policy="evict_first")

    if v_major:
        tile(pl.program_id(2), pl.program_id(1), pl.program_id(0))
    else:
        tile(pl.program_id(0), pl.program_id(1), pl.program_id(2))


def _recurrent_kernel(
    *refs,
    group: int,
    scale: float,
    use_qk_l2norm: bool,
    block_v: int,
    num_tokens: int,
    one_token_per_row: bool,
    one_pass: bool,
):
    """Refs: ``cu i32[N+1], rows i32[N], flags i32[N], q, k, v, g, beta, pool_in, o, pool`` with a pool
    ``f32[R, Hv, K, V]`` indexed by ``rows``."""
    cu_ref, rows_ref, flags_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in_ref, o_ref, pool_ref = refs
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs = pl.num_programs(0)
    hk = h // group
    vs = pl.ds(pl.multiple_of(vb * block_v, block_v), block_v)
    if one_token_per_row:  # decode: token n belongs to row n (cu_seqlens == arange(N + 1))
        start, end = n, n + 1
    else:
        start, end = cu_ref[n], cu_ref[n + 1]
    row = rows_ref[n]
    flags = flags_ref[n]
    live = (flags & FLAG_LIVE) != 0
    has_init = (flags & FLAG_HAS_INITIAL) != 0
    state_in, state_out = pool_in_ref.at[row, h, :, vs], pool_ref.at[row, h, :, vs]
    kd = pool_in_ref.shape[-2]

    @pl.when(live)
    def _():
        s0 = plt.load(state_in, mask=jnp.full((kd, block_v), has_init), other=0.0, eviction_policy="evict_first")

        def step(t, s):  # s: f32[K, block_v]
            s, o = _token_update(s, q_ref, k_ref, v_ref, g_ref, beta_ref, t, h, hk, vs, scale=scale,
                                 use_qk_l2norm=use_qk_l2norm, one_pass=one_pass)
            o_ref[t, h, vs] = o.astype(o_ref.dtype)
            return s

        s = step(start, s0) if one_token_per_row else lax.fori_loop(start, end, step, s0)
        plt.store(state_out, s, eviction_policy="evict_first")

    @pl.when(jnp.logical_not(live))
    def _():
        _zero_tokens(o_ref, h, vs, start, end, block_v)

    if not one_token_per_row:

        @pl.when(n == 0)
        def _():
            _zero_tokens(o_ref, h, vs, 0, start, block_v)

        @pl.when(n == num_seqs - 1)
        def _():
            _zero_tokens(o_ref, h, vs, end, num_tokens, block_v)


def _recurrent_call(
    q, k, v, g, beta, pool, cu_seqlens, rows, flags, *, scale, use_qk_l2norm, block_v, num_warps,
    one_token_per_row, one_pass, interpret
):
    num_tokens, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    num_seqs = rows.shape[0]
    kernel = functools.partial(
        _recurrent_kernel,
        group=hv // hk,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        block_v=block_v,
        num_tokens=num_tokens,
        one_token_per_row=one_token_per_row,
        one_pass=one_pass,
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, hv, vd), v.dtype),
            jax.ShapeDtypeStruct(pool.shape, jnp.float32),
        ),
        grid=(num_seqs, hv, vd // block_v),
        input_output_aliases={8: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_recurrent",
    )(cu_seqlens, rows, flags, q, k, v, g, beta, pool)


def _slots_call(q, k, v, g, beta, ssm, slots, *, layer, scale, use_qk_l2norm, block_v, num_warps, one_pass,
                v_major, interpret):
    num_tokens, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    kernel = functools.partial(
        _slots_kernel, layer=layer, group=hv // hk, scale=scale, use_qk_l2norm=use_qk_l2norm, block_v=block_v,
        one_pass=one_pass, v_major=v_major,
    )
    grid = (num_tokens, hv, vd // block_v)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, hv, vd), v.dtype),
            jax.ShapeDtypeStruct(ssm.shape, jnp.float32),
        ),
        grid=grid[::-1] if v_major else grid,
        input_output_aliases={6: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_decode_slots",
    )(slots, q, k, v, g, beta, ssm)


def _check_pow2(name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"the Pallas GDN kernels need power-of-two {name}, got {value}")


def _pick_block_v(vd: int, block_v: int | None) -> int:
    bv = min(vd, block_v or 64)
    _check_pow2("block_v", bv)
    if vd % bv:
        raise ValueError(f"block_v={bv} must divide V={vd}")
    return bv


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm", "block_v", "num_warps", "one_token_per_row", "one_pass",
                     "interpret"),
    donate_argnames=("pool",),
)
def recurrent_gated_delta_rule_pool(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    pool: jax.Array,  # f32[R, Hv, K, V]  donated, updated in place
    *,
    cu_seqlens: jax.Array,  # i32[N+1]
    rows: jax.Array,  # i32[N]  pool row per sequence
    flags: jax.Array,  # i32[N]  FLAG_HAS_INITIAL | FLAG_LIVE
    scale: float,
    use_qk_l2norm: bool = False,
    block_v: int | None = None,
    num_warps: int = 2,
    one_token_per_row: bool = False,
    one_pass: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Stepwise gated delta rule reading/writing states in ``pool`` at ``rows``; returns ``(o, pool)``.

    ``one_pass=True`` computes ``k^T S`` and ``q^T S`` together on the state as loaded and forms the output
    as ``decay q^T S + (q . k) delta`` (equal in exact arithmetic), so the store of the new state does not
    wait for a second reduction; ``False`` reduces the updated state for the output (the textbook order).

    Non-live rows (``flags & FLAG_LIVE == 0``) are neither read nor written and their tokens get ``o = 0``.
    ``one_token_per_row=True`` is the decode fast path: it requires ``T == N`` and ignores ``cu_seqlens``
    (row ``n`` owns token ``n``).
    """
    if one_token_per_row and q.shape[0] != rows.shape[0]:
        raise ValueError(f"one_token_per_row needs one token per row: T={q.shape[0]}, N={rows.shape[0]}")
    kd, vd = q.shape[2], v.shape[2]
    _check_pow2("K", kd)
    _check_pow2("V", vd)
    return _recurrent_call(
        q, k, v, g, beta, pool, cu_seqlens, rows, flags,
        scale=scale, use_qk_l2norm=use_qk_l2norm, block_v=_pick_block_v(vd, block_v), num_warps=num_warps,
        one_token_per_row=one_token_per_row, one_pass=one_pass, interpret=interpret,
    )


@functools.partial(
    jax.jit,
    static_argnames=("layer", "scale", "use_qk_l2norm", "block_v", "num_warps", "one_pass", "v_major",
                     "interpret"),
    donate_argnames=("ssm",),
)
def recurrent_gated_delta_rule_slots(
    q: jax.Array,  # [B, Hk, K]  one token per batch row
    k: jax.Array,  # [B, Hk, K]
    v: jax.Array,  # [B, Hv, V]
    g: jax.Array,  # f32[B, Hv]
    beta: jax.Array,  # [B, Hv]
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]  GDN pool, donated, updated in place
    *,
    slot_ids: jax.Array,  # i32[B]  0 (or out of range) = padding row
    layer: int,
    scale: float,
    use_qk_l2norm: bool = False,
    block_v: int | None = None,
    num_warps: int = 4,
    one_pass: bool = True,
    v_major: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Decode step straight on the GDN pool: row ``b`` continues the state at ``ssm[layer, slot_ids[b]]``.

    No XLA work around the kernel (no row/flag arrays): the slot ids index the pool inside the kernel.
    Rows whose slot is not in ``1..S`` are padding: nothing read or written, ``o = 0``. Tuning:
    ``v_major`` launches the value blocks of a head next to each other (grid order; 3-5% faster on an H200
    than rows first). Defaults: the fastest configuration measured (benchmarks/RESULTS.md).
    """
    kd, vd = q.shape[2], v.shape[2]
    _check_pow2("K", kd)
    _check_pow2("V", vd)
    if q.shape[0] != slot_ids.shape[0]:
        raise ValueError(f"one token per row: q has {q.shape[0]} tokens, slot_ids {slot_ids.shape[0]} rows")
    return _slots_call(
        q, k, v, g, beta, ssm, slot_ids, layer=layer, scale=scale, use_qk_l2norm=use_qk_l2norm,
        block_v=_pick_block_v(vd, block_v), num_warps=num_warps, one_pass=one_pass, v_major=v_major,
        interpret=interpret,
    )


def recurrent_gated_delta_rule_pallas(
    q: jax.Array,  # [T, Hk, K]
    k: jax.Array,  # [T, Hk, K]
    v: jax.Array,  # [T, Hv, V]
    g: jax.Array,  # f32[T, Hv]
    beta: jax.Array,  # [T, Hv]
    *,
    cu_seqlens: jax.Array,  # i32[N+1]
    initial_state: jax.Array | None,  # f32[N, Hv, K, V]
    scale: float,
    use_qk_l2norm: bool,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Kernel for ``kvjax.ops.recurrent_gated_delta_rule``: ``(o: [T, Hv, V], final: f32[N, Hv, K, V])``."""
    pool, rows, flags = state_as_pool(initial_state, cu_seqlens.shape[0] - 1, v.shape[1], q.shape[2], v.shape[2])
    return recurrent_gated_delta_rule_pool(
        q, k, v, g, beta, pool, cu_seqlens=cu_seqlens, rows=rows, flags=flags, scale=scale,
        use_qk_l2norm=use_qk_l2norm, interpret=interpret,
    )
