"""Depthwise causal conv1d over a ragged batch (the GDN q/k/v short conv), with carried conv state.

For a sequence with tokens ``x_0 .. x_{L-1}`` and a state ``s: [D, W-1]`` holding the ``W-1`` inputs that
precede it (oldest first, ``s[:, -1]`` the most recent; zeros if ``initial_state`` is ``None``)::

    window_t = [s, x_0, .., x_{L-1}][t : t + W]               # the W inputs ending at x_t
    y_t      = act(sum_w weight[:, w] * window_t[w] + bias)    # act: None or "silu"
    final    = [s, x_0, .., x_{L-1}][-(W-1):]                  # the last W-1 inputs (state for short L)

This is Hugging Face transformers' ``causal_conv1d_update`` (qwen3_5 modeling) with a ``W-1`` state; HF's
cache keeps ``W`` columns, the oldest of which never reaches an output. Tokens outside every sequence (padding
of a static bucket) get ``y = 0``; an empty sequence returns its initial state.

The public ops validate on the host and call what their backend table chooses for ``impl`` (kernels with an
extra ``interpret=``); the normalised calls::

    causal_conv1d:        fn(x, weight, bias, *, cu_seqlens, initial_state, activation)
        # x [T, D]; weight [D, W]; bias [D] | None; cu_seqlens i32[N+1] (may be traced);
        # initial_state [N, D, W-1] | None; activation None | "silu"
        -> (y: [T, D] in x's dtype, final_state: [N, D, W-1] in initial_state's dtype, else x's)
    causal_conv1d_update: fn(x, conv_state, weight, bias, *, activation)   # x [B, D]; conv_state [B, D, W-1]
        -> (y: [B, D] in x's dtype, new_state: [B, D, W-1] in conv_state's dtype)

Both have only their reference (no kernel; :data:`CONV_TABLE`, :data:`UPDATE_TABLE`). The references compute
in float32.

On the GDN conv pool ``conv: [L, S+1, D, W-1]`` (slot convention of :mod:`kvjax.base.slots`: padding rows,
slot ids outside ``1..S``, read and write nothing and get ``y = 0``; slot 0 is never written) a call is one
:class:`ConvPoolCall` (built once, checked once by :func:`check_pool_call`, handed down unchanged)::

    conv_prefill_pool:    fn(call, conv)   # call: x [T, D], weight, bias, layer, slot_ids i32[N],
                                           #       has_initial_state bool[N], cu_seqlens i32[N+1], activation
    conv_decode_pool:     fn(call, conv)   # call: x [B, D], weight, bias, layer, slot_ids i32[B], activation
        -> (y, new conv)

Reference = the fused XLA path (gather by slot, reference above, scatter). Backend ``"pallas"`` =
:mod:`kvjax.pallas.gdn.conv` (in place by slot id, any CUDA GPU); ``auto`` takes it there: the decode update is
faster than XLA's and prefill a near tie (RESULTS.md, "Causal conv1d on the pool").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.base.checks import check_array, check_cu_seqlens, check_float, check_int32
from kvjax.base.ragged import count_le
from kvjax.ops.backends import Backend, BackendTable
from kvjax.pallas.gdn import conv as conv_kernels
from kvjax.base.slots import check_slot_ids, live_slots, slot_index, static_layer

CONV_OP = "causal_conv1d"
UPDATE_OP = "causal_conv1d_update"
CONV_PREFILL_OP = "conv_prefill_pool"
CONV_DECODE_OP = "conv_decode_pool"
ACTIVATIONS = (None, "silu")


def _activate(y, activation):
    return jax.nn.silu(y) if activation == "silu" else y


def _conv_out(window, weight, bias, activation):
    """``window: f32[..., D, W]`` -> ``f32[..., D]``."""
    y = jnp.sum(window * weight.astype(jnp.float32), axis=-1)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return _activate(y, activation)


@functools.partial(jax.jit, static_argnames=("activation",))
def causal_conv1d_reference(
    x: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None = None,  # [D]
    *,
    cu_seqlens: jax.Array,  # i32[N+1]
    initial_state: jax.Array | None = None,  # [N, D, W-1]; None = zeros
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:  # (y [T, D] in x's dtype, final state [N, D, W-1])
    """Varlen causal conv1d with initial/final state (see the module docstring for the contract)."""
    num_tokens, dim = x.shape
    width = weight.shape[1]
    cu_seqlens = jnp.asarray(cu_seqlens)
    num_seqs = cu_seqlens.shape[0] - 1
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    if initial_state is None:
        init = jnp.zeros((num_seqs, width - 1, dim), jnp.float32)
    else:
        init = jnp.asarray(initial_state, jnp.float32).transpose(0, 2, 1)  # f32[N, W-1, D], oldest first
    xf = x.astype(jnp.float32)

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens, t, side="right", method="compare_all").astype(jnp.int32) - 1
    valid = (seq >= 0) & (seq < num_seqs)
    seq = jnp.clip(seq, 0, num_seqs - 1)
    pos = t - cu_seqlens[seq]  # i32[T]

    # window[t, w] is the input at position pos - (W-1-w) of token t's sequence; negative: from the state.
    src = pos[:, None] - (width - 1) + jnp.arange(width)[None, :]  # i32[T, W]
    from_x = xf[jnp.clip(t[:, None] - pos[:, None] + src, 0, num_tokens - 1)]  # f32[T, W, D]
    from_state = init[seq[:, None], jnp.clip(src + width - 1, 0, width - 2)]  # f32[T, W, D]
    window = jnp.where((src >= 0)[..., None], from_x, from_state)
    y = _conv_out(window.transpose(0, 2, 1), weight, bias, activation)
    y = jnp.where(valid[:, None], y, 0.0).astype(x.dtype)

    # final[n, j] is the input at position len_n - (W-1) + j; negative: from the initial state.
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    rel = lens[:, None] - (width - 1) + jnp.arange(width - 1)[None, :]  # i32[N, W-1]
    last_x = xf[jnp.clip(cu_seqlens[:-1, None] + rel, 0, num_tokens - 1)]  # f32[N, W-1, D]
    last_state = init[jnp.arange(num_seqs)[:, None], jnp.clip(rel + width - 1, 0, width - 2)]
    final = jnp.where((rel >= 0)[..., None], last_x, last_state).transpose(0, 2, 1)
    return y, final.astype(state_dtype)


@functools.partial(jax.jit, static_argnames=("activation",))
def causal_conv1d_update_reference(
    x: jax.Array,  # [B, D]
    conv_state: jax.Array,  # [B, D, W-1], oldest column first
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None = None,  # [D]
    *,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:  # (y [B, D] in x's dtype, new state [B, D, W-1] in conv_state's dtype)
    """One new token per row (decode); see the module docstring for the contract."""
    window = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)[:, :, None]], axis=-1)
    y = _conv_out(window, weight, bias, activation)  # f32[B, D]
    return y.astype(x.dtype), window[:, :, 1:].astype(conv_state.dtype)


def _check_weights(weight, bias, dim: int, activation) -> int:
    check_float("weight", weight, rank=2)
    if weight.shape[0] != dim:
        raise ValueError(f"weight must have shape (D={dim}, W), got {tuple(weight.shape)}")
    width = weight.shape[1]
    if width < 2:
        raise ValueError(f"weight must have a kernel width W >= 2, got shape {tuple(weight.shape)}")
    if bias is not None:
        check_float("bias", bias, shape=(dim,))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return width


def _check_impl(impl) -> None:
    if not isinstance(impl, str):
        raise ValueError(f"impl must be a string, got {impl!r}")


def causal_conv1d(
    x: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None = None,  # [D]
    *,
    cu_seqlens: jax.Array,  # i32[N+1]
    initial_state: jax.Array | None = None,  # [N, D, W-1]
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv1d over a ragged batch, starting from (and returning) each sequence's conv state.

    Returns ``(y: [T, D] in x's dtype, final_state: [N, D, W-1])``: the last ``W-1`` inputs of each sequence,
    taken from the initial state where the sequence is shorter than ``W-1`` (dtype of ``initial_state``, else
    of ``x``). Raises ``ValueError`` naming a bad argument, ``UnknownImplError`` for an unavailable ``impl``.
    """
    check_float("x", x, rank=2)
    num_tokens, dim = x.shape
    width = _check_weights(weight, bias, dim, activation)
    check_cu_seqlens(cu_seqlens, num_tokens)
    if initial_state is not None:
        check_float("initial_state", initial_state, shape=(cu_seqlens.shape[0] - 1, dim, width - 1))
    _check_impl(impl)
    args, kwargs = (x, weight, bias), dict(cu_seqlens=cu_seqlens, initial_state=initial_state, activation=activation)
    return CONV_TABLE.choose(impl, args, kwargs)[1](*args, **kwargs)


