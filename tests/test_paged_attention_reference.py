"""paged_attention reference vs an independent float64 dense oracle on contiguous K/V.

The test builds each sequence's K/V contiguously, scatters it into randomly permuted single-head pages, punches
holes (-1) exactly where a sliding window allows (blocks wholly outside every query's window that hold no sink
position), fills every unreferenced page and hole page with NaN, and compares.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.ops import attention as attn_mod
from kvjax.ops.attention import dense_attention_reference, paged_attention
from kvjax.ops.backends import Backend, BackendTable

WINDOW = np.array([0, 5, 16, 7], np.int32)  # mixed full / SWA KV heads; 5 and 7 straddle page edges
SINKS = np.array([0, 0, 4, 3], np.int32)
# (seq_len, new tokens): prefill, chunked prefill, padding row, decode, long decode, verify-like
ROWS = [(37, 37), (50, 13), (0, 0), (61, 1), (93, 1), (29, 3)]
PAD_TOKENS = 3  # token padding after cu_seqlens[-1]


@dataclasses.dataclass
class Batch:
    q: np.ndarray  # f32[T, Hq, D]
    k_pages: np.ndarray  # f32[P, ps, D]
    v_pages: np.ndarray
    block_tables: np.ndarray  # i32[B, Hkv, max_blocks]
    seq_lens: np.ndarray  # i32[B]
    cu_seqlens: np.ndarray  # i32[B+1]
    k_dense: list  # per row f64[S, Hkv, D]
    v_dense: list
    num_holes: int


def _dense_oracle(batch: Batch, window, sinks, scale, hidden=frozenset()) -> np.ndarray:
    """float64 attention of each new token over its row's contiguous K/V, written from the DESIGN mask.

    ``hidden``: (row, kv head, block) triples whose positions are not attendable (holes inside the window).
    """
    t_total, hq, d = batch.q.shape
    hkv = batch.block_tables.shape[1]
    group = hq // hkv
    out = np.zeros((t_total, hq, d))
    for b, s in enumerate(batch.seq_lens):
        lo, hi = batch.cu_seqlens[b], batch.cu_seqlens[b + 1]
        for t in range(lo, hi):
            i = s - (hi - lo) + (t - lo)
            for head in range(hq):
                h = head // group
                j = np.arange(s)
                vis = (j <= i) & ((window[h] == 0) | (i - j < window[h]) | (j < sinks[h]))
                if hidden:
                    vis &= ~np.isin(j // batch.k_pages.shape[1], [k for bb, hh, k in hidden if (bb, hh) == (b, h)])
                if not vis.any():
                    continue
                logits = batch.k_dense[b][j[vis], h] @ batch.q[t, head].astype(np.float64) * scale
                p = np.exp(logits - logits.max())
                out[t, head] = p @ batch.v_dense[b][j[vis], h] / p.sum()
    return out


def _make_batch(rng, *, group, page_size, head_dim=32, hkv=4, window=WINDOW, sinks=SINKS, extra_pages=7):
    hq = group * hkv
    max_blocks = -(-max(s for s, _ in ROWS) // page_size) + 1  # one spare column of -1
    seq_lens = np.array([s for s, _ in ROWS], np.int32)
    cu = np.concatenate([[0], np.cumsum([n for _, n in ROWS])]).astype(np.int32)
    t_total = int(cu[-1]) + PAD_TOKENS
    q = rng.standard_normal((t_total, hq, head_dim)).astype(np.float32)

    needed = []  # (b, h, block) that must hold a real page
    holes = 0
    for b, (s, n) in enumerate(ROWS):
        first_q = s - n
        for h in range(hkv):
            for blk in range(-(-s // page_size)):
                start, end = blk * page_size, (blk + 1) * page_size - 1
                outside = window[h] > 0 and first_q - end >= window[h] and start >= sinks[h]
                if outside:
                    holes += 1
                else:
                    needed.append((b, h, blk))
    num_pages = len(needed) + extra_pages
    perm = rng.permutation(num_pages)
    k_pages = np.full((num_pages, page_size, head_dim), np.nan, np.float32)
    v_pages = np.full((num_pages, page_size, head_dim), np.nan, np.float32)
    tables = np.full((len(ROWS), hkv, max_blocks), -1, np.int32)
    k_dense = [rng.standard_normal((s, hkv, head_dim)).astype(np.float32) for s, _ in ROWS]
    v_dense = [rng.standard_normal((s, hkv, head_dim)).astype(np.float32) for s, _ in ROWS]
    for page, (b, h, blk) in zip(perm, needed):
        tables[b, h, blk] = page
        rows = slice(blk * page_size, min((blk + 1) * page_size, seq_lens[b]))
        count = rows.stop - rows.start
        k_pages[page, :count] = k_dense[b][rows, h]
        v_pages[page, :count] = v_dense[b][rows, h]
    return Batch(q, k_pages, v_pages, tables, seq_lens, cu,
                 [k.astype(np.float64) for k in k_dense], [v.astype(np.float64) for v in v_dense], holes)


def _run(batch: Batch, impl: str = "reference", **kw):
    return paged_attention(
        jnp.asarray(batch.q), jnp.asarray(batch.k_pages), jnp.asarray(batch.v_pages),
        jnp.asarray(batch.block_tables), jnp.asarray(batch.seq_lens), cu_seqlens=jnp.asarray(batch.cu_seqlens),
        impl=impl, **kw,
    )


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_dense_oracle(rng, group, page_size):
    batch = _make_batch(rng, group=group, page_size=page_size)
    assert batch.num_holes > 0  # the window really punched holes
    assert np.isnan(batch.k_pages).any()  # and unreferenced / tail storage is poisoned
    scale = 0.7 / np.sqrt(batch.q.shape[-1])
    out = np.asarray(_run(batch, scale=scale, window=jnp.asarray(WINDOW), sinks=jnp.asarray(SINKS)))
    want = _dense_oracle(batch, WINDOW, SINKS, scale)
    assert out.dtype == np.float32
    assert np.isfinite(out).all()
    real = int(batch.cu_seqlens[-1])
    np.testing.assert_allclose(out[:real], want[:real], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(out[real:], 0.0)  # padding tokens after cu_seqlens[-1]


def test_garbage_in_unreferenced_and_hole_pages_is_ignored(rng):
    """NaN/inf in every unreferenced page (the -1 holes' former pages, page 0 that a hole's safe index aliases)
    and in the tails of partly filled pages never reaches the output."""
    batch = _make_batch(rng, group=2, page_size=4, extra_pages=5)
    unused = np.setdiff1d(np.arange(batch.k_pages.shape[0]), batch.block_tables[batch.block_tables >= 0])
    if 0 in batch.block_tables:  # move page 0's content elsewhere so that page 0 is garbage
        spare = unused[0]
        batch.k_pages[spare], batch.v_pages[spare] = batch.k_pages[0], batch.v_pages[0]
        batch.block_tables[batch.block_tables == 0] = spare
        batch.k_pages[0] = batch.v_pages[0] = np.nan
        unused = np.setdiff1d(np.arange(batch.k_pages.shape[0]), batch.block_tables[batch.block_tables >= 0])
    assert 0 in unused and unused.size >= 5 and np.isnan(batch.k_pages[unused]).all()
    kw = dict(window=WINDOW, sinks=SINKS)
    base = np.asarray(_run(batch, **kw))
    real = int(batch.cu_seqlens[-1])
    assert np.isfinite(base).all()
    np.testing.assert_allclose(base[:real], _dense_oracle(batch, WINDOW, SINKS, 32 ** -0.5)[:real],
                               rtol=2e-5, atol=2e-5)
    for fill in (np.inf, 1e30):
        batch.k_pages[unused] = fill
        batch.v_pages[unused] = -fill
        np.testing.assert_array_equal(np.asarray(_run(batch, **kw)), base)


def test_hole_inside_window_is_not_attendable(rng):
    """A -1 where the mask would allow reading (not produced by a valid plan) hides exactly those positions;
    a query left with no visible key at all gets 0, not NaN."""
    batch = _make_batch(rng, group=2, page_size=4)
    hidden = {(0, 0, 3), (4, 1, 22), (4, 3, 0), (1, 2, 11)}  # full head, SWA head, a sink block, mid-window
    for b, h, blk in hidden:
        assert batch.block_tables[b, h, blk] >= 0
        batch.block_tables[b, h, blk] = -1
    batch.block_tables[3, 1, 60 // 4] = -1  # decode row 3, SWA head 1: its only visible key (window 5)...
    batch.block_tables[3, 1, 56 // 4] = -1  # ...positions 56..60 all sit in holes now
    hidden |= {(3, 1, 15), (3, 1, 14)}
    out = np.asarray(_run(batch, window=WINDOW, sinks=SINKS))
    want = _dense_oracle(batch, WINDOW, SINKS, 32 ** -0.5, hidden)
    real = int(batch.cu_seqlens[-1])
    np.testing.assert_allclose(out[:real], want[:real], rtol=2e-5, atol=2e-5)
    decode_row3 = batch.cu_seqlens[3]
    np.testing.assert_array_equal(out[decode_row3, 2:4], 0.0)  # query heads 2, 3 use KV head 1


def test_scalar_window_default_scale_and_bf16(rng):
    batch = _make_batch(rng, group=2, page_size=4, window=np.full(4, 6, np.int32), sinks=np.full(4, 2, np.int32))
    want = _dense_oracle(batch, np.full(4, 6), np.full(4, 2), batch.q.shape[-1] ** -0.5)
    real = int(batch.cu_seqlens[-1])
    out = np.asarray(_run(batch, window=6, sinks=2))
    np.testing.assert_allclose(out[:real], want[:real], rtol=2e-5, atol=2e-5)
    batch.q = batch.q.astype(jnp.bfloat16)
    out_bf16 = _run(batch, window=[6, 6, 6, 6], sinks=(2, 2, 2, 2))
    assert out_bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out_bf16, np.float32)[:real], want[:real], rtol=3e-2, atol=3e-2)


def test_jit_with_traced_window_matches_eager(rng):
    batch = _make_batch(rng, group=1, page_size=16)
    eager = _run(batch, window=WINDOW, sinks=SINKS)

    @jax.jit
    def f(q, kp, vp, bt, sl, cu, window, sinks):
        return paged_attention(q, kp, vp, bt, sl, cu_seqlens=cu, window=window, sinks=sinks, impl="reference")

    got = f(batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens, batch.cu_seqlens,
            jnp.asarray(WINDOW), jnp.asarray(SINKS))
    np.testing.assert_allclose(np.asarray(got), np.asarray(eager), rtol=1e-6, atol=1e-6)


def test_dense_attention_reference_matches_oracle(rng):
    s, n, hkv, group, d = 23, 5, 2, 3, 16
    q = rng.standard_normal((n, hkv * group, d)).astype(np.float32)
    k = rng.standard_normal((s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((s, hkv, d)).astype(np.float32)
    window, sinks = np.array([4, 0], np.int32), np.array([2, 0], np.int32)
    batch = Batch(q, None, None, np.zeros((1, hkv, 1), np.int32), np.array([s]), np.array([0, n]),
                  [k.astype(np.float64)], [v.astype(np.float64)], 0)
    want = _dense_oracle(batch, window, sinks, d ** -0.5)
    got = dense_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window=window, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_normalised_kernel_contract(rng, monkeypatch):
    """The chosen kernel (and its unsupported() check) receives one checked PagedAttentionCall: a float scale and
    i32[Hkv] window/sinks arrays beside the op's arrays."""
    seen: dict = {}  # what the spy backend and its unsupported() check received

    def spy_kernel(call, *, interpret):
        seen["kernel"] = dict(call=call, interpret=interpret)
        return call.q

    def spy_unsupported(call):
        seen["unsupported"] = call
        return None

    batch = _make_batch(rng, group=1, page_size=4)
    spy = Backend("spy", spy_kernel, priority=1, device=lambda device: None, unsupported=spy_unsupported)
    monkeypatch.setattr(attn_mod, "TABLE", BackendTable("paged_attention", attn_mod.paged_attention_reference, (spy,)))
    _run(batch, window=3, impl="spy")
    call = seen["kernel"]["call"]
    assert seen["kernel"]["interpret"] is False and seen["unsupported"] is call
    assert isinstance(call, attn_mod.PagedAttentionCall) and call.k_scale is None and call.v_scale is None
    assert type(call.scale) is float and call.scale == pytest.approx(32 ** -0.5)
    for name, want in (("window", [3, 3, 3, 3]), ("sinks", [0, 0, 0, 0])):
        assert getattr(call, name).dtype == jnp.int32 and getattr(call, name).tolist() == want
    for got, want in zip((call.q, call.k_pages, call.v_pages, call.block_tables, call.seq_lens),
                         (batch.q, batch.k_pages, batch.v_pages, batch.block_tables, batch.seq_lens)):
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(call.cu_seqlens), batch.cu_seqlens)
    seen.clear()
    _run(batch, window=3, impl="spy:interpret")
    assert seen["kernel"]["interpret"] is True


