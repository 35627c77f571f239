"""GDN reference ops against Hugging Face transformers' qwen3_5 torch implementations, and against themselves.

Tolerance (float32 everywhere): ``max|ours - ref| <= 2e-5 * max|ref|`` (HF_TOL). Observed error is ~1e-6 relative.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from kvjax.ops import gdn

HF_TOL = 2e-5
LENS = (1, 63, 0, 64, 65, 20)  # includes an empty sequence; 3 padding tokens follow the last one
PAD_TOKENS = 3
HK, HV, K, V = 2, 4, 16, 12  # Hv = 2 * Hk; K != V so a transposed state cannot pass


def _assert_close(actual, expected, tol=HF_TOL, what=""):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err, scale = np.abs(actual - expected).max(initial=0.0), np.abs(expected).max(initial=0.0)
    assert err <= tol * max(scale, 1e-6), f"{what}: max error {err:.3g} vs max |ref| {scale:.3g}"


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _inputs(rng, num_tokens, num_seqs, *, l2norm=True, dtype=np.float32):
    """Random q, k, v, g (negative log-decays), beta in (0, 1) and an initial state."""
    k_scale = 1.0 if l2norm else K ** -0.5  # without l2norm keep |k| ~ 1 so the delta rule stays stable
    q = rng.standard_normal((num_tokens, HK, K))
    k = rng.standard_normal((num_tokens, HK, K)) * k_scale
    v = rng.standard_normal((num_tokens, HV, V))
    g = -rng.uniform(0.02, 1.0, (num_tokens, HV)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (num_tokens, HV))
    h0 = rng.standard_normal((num_seqs, HV, K, V)).astype(np.float32)
    return (q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype)), h0


def _hf_per_sequence(fn, args, cu, h0, l2norm):
    """Run an HF function on each sequence as a batch of one; returns (o: [T, Hv, V] zeros elsewhere, finals)."""
    o = np.zeros(args[2].shape, np.float32)
    finals = []
    for n in range(len(cu) - 1):
        s, e = int(cu[n]), int(cu[n + 1])
        init = None if h0 is None else torch.from_numpy(h0[n : n + 1])
        if e == s:
            finals.append(np.zeros((HV, K, V), np.float32) if h0 is None else h0[n])
            continue
        q, k, v, g, beta = (torch.from_numpy(np.asarray(x[s:e], np.float32))[None] for x in args)
        o_n, f_n = fn(q, k, v, g, beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        o[s:e] = o_n[0].numpy()
        finals.append(f_n[0].numpy())
    return o, np.stack(finals)


@pytest.mark.parametrize("l2norm, with_init", [(True, True), (True, False), (False, True)])
def test_matches_hugging_face(rng, l2norm, with_init):
    cu = _cu(LENS)
    args, h0 = _inputs(rng, int(cu[-1]) + PAD_TOKENS, len(LENS), l2norm=l2norm)
    h0 = h0 if with_init else None
    for ours, theirs in [
        (gdn.chunk_gated_delta_rule, hf.torch_chunk_gated_delta_rule),
        (gdn.recurrent_gated_delta_rule, hf.torch_recurrent_gated_delta_rule),
    ]:
        o, final = ours(*args, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=l2norm, impl="reference")
        chex.assert_shape(o, args[2].shape)
        chex.assert_shape(final, (len(LENS), HV, K, V))
        assert o.dtype == jnp.float32 and final.dtype == jnp.float32
        o_hf, final_hf = _hf_per_sequence(theirs, args, cu, h0, l2norm)
        _assert_close(o, o_hf, what=f"{ours.__name__} output")
        _assert_close(final, final_hf, what=f"{ours.__name__} final state")
        assert not np.any(np.asarray(o[cu[-1] :])), "padding tokens must get zero output"


def test_chunked_equals_recurrent_bf16_custom_scale(rng):
    cu = _cu(LENS)
    args, h0 = _inputs(rng, int(cu[-1]) + PAD_TOKENS, len(LENS), dtype=jnp.bfloat16)
    kwargs = dict(cu_seqlens=cu, initial_state=h0, scale=0.37, use_qk_l2norm=True, impl="reference")
    o_c, f_c = gdn.chunk_gated_delta_rule(*args, **kwargs)
    o_r, f_r = gdn.recurrent_gated_delta_rule(*args, **kwargs)
    assert o_c.dtype == jnp.bfloat16 and o_r.dtype == jnp.bfloat16
    assert f_c.dtype == jnp.float32 and f_r.dtype == jnp.float32
    _assert_close(f_c, f_r, what="final state")
    _assert_close(o_c, o_r, tol=1e-2, what="bf16 output")  # both round the same f32 value to bf16
    # the custom scale is honoured: outputs scale linearly with it (state does not depend on scale)
    o_half, f_half = gdn.chunk_gated_delta_rule(*args, **{**kwargs, "scale": 0.37 / 2})
    _assert_close(f_half, f_c, what="final state vs scale")
    _assert_close(2 * np.asarray(o_half, np.float32), o_c, tol=1e-2, what="output vs scale")


@pytest.mark.parametrize("op", [gdn.chunk_gated_delta_rule, gdn.recurrent_gated_delta_rule])
def test_one_varlen_call_equals_separate_calls(rng, op):
    """Each sequence alone (in the same static token bucket, random garbage after it) == its share of one call."""
    cu = _cu(LENS)
    num_tokens = int(cu[-1]) + PAD_TOKENS
    args, h0 = _inputs(rng, num_tokens, len(LENS))
    o, final = op(*args, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=True, impl="reference")
    for n, length in enumerate(LENS):
        s = int(cu[n])
        alone = [np.roll(x, -s, axis=0) for x in args]  # sequence n first, the other tokens as garbage after it
        o_n, f_n = op(*alone, cu_seqlens=np.array([0, length], np.int32), initial_state=h0[n : n + 1],
                      use_qk_l2norm=True, impl="reference")
        _assert_close(o[s : s + length], o_n[:length], tol=1e-5, what=f"output of sequence {n}")
        _assert_close(final[n], f_n[0], tol=1e-5, what=f"final state of sequence {n}")
        assert not np.any(np.asarray(o_n[length:])), "tokens outside the sequence must get zero output"
        if length == 0:
            np.testing.assert_array_equal(f_n[0], h0[n])  # an empty sequence returns its initial state


def test_jit_with_traced_cu_seqlens_does_not_retrace(rng):
    cu = _cu(LENS)
    args, h0 = _inputs(rng, int(cu[-1]) + PAD_TOKENS, len(LENS))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(cu_seqlens):
        return gdn.recurrent_gated_delta_rule(*args, cu_seqlens=cu_seqlens, initial_state=h0, use_qk_l2norm=True)

    chex.clear_trace_counter()
    for lens in (LENS, LENS[::-1]):
        cu_n = _cu(lens)
        o, final = run(jnp.asarray(cu_n))
        o_eager, f_eager = gdn.chunk_gated_delta_rule(
            *args, cu_seqlens=cu_n, initial_state=h0, use_qk_l2norm=True, impl="reference")
        _assert_close(o, o_eager, what="jitted output")
        _assert_close(final, f_eager, what="jitted final state")


def _bad_cases():
    f32, i32 = np.float32, np.int32
    r = np.random.default_rng(7)
    q, k = r.standard_normal((8, 2, 4)).astype(f32), r.standard_normal((8, 2, 4)).astype(f32)
    v, g, beta = r.standard_normal((8, 4, 3)).astype(f32), -r.random((8, 4), f32), r.random((8, 4), f32)
    cu = np.array([0, 3, 8], i32)
    ok = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, initial_state=None, scale=None)
    return [
        ({"q": q[0]}, "q must have rank 3"),
        ({"k": q[..., :3].copy()}, "k must have shape"),
        ({"v": v[:, :3]}, "Hv=3 .* not a multiple of .*Hk=2"),
        ({"v": v[:7]}, "v has 7 tokens"),
        ({"v": v.astype(jnp.bfloat16)}, "v must have dtype"),
        ({"g": g.astype(jnp.bfloat16)}, "g must have dtype"),
        ({"beta": beta[:, :2]}, "beta must have shape"),
        ({"cu_seqlens": cu.astype(np.int64)}, "cu_seqlens must have dtype"),
        ({"cu_seqlens": cu.astype(f32)}, "cu_seqlens must have dtype"),
        ({"cu_seqlens": np.array([0, 9], i32)}, "cu_seqlens must be non-decreasing within"),
        ({"cu_seqlens": np.array([0], i32)}, "cu_seqlens must have N\\+1 >= 2"),
        ({"initial_state": r.standard_normal((2, 4, 3, 4)).astype(f32)}, "initial_state must have shape"),
        ({"initial_state": r.standard_normal((2, 4, 4, 3)).astype(jnp.bfloat16)}, "initial_state must have dtype"),
        ({"scale": r.standard_normal(2)}, "scale must be a finite Python number"),
    ], ok


@pytest.mark.parametrize("case", range(len(_bad_cases()[0])))
@pytest.mark.parametrize("op", [gdn.chunk_gated_delta_rule, gdn.recurrent_gated_delta_rule])
def test_bad_inputs_raise(op, case):
    cases, ok = _bad_cases()
    change, message = cases[case]
    a = {**ok, **change}
    with pytest.raises(ValueError, match=message):
        op(a["q"], a["k"], a["v"], a["g"], a["beta"], cu_seqlens=a["cu_seqlens"],
           initial_state=a["initial_state"], scale=a["scale"])
