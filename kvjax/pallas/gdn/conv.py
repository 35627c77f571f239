"""Depthwise causal conv1d on the slot-addressed GDN conv pool as Pallas kernels (Triton lowering).

The pool ``conv: [L, S+1, D, W-1]`` holds, per (layer, slot), the last ``W-1`` conv inputs of each channel,
oldest column first; the ``W-1`` columns of a channel are contiguous, so a kernel reads or writes column ``j``
of a block of channels as one strided vector. A slot id outside ``1..S`` marks a padding row: its state is
neither read nor written and its outputs are zero. Everything is computed in float32.

- :func:`conv_update_slots` (decode, one token per row): one program per (row, block of channels) reads the
  row's state, computes ``y = act(sum_j w[:, j] * window[:, j] + bias)`` with ``window = [state, x]`` and
  writes the shifted state back in place (pool aliased input -> output, donated under jit).
- :func:`conv_prefill_slots` (varlen prefill): a token-block kernel computes ``y``; a block of tokens may
  straddle sequences, each token takes its window from its own sequence's inputs and, for its first ``W-1``
  positions, from the sequence's initial state (a per-token gather). A second kernel, one program per
  (sequence, block of channels), writes each live row's final state (the last ``W-1`` inputs, from the
  initial state when the sequence is shorter) into the pool in place. It takes ``y`` as an (unread) operand
  so XLA orders it after the ``y`` kernel that reads the initial states: no pool copy, no read-after-write
  race. The per-token metadata (position in its sequence, slot to read) is one small fused XLA op with static
  shapes (``count_le`` broadcast compare, no ``searchsorted`` scan).

Both wrappers take the normalised call ``(call, conv)`` of the pool ops ``conv_prefill_pool`` / ``conv_decode_pool``
(:mod:`kvjax.ops.conv`, backend ``"pallas"``; ``call`` a ``ConvPoolCall``) plus launch tuning.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kvjax.base.device import is_pow2, next_pow2
from kvjax.base.ragged import count_le


def _act(y, activation):
    return y * jax.nn.sigmoid(y) if activation == "silu" else y


def _and(a, b):
    """Combine optional masks (``None`` = all true: lets Triton vectorise unmasked channel blocks)."""
    if a is None or b is None:
        return b if a is None else a
    return a & b


def _load(ref, mask, other=0.0):
    return plt.load(ref) if mask is None else plt.load(ref, mask=mask, other=other)


def _channel_mask(d0, block_d: int, dim: int):
    return None if dim % block_d == 0 else d0 + jnp.arange(block_d) < dim


def _row_program(layer_ref, slots_ref, x_ref, pool_in_ref, block_d: int):
    """A (row, channel block) program's place: ``(row, channels, channel mask, layer, slot, live)``; a row is
    live iff its slot is in ``1..S`` (else it is padding)."""
    row, db = pl.program_id(0), pl.program_id(1)
    d0 = pl.multiple_of(db * block_d, block_d)
    ds = pl.ds(d0, block_d)
    dmask = _channel_mask(d0, block_d, x_ref.shape[1])
    slot = slots_ref[row]
    layer = layer_ref[0]
    live = (slot >= 1) & (slot < pool_in_ref.shape[1])
    return row, ds, dmask, layer, slot, live


def _weights(w_ref, b_ref, ds, dmask, width):
    w = [_load(w_ref.at[ds, jnp.int32(j)], dmask, 0.0).astype(jnp.float32) for j in range(width)]
    b = None if b_ref is None else _load(b_ref.at[ds], dmask, 0.0).astype(jnp.float32)
    return w, b


def _conv(window, w, b, activation):
    y = window[0] * w[0]
    for col, wj in zip(window[1:], w[1:]):
        y = y + col * wj
    if b is not None:
        y = y + b
    return _act(y, activation)


# ------------------------------------------------------------------------------------------------ decode
def _update_kernel(*refs, width: int, block_d: int, has_bias: bool, activation):
    """Refs: ``layer i32[1], slots i32[B], x [B, D], w [D, W], (bias [D]), pool_in, y [B, D], pool``."""
    if has_bias:
        layer_ref, slots_ref, x_ref, w_ref, b_ref, pool_in_ref, y_ref, pool_ref = refs
    else:
        layer_ref, slots_ref, x_ref, w_ref, pool_in_ref, y_ref, pool_ref = refs
        b_ref = None
    b, ds, dmask, layer, slot, live = _row_program(layer_ref, slots_ref, x_ref, pool_in_ref, block_d)

    @pl.when(live)
    def _():
        cols = [_load(pool_in_ref.at[layer, slot, ds, jnp.int32(j)], dmask, 0.0).astype(jnp.float32)
                for j in range(width - 1)]
        cols.append(_load(x_ref.at[b, ds], dmask, 0.0).astype(jnp.float32))
        w, bias = _weights(w_ref, b_ref, ds, dmask, width)
        plt.store(y_ref.at[b, ds], _conv(cols, w, bias, activation).astype(y_ref.dtype), mask=dmask)
        for j in range(width - 1):
            plt.store(pool_ref.at[layer, slot, ds, jnp.int32(j)], cols[j + 1].astype(pool_ref.dtype), mask=dmask)

    @pl.when(jnp.logical_not(live))
    def _():
        plt.store(y_ref.at[b, ds], jnp.zeros((block_d,), y_ref.dtype), mask=dmask)


def _update_call(x, weight, bias, conv, layer, slot_ids, *, activation, block_d, num_warps, interpret):
    batch, dim = x.shape
    width = weight.shape[1]
    kernel = functools.partial(_update_kernel, width=width, block_d=block_d, has_bias=bias is not None,
                               activation=activation)
    args = [layer, slot_ids, x, weight] + ([] if bias is None else [bias]) + [conv]
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((batch, dim), x.dtype), jax.ShapeDtypeStruct(conv.shape, conv.dtype)),
        grid=(batch, pl.cdiv(dim, block_d)),
        input_output_aliases={len(args) - 1: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="conv_update_slots",
    )(*args)


# ------------------------------------------------------------------------------------------------ prefill
def _prefill_y_kernel(*refs, width: int, block_t: int, block_d: int, has_bias: bool, activation):
    """Refs: ``layer i32[1], tok_pos i32[T], tok_slot i32[T], x [T, D], w, (bias), pool [L, S+1, D, W-1], y``.

    ``tok_pos[t]``: position of token ``t`` in its sequence (-1: outside every sequence or in a padding row:
    ``y = 0``); ``tok_slot[t]``: the pool slot holding its sequence's initial state, 0 = start from zeros."""
    if has_bias:
        layer_ref, pos_ref, slot_ref, x_ref, w_ref, b_ref, pool_ref, y_ref = refs
    else:
        layer_ref, pos_ref, slot_ref, x_ref, w_ref, pool_ref, y_ref = refs
        b_ref = None
    tb, db = pl.program_id(0), pl.program_id(1)
    num_tokens, dim = x_ref.shape
    t0 = pl.multiple_of(tb * block_t, block_t)
    d0 = pl.multiple_of(db * block_d, block_d)
    t = t0 + jnp.arange(block_t)
    d = (d0 + jnp.arange(block_d))[None, :]  # gather form: contiguous along channels, no clamp
    tmask = None if num_tokens % block_t == 0 else t < num_tokens
    dmask = _channel_mask(d0, block_d, dim)
    dmask2 = None if dmask is None else dmask[None, :]
    pos = _load(pos_ref.at[pl.ds(t0, block_t)], tmask, -1)
    slot = _load(slot_ref.at[pl.ds(t0, block_t)], tmask, 0)
    slot = jnp.where(pos >= 0, slot, 0)
    layer = layer_ref[0]
    w, bias = _weights(w_ref, b_ref, pl.ds(d0, block_d), dmask, width)
    window = []
    for j in range(width):
        s = width - 1 - j  # this column holds the input s steps before the token
        if s == 0:
            xv = _load(x_ref.at[pl.ds(t0, block_t), pl.ds(d0, block_d)],
                       _and(None if tmask is None else tmask[:, None], dmask2))
            window.append(xv.astype(jnp.float32))
            continue
        rows = jnp.clip(t - s, 0, num_tokens - 1)[:, None]
        xv = _load(x_ref.at[rows, d], _and((pos >= s)[:, None], dmask2), 0.0)
        from_state = ((pos >= 0) & (pos < s) & (slot > 0))[:, None]
        col = jnp.clip(pos + width - 1 - s, 0, width - 2)[:, None]
        sv = _load(pool_ref.at[layer, slot[:, None], d, col], _and(from_state, dmask2), 0.0)
        window.append(xv.astype(jnp.float32) + sv.astype(jnp.float32))
    y = _conv(window, [wj[None, :] for wj in w], None if bias is None else bias[None, :], activation)
    y = jnp.where((pos >= 0)[:, None], y, 0.0)
    plt.store(y_ref.at[pl.ds(t0, block_t), pl.ds(d0, block_d)], y.astype(y_ref.dtype),
              mask=_and(None if tmask is None else tmask[:, None], dmask2))