def _args(rng, t=5, hq=4, hkv=2, d=8, p=6, ps=4, b=2, mb=3):
    return dict(
        q=jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32),
        k_pages=jnp.asarray(rng.standard_normal((p, ps, d)), jnp.float32),
        v_pages=jnp.asarray(rng.standard_normal((p, ps, d)), jnp.float32),
        block_tables=jnp.asarray(rng.integers(0, p, (b, hkv, mb)), jnp.int32),
        seq_lens=jnp.asarray([3, 2], jnp.int32),
        cu_seqlens=jnp.asarray([0, 3, 5], jnp.int32),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a, r: a.update(q=a["q"][0]), "q must have rank 3"),
        (lambda a, r: a.update(block_tables=a["block_tables"].astype(jnp.float32)), "block_tables must have dtype"),
        (lambda a, r: a.update(block_tables=a["block_tables"][0]), "block_tables must have rank 3"),
        (lambda a, r: a.update(seq_lens=a["seq_lens"].astype(jnp.float32)), "seq_lens must have dtype"),
        (lambda a, r: a.update(cu_seqlens=a["cu_seqlens"][:2]), "cu_seqlens must have shape"),
        (lambda a, r: a.update(q=jnp.asarray(r.standard_normal((5, 3, 8)), jnp.float32)), "multiple of"),
        (lambda a, r: a.update(k_pages=a["k_pages"][..., :4], v_pages=a["v_pages"][..., :4]), "head_dim 4"),
        (lambda a, r: a.update(v_pages=a["v_pages"][:5]), "v_pages must have shape"),
        (lambda a, r: a.update(window=[1, 2, 3]), r"window must have shape \(2,\)"),
        (lambda a, r: a.update(sinks=-1), "sinks must be >= 0"),
        (lambda a, r: a.update(window=np.array([1.5, 2.0])), "window must be an int"),
        (lambda a, r: a.update(window=np.array([4, -1], np.int32)), "window entries must be >= 0"),
    ],
)
def test_bad_inputs_raise(rng, change, match):
    args = _args(rng)
    change(args, rng)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args, impl="reference")