def causal_conv1d_update(
    x: jax.Array,  # [B, D]
    conv_state: jax.Array,  # [B, D, W-1]
    weight: jax.Array,  # [D, W]
    bias: jax.Array | None = None,  # [D]
    *,
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """One decode token per row: ``(y: [B, D] in x's dtype, new_state: [B, D, W-1] in conv_state's dtype)``.

    ``new_state`` is ``conv_state`` shifted left by one column with ``x`` appended. Nothing is updated in place.
    """
    check_float("x", x, rank=2)
    batch, dim = x.shape
    width = _check_weights(weight, bias, dim, activation)
    check_float("conv_state", conv_state, shape=(batch, dim, width - 1))
    _check_impl(impl)
    args, kwargs = (x, conv_state, weight, bias), dict(activation=activation)
    return UPDATE_TABLE.choose(impl, args, kwargs)[1](*args, **kwargs)



# ---------------------------------------------------------------------------------------------- on the GDN pool
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvPoolCall:
    """One conv call on the GDN conv pool, built once (the pool functions of :mod:`kvjax.state.gdn_pool`) and
    handed unchanged to the op's check, its backend table and the chosen kernel; the pool array goes beside it.
    ``cu_seqlens`` (with ``has_initial_state``) makes it a prefill call; ``None``: decode, one token per row. A
    pytree: ``activation`` is static, every other field a leaf."""

    x: jax.Array  # [T, D] prefill, [B, D] decode
    weight: jax.Array  # [D, W]
    bias: jax.Array | None  # [D]
    layer: int | jax.Array  # the GDN layer (a Python int, or i32[])
    slot_ids: jax.Array  # i32[N]  outside 1..S = padding row
    has_initial_state: jax.Array | None = None  # bool[N] prefill: read the slot's state (else zeros)
    cu_seqlens: jax.Array | None = None  # i32[N+1] prefill; None = decode
    activation: str | None = dataclasses.field(default="silu", metadata=dict(static=True))


def _pool_rows(conv_pool, layer, slot_ids, has_initial_state):
    num_slots = conv_pool.shape[1]
    live = live_slots(slot_ids, num_slots)
    idx = slot_index(slot_ids, num_slots)
    read = live if has_initial_state is None else live & has_initial_state
    state = conv_pool.at[layer, idx].get(mode="fill", fill_value=0)
    return live, idx, jnp.where(read[:, None, None], state, jnp.zeros((), state.dtype))


def conv_prefill_pool_reference(
    call: ConvPoolCall,  # a prefill call
    conv_pool: jax.Array,  # [L, S+1, D, W-1]
) -> tuple[jax.Array, jax.Array]:  # (y [T, D], new conv pool)
    """Oracle (and the fused-XLA path): gather the initial states, ``causal_conv1d_reference``, zero the
    padding rows' outputs, scatter the final states (slot 0 and out-of-range ids dropped)."""
    x, slot_ids, cu_seqlens = call.x, call.slot_ids, call.cu_seqlens
    live, idx, init = _pool_rows(conv_pool, call.layer, slot_ids, call.has_initial_state)
    y, final = causal_conv1d_reference(x, call.weight, call.bias, cu_seqlens=cu_seqlens, initial_state=init,
                                       activation=call.activation)
    row = jnp.clip(count_le(cu_seqlens, jnp.arange(x.shape[0], dtype=jnp.int32)) - 1, 0, slot_ids.shape[0] - 1)
    y = jnp.where(live[row][:, None], y, jnp.zeros((), y.dtype))
    return y, conv_pool.at[call.layer, idx].set(final.astype(conv_pool.dtype), mode="drop")


def conv_decode_pool_reference(
    call: ConvPoolCall,  # a decode call
    conv_pool: jax.Array,  # [L, S+1, D, W-1]
) -> tuple[jax.Array, jax.Array]:  # (y [B, D], new conv pool)
    """Oracle (and the fused-XLA path): gather by slot, ``causal_conv1d_update_reference``, scatter back."""
    live, idx, state = _pool_rows(conv_pool, call.layer, call.slot_ids, None)
    y, new = causal_conv1d_update_reference(call.x, state, call.weight, call.bias, activation=call.activation)
    y = jnp.where(live[:, None], y, jnp.zeros((), y.dtype))
    return y, conv_pool.at[call.layer, idx].set(new, mode="drop")


def check_pool_call(call: ConvPoolCall, conv_pool: jax.Array, impl: str, *, prefill: bool) -> None:
    """Host-side (trace-time) check of a conv pool op's call: ranks, dtypes, the pool's per-slot shape
    ``(D, W-1)``, ``slot_ids`` i32[N] (host values by :func:`kvjax.base.slots.check_slot_ids`), an int
    ``layer`` in range, for prefill ``cu_seqlens`` and ``has_initial_state`` (decode: neither); ``impl`` a
    string. Raises ``ValueError`` (``InvalidPlanError`` for slot ids) naming the argument."""
    if not isinstance(call, ConvPoolCall):
        raise ValueError(f"call must be a ConvPoolCall, got {type(call).__name__}")
    x, weight, slot_ids, cu_seqlens = call.x, call.weight, call.slot_ids, call.cu_seqlens
    if prefill and cu_seqlens is None:
        raise ValueError("conv_prefill_pool needs cu_seqlens (i32[N+1]) and has_initial_state (bool[N])")
    if not prefill and (cu_seqlens is not None or call.has_initial_state is not None):
        raise ValueError("conv_decode_pool takes one token per row, every live row reading its state: "
                         "cu_seqlens and has_initial_state must be None")
    check_array("x", x, rank=2)
    _check_weights(weight, call.bias, x.shape[1], call.activation)
    check_float("pool.conv", conv_pool, rank=4)
    if conv_pool.shape[2:] != (x.shape[1], weight.shape[1] - 1):
        raise ValueError(f"pool.conv has per-slot shape {conv_pool.shape[2:]}, expected "
                         f"(D={x.shape[1]}, W-1={weight.shape[1] - 1}) from x {x.shape} and weight {weight.shape}")
    rows = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    check_int32("slot_ids", slot_ids, shape=(rows,))
    fixed = static_layer(call.layer)
    if fixed is not None and not 0 <= fixed < conv_pool.shape[0]:
        raise ValueError(f"layer={call.layer} out of range for a GDN pool of {conv_pool.shape[0]} layers")
    if isinstance(slot_ids, np.ndarray):
        check_slot_ids(slot_ids, conv_pool.shape[1] - 1)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, x.shape[0])
        check_array("has_initial_state", call.has_initial_state, shape=(rows,), dtypes=[jnp.bool_])
    _check_impl(impl)


