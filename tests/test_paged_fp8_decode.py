"""The CUDA-core split-KV decode kernel (:mod:`kvjax.pallas.paged.decode_fma`) in interpret mode, against the
float32 reference over the same pages.

Batches: random ragged decode rows over a permuted page pool, a full head beside SWA heads with and without sinks
(windows straddling pages of 16 and 64), pages below a window either recycled (``-1``) or still listed but NaN,
NaN in every unwritten tail and unused page, padding tokens after the rows; GQA groups 1, 4 and 8; one split and
several (empty ones included); blocks of one and several sub-blocks, with and without the prefetch.

fp8 pages (float8_e4m3fn, one power-of-two f32 scale per page, NaN scale for a NaN page, so reading a scale that
must not be read fails too). Kernel and reference read the same e4m3 values, so the kernel's own error is all
that is bounded: an e4m3 value (4 significant bits) times a bf16 q element (8) is exact in f32, the scales are
powers of two (exact products), the probabilities are never rounded below f32, so what remains is the output's
rounding to q's dtype (``2**-8 |o|`` for bf16) and ``2**-12 max|v|`` for f32 summation order and exp2 against
exp. Against the *unquantised* pages the e4m3 rounding itself adds ``docs/contracts.md``'s fp8 bound (each
element within ``2**-4`` relative plus ``2**-9`` of its page scale, each logit then within ``eps``, each weight
within ``exp(+-2 eps)``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.base.fp8 import FP8_DTYPE, pow2_scale
from kvjax.ops.attention import PagedAttentionCall, check_call, paged_attention_reference
from kvjax.pallas.paged import decode, decode_fma

_HEADS = dict(window=(0, 40, 70), sinks=(0, 4, 0))  # full; SWA with sinks; SWA without
_CTX = (200, 70, 1, 40, 17)


def _batch(rng, *, group, page_size, d=32, ctx=_CTX, pad_tokens=2):
    """Decode rows (one new token each) over a permuted pool; (q f32[T, Hq, D], k, v f32[P, page, D], table,
    seq_lens, kwargs)."""
    window, sinks = np.asarray(_HEADS["window"], np.int32), np.asarray(_HEADS["sinks"], np.int32)
    hkv = len(window)
    ctx = np.asarray(ctx, np.int32)
    max_blocks = int(-(-ctx.max() // page_size)) + 1
    num_pages = len(ctx) * hkv * max_blocks + 3
    perm = rng.permutation(num_pages)
    k = rng.standard_normal((num_pages, page_size, d)).astype(np.float32)
    v = rng.standard_normal((num_pages, page_size, d)).astype(np.float32)
    k *= rng.uniform(0.05, 4.0, (num_pages, 1, 1))  # page scales that differ
    v *= rng.uniform(0.05, 4.0, (num_pages, 1, 1))
    used = np.zeros(num_pages, bool)
    table = np.full((len(ctx), hkv, max_blocks), -1, np.int32)
    nxt = 0
    for b, n in enumerate(ctx):
        for h in range(hkv):
            for p in range(-(-int(n) // page_size)):
                page = perm[nxt]
                nxt += 1
                table[b, h, p] = page
                used[page] = True
                tail = int(n) - p * page_size
                if tail < page_size:
                    k[page, tail:] = np.nan
                    v[page, tail:] = np.nan
                dead = window[h] > 0 and (p + 1) * page_size <= n - window[h] and p * page_size >= sinks[h]
                if dead and p % 2 == 0:
                    table[b, h, p] = -1  # recycled
                    used[page] = False
                elif dead:
                    k[page] = v[page] = np.nan  # still listed: must not be visited
    k[~used] = np.nan
    v[~used] = np.nan
    q = rng.standard_normal((len(ctx) + pad_tokens, group * hkv, d)).astype(np.float32)
    kw = dict(cu_seqlens=jnp.arange(len(ctx) + 1, dtype=jnp.int32), scale=float(d) ** -0.5,
              window=jnp.asarray(window), sinks=jnp.asarray(sinks))
    return q, k, v, table, ctx, kw


def _quantise(x):
    """fp8 pages with one power-of-two scale per page (the cache write's rule; NaN stays NaN, an all-NaN page gets
    scale NaN): (f8e4m3[P, page, D], f32[P])."""
    amax = np.where(np.isnan(x), 0.0, np.abs(x)).max(axis=(1, 2))
    s = np.asarray(pow2_scale(jnp.asarray(amax)))
    pages = jnp.asarray(x / np.where(s > 0, s, 1.0)[:, None, None]).astype(FP8_DTYPE)
    return pages, jnp.asarray(np.where(np.isnan(x).all(axis=(1, 2)), np.nan, s), jnp.float32)


def _call(q, k, v, table, ctx, kw, scales=(None, None)):
    return check_call(PagedAttentionCall(q, k, v, jnp.asarray(table), jnp.asarray(ctx), **kw,
                                         k_scale=scales[0], v_scale=scales[1]))


def _fp8_case(rng, dtype, **batch):
    """(call over fp8 pages, reference over the same pages f32[T, Hq, D], max |v| over them, the batch)."""
    q, k, v, table, ctx, kw = b = _batch(rng, **batch)
    (k8, ks), (v8, vs) = _quantise(k), _quantise(v)
    q = jnp.asarray(q, dtype)
    ref = paged_attention_reference(_call(q.astype(jnp.float32), k8, v8, table, ctx, kw, (ks, vs)))
    v_max = float(np.nanmax(np.abs(np.asarray(v8, np.float32) * np.asarray(vs)[:, None, None])))
    return _call(q, k8, v8, table, ctx, kw, (ks, vs)), np.asarray(ref), v_max, b


def _check(out, ref, v_max, dtype):
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    bound = (2.0 ** -8 if dtype == jnp.bfloat16 else 0.0) * np.abs(ref) + 2.0 ** -12 * v_max
    err = np.abs(out - ref)
    assert (err <= bound).all(), (float(err.max()), float((err - bound).max()))


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fma_decode_fp8_pages_match_reference(rng, group, page_size):
    call, ref, v_max, (_, _, _, table, _, _) = _fp8_case(rng, jnp.bfloat16, group=group, page_size=page_size)
    assert (table == -1).any() and np.isnan(np.asarray(call.v_scale)[table[table >= 0]]).any()  # holes, NaN pages
    for splits, block_k, prefetch in ((1, 64, False), (5, 128, True)):
        out = decode_fma.paged_decode_fma(call, interpret=True, num_splits=splits, block_k=block_k,
                                          prefetch=prefetch)
        _check(out, ref, v_max, jnp.bfloat16)
    assert float(np.abs(np.asarray(out, np.float32)[len(_CTX):]).max()) == 0.0  # padding tokens get 0


def test_fma_decode_f32_q_is_exact_to_f32_rounding(rng):
    # f32 q: nothing is rounded below f32 anywhere, so only summation order and exp2 remain
    call, ref, v_max, _ = _fp8_case(rng, jnp.float32, group=4, page_size=16)
    for slots, block_k in ((None, 64), (8, 32)):  # one sub-block a step (D=32: 64 slots), four
        out = decode_fma.paged_decode_fma(call, interpret=True, num_splits=2, block_k=block_k, slots=slots)
        _check(out, ref, v_max, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fma_decode_float_pages_match_reference(rng, dtype):
    # the same kernel over bf16 / f32 pages (no scales): the bf16 kernel's contract
    q, k, v, table, ctx, kw = _batch(rng, group=4, page_size=16)
    ref = np.asarray(paged_attention_reference(_call(jnp.asarray(q, dtype).astype(jnp.float32),
                                                     jnp.asarray(k, dtype).astype(jnp.float32),
                                                     jnp.asarray(v, dtype).astype(jnp.float32), table, ctx, kw)))
    call = _call(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), table, ctx, kw)
    out = decode_fma.paged_decode_fma(call, interpret=True, num_splits=3, prefetch=True)
    _check(out, ref, float(np.nanmax(np.abs(v))), dtype)


def test_fma_decode_agrees_with_the_tensor_core_kernel(rng):
    # the two decode kernels over the same fp8 pages: f32 q, so both differ from the reference by f32 rounding only
    call, ref, v_max, _ = _fp8_case(rng, jnp.float32, group=4, page_size=64)
    a = np.asarray(decode_fma.paged_decode_fma(call, interpret=True, num_splits=2))
    b = np.asarray(decode.paged_decode(call, interpret=True, num_splits=2))
    np.testing.assert_allclose(a, b, rtol=0, atol=2.0 ** -11 * v_max)


def test_fma_decode_fp8_against_unquantised_pages_within_the_e4m3_bound(rng):
    # docs/contracts.md: |dk| <= 2**-4 |k| + 2**-9 s_k per element, so each logit moves by at most
    # eps = scale * max_j sum_i |q_i| |dk_ji|, each weight by exp(+-2 eps), an output element by at most
    # (exp(2 eps) - 1) max|v| + 2**-4 max|v| + 2**-9 s_v; plus the kernel's own (bf16 output) rounding
    q, k, v, table, ctx, kw = _batch(rng, group=4, page_size=16)
    (k8, ks), (v8, vs) = _quantise(k), _quantise(v)
    call = _call(jnp.asarray(q, jnp.bfloat16), k8, v8, table, ctx, kw, (ks, vs))
    out = np.asarray(decode_fma.paged_decode_fma(call, interpret=True, num_splits=2), np.float32)
    qb = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    ref = np.asarray(paged_attention_reference(_call(jnp.asarray(qb), jnp.asarray(k), jnp.asarray(v), table, ctx,
                                                     kw)))
    dk = 2.0 ** -4 * np.abs(np.nan_to_num(k)) + 2.0 ** -9 * np.nan_to_num(np.asarray(ks))[:, None, None]
    s_v = float(np.nanmax(np.asarray(vs)))
    v_max = float(np.nanmax(np.abs(v)))
    hkv, group = table.shape[1], q.shape[1] // table.shape[1]
    for b, n in enumerate(ctx):
        for h in range(hkv):
            pages = table[b, h][table[b, h] >= 0]
            dk_rows = dk[pages].reshape(-1, k.shape[-1])  # every key the head could see (a superset: a bound)
            for g in range(group):
                qh = np.abs(qb[b, h * group + g])
                eps = kw["scale"] * float((dk_rows @ qh).max())
                bound = (np.expm1(2 * eps) + 2.0 ** -4) * v_max + 2.0 ** -9 * s_v
                bound = bound + 2.0 ** -8 * np.abs(out[b, h * group + g]) + 2.0 ** -12 * v_max
                err = np.abs(out[b, h * group + g] - ref[b, h * group + g])
                assert (err <= bound).all(), (b, h, g, float(err.max()), bound)
    assert np.abs(out - ref)[: len(ctx)].max() > 0  # fp8 pages do change the output


def test_fma_decode_refuses_bad_knobs(rng):
    call, _, _, _ = _fp8_case(rng, jnp.bfloat16, group=1, page_size=16, ctx=(20,))
    with pytest.raises(ValueError, match="block_k must be a power of two, got 48"):
        decode_fma.paged_decode_fma(call, interpret=True, block_k=48)
    with pytest.raises(ValueError, match="slots must be a power of two, got 12"):
        decode_fma.paged_decode_fma(call, interpret=True, slots=12)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_fma_decode_fp8_grid(rng, group, page_size):
    # the compiled kernel over fp8 pages, D=128, lengths 1..8k, at the knobs benchmarks/fp8_decode.py times
    call, ref, v_max, _ = _fp8_case(rng, jnp.bfloat16, group=group, page_size=page_size, d=128,
                                    ctx=(1, 15, 16, 17, 300, 1000, 4099, 8192))
    for knobs in ({}, {"prefetch": True}, {"slots": 8}, {"num_warps": 8, "prefetch": True}, {"num_splits": 1}):
        _check(decode_fma.paged_decode_fma(call, **knobs), ref, v_max, jnp.bfloat16)