def _final_state_kernel(layer_ref, cu_ref, slots_ref, read_ref, x_ref, y_ref, pool_in_ref, pool_ref, *,
                        width: int, block_d: int):
    """One (sequence, channel block): final state = last ``W-1`` inputs, from the initial state if short.

    ``y_ref`` is not read: it only orders this kernel after the ``y`` kernel (see the module docstring)."""
    del y_ref
    n, ds, dmask, layer, slot, live = _row_program(layer_ref, slots_ref, x_ref, pool_in_ref, block_d)

    @pl.when(live)
    def _():
        start = cu_ref[n]
        length = cu_ref[n + 1] - start
        read = read_ref[n] != 0
        cols = []
        for c in range(width - 1):
            rel = length - (width - 1) + c  # >= 0: input at position rel of the sequence; else state column
            xv = plt.load(x_ref.at[jnp.minimum(start + jnp.maximum(rel, 0), x_ref.shape[0] - 1), ds],
                          mask=_and(dmask, jnp.full((block_d,), rel >= 0)), other=0.0)
            sv = plt.load(pool_in_ref.at[layer, slot, ds, jnp.clip(rel + width - 1, 0, width - 2)],
                          mask=_and(dmask, jnp.full((block_d,), (rel < 0) & read)), other=0.0)
            cols.append(jnp.where(rel >= 0, xv.astype(pool_ref.dtype), sv.astype(pool_ref.dtype)))
        for c in range(width - 1):
            plt.store(pool_ref.at[layer, slot, ds, jnp.int32(c)], cols[c], mask=dmask)


