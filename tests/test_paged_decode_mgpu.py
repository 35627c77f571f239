"""The Mosaic GPU split-KV paged decode (:mod:`kvjax.pallas.paged.decode_mgpu`, issue #35 goal 1 candidate)
against the float32 reference.

Inputs (:func:`helpers.paged.build_batch`): random ragged decode rows (one token each, a padding row, padding
tokens), GQA group 4, a full KV head beside a SWA head with sinks, a ``-1`` hole in the full head's walk whose
page is NaN-poisoned, pages below the window NaN (recycled or still listed), every unused page NaN, and the
unwritten tail of each row's last page finite but large (300: the kernel copies whole pages and masks the tail).

fp8 pages, two checks per output element (as ``test_paged_prefill_fp8``):

- against the reference over the same fp8 pages and the q the kernel multiplies, ``q_eff = s (h + l)`` (computed
  here with numpy's ``frexp``, not the kernel's bit arithmetic): only the kernel's own rounding,
  :func:`helpers.paged.fp8_bound` with f16 probabilities (:data:`helpers.paged.P_ROUND_F16`: ``p * s_v / s_ref``
  cast to f16, relative ``2**-11``, ``2**-24 max|v|`` a key below f16's normal range) and the bf16 output;
- against the reference with q itself: that bound plus q's rounding. Every logit moves by at most
  ``eps = scale |q - q_eff|_1 max|k|`` (per token and head, ``max|k|`` over the row's keys), every softmax weight
  by a factor within ``exp(+-2 eps)``, so an output element by at most ``(exp(2 eps) - 1) sum p |v| / sum p``.

bf16 pages: q K^T exact in f32 (bf16 x bf16), the probabilities rounded to bf16 (relative ``2**-8``) and the
output to bf16: :func:`helpers.paged.fp8_bound` with ``dtype=bf16`` (the bound names fp8 but is the bf16 one).

Compiled on a GPU the e4m3 products accumulate with about 14 bits (DeepSeek-V3 report): the GPU test adds a
logit error of ``2**-10 scale |q_eff| . |k|`` through the same ``exp(2 eps) - 1`` factor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.paged import (P_ROUND_F16, build_batch, checked_call, e4m3_split_q, fp8_bound, poison_hole,
                           quantise_pages, reference_fp8)
from kvjax.base.fp8 import FP8_DTYPE
from kvjax.ops.attention import paged_attention_reference
from kvjax.pallas.paged import decode_mgpu


def _k_max(args, scales) -> np.ndarray:  # f32[T, Hq]: max |k| over each token's row's finite keys (all heads)
    _, k8, _, table, seq_lens = args
    k = np.abs(np.asarray(k8, np.float32)) * np.asarray(scales["k_scale"])[:, None, None]
    k = np.where(np.isfinite(k), k, 0.0).max(axis=(1, 2))  # per page
    table = np.asarray(table)
    kmax = np.array([k[table[b][table[b] >= 0]].max(initial=0.0) for b in range(table.shape[0])])
    return kmax


def _batch(rng, *, page_size, ctx, window, sinks, dtype=jnp.bfloat16, hq=8, hkv=2, d=64, extra_tokens=2):
    """A decode batch (module doc): one token a row, the hole at ``table[0, 0, 1]`` (NaN page)."""
    new = [1 if c > 0 else 0 for c in ctx]
    args, kw = build_batch(rng, hq=hq, hkv=hkv, d=d, page_size=page_size, ctx=ctx, new=new, window=window,
                           sinks=sinks, dtype=dtype, tail_fill=300.0, extra_tokens=extra_tokens)
    return poison_hole(args), kw


def _check_fp8(out, args, scales, kw, n_keys: int, acc_rel: float = 0.0) -> dict:
    """Both checks of the module doc; returns the largest errors."""
    q, k8, v8, table, seq_lens = args
    q_eff = e4m3_split_q(q, 2)
    ref_eff, abs_v, v_max = reference_fp8((jnp.asarray(q_eff), k8, v8, table, seq_lens), scales, kw)
    ref, _, _ = reference_fp8(args, scales, kw)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    rows = np.searchsorted(np.asarray(kw["cu_seqlens"]), np.arange(out.shape[0]), side="right") - 1
    rows = np.clip(rows, 0, len(seq_lens) - 1)
    kmax = _k_max(args, scales)[rows][:, None]  # f32[T, 1]
    tight = fp8_bound(ref_eff, abs_v, v_max, jnp.bfloat16, p_round=P_ROUND_F16, n_keys=n_keys)
    if acc_rel:
        acc_eps = acc_rel * kw["scale"] * np.abs(q_eff).sum(-1) * kmax
        tight = tight + np.expm1(2 * acc_eps)[..., None] * abs_v
    err_eff = np.abs(out - ref_eff)
    assert (err_eff <= tight).all(), (float(err_eff.max()), float((err_eff - tight).max()))
    eps = kw["scale"] * np.abs(np.asarray(q, np.float32) - q_eff).sum(-1) * kmax  # f32[T, Hq]
    err = np.abs(out - ref)
    bound = tight + np.expm1(2 * eps)[..., None] * abs_v
    assert (err <= bound).all(), (float(err.max()), float((err - bound).max()))
    assert (out[int(kw["cu_seqlens"][-1]):] == 0).all()  # tokens of no row
    return {"err": float(err.max()), "err_vs_q_eff": float(err_eff.max())}


def _check_bf16(out, args, kw):
    q, k, v, table, seq_lens = args
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = np.asarray(paged_attention_reference(checked_call((f32(q), f32(k), f32(v), table, seq_lens), kw)))
    abs_v = np.asarray(paged_attention_reference(checked_call((f32(q), f32(k), jnp.abs(f32(v)), table, seq_lens),
                                                              kw)))
    v_max = float(np.nanmax(np.abs(np.asarray(v, np.float32))[np.abs(np.asarray(v, np.float32)) < 100]))
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    err, bound = np.abs(out - ref), fp8_bound(ref, abs_v, v_max, jnp.bfloat16)
    assert (err <= bound).all(), (float(err.max()), float((err - bound).max()))
    assert (out[int(kw["cu_seqlens"][-1]):] == 0).all()


# interpret cases: the Mosaic GPU interpreter costs about 5-10 s a CTA on 2 cores, so each case is one decode row
# (2 KV heads x 2 splits: 4 CTAs). Pages of 16 (8 a slot, the hole and the walk's end inside a slot) and of 64
# (2 a slot); a full head with the hole beside a SWA head with sinks, its sink page and its window pages in
# different splits.
_CASES = [
    (16, dict(ctx=[100], window=[0, 40], sinks=[0, 5])),
    (64, dict(ctx=[300], window=[0, 100], sinks=[0, 3])),
]


@pytest.mark.parametrize("page_size,case", _CASES, ids=[f"page{p}" for p, _ in _CASES])
def test_decode_mgpu_fp8_interpret(rng, page_size, case):
    # under the interpreter: the products in jnp over the same e4m3 tiles and f16 V buffer; ring, barriers, masks,
    # page scales and the split merge as compiled
    args, kw = _batch(rng, page_size=page_size, extra_tokens=0, **case)
    args, scales = quantise_pages(args)
    out = decode_mgpu.paged_decode_mgpu(checked_call(args, kw, scales), num_splits=2, interpret=True)
    _check_fp8(out, args, scales, kw, n_keys=max(case["ctx"]))


def test_decode_mgpu_bf16_interpret(rng):
    # bf16 pages (V straight from the ring), one split, a padding token (a CTA that attends to nothing: 0)
    args, kw = _batch(rng, page_size=64, ctx=[200], window=[0, 70], sinks=[0, 2], extra_tokens=1)
    out = decode_mgpu.paged_decode_mgpu(checked_call(args, kw), num_splits=1, interpret=True)
    _check_bf16(out, args, kw)


def _goal_args(page_size: int, fp8: bool):
    sds = jax.ShapeDtypeStruct
    b, l, hq, hkv, d = 64, 4096, 32, 8, 128
    n_pages = b * hkv * l // page_size
    pages = sds((n_pages, page_size, d), FP8_DTYPE if fp8 else jnp.bfloat16)
    return (sds((b, hq, d), jnp.bfloat16), pages, pages, sds((b, hkv, l // page_size), jnp.int32),
            sds((b,), jnp.int32), sds((b + 1,), jnp.int32), sds((n_pages,), jnp.float32),
            sds((n_pages,), jnp.float32), sds((hkv,), jnp.int32), sds((hkv,), jnp.int32))


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_decode_mgpu_lowers_for_cuda(page_size, fp8):
    # the compiled path without a GPU, at the goal shape (B=64, L=4096, Hq=32, Hkv=8, D=128): the transposed e4m3
    # wgmma (K slot x q tiles), the f16 V^T P^T product with the 32-byte swizzle, the reductions over the
    # accumulator's rows, the per-row page masks and scales; 3 stages
    from jax import export

    from kvjax.ops.attention import PagedAttentionCall, check_call

    def fn(q, kp, vp, bt, sl, cu, ks, vs, window, sinks):
        call = check_call(PagedAttentionCall(q, kp, vp, bt, sl, cu, window=window, sinks=sinks,
                                             k_scale=ks if fp8 else None, v_scale=vs if fp8 else None))
        return decode_mgpu.paged_decode_mgpu(call, stages=3)

    module = export.export(jax.jit(fn), platforms=["cuda"])(*_goal_args(page_size, fp8)).mlir_module()
    assert "mosaic_gpu" in module
    assert ("e4m3.e4m3" in module) == fp8


def test_decode_mgpu_refuses(rng):
    args, kw = _batch(rng, page_size=8, ctx=[40], window=[0, 0], sinks=[0, 0])
    with pytest.raises(ValueError, match="page_size"):
        decode_mgpu.paged_decode_mgpu(checked_call(args, kw), interpret=True)
    args, kw = _batch(rng, page_size=16, ctx=[40], window=[0, 0], sinks=[0, 0])
    with pytest.raises(ValueError, match="stages"):
        decode_mgpu.paged_decode_mgpu(checked_call(args, kw), stages=0, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_decode_mgpu_fp8(rng, page_size):
    # compiled, the goal-sized batch: 64 decode rows of up to 4096 keys (ragged, a padding row, padding tokens),
    # Hq=32 over Hkv=8, full heads beside SWA heads with sinks, the hole; default splits and stages, then 3 stages and
    # 1 split; both checks of the module doc with the e4m3 accumulation term; bf16 pages against their bound
    ctx = list(rng.integers(1, 4097, 63)) + [0]
    ctx[0] = 4096
    window, sinks = [0, 100, 0, 513] * 2, [0, 4, 0, 0] * 2
    args, kw = _batch(rng, page_size=page_size, ctx=ctx, window=window, sinks=sinks, hq=32, hkv=8, d=128)
    args8, scales = quantise_pages(args)
    for cfg in ({}, dict(stages=3), dict(num_splits=1)):
        out = decode_mgpu.paged_decode_mgpu(checked_call(args8, kw, scales), **cfg)
        print(page_size, cfg, _check_fp8(out, args8, scales, kw, n_keys=max(ctx), acc_rel=2.0 ** -10))  # pytest -s
    _check_bf16(decode_mgpu.paged_decode_mgpu(checked_call(args, kw)), args, kw)
