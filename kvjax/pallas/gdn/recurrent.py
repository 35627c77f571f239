"""Recurrent (stepwise) gated delta rule as Pallas kernels (Triton lowering): decode and verification.

``_recurrent_kernel``: one program per (sequence row ``n``, value head ``h``, block of ``block_v`` value
columns). It holds the state slice ``S: f32[K, block_v]`` in registers, walks the row's tokens
``cu_seqlens[n]:cu_seqlens[n+1]`` and updates ``S`` with the delta rule. Value columns of the state are
independent, so splitting ``V`` costs no extra state traffic: each program reads and writes its
``K * block_v * 4`` bytes exactly once. States live in a pool at ``rows[n]`` with ``flags[n]`` (the convention
of :mod:`kvjax.pallas.gdn.common`); the pool is aliased input -> output (``input_output_aliases``), so under jit
with a donated pool the update happens in place. Tokens outside every sequence get zero outputs.

``_slots_kernel``: the decode step on the slot-addressed GDN pool ``f32[L, S+1, Hv, K, V]`` (one token per
row, the slot ids index the pool inside the kernel, no XLA op around it), one program per state tile, the
value blocks of a head launched next to each other (measured faster than rows first; RESULTS.md, "GDN
decode"). It reads q / k / v as column ranges of 2-D arrays: the separate ``[B, H, D]`` arrays
flattened (:func:`recurrent_gated_delta_rule_slots`), or Qwen3.5's packed conv output with the gates projected
from the hidden state in the kernel (:func:`gated_delta_decode_slots`). Its backend-table checks
:func:`decode_slots_unsupported` / :func:`gated_decode_slots_unsupported` name the calls it cannot take.

Both update a token in one pass: ``k^T S`` and ``q^T S`` on the state as loaded,
``o = decay q^T S + (q . k) delta`` (equal in exact arithmetic to the textbook order, and measured faster), so
the new state's store does not wait for a reduction of the updated state.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.base.device import is_pow2, next_pow2
from kvjax.pallas.gdn.common import (FLAG_HAS_INITIAL, FLAG_LIVE, L2NORM_EPS, col_block, head_cols, load,
                                     on_initial_state, on_slot_pool, store, tile_mask)

BLOCK_V = 64  # value columns per program (the fastest measured; RESULTS.md, "GDN decode")


def _l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x) + L2NORM_EPS)


def zero_tokens(o_ref, h, vs, vmask, lo, hi, block_v):
    """Zero outputs ``o_ref[lo:hi, h, vs]`` (tokens of no live row; call inside a kernel)."""
    def body(t, carry):
        store(o_ref, (t, h, vs), jnp.zeros((block_v,), o_ref.dtype), vmask)
        return carry

    lax.fori_loop(lo, hi, body, 0)


def zero_outside_rows(o_ref, h, vs, vmask, n, num_rows, start, end, num_tokens, block_v):
    """Zero the outputs of the tokens outside every row: before row 0 (by row 0's programs, whose tokens start at
    ``start``) and past the last row (by its programs, whose tokens end at ``end``); call inside a kernel."""

    @pl.when(n == 0)
    def _():
        zero_tokens(o_ref, h, vs, vmask, 0, start, block_v)

    @pl.when(n == num_rows - 1)
    def _():
        zero_tokens(o_ref, h, vs, vmask, end, num_tokens, block_v)


def _delta_token(s, q, k, v, decay, beta, *, scale, use_qk_l2norm):
    """One delta-rule token on the state slice ``s: f32[Kp, block_v]`` from its loaded ``q, k: [Kp]``,
    ``v: [block_v]`` and scalar ``decay = exp(g)``, ``beta``; returns ``(new s, o: f32[block_v])``."""
    q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    ks = jnp.sum(s * k[:, None], axis=0)
    qs = jnp.sum(s * q[:, None], axis=0)
    delta = (v - decay * ks) * beta
    return s * decay + k[:, None] * delta[None, :], (decay * qs + jnp.sum(q * k) * delta) * scale


def token_update(s, q_ref, k_ref, v_ref, g_ref, beta_ref, t, h, hk, cols, *, scale, use_qk_l2norm):
    """:func:`_delta_token` of token ``t``, head ``h`` read from ``[T, H, D]`` refs (``cols = (kc, kmask, vs,
    vmask)``: the padded K lanes and the value block, :mod:`kvjax.pallas.gdn.common`)."""
    kc, kmask, vs, vmask = cols
    return _delta_token(s, load(q_ref, (t, hk, kc), kmask), load(k_ref, (t, hk, kc), kmask),
                        load(v_ref, (t, h, vs), vmask), jnp.exp(g_ref[t, h].astype(jnp.float32)),
                        beta_ref[t, h].astype(jnp.float32), scale=scale, use_qk_l2norm=use_qk_l2norm)


def _gates(x_ref, w_a_ref, w_b_ref, a_log, dt_bias, n, h):
    """Qwen3.5's gates of row ``n``, head ``h`` from the hidden state: ``a = x . w_a[h]``, ``b = x . w_b[h]``
    (f32 sums rounded to x's dtype, as the unfused projection returns them), ``decay = exp(g)`` with ``g =
    -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` rounded to x's dtype."""
    cols, mask = head_cols(x_ref.shape[1])
    x = load(x_ref, (n, cols), mask).astype(jnp.float32)
    dtype = x_ref.dtype
    a = jnp.sum(x * load(w_a_ref, (h, cols), mask).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    b = jnp.sum(x * load(w_b_ref, (h, cols), mask).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    z = a + dt_bias.astype(jnp.float32)
    softplus = jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(z)))
    g = -jnp.exp(a_log.astype(jnp.float32)) * softplus
    beta = 1.0 / (1.0 + jnp.exp(-b))
    return jnp.exp(g), beta.astype(dtype).astype(jnp.float32)


def _slots_kernel(
    slots_ref,  # i32[B]
    q_ref,  # [B, Cq]  head hk's K columns at q0 + hk * K
    k_ref,  # [B, Ck]  at k0 + hk * K
    v_ref,  # [B, Cv]  head h's V columns at v0 + h * V
    *refs,  # g f32[B, Hv], beta [B, Hv]; or (project_gates) x [B, D], w_a [Hv, D], w_b [Hv, D], A_log [Hv],
    #         dt_bias [Hv]; then pool_in f32[L, S+1, Hv, K, V] (aliased with pool), o [B, Hv, V], pool
    layer: int,
    group: int,
    scale: float,
    use_qk_l2norm: bool,
    block_v: int,
    offsets: tuple[int, int, int],
    project_gates: bool,
):
    """Decode on the GDN pool by slot: one program per state tile ``[K, block_v]`` of one (row, head); grid
    ``(value block, head, row)``. q / k / v are column ranges of 2-D arrays (separate arrays at offset 0, or the
    packed conv output); with ``project_gates`` the kernel computes ``g`` and ``beta`` from the hidden state
    (:func:`_gates`). Rows whose slot is not in ``1..S`` read and write nothing (uniform masks) and output
    zeros."""
    *gate_refs, pool_in_ref, o_ref, pool_ref = refs
    lay = jnp.asarray(layer, jnp.int32)  # an array index: interpret mode rejects a Python int under pl.when
    vb, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kd, vd = pool_in_ref.shape[3], pool_in_ref.shape[4]
    kp, (q0, k0, v0) = next_pow2(kd), offsets
    kc, kmask = head_cols(kd)
    vs, vmask = col_block(vb, block_v, vd)
    slot = slots_ref[n]
    live = (slot >= 1) & (slot < pool_in_ref.shape[1])
    slot = jnp.where(live, slot, 0)
    shape = (kp, block_v)
    mask = tile_mask(shape, kmask, vmask, jnp.full(shape, live))
    s = plt.load(pool_in_ref.at[lay, slot, h, kc, vs], mask=mask, other=0.0, eviction_policy="evict_first")
    hk = h // group
    q = load(q_ref, (n, _cols(q0, hk, kd, kp)), kmask)
    k = load(k_ref, (n, _cols(k0, hk, kd, kp)), kmask)
    v = load(v_ref, (n, _cols(v0, h, vd, block_v, vb)), vmask)
    if project_gates:
        x_ref, w_a_ref, w_b_ref, a_log_ref, dt_bias_ref = gate_refs
        decay, beta = _gates(x_ref, w_a_ref, w_b_ref, a_log_ref[h], dt_bias_ref[h], n, h)
    else:
        g_ref, beta_ref = gate_refs
        decay, beta = jnp.exp(g_ref[n, h].astype(jnp.float32)), beta_ref[n, h].astype(jnp.float32)
    s, o = _delta_token(s, q, k, v, decay, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)
    store(o_ref, (n, h, vs), jnp.where(live, o, 0.0).astype(o_ref.dtype), vmask)
    plt.store(pool_ref.at[lay, slot, h, kc, vs], s, mask=mask, eviction_policy="evict_first")


def _cols(base: int, head: jax.Array, dim: int, width: int, block: jax.Array | None = None):
    """``width`` columns of a 2-D ref from ``base + head * dim`` (plus ``block * width`` for a value block)."""
    start = base + head * dim + (0 if block is None else block * width)
    align = math.gcd(base, dim, width if block is not None else dim)
    return pl.ds(pl.multiple_of(start, align) if align > 1 else start, width)


def _recurrent_kernel(
    *refs,
    group: int,
    scale: float,
    use_qk_l2norm: bool,
    block_v: int,
    num_tokens: int,
    one_token_per_row: bool,
):
    """Refs: ``cu i32[N+1], rows i32[N], flags i32[N], q, k, v, g, beta, pool_in, o, pool`` with a pool
    ``f32[R, Hv, K, V]`` indexed by ``rows``."""
    cu_ref, rows_ref, flags_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in_ref, o_ref, pool_ref = refs
    n, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs = pl.num_programs(0)
    hk = h // group
    kd, vd = pool_in_ref.shape[-2], pool_in_ref.shape[-1]
    kc, kmask = head_cols(kd)
    vs, vmask = col_block(vb, block_v, vd)
    if one_token_per_row:  # decode: token n belongs to row n (cu_seqlens == arange(N + 1))
        start, end = n, n + 1
    else:
        start, end = cu_ref[n], cu_ref[n + 1]
    row = rows_ref[n]
    flags = flags_ref[n]
    live = (flags & FLAG_LIVE) != 0
    has_init = (flags & FLAG_HAS_INITIAL) != 0
    state_in, state_out = pool_in_ref.at[row, h, kc, vs], pool_ref.at[row, h, kc, vs]
    shape = (next_pow2(kd), block_v)

    @pl.when(live)
    def _():
        s0 = plt.load(state_in, mask=tile_mask(shape, kmask, vmask, jnp.full(shape, has_init)), other=0.0,
                      eviction_policy="evict_first")

        def step(t, s):  # s: f32[Kp, block_v]
            s, o = token_update(s, q_ref, k_ref, v_ref, g_ref, beta_ref, t, h, hk, (kc, kmask, vs, vmask),
                                 scale=scale, use_qk_l2norm=use_qk_l2norm)
            store(o_ref, (t, h, vs), o.astype(o_ref.dtype), vmask)
            return s

        s = step(start, s0) if one_token_per_row else lax.fori_loop(start, end, step, s0)
        plt.store(state_out, s, mask=tile_mask(shape, kmask, vmask), eviction_policy="evict_first")

    @pl.when(jnp.logical_not(live))
    def _():
        zero_tokens(o_ref, h, vs, vmask, start, end, block_v)

    if not one_token_per_row:
        zero_outside_rows(o_ref, h, vs, vmask, n, num_seqs, start, end, num_tokens, block_v)


def _block_v(vd: int, block_v: int | None) -> int:
    """Value columns per program: ``block_v`` (default :data:`BLOCK_V`, a power of two), at most V padded to a
    power of two; blocks that overrun V are masked."""
    if block_v is not None and not is_pow2(block_v):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    return min(next_pow2(vd), block_v or BLOCK_V)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm", "block_v", "num_warps", "one_token_per_row", "interpret"),
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
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, V] in v's dtype, pool f32[R, Hv, K, V])
    """Stepwise gated delta rule reading/writing states in ``pool`` at ``rows``; returns ``(o, pool)``.

    Non-live rows (``flags & FLAG_LIVE == 0``) are neither read nor written and their tokens get ``o = 0``.
    ``one_token_per_row=True`` is the decode form: it needs ``T == N`` and ignores ``cu_seqlens`` (row ``n``
    owns token ``n``). Any K and V (padded to power-of-two blocks in the kernel); ``block_v`` a power of two.
    """
    num_tokens, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    if one_token_per_row and num_tokens != rows.shape[0]:
        raise ValueError(f"one_token_per_row needs one token per row: T={num_tokens}, N={rows.shape[0]}")
    bv = _block_v(vd, block_v)
    kernel = functools.partial(_recurrent_kernel, group=hv // hk, scale=scale, use_qk_l2norm=use_qk_l2norm,
                               block_v=bv, num_tokens=num_tokens, one_token_per_row=one_token_per_row)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, hv, vd), v.dtype),
            jax.ShapeDtypeStruct(pool.shape, jnp.float32),
        ),
        grid=(rows.shape[0], hv, pl.cdiv(vd, bv)),
        input_output_aliases={8: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_recurrent",
    )(cu_seqlens, rows, flags, q, k, v, g, beta, pool)


def _slots_call(slot_ids, q, k, v, gates: tuple, ssm, *, hk: int, offsets, layer, scale, use_qk_l2norm, block_v,
                num_warps, interpret):
    """The slot kernel on 2-D ``q, k, v`` column ranges (``offsets``); ``gates``: ``(g, beta)``, or ``(x, w_a,
    w_b, A_log, dt_bias)`` to compute them in the kernel. Returns ``(o [B, Hv, V] in v's dtype, ssm)``."""
    num_tokens = slot_ids.shape[0]
    hv, vd = ssm.shape[2], ssm.shape[4]
    bv = _block_v(vd, block_v)
    kernel = functools.partial(_slots_kernel, layer=layer, group=hv // hk, scale=scale,
                               use_qk_l2norm=use_qk_l2norm, block_v=bv, offsets=offsets,
                               project_gates=len(gates) == 5)
    args = (slot_ids, q, k, v, *gates, ssm)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, hv, vd), v.dtype),
            jax.ShapeDtypeStruct(ssm.shape, jnp.float32),
        ),
        grid=(pl.cdiv(vd, bv), hv, num_tokens),
        input_output_aliases={len(args) - 1: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_decode_slots",
    )(*args)


@functools.partial(
    jax.jit,
    static_argnames=("layer", "scale", "use_qk_l2norm", "block_v", "num_warps", "interpret"),
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
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (o [B, Hv, V] in v's dtype, ssm f32[L, S+1, Hv, K, V])
    """Decode step straight on the GDN pool: row ``b`` continues the state at ``ssm[layer, slot_ids[b]]``.

    No XLA work around the kernel (no row/flag arrays): the slot ids index the pool inside the kernel.
    Rows whose slot is not in ``1..S`` are padding: nothing read or written, ``o = 0``. Defaults: the fastest
    configuration measured (block_v 64, 4 warps; RESULTS.md, "GDN decode").
    """
    num_tokens, hk, _ = q.shape
    if num_tokens != slot_ids.shape[0]:
        raise ValueError(f"one token per row: q has {num_tokens} tokens, slot_ids {slot_ids.shape[0]} rows")
    flat = lambda x: x.reshape(num_tokens, -1)  # noqa: E731  (a bitcast: the head columns stay in place)
    return _slots_call(slot_ids, flat(q), flat(k), flat(v), (g, beta), ssm, hk=hk, offsets=(0, 0, 0),
                       layer=layer, scale=scale, use_qk_l2norm=use_qk_l2norm, block_v=block_v,
                       num_warps=num_warps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret"), donate_argnames=("ssm",))
def gated_delta_decode_slots(
    call,  # kvjax.ops.gdn_on_pool.GatedDecodeCall: qkv [B, 2*Hk*K + Hv*V], x [B, D], w_a / w_b [Hv, D],
    #        a_log / dt_bias [Hv], slot_ids i32[B] (0 or out of range = padding row); static layer, scale, l2norm
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]  GDN pool, donated, updated in place
    *,
    block_v: int | None = None,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (o [B, Hv, V] in qkv's dtype, ssm f32[L, S+1, Hv, K, V])
    """Backend ``"slots"`` of ``gated_delta_decode_pool``: :func:`recurrent_gated_delta_rule_slots` reading
    q / k / v from the packed conv output by column and computing Qwen3.5's gates in the kernel from the hidden
    state (:func:`_gates`): no XLA op between the conv and the kernel, none for the gates. ``Hk`` follows from
    the widths. The op checked the call (``kvjax.ops.gdn_on_pool.validate_gated_call``)."""
    hv, kd, vd = ssm.shape[2:]
    hk = (call.qkv.shape[1] - hv * vd) // (2 * kd)
    gates = (call.x, call.w_a, call.w_b, call.a_log, call.dt_bias)
    return _slots_call(call.slot_ids, call.qkv, call.qkv, call.qkv, gates, ssm, hk=hk,
                       offsets=(0, hk * kd, 2 * hk * kd), layer=call.layer, scale=call.scale,
                       use_qk_l2norm=call.use_qk_l2norm, block_v=block_v, num_warps=num_warps, interpret=interpret)


# ---------------------------------------------------------------------------------------- backend-table entries
recurrent_gated_delta_rule_pallas = on_initial_state(
    recurrent_gated_delta_rule_pool,
    """Kernel of ``kvjax.ops.recurrent_gated_delta_rule`` (backend ``"pallas"``).""")

gdn_decode_pool_pallas = on_slot_pool(
    recurrent_gated_delta_rule_pool,
    """Backend ``"pallas"`` of ``gdn_decode_pool``: the rows/flags kernel on the flattened pool (any call).""",
    one_token_flag=True)


def gdn_decode_slots_pallas(
    call,  # kvjax.ops.gdn.DeltaRuleCall: q / k [B, Hk, K], v [B, Hv, V], g f32[B, Hv], beta [B, Hv], slot_ids i32[B]
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (o [B, Hv, V], new ssm)
    """Backend ``"slots"`` of ``gdn_decode_pool``: :func:`recurrent_gated_delta_rule_slots` (the calls
    :func:`decode_slots_unsupported` accepts)."""
    return recurrent_gated_delta_rule_slots(call.q, call.k, call.v, call.g, call.beta, ssm, slot_ids=call.slot_ids,
                                            layer=call.layer, scale=call.scale, use_qk_l2norm=call.use_qk_l2norm,
                                            interpret=interpret)


def decode_slots_unsupported(call, ssm) -> str | None:  # a DeltaRuleCall of gdn_decode_pool, f32[L, S+1, Hv, K, V]
    """Why the slot decode kernel cannot take a ``gdn_decode_pool`` call, or ``None``: it needs one token per
    row (``cu_seqlens=None``), every live row continuing its state (``has_initial_state=None``) and a static
    Python-int ``layer`` (any K, V)."""
    del ssm
    if call.cu_seqlens is not None:
        return "the slot decode kernel takes one token per row (cu_seqlens=None)"
    if call.has_initial_state is not None:
        return "the slot decode kernel continues every live row's state (has_initial_state=None)"
    return layer_unsupported(call.layer)


def layer_unsupported(layer, kernel: str = "the slot decode kernel") -> str | None:
    """Why ``kernel``, which indexes the pool by a static Python int, cannot take ``layer`` (``None``: it can)."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        return f"{kernel} needs a static Python-int layer, got a traced one ({type(layer).__name__})"
    return None