def _prefill_calls(x, weight, bias, conv, layer, tok_pos, tok_slot, cu_seqlens, slot_ids, read, *, activation,
                   block_t, block_d, num_warps, interpret):
    num_tokens, dim = x.shape
    width = weight.shape[1]
    has_bias = bias is not None
    y_kernel = functools.partial(_prefill_y_kernel, width=width, block_t=block_t, block_d=block_d,
                                 has_bias=has_bias, activation=activation)
    args = [layer, tok_pos, tok_slot, x, weight] + ([bias] if has_bias else []) + [conv]
    y = pl.pallas_call(
        y_kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, dim), x.dtype),
        grid=(pl.cdiv(num_tokens, block_t), pl.cdiv(dim, block_d)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="conv_prefill_y",
    )(*args)
    state_block = min(block_d * 2, 1024)
    final_kernel = functools.partial(_final_state_kernel, width=width, block_d=state_block)
    conv = pl.pallas_call(
        final_kernel,
        out_shape=jax.ShapeDtypeStruct(conv.shape, conv.dtype),
        grid=(slot_ids.shape[0], pl.cdiv(dim, state_block)),
        input_output_aliases={6: 0},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="conv_prefill_final_state",
    )(layer, cu_seqlens, slot_ids, read, x, y, conv)
    return y, conv


