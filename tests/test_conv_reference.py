"""causal_conv1d references: varlen with state == token-by-token updates == Hugging Face's torch fallbacks.

Tolerance (float32): ``max|ours - ref| <= 1e-5 * max|ref|``. Conv states are copies of inputs: compared exactly.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from kvjax.ops import conv

TOL = 1e-5
D, W = 6, 4
LENS = (5, 0, 1, 2, 3, 9)  # shorter than, equal to and longer than W-1 = 3, and empty
PAD_TOKENS = 2


def _assert_close(actual, expected, tol=TOL, what=""):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err, scale = np.abs(actual - expected).max(initial=0.0), np.abs(expected).max(initial=0.0)
    assert err <= tol * max(scale, 1e-6), f"{what}: max error {err:.3g} vs max |ref| {scale:.3g}"


def _inputs(rng, lens=LENS, dtype=np.float32):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = rng.standard_normal((int(cu[-1]) + PAD_TOKENS, D)).astype(dtype)
    weight = rng.standard_normal((D, W)).astype(dtype)
    bias = rng.standard_normal(D).astype(dtype)
    init = rng.standard_normal((len(lens), D, W - 1)).astype(dtype)
    return cu, x, weight, bias, init


def _hf_update(x_seq, state, weight, bias, activation):
    """HF causal_conv1d_update on one sequence ``[L, D]`` from ``state [D, W-1]``: (y [L, D], new state)."""
    state_t = torch.from_numpy(np.array(state, np.float32))[None].clone()
    y = hf.causal_conv1d_update(
        torch.from_numpy(np.asarray(x_seq, np.float32)).T[None].contiguous(), state_t,
        torch.from_numpy(np.asarray(weight, np.float32)),
        None if bias is None else torch.from_numpy(np.asarray(bias, np.float32)), activation,
    )
    return y[0].T.numpy(), state_t[0].numpy()


@pytest.mark.parametrize("activation, with_bias", [("silu", True), (None, False)])
def test_varlen_with_state_equals_token_by_token_and_hf(rng, activation, with_bias):
    cu, x, weight, bias, init = _inputs(rng)
    bias = bias if with_bias else None
    y, final = conv.causal_conv1d(x, weight, bias, cu_seqlens=cu, initial_state=init, activation=activation,
                                  impl="reference")
    chex.assert_shape((y, final), [(x.shape[0], D), (len(LENS), D, W - 1)])
    assert not np.any(np.asarray(y[cu[-1]:])), "padding tokens must get zero output"
    for n, length in enumerate(LENS):
        s = int(cu[n])
        state = jnp.asarray(init[n : n + 1])
        for i in range(length):  # token by token through the decode form
            y_t, state = conv.causal_conv1d_update(x[s + i][None], state, weight, bias, activation=activation,
                                                   impl="reference")
            _assert_close(y[s + i], y_t[0], what=f"sequence {n} token {i}")
        np.testing.assert_array_equal(final[n], state[0])
        if length:  # HF's torch conv needs at least one token
            y_hf, state_hf = _hf_update(x[s : s + length], init[n], weight, bias, activation)
            _assert_close(y[s : s + length], y_hf, what=f"sequence {n} vs HF")
            np.testing.assert_array_equal(final[n], state_hf)
    np.testing.assert_array_equal(final[1], init[1])  # empty sequence: initial state unchanged
    np.testing.assert_array_equal(final[2], np.concatenate([init[2][:, 1:], x[cu[2]][:, None]], axis=1))


def test_without_state_matches_hf_causal_conv1d_fn(rng):
    cu, x, weight, bias, _ = _inputs(rng)
    y, final = conv.causal_conv1d(x, weight, bias, cu_seqlens=cu, impl="reference")
    for n, length in enumerate(LENS):
        s = int(cu[n])
        if length == 0:
            continue
        y_hf = hf.causal_conv1d_fn(
            torch.from_numpy(x[s : s + length].T[None].copy()), torch.from_numpy(weight), torch.from_numpy(bias),
            activation="silu",
        )
        _assert_close(y[s : s + length], y_hf[0].T.numpy(), what=f"sequence {n}")
        padded = np.concatenate([np.zeros((W - 1, D), np.float32), x[s : s + length]])  # zero initial state
        np.testing.assert_array_equal(final[n], padded[-(W - 1):].T)


def test_update_batch_matches_hf_and_keeps_dtypes(rng):
    b = 5
    x = rng.standard_normal((b, D)).astype(jnp.bfloat16)
    state = rng.standard_normal((b, D, W - 1)).astype(np.float32)
    weight, bias = rng.standard_normal((D, W)).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    y, new_state = conv.causal_conv1d_update(x, state, weight, bias, impl="reference")
    assert y.dtype == jnp.bfloat16 and new_state.dtype == jnp.float32
    for i in range(b):
        y_hf, s_hf = _hf_update(np.asarray(x[i : i + 1], np.float32), state[i], weight, bias, "silu")
        _assert_close(y[i], y_hf[0], tol=1e-2, what=f"row {i}")  # y rounded to bf16
        np.testing.assert_array_equal(new_state[i], s_hf)


def test_bf16_state_is_copied_exactly_and_jit_with_traced_cu_seqlens(rng):
    cu, x, weight, bias, init = _inputs(rng, dtype=jnp.bfloat16)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(cu_seqlens):
        return conv.causal_conv1d(x, weight, bias, cu_seqlens=cu_seqlens, initial_state=init)

    chex.clear_trace_counter()
    for lens in (LENS, LENS[::-1]):
        cu_n = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        y, final = run(jnp.asarray(cu_n))
        assert y.dtype == jnp.bfloat16 and final.dtype == jnp.bfloat16
        y_eager, final_eager = conv.causal_conv1d(x, weight, bias, cu_seqlens=cu_n, initial_state=init,
                                                  impl="reference")
        np.testing.assert_array_equal(final, final_eager)
        _assert_close(y, y_eager, tol=1e-2, what="jitted output")
        n_last = len(lens) - 1  # the last sequence is long enough: its state is its last W-1 inputs
        np.testing.assert_array_equal(final[n_last], x[cu_n[-1] - (W - 1): cu_n[-1]].T)


def _bad_cases():
    r = np.random.default_rng(3)
    f32 = np.float32
    x, weight, bias = r.standard_normal((8, D)).astype(f32), r.standard_normal((D, W)).astype(f32), r.random(D, f32)
    cu, init = np.array([0, 3, 8], np.int32), r.standard_normal((2, D, W - 1)).astype(f32)
    ok = dict(x=x, weight=weight, bias=bias, cu_seqlens=cu, initial_state=init, activation="silu")
    return [
        ({"x": x[None]}, "x must have rank 2"),
        ({"weight": weight[:3]}, "weight must have shape \\(D=6, W\\)"),
        ({"weight": weight[:, :1]}, "kernel width W >= 2"),
        ({"bias": bias[:2]}, "bias must have shape"),
        ({"cu_seqlens": cu.astype(np.int64)}, "cu_seqlens must have dtype"),
        ({"cu_seqlens": np.array([0, 9], np.int32)}, "cu_seqlens must be non-decreasing within"),
        ({"initial_state": init[:, :, :2]}, "initial_state must have shape"),
        ({"initial_state": init.astype(np.int32)}, "initial_state must have dtype"),
        ({"activation": "gelu"}, "activation must be one of"),
    ], ok


@pytest.mark.parametrize("case", range(len(_bad_cases()[0])))
def test_bad_inputs_raise(case):
    cases, ok = _bad_cases()
    change, message = cases[case]
    a = {**ok, **change}
    with pytest.raises(ValueError, match=message):
        conv.causal_conv1d(a["x"], a["weight"], a["bias"], cu_seqlens=a["cu_seqlens"],
                           initial_state=a["initial_state"], activation=a["activation"])


def test_update_bad_inputs_raise(rng):
    x, state = rng.standard_normal((3, D)).astype(np.float32), rng.standard_normal((3, D, W - 1)).astype(np.float32)
    weight = rng.standard_normal((D, W)).astype(np.float32)
    with pytest.raises(ValueError, match="conv_state must have shape"):
        conv.causal_conv1d_update(x, state[:, :, :1], weight)
    with pytest.raises(ValueError, match="activation must be one of"):
        conv.causal_conv1d_update(x, state, weight, activation="relu")
    with pytest.raises(ValueError, match="x must have rank 2"):
        conv.causal_conv1d_update(x[0], state, weight)
