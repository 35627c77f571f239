"""The Mosaic GPU paged prefill over fp8 pages with ``q K^T`` on e4m3 tensor cores (issue #35, goal 2):
``paged_prefill_mgpu(call, fp8_products="e4m3_qk" | "e4m3x2_qk")`` against the float32 reference.

The kernel splits each q row into ``s (h + l)`` (``s`` a power of two per (token, head) row, ``h`` and ``l`` e4m3
tiles; ``"e4m3_qk"`` keeps ``h`` only), multiplies them with the e4m3 K pages straight from the TMA ring, and runs
``P V`` in f16 over V converted once per slot by the producer warpgroup. Two checks per output element:

- against the reference over the same fp8 pages *and* the same quantised q (``q_eff``, computed here from
  numpy's ``frexp``, independently of the kernel's bit arithmetic): the kernel's own rounding only, the bound of
  the f16 path (:func:`test_paged_attention_kernels.fp8_bound` with f16 probabilities);
- against the reference over the same fp8 pages with q itself: that bound plus the effect of q's rounding. With
  ``d_j = scale |(q - q_eff) . k_j|`` every logit moves by at most ``eps = max_j d_j``, every softmax weight by a
  factor within ``exp(+-2 eps)``, so an output element by at most ``(exp(2 eps) - 1) sum_j p_j |v_j| / sum_j p_j``
  (``eps`` computed per (token, head) over every key of the row's pages).

Compiled, the e4m3 tensor cores accumulate with less than f32's precision (Hopper keeps about 14 bits in fp8
products' sums: the DeepSeek-V3 technical report, FP8 training): the GPU test adds to both bounds a logit error of
``2**-10 scale max_j |q_eff| . |k_j|`` (eight adds, two products of four k-steps, each losing up to ``2**-13`` of
the running sum), through the same ``exp(2 eps) - 1`` factor.

The producer's V conversion (its barriers, the two f16 buffers used in turn, 2 and 3 ring stages) runs under the
interpreter's race detector.

Inputs as in ``test_paged_attention_kernels``: random ragged rows (chunked prefill over a cached prefix, a decode
row, a padding row, padding tokens), GQA 2, a full head next to a SWA head with sinks, a ``-1`` hole in the full
head's walk whose page is poisoned with NaN, finite but large tails, one page 8x louder than the others.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.mosaic_interpret import cache_thread_programs
from helpers.paged import (P_ROUND_F16, build_batch, checked_call, e4m3_split_q, fp8_bound, poison_hole,
                           quantise_pages, reference_fp8)
from kvjax.base.fp8 import FP8_DTYPE
from kvjax.pallas.paged import prefill_mgpu

E4M3_MODES = {"e4m3_qk": 1, "e4m3x2_qk": 2}  # fp8_products -> e4m3 tiles per q row


def _logit_shift(dq, args, scales, kwargs) -> np.ndarray:  # f32[T, Hq]: eps per (token, head)
    """``scale max_j dq . |k_j|`` (``dq`` f32[T, Hq, D] >= 0) over the keys of the token's row (positions below
    its length in its kv head's pages; NaN pages, below a window, out)."""
    _, k8, _, table, seq_lens = args
    k = np.asarray(k8, np.float32) * np.asarray(scales["k_scale"])[:, None, None]
    table, cu = np.asarray(table), np.asarray(kwargs["cu_seqlens"])
    hq, hkv, page = dq.shape[1], table.shape[1], k.shape[1]
    eps = np.zeros(dq.shape[:2], np.float32)
    for b in range(len(cu) - 1):
        n_keys = int(seq_lens[b])
        for h in range(hkv):
            keys = [k[p, : n_keys - i * page] for i, p in enumerate(table[b, h, : (n_keys + page - 1) // page])
                    if p >= 0]
            keys = np.abs(np.concatenate(keys)) if keys else np.zeros((0, k.shape[-1]), np.float32)
            keys = np.where(np.isnan(keys), 0.0, keys)  # NaN pages are below the window: never visible
            heads = slice(h * hq // hkv, (h + 1) * hq // hkv)
            if len(keys):  # on the device (the GPU test's rows are 4096 x 4096)
                shift = jnp.einsum("thd,kd->thk", dq[cu[b]:cu[b + 1], heads], keys,
                                   precision="highest").max(axis=-1)
                eps[cu[b]:cu[b + 1], heads] = np.asarray(shift)
    return eps * kwargs["scale"]


def _check(out, args, scales, kwargs, parts: int, n_keys: int, acc_rel: float = 0.0) -> dict:
    """Both checks of the module doc (``acc_rel``: the tensor cores' accumulation error, relative to
    ``|q_eff| . |k_j|``); returns the errors."""
    q, k8, v8, table, seq_lens = args
    q_eff = e4m3_split_q(q, parts)
    ref_eff, abs_v, v_max = reference_fp8((jnp.asarray(q_eff), k8, v8, table, seq_lens), scales, kwargs)
    ref, _, _ = reference_fp8(args, scales, kwargs)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    tight = fp8_bound(ref_eff, abs_v, v_max, jnp.bfloat16, p_round=P_ROUND_F16, n_keys=n_keys)
    if acc_rel:
        tight = tight + np.expm1(2 * acc_rel * _logit_shift(np.abs(q_eff), args, scales, kwargs)[..., None]) * abs_v
    err_eff = np.abs(out - ref_eff)
    assert (err_eff <= tight).all(), (float(err_eff.max()), float((err_eff - tight).max()))
    eps = _logit_shift(np.abs(np.asarray(q, np.float32) - q_eff), args, scales, kwargs)[..., None]
    err = np.abs(out - ref)
    bound = tight + np.expm1(2 * eps) * abs_v
    assert (err <= bound).all(), (float(err.max()), float((err - bound).max()))
    assert float(np.abs(out[int(kwargs["cu_seqlens"][-1]):]).max()) == 0.0  # tokens of no row
    return {"err": float(err.max()), "err_vs_q_eff": float(err_eff.max()), "eps": float(eps.max())}


def _batch(rng, *, page_size: int, ctx, new, hq: int, hkv: int, d: int, window, sinks, loud: tuple[int, int]):
    """An fp8 batch (module doc): ``(args, scales, kwargs)``; page ``table[loud]`` 8x louder."""
    args, kw = build_batch(rng, hq=hq, hkv=hkv, d=d, page_size=page_size, ctx=ctx, new=new, window=window, sinks=sinks,
                           dtype=jnp.bfloat16, tail_fill=300.0)
    q, k, v, table, seq_lens = args
    v = v.at[np.asarray(table)[loud[0], 0, loud[1]]].multiply(8.0)
    args, scales = quantise_pages(poison_hole((q, k, v, table, seq_lens)))
    return args, scales, kw


def test_q_row_scales():
    # powers of two with max|q| / s in [128, 256) (so |q| / s < 448, and q / s keeps q's bits), s * (1 / s) == 1,
    # zero rows scale 2**-7; against numpy's frexp
    rng = np.random.default_rng(0)
    amax = np.concatenate([np.exp2(rng.uniform(-60, 60, 200)), [0.0, 1.0, 255.0, 256.0, 2.0 ** -99]]).astype(np.float32)
    s, inv = (np.asarray(x) for x in prefill_mgpu.q_row_scales(jnp.asarray(amax)))
    _, k = np.frexp(np.where(amax > 0, amax, 1.0))
    np.testing.assert_array_equal(s, np.ldexp(np.float32(1.0), k - 8))
    assert (s * inv == 1.0).all()
    live = amax > 0
    assert ((amax[live] / s[live] >= 128) & (amax[live] / s[live] < 256)).all()
    assert s[~live][0] == 2.0 ** -7


def test_q_split_is_exact_for_bf16():
    # "e4m3x2_qk": h + l carries every bit of a bf16 q whose value is at least 2**-10 s (and within 2**-10 s
    # below it); "e4m3_qk": h carries q to 2**-4 relative (e4m3 has 3 mantissa bits) or 2**-10 s absolute
    rng = np.random.default_rng(1)
    q = np.asarray(jnp.asarray(rng.standard_normal((64, 4, 128)) * np.exp2(rng.integers(-8, 8, (64, 4, 1))),
                               jnp.bfloat16), np.float32)
    s = np.ldexp(np.float32(1.0), np.frexp(np.abs(q).max(axis=-1, keepdims=True))[1] - 8)
    two, one = e4m3_split_q(q, 2), e4m3_split_q(q, 1)
    big = np.abs(q) >= 2.0 ** -2 * s  # normal-range residuals
    np.testing.assert_array_equal(two[big], q[big])
    assert (np.abs(two - q) <= 2.0 ** -10 * s).all()
    assert (np.abs(one - q) <= 2.0 ** -4 * np.abs(q) + 2.0 ** -10 * s).all()
    assert (one != q).any()


# the interpreter is slow (about a second a CTA once helpers.mosaic_interpret compiles each kernel once): each call
# covers part of the features. Pages of 64 (two per slot: per-column key scales) with the single e4m3 q, a full head
# (with the hole) beside a SWA head with sinks; pages of 128 with the split q, GQA 2 over one full head (with the
# hole). The loud page is met after the walk's first slot (the running value reference scale grows).
_INTERPRET_CASES = [
    (64, "e4m3_qk", dict(ctx=[140, 9, 0], hq=2, hkv=2, window=[0, 70], sinks=[0, 4])),
    (128, "e4m3x2_qk", dict(ctx=[260, 9, 0], hq=2, hkv=1, window=[0], sinks=[0])),
]


@pytest.mark.slow
@pytest.mark.parametrize("page_size,mode,case", _INTERPRET_CASES, ids=[m for _, m, _ in _INTERPRET_CASES])
def test_prefill_e4m3_qk_interpret(rng, monkeypatch, page_size, mode, case):
    # under the Mosaic GPU interpreter: products in jnp over the same e4m3 tiles; the q split, its row scales, the
    # barriers and the shared f16 V buffers converted by the producer as compiled
    cache_thread_programs(monkeypatch)
    args, scales, kw = _batch(rng, page_size=page_size, new=[70, 1, 0], d=64, loud=(0, 2), **case)
    out = prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw, scales), fp8_products=mode, interpret=True)
    _check(out, args, scales, kw, E4M3_MODES[mode], n_keys=max(case["ctx"]))


def _cuda_module(page_size: int, d: int, **kernel_kw) -> str:
    """The MLIR text of the Mosaic GPU prefill over fp8 pages exported for CUDA on the CPU (T=512, 4 query and 2 KV
    heads, 64 pages of ``page_size`` x ``d``); ``kernel_kw`` go to ``paged_prefill_mgpu``."""
    from jax import export

    from kvjax.ops.attention import PagedAttentionCall, check_call

    def fn(q, kp, vp, bt, sl, cu, ks, vs, window, sinks):
        call = check_call(PagedAttentionCall(q, kp, vp, bt, sl, cu, window=window, sinks=sinks, k_scale=ks,
                                             v_scale=vs))
        return prefill_mgpu.paged_prefill_mgpu(call, **kernel_kw)

    sds = jax.ShapeDtypeStruct
    pages = sds((64, page_size, d), FP8_DTYPE)
    args = (sds((512, 4, d), jnp.bfloat16), pages, pages, sds((1, 2, 16), jnp.int32), sds((1,), jnp.int32),
            sds((2,), jnp.int32), sds((64,), jnp.float32), sds((64,), jnp.float32), sds((2,), jnp.int32),
            sds((2,), jnp.int32))
    return export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


@pytest.mark.parametrize("mode", list(E4M3_MODES))
def test_e4m3_qk_lowers_for_cuda(mode):
    # the compiled path without a GPU: e4m3 wgmma operands (the q tiles, the K ring slot), the q split and its
    # bit-arithmetic row scales in register layouts, the producer's V conversion and its register split; pages of 64
    # and 128 at 2 and 3 stages, head_dim 128 and 64 (64-byte swizzle); the kernel's name
    for page_size, d, stages in [(64, 128, 2), (128, 128, 3), (64, 64, 3), (128, 64, 2)]:
        module = _cuda_module(page_size, d, fp8_products=mode, stages=stages)
        name = f"kvjax_paged_prefill_mgpu_float8_e4m3fn_{mode}_page{page_size}_d{d}_s{stages}"
        assert "mosaic_gpu" in module and "e4m3.e4m3" in module, (page_size, d, stages)  # the e4m3 x e4m3 wgmma
        assert name in module, (page_size, d, stages)


# the producer's V conversion under the race detector: pages of 64 and 128 with the split q, a full head (with the
# hole) beside a SWA head with sinks; three rows (a prefill over a cached prefix, a decode row, a padding row) over
# two programs: several items per program, so the ring and the two f16 buffers wrap, across items too; 2 and 3
# stages (the ring must stay ahead of the conversion).
_RACE_CASES = [(64, dict(ctx=[140, 9, 0])), (128, dict(ctx=[260, 9, 0]))]


def _detect_races(monkeypatch):
    """Turn on the interpreter's happens-before race detector for ``prefill_mgpu`` (until the test ends) and return
    a function telling whether the last interpreted kernel raced; None where this jax has no such detector."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
        return None
    params = prefill_mgpu.interpret_params
    if "detect_races" not in {f.name for f in dataclasses.fields(params())} or not hasattr(gpu_callbacks, "get_races"):
        return None
    monkeypatch.setattr(prefill_mgpu, "interpret_params", lambda: dataclasses.replace(params(), detect_races=True))
    return lambda: gpu_callbacks.get_races().races_found


@pytest.mark.slow
@pytest.mark.parametrize("page_size,case", _RACE_CASES, ids=[f"page{p}" for p, _ in _RACE_CASES])
def test_prefill_fp8_stages_interpret(rng, monkeypatch, page_size, case):
    # under the Mosaic GPU interpreter, with its race detector (a shared-memory read and write not ordered by a
    # barrier; its barriers also check that every waiter observes every phase): at 2 and 3 stages, no race and
    # both checks of the module doc against the float32 reference
    cache_thread_programs(monkeypatch)
    raced = _detect_races(monkeypatch)
    kernel = prefill_mgpu.paged_prefill_mgpu
    kernel.clear_cache()  # no kernel traced without the detector (and none kept with it)
    args, scales, kw = _batch(rng, page_size=page_size, new=[70, 1, 0], hq=2, hkv=2, d=64, window=[0, 70],
                              sinks=[0, 4], loud=(0, 2), **case)
    call = checked_call(args, kw, scales)
    try:
        for stages in (2, 3):
            out = np.asarray(kernel(call, stages=stages, interpret=True))
            assert raced is None or not raced(), stages
            _check(out, args, scales, kw, E4M3_MODES["e4m3x2_qk"], n_keys=max(case["ctx"]))
    finally:
        kernel.clear_cache()


def test_fp8_products_checked(rng):
    args, scales, kw = _batch(rng, page_size=64, ctx=[70], new=[64], hq=2, hkv=1, d=64, window=[0], sinks=[0],
                              loud=(0, 0))
    with pytest.raises(ValueError, match="fp8_products must be one of"):
        prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw, scales), fp8_products="e5m2", interpret=True)
    with pytest.raises(ValueError, match="fp8 pages need stages >= 2.*got 1"):  # the producer releases V itself
        prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw, scales), stages=1, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("mode", list(E4M3_MODES))
def test_gpu_prefill_e4m3_qk(rng, mode, page_size):
    # compiled (e4m3 wgmma from the TMA ring, V converted by the producer warpgroup into the shared f16 buffers): a
    # 4096-token causal prefill beside chunked prefill over a cached prefix, a decode row and a padding row; Hq=32
    # over Hkv=8, full heads next to SWA heads with sinks; both checks of the module doc per element; the default
    # stages (2) and 3
    ctx, new = [4096, 1500, 700, 17, 0], [4096, 300, 129, 1, 0]
    window, sinks = [0, 100, 0, 513] * 2, [0, 4, 0, 0] * 2
    args, scales, kw = _batch(rng, page_size=page_size, ctx=ctx, new=new, hq=32, hkv=8, d=128, window=window,
                              sinks=sinks, loud=(1, 3))
    for stages in (None, 3):
        out = prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw, scales), fp8_products=mode, stages=stages)
        errs = _check(out, args, scales, kw, E4M3_MODES[mode], n_keys=max(ctx), acc_rel=2.0 ** -10)
        print(mode, page_size, stages, errs)  # pytest -s