def prefill_metadata(
    cu_seqlens: jax.Array,  # i32[N+1]
    slot_ids: jax.Array,  # i32[N]
    has_initial_state: jax.Array,  # bool[N]
    num_tokens: int,
    num_slots: int,  # S + 1
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (tok_pos i32[T], tok_slot i32[T], read i32[N])
    """Per token: position in its sequence (-1 outside every sequence or in a padding row) and the slot to
    read the initial state from (0 = zeros); per sequence: 1 if its initial state is read from the pool."""
    num_seqs = slot_ids.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.clip(count_le(cu_seqlens, t) - 1, 0, num_seqs - 1)
    live = (slot_ids >= 1) & (slot_ids < num_slots)
    read = live & has_initial_state
    inside = (t >= cu_seqlens[0]) & (t < cu_seqlens[num_seqs]) & live[row]
    tok_pos = jnp.where(inside, t - cu_seqlens[row], -1).astype(jnp.int32)
    tok_slot = jnp.where(read[row], slot_ids[row], 0).astype(jnp.int32)
    return tok_pos, tok_slot, read.astype(jnp.int32)


# ------------------------------------------------------------------------------------------------ wrappers
def _block(dim: int, block: int) -> int:
    if not is_pow2(block):
        raise ValueError(f"the Pallas conv kernels need a power-of-two block size, got {block}")
    return min(block, next_pow2(dim))


def _layer_array(layer) -> jax.Array:  # i32[1]
    return jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


@functools.partial(jax.jit, static_argnames=("block_d", "num_warps", "interpret"), donate_argnames=("conv",))
def conv_update_slots(
    call,  # kvjax.ops.conv.ConvPoolCall (decode): x [B, D] one token per row, weight [D, W], bias [D] | None,
    #        layer (int or i32[]), slot_ids i32[B] (outside 1..S = padding row); static activation
    conv: jax.Array,  # [L, S+1, D, W-1]  GDN conv pool, donated, updated in place
    *,
    block_d: int = 256,
    num_warps: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (y [B, D] in x's dtype, conv pool)
    """Decode conv update straight on the pool: row ``b`` uses and shifts the state at ``conv[layer,
    slot_ids[b]]``. Padding rows: nothing read or written, ``y = 0``."""
    x = call.x
    return _update_call(x, call.weight, call.bias, conv, _layer_array(call.layer), call.slot_ids,
                        activation=call.activation, block_d=_block(x.shape[1], block_d), num_warps=num_warps,
                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_t", "block_d", "num_warps", "interpret"),
                   donate_argnames=("conv",))
def conv_prefill_slots(
    call,  # kvjax.ops.conv.ConvPoolCall (prefill): x [T, D], weight [D, W], bias [D] | None, layer, slot_ids
    #        i32[N] (outside 1..S = padding row), has_initial_state bool[N], cu_seqlens i32[N+1]; static activation
    conv: jax.Array,  # [L, S+1, D, W-1]  GDN conv pool, donated, updated in place
    *,
    block_t: int = 32,
    block_d: int = 128,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (y [T, D] in x's dtype, conv pool)
    """Varlen causal conv1d starting from ``conv[layer, slot_ids[n]]`` where ``has_initial_state[n]`` (else
    zeros); each live row's final state is written back there. Padding rows and tokens outside every
    sequence: ``y = 0``, nothing read or written."""
    x, slot_ids, cu_seqlens = call.x, call.slot_ids, call.cu_seqlens
    num_tokens, dim = x.shape
    tok_pos, tok_slot, read = prefill_metadata(cu_seqlens, slot_ids, call.has_initial_state, num_tokens,
                                               conv.shape[1])
    return _prefill_calls(
        x, call.weight, call.bias, conv, _layer_array(call.layer), tok_pos, tok_slot, cu_seqlens, slot_ids, read,
        activation=call.activation, block_t=_block(max(num_tokens, 1), block_t), block_d=_block(dim, block_d),
        num_warps=num_warps, interpret=interpret,
    )