def conv_prefill_pool(
    call: ConvPoolCall,  # x [T, D], weight, bias, layer, slot_ids i32[N], has_initial_state, cu_seqlens
    conv_pool: jax.Array,  # [L, S+1, D, W-1]
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:  # (y [T, D] in x's dtype, new conv pool)
    """Varlen causal conv1d starting from each live row's conv state ``conv_pool[layer, slot]`` (zeros where
    not ``has_initial_state``), final states written back there (slot 0 never). Padding rows read and write
    nothing and their tokens get ``y = 0``. ``ValueError`` / ``InvalidPlanError`` name a bad argument."""
    check_pool_call(call, conv_pool, impl, prefill=True)
    return CONV_PREFILL_TABLE.choose(impl, (call, conv_pool), {})[1](call, conv_pool)


def conv_decode_pool(
    call: ConvPoolCall,  # x [B, D], weight, bias, layer, slot_ids i32[B]
    conv_pool: jax.Array,  # [L, S+1, D, W-1]
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:  # (y [B, D] in x's dtype, new conv pool)
    """One token per row: conv with the row's state from ``conv_pool[layer, slot]``, the shifted state written
    back. Padding rows read and write nothing and get ``y = 0``."""
    check_pool_call(call, conv_pool, impl, prefill=False)
    return CONV_DECODE_TABLE.choose(impl, (call, conv_pool), {})[1](call, conv_pool)


# ---------------------------------------------------------------------------------------------- backend tables
def _example(tokens: int, rows: int, dim: int, *, pool: bool, prefill: bool):
    """A representative normalised call: bf16 x and state, f32 weights of width 4, SiLU."""
    sds = jax.ShapeDtypeStruct
    x, weight = sds((tokens, dim), jnp.bfloat16), sds((dim, 4), jnp.float32)
    if not pool:
        if prefill:
            return (x, weight, None), dict(cu_seqlens=sds((rows + 1,), jnp.int32), initial_state=None,
                                           activation="silu")
        return (x, sds((rows, dim, 3), jnp.bfloat16), weight, None), dict(activation="silu")
    call = ConvPoolCall(x, weight, None, sds((), jnp.int32), sds((rows,), jnp.int32),
                        sds((rows,), jnp.bool_) if prefill else None, sds((rows + 1,), jnp.int32) if prefill else None)
    return (call, sds((8, rows + 9, dim, 3), jnp.bfloat16)), {}


CONV_TABLE = BackendTable(CONV_OP, causal_conv1d_reference, (), examples={
    "prefill N=4 T=16384 D=12288": lambda: _example(16384, 4, 12288, pool=False, prefill=True)})
UPDATE_TABLE = BackendTable(UPDATE_OP, causal_conv1d_update_reference, (), examples={
    "decode B=128 D=12288": lambda: _example(128, 128, 12288, pool=False, prefill=False)})
CONV_PREFILL_TABLE = BackendTable(
    CONV_PREFILL_OP,
    conv_prefill_pool_reference,
    (Backend("pallas", conv_kernels.conv_prefill_slots, priority=10,
             note="token-block y kernel + final-state kernel, in place by construction; a near tie with XLA "
                  "(RESULTS.md, Causal conv1d on the pool)"),),
    examples={"prefill N=4 T=16384 D=12288": lambda: _example(16384, 4, 12288, pool=True, prefill=True)},
)
CONV_DECODE_TABLE = BackendTable(
    CONV_DECODE_OP,
    conv_decode_pool_reference,
    (Backend("pallas", conv_kernels.conv_update_slots, priority=10,
             note="ahead of the fused XLA path (RESULTS.md, Causal conv1d on the pool)"),),
    examples={"decode B=128 D=12288": lambda: _example(128, 128, 12288, pool=True, prefill=False)},
)
