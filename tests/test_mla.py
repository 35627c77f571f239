"""MLA: absorbed decode == un-absorbed multi-head attention; kernels == reference; split merge; validation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.ops import mla

RANK, ROPE = 512, 64


def _paged_latent(rng, lens, page_size, max_blocks, *, extra_pages=3, dtype=np.float32):
    """Latent rows f32[B, L, R+r] (L = max_blocks*page_size) scattered into randomly permuted pages.

    Pages and positions past each length hold large finite garbage. Returns (rows, pages, block_tables).
    """
    b = len(lens)
    length = max_blocks * page_size
    rows = rng.standard_normal((b, length, RANK + ROPE)).astype(np.float32)
    needed = [-(-int(n) // page_size) for n in lens]
    num_pages = sum(needed) + extra_pages
    pages = (rng.standard_normal((num_pages, page_size, RANK + ROPE)) * 1e3).astype(np.float32)
    perm = rng.permutation(num_pages)
    tables = np.full((b, 1, max_blocks), -1, np.int32)
    k = 0
    for i, n in enumerate(needed):
        for j in range(n):
            page = perm[k]
            k += 1
            tables[i, 0, j] = page
            upto = min(page_size, int(lens[i]) - j * page_size)
            pages[page, :upto] = rows[i, j * page_size : j * page_size + upto]
    return rows, pages.astype(dtype), tables


def _dense_mha(q, k, v, scale):
    """float64 softmax attention: q [H, Dk], k [H, L, Dk], v [H, L, Dv] -> [H, Dv]."""
    s = np.einsum("hd,hld->hl", q, k) * scale
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hl,hld->hd", p, v)


def test_absorbed_decode_equals_unabsorbed_mha(rng):
    h, nope, vdim, page_size, max_blocks = 4, 32, 48, 16, 6
    lens = np.array([1, 37, 96, 50], np.int32)
    rows, pages, tables = _paged_latent(rng, lens, page_size, max_blocks)
    w_uk = rng.standard_normal((h, nope, RANK)).astype(np.float32) / np.sqrt(RANK)
    w_uv = rng.standard_normal((h, vdim, RANK)).astype(np.float32) / np.sqrt(RANK)
    q_nope = rng.standard_normal((len(lens), h, nope)).astype(np.float32)
    q_pe = rng.standard_normal((len(lens), h, ROPE)).astype(np.float32)
    scale = (nope + ROPE) ** -0.5

    q_latent = mla.absorb_query(jnp.asarray(q_nope), jnp.asarray(w_uk))
    o_lat = mla.mla_decode(q_latent, jnp.asarray(q_pe), jnp.asarray(pages), jnp.asarray(tables),
                           jnp.asarray(lens), scale=scale, impl="reference")
    got = np.asarray(mla.absorb_output(o_lat, jnp.asarray(w_uv)))

    for b, n in enumerate(lens):
        kv_c, k_pe = rows[b, :n, :RANK].astype(np.float64), rows[b, :n, RANK:].astype(np.float64)
        k = np.concatenate([np.einsum("hnr,lr->hln", w_uk, kv_c), np.broadcast_to(k_pe, (h, n, ROPE))], -1)
        v = np.einsum("hvr,lr->hlv", w_uv, kv_c)
        want = _dense_mha(np.concatenate([q_nope[b], q_pe[b]], -1).astype(np.float64), k, v, scale)
        np.testing.assert_allclose(got[b], want, rtol=2e-4, atol=2e-4)


def test_prefill_reference_ragged_causal(rng):
    """Un-absorbed ragged reference == per-sequence dense causal MHA; decode rows == absorbed decode."""
    h, nope, vdim, page_size, max_blocks = 2, 16, 24, 8, 5
    lens = np.array([9, 33, 17], np.int32)  # context incl. new tokens
    new = np.array([9, 4, 1], np.int32)  # full prefill, chunked prefill, decode
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    t = int(cu[-1]) + 2  # two padding tokens
    rows, pages, tables = _paged_latent(rng, lens, page_size, max_blocks)
    w_uk = rng.standard_normal((h, nope, RANK)).astype(np.float32) / np.sqrt(RANK)
    w_uv = rng.standard_normal((h, vdim, RANK)).astype(np.float32) / np.sqrt(RANK)
    q_nope = rng.standard_normal((t, h, nope)).astype(np.float32)
    q_pe = rng.standard_normal((t, h, ROPE)).astype(np.float32)
    scale = 0.11

    got = np.asarray(mla.mla_prefill_reference(
        jnp.asarray(q_nope), jnp.asarray(q_pe), jnp.asarray(pages), jnp.asarray(tables), jnp.asarray(lens),
        jnp.asarray(w_uk), jnp.asarray(w_uv), cu_seqlens=jnp.asarray(cu), scale=scale))
    assert got.shape == (t, h, vdim)
    np.testing.assert_array_equal(got[cu[-1]:], 0.0)
    for b in range(len(lens)):
        for i in range(new[b]):
            tok, pos = cu[b] + i, lens[b] - new[b] + i
            kv_c, k_pe = rows[b, : pos + 1, :RANK].astype(np.float64), rows[b, : pos + 1, RANK:]
            k = np.concatenate([np.einsum("hnr,lr->hln", w_uk, kv_c),
                                np.broadcast_to(k_pe, (h, pos + 1, ROPE))], -1)
            v = np.einsum("hvr,lr->hlv", w_uv, kv_c)
            want = _dense_mha(np.concatenate([q_nope[tok], q_pe[tok]], -1).astype(np.float64), k, v, scale)
            np.testing.assert_allclose(got[tok], want, rtol=2e-4, atol=2e-4)

    # the decode row (b=2) through the absorbed path agrees
    b, tok = 2, cu[2]
    o_lat = mla.mla_decode(mla.absorb_query(jnp.asarray(q_nope[tok:tok + 1]), jnp.asarray(w_uk)),
                           jnp.asarray(q_pe[tok:tok + 1]), jnp.asarray(pages), jnp.asarray(tables[b:b + 1]),
                           jnp.asarray(lens[b:b + 1]), scale=scale, impl="reference")
    np.testing.assert_allclose(np.asarray(mla.absorb_output(o_lat, jnp.asarray(w_uv)))[0], got[tok],
                               rtol=2e-4, atol=2e-4)


def test_split_kv_b_proj_layout(rng):
    h, nope, vdim, r = 3, 4, 5, 8
    w = rng.standard_normal((h * (nope + vdim), r)).astype(np.float32)
    w_uk, w_uv = mla.split_kv_b_proj(jnp.asarray(w), h, nope, vdim)
    x = rng.standard_normal(r).astype(np.float32)
    kv = (w @ x).reshape(h, nope + vdim)  # what kv_b_proj(x).view(H, nope + v) gives
    np.testing.assert_allclose(np.einsum("hnr,r->hn", w_uk, x), kv[:, :nope], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.einsum("hvr,r->hv", w_uv, x), kv[:, nope:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kv_b_weight must have"):
        mla.split_kv_b_proj(jnp.asarray(w), h + 1, nope, vdim)


def _decode_args(b=2, h=4, page_size=8, max_blocks=3, num_pages=6):
    q = jnp.ones((b, h, RANK), jnp.bfloat16)
    qr = jnp.ones((b, h, ROPE), jnp.bfloat16)
    pages = jnp.ones((num_pages, page_size, RANK + ROPE), jnp.bfloat16)
    tables = jnp.zeros((b, 1, max_blocks), jnp.int32)
    lens = jnp.full((b,), 5, jnp.int32)
    return q, qr, pages, tables, lens


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: (a[0][0],) + a[1:], "q_latent must have rank 3"),
        (lambda a: (a[0], a[1][:, :2]) + a[2:], "q_rope must have shape"),
        (lambda a: a[:2] + (a[2][..., :RANK],) + a[3:], "latent_pages last dim"),
        (lambda a: a[:3] + (a[3].astype(jnp.float32),) + a[4:], "block_tables must have dtype"),
        (lambda a: a[:3] + (jnp.zeros((2, 2, 3), jnp.int32),) + a[4:], r"block_tables must have shape \(2, 1"),
        (lambda a: a[:4] + (a[4][:1],), "seq_lens must have shape"),
        (lambda a: a[:4] + (jnp.array([5, 25], jnp.int32),), r"rows \[1\] have \[25\]"),
    ],
)
def test_decode_validation(mutate, match):
    args = mutate(_decode_args())
    with pytest.raises(ValueError, match=match):
        mla.mla_decode(*args, scale=0.1, impl="reference")


def test_decode_validation_scalars():
    args = _decode_args()
    with pytest.raises(ValueError, match="scale must be a positive"):
        mla.mla_decode(*args, scale=0.0, impl="reference")
    with pytest.raises(ValueError, match="num_kv_splits must be None or an int >= 1"):
        mla.mla_decode(*args, scale=0.1, num_kv_splits=0, impl="reference")
