"""The split-KV decode kernel's row mode (a verification step's rows, ``kvjax.pallas.paged.decode``): one program
per (span of <= J tokens of one row, KV head, split) against the float32 reference, and the backend table sending
verification calls (a static ``max_query_len``) to it.

Batches are built so that a kernel that reads what it must not fails: ragged rows of 1..J new tokens (and an empty
row, and padding tokens after the rows), a full KV head beside a SWA head with sinks whose pages below the window
are either holes (-1) or still listed but NaN, NaN in the unwritten tail of every last page and in every unused
page, rows whose new tokens straddle a page boundary. Interpret mode on CPU, f32 (or fp8 pages read by an f32
query: e4m3 values and power-of-two scales are exact in f32), so kernel and reference differ by f32 summation
order and the online softmax only: ``atol = rtol = 2e-5``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.base.device import NAMED
from kvjax.base.fp8 import FP8_DTYPE, pow2_scale
from kvjax.ops import attention
from kvjax.ops.attention import PagedAttentionCall, check_call, paged_attention_reference
from kvjax.pallas.paged import common, decode
from kvjax.pallas.paged import prefill as paged_prefill

TOL = dict(atol=2e-5, rtol=2e-5)
J = 5  # a verification step's K + 1


def _batch(rng, *, hq, hkv, page_size, ctx, new, window, sinks, d=16, pad_tokens=3, fp8=False):
    """A checked call over a permuted page pool: row ``b`` has ``ctx[b]`` positions, its last ``new[b]`` the new
    tokens; ``pad_tokens`` tokens after the rows belong to none. Dead SWA pages (below every new token's window,
    above the sinks) are holes or NaN at random, unwritten tails and unused pages NaN (fp8: NaN scales)."""
    ctx, new = np.asarray(ctx), np.asarray(new)
    max_blocks = int(-(-ctx.max() // page_size)) + 1
    num_pages = len(ctx) * hkv * max_blocks + 2
    perm = rng.permutation(num_pages)
    k = rng.standard_normal((num_pages, page_size, d)).astype(np.float32)
    v = rng.standard_normal((num_pages, page_size, d)).astype(np.float32)
    used = np.zeros(num_pages, bool)
    table = np.full((len(ctx), hkv, max_blocks), -1, np.int32)
    nxt = 0
    for b in range(len(ctx)):
        first_q = ctx[b] - new[b]
        for h in range(hkv):
            for p in range(-(-ctx[b] // page_size)):
                page = perm[nxt]
                nxt += 1
                table[b, h, p], used[page] = page, True
                k[page, max(ctx[b] - p * page_size, 0):] = np.nan
                v[page, max(ctx[b] - p * page_size, 0):] = np.nan
                if window[h] and (p + 1) * page_size <= first_q - window[h] + 1 and p * page_size >= sinks[h]:
                    if rng.random() < 0.5:
                        table[b, h, p], used[page] = -1, False
                    else:
                        k[page] = v[page] = np.nan
    k[~used] = v[~used] = np.nan
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]) + pad_tokens, hq, d)).astype(np.float32)
    scales = {}
    if fp8:
        pages = []
        for name, x in (("k", k), ("v", v)):
            amax = np.where(np.isnan(x), 0.0, np.abs(x)).max(axis=(1, 2))
            s = np.asarray(pow2_scale(jnp.asarray(amax)))
            pages.append(jnp.asarray(x / np.where(s > 0, s, 1.0)[:, None, None]).astype(FP8_DTYPE))
            scales[f"{name}_scale"] = jnp.asarray(np.where(np.isnan(x).all(axis=(1, 2)), np.nan, s), jnp.float32)
        k, v = pages
    return check_call(PagedAttentionCall(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(ctx, jnp.int32),
        jnp.asarray(cu), jnp.asarray(window, jnp.int32), jnp.asarray(sinks, jnp.int32), **scales,
        scale=float(d) ** -0.5, max_query_len=int(new.max())))


def _check(out, call):
    ref = np.asarray(paged_attention_reference(call))
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(np.asarray(out), ref, **TOL)
    n_real = int(call.cu_seqlens[-1])
    assert n_real < call.q.shape[0] and float(jnp.abs(out[n_real:]).max()) == 0.0  # padding tokens get 0


# (GQA group, page size, splits): rows of 1..J tokens, one empty; row 1 straddles a page boundary at 16 and 64;
# 4 spans of padding tokens, so that programs take a second span
@pytest.mark.parametrize("group,page_size,num_splits", [(1, 16, 1), (4, 64, 3), (8, 16, 2), (4, 16, 1)])
def test_row_mode_matches_reference(rng, group, page_size, num_splits):
    hkv = 2
    ctx = [3 * page_size + 9, page_size + 2, 40, 0, 2 * page_size + 30]
    call = _batch(rng, hq=group * hkv, hkv=hkv, page_size=page_size, ctx=ctx, new=[J, 4, 1, 0, 3],
                  window=[0, page_size + 5], sinks=[0, 3], pad_tokens=4 * J - 2)  # padding spans past B
    assert decode.default_tokens_per_program(call.max_query_len) == J
    out = decode.paged_decode(call, interpret=True, num_splits=num_splits, block_k=max(page_size, 32))
    _check(out, call)


def test_row_mode_fp8_pages(rng):
    call = _batch(rng, hq=8, hkv=2, page_size=16, ctx=[57, 18, 33], new=[J, 3, 2], window=[21, 0], sinks=[4, 0],
                  fp8=True)
    for num_splits in (1, 2):
        _check(decode.paged_decode(call, interpret=True, num_splits=num_splits, block_k=32), call)


def test_rows_longer_than_a_program_and_one_token_programs(rng):
    # the kernel is exact whatever the promise: rows of up to 7 tokens in programs of 3 (two or three spans a
    # row), and today's one token a program
    call = _batch(rng, hq=8, hkv=2, page_size=16, ctx=[50, 21, 9], new=[7, 4, 1], window=[0, 12], sinks=[0, 2])
    for tokens in (3, 1):
        _check(decode.paged_decode(call, interpret=True, tokens_per_program=tokens, num_splits=2, block_k=16), call)
    with pytest.raises(ValueError, match="tokens_per_program must be a positive int"):
        decode.paged_decode(call, interpret=True, tokens_per_program=0)


def test_spans_are_a_rows_consecutive_tokens(rng):
    # the row mode's premise, checked against the reference's own token map: every token lies in exactly one
    # span, a span's tokens are consecutive tokens of its row at consecutive positions (cu_seqlens makes a row's
    # tokens contiguous, seq_lens puts them in position order), padding tokens in spans that attend to nothing
    call = _batch(rng, hq=4, hkv=2, page_size=16, ctx=[40, 20, 0, 9], new=[5, 2, 0, 1], window=[0, 10],
                  sinks=[0, 1], pad_tokens=4)
    t_total = call.q.shape[0]
    row, pos, real = (np.asarray(x) for x in common.token_positions(call.cu_seqlens, call.seq_lens, t_total))
    for tokens in (1, 2, J):
        (s_row, s_tok, s_len, s_pos), (_, _, n_pages) = (
            tuple(np.asarray(x) for x in part) for part in decode.spans_and_walks(call, tokens))
        seen = np.zeros(t_total, int)
        for n in range(len(s_row)):
            toks = np.arange(s_tok[n], s_tok[n] + s_len[n])
            assert s_len[n] <= tokens
            seen[toks] += 1
            if real[toks].any():
                assert real[toks].all() and (row[toks] == s_row[n]).all()
                np.testing.assert_array_equal(pos[toks], s_pos[n] + np.arange(s_len[n]))
            else:
                assert (n_pages[n] == 0).all()
        np.testing.assert_array_equal(seen, 1)
        if tokens > 1:  # the used spans first: a row-mode program stops at the first empty span of its stride
            used = s_len > 0
            assert 0 < used.sum() < len(used) and not used[used.sum():].any()


def test_table_sends_verification_rows_to_the_row_mode(rng):
    assert paged_prefill.FEW_TOKENS <= decode.MAX_TOKENS_PER_PROGRAM  # every call it declines gets the row mode
    sds = jax.ShapeDtypeStruct
    few = paged_prefill.FEW_TOKENS
    for b, tokens in ((1, 2), (1, J), (16, few), (64, few), (16, few + 1)):  # the last: more than FEW_TOTAL tokens
        pages = sds((b * 8 * 256, 16, 128), jnp.bfloat16)
        call = PagedAttentionCall(sds((b * tokens, 32, 128), jnp.bfloat16), pages, pages,
                                  sds((b, 8, 256), jnp.int32), sds((b,), jnp.int32), sds((b + 1,), jnp.int32),
                                  sds((8,), jnp.int32), sds((8,), jnp.int32), scale=128 ** -0.5,
                                  max_query_len=tokens)
        want = "pallas" if tokens <= few or b * tokens <= paged_prefill.FEW_TOTAL else "prefill"
        for device in ("h100", "a100"):
            assert attention.TABLE.choose("auto", (call,), {}, NAMED[device])[0] == want
        assert attention.TABLE.choose("auto", (dataclasses.replace(call, max_query_len=None),), {},
                                      NAMED["h100"])[0] == ("pallas" if tokens == 1 else "prefill")
    # and the decode kernel the table binds runs the row mode for that bound (its kernel name says so)
    call = _batch(rng, hq=4, hkv=2, page_size=16, ctx=[30, 12], new=[J, 2], window=[0, 0], sinks=[0, 0])
    _, fn = attention.TABLE.choose("pallas:interpret", (call,), {})
    assert f"kvjax_paged_decode_rows{J}_" in str(jax.make_jaxpr(fn)(call))
    text = str(jax.make_jaxpr(fn)(dataclasses.replace(call, max_query_len=None)))
    assert "kvjax_paged_decode_s" in text and "_rows" not in text
    out = attention.paged_attention(call.q, call.k_pages, call.v_pages, call.block_tables, call.seq_lens,
                                    cu_seqlens=call.cu_seqlens, max_query_len=J, impl="interpret")
    _check(out, call)


# ---------------------------------------------------------------- GPU (compiled): bf16, D = 128, long rows

@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_row_mode_grid(rng, group, page_size, fp8):
    # rows of 5, 3, 1, 0 and 4 tokens over 4100 positions down to 130; head 0 full, head 1 SWA with sinks whose
    # window straddles page edges. bf16 q and pages: relative L2 error <= 2e-2 per row (the kernel rounds the
    # probabilities to bf16 before P V; fp8 pages: kernel and reference read the same e4m3 values)
    hkv = 2
    ctx, new = [3001, 700, 130, 0, 4100], [J, 3, 1, 0, 4]
    call = _batch(rng, hq=group * hkv, hkv=hkv, page_size=page_size, ctx=ctx, new=new, window=[0, 100],
                  sinks=[0, 4], d=128, fp8=fp8)
    call = dataclasses.replace(call, q=call.q.astype(jnp.bfloat16))
    if not fp8:
        call = dataclasses.replace(call, k_pages=call.k_pages.astype(jnp.bfloat16),
                                   v_pages=call.v_pages.astype(jnp.bfloat16))
    ref = np.asarray(paged_attention_reference(dataclasses.replace(call, q=call.q.astype(jnp.float32))))
    cu = np.asarray(call.cu_seqlens)
    for splits, block_k in ((None, None), (1, 128), (7, 64)):
        out = np.asarray(decode.paged_decode(call, num_splits=splits, block_k=block_k), np.float32)
        assert np.isfinite(out).all()
        for b in range(len(ctx)):
            seg = slice(cu[b], cu[b + 1])
            assert np.linalg.norm(out[seg] - ref[seg]) <= 2e-2 * np.linalg.norm(ref[seg]), (b, splits, block_k)
        assert float(np.abs(out[cu[-1]:]).max()) == 0.0
