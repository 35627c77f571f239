"""Depthwise causal conv1d over a ragged batch (the GDN q/k/v short conv), with carried conv state.

For a sequence with tokens ``x_0 .. x_{L-1}`` and a state ``s: [D, W-1]`` holding the ``W-1`` inputs that
precede it (oldest first, ``s[:, -1]`` the most recent; zeros if ``initial_state`` is ``None``)::

    window_t = [s, x_0, .., x_{L-1}][t : t + W]               # the W inputs ending at x_t
    y_t      = act(sum_w weight[:, w] * window_t[w] + bias)    # act: None or "silu"
    final    = [s, x_0, .., x_{L-1}][-(W-1):]                  # the last W-1 inputs (state for short L)

This is Hugging Face transformers' ``causal_conv1d_update`` (qwen3_5 modeling) with a ``W-1`` state; HF's
cache keeps ``W`` columns, the oldest of which never reaches an output. Tokens outside every sequence (padding
of a static bucket) get ``y = 0``; an empty sequence returns its initial state.

Kernel contract (names ``"causal_conv1d"`` and ``"causal_conv1d_update"`` in :mod:`kvjax.ops.dispatch`);
the public ops validate on the host and call, kernels with an extra ``interpret=``::

    fn(x, weight, bias, *, cu_seqlens, initial_state, activation)   # x [T, D]; weight [D, W]; bias [D] | None
        # cu_seqlens i32[N+1] (may be traced); initial_state [N, D, W-1] | None; activation None | "silu"
        -> (y: [T, D] in x's dtype, final_state: [N, D, W-1] in initial_state's dtype, else x's)
    fn(x, conv_state, weight, bias, *, activation)                  # x [B, D]; conv_state [B, D, W-1]
        -> (y: [B, D] in x's dtype, new_state: [B, D, W-1] in conv_state's dtype)

The references compute in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.ops import dispatch
from kvjax.base.checks import check_cu_seqlens, check_float

CONV_OP = "causal_conv1d"
UPDATE_OP = "causal_conv1d_update"
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
    fn = dispatch.resolve(CONV_OP, impl)
    return fn(x, weight, bias, cu_seqlens=cu_seqlens, initial_state=initial_state, activation=activation)


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
    fn = dispatch.resolve(UPDATE_OP, impl)
    return fn(x, conv_state, weight, bias, activation=activation)


dispatch.register_reference(CONV_OP, causal_conv1d_reference)
dispatch.register_reference(UPDATE_OP, causal_conv1d_update_reference)
