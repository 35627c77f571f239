"""MLA: absorbed decode == un-absorbed multi-head attention; kernels == reference; split merge; validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.mosaic_interpret import cache_thread_programs
from kvjax.base.device import NAMED, current_device
from kvjax.errors import UnknownImplError
from kvjax.ops import mla
from kvjax.pallas.split_kv import Tiles

RANK, ROPE = 512, 64


def _call(q, qr, pages, tables, lens, *, scale, splits=None, topk=None):
    """The public op's positional arguments as a kernel's normalised call ``(call, latent_pages)``."""
    return mla.MLADecodeCall(q, qr, tables, lens, scale=scale, num_kv_splits=splits, topk_indices=topk), pages


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
        (lambda a: a[:2] + (a[2][..., :RANK],) + a[3:], r"latent_pages must have shape \('\*', '\*', 576\)"),
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


def test_call_is_a_pytree_with_static_options(rng):
    """The call's arrays are its leaves (``topk_indices=None`` adds none), ``scale`` / ``num_kv_splits`` are static
    (a new value is a new tree structure, so a jitted kernel retraces) and are checked when the call is built."""
    q, qr, pages, tables, lens = _random_decode(rng, [5, 9], h=4, page_size=8, max_blocks=2, dtype=jnp.bfloat16)
    call, _ = _call(q, qr, pages, tables, lens, scale=1, splits=3)
    leaves, tree = jax.tree.flatten(call)
    assert [x is y for x, y in zip(leaves, (q, qr, tables, lens))] == [True] * 4 and len(leaves) == 4
    assert call.scale == 1.0 and isinstance(call.scale, float)
    assert jax.tree.unflatten(tree, leaves) == call
    assert jax.tree.structure(_call(q, qr, pages, tables, lens, scale=0.5, splits=3)[0]) != tree
    topk = jnp.asarray(rng.integers(0, 5, (2, 3)), jnp.int32)
    assert len(jax.tree.leaves(_call(q, qr, pages, tables, lens, scale=1, topk=topk)[0])) == 5
    for bad in (0.0, -1.0, True, "0.1", float("nan")):
        with pytest.raises(ValueError, match="scale must be a positive"):
            mla.MLADecodeCall(q, qr, tables, lens, scale=bad)
    for bad in (0, True, 2.0, 2**31):
        with pytest.raises(ValueError, match="num_kv_splits must be None or an int"):
            mla.MLADecodeCall(q, qr, tables, lens, scale=0.1, num_kv_splits=bad)


# ----------------------------------------------------------------------------------------------------------
# Kernels against the reference.


def _random_decode(rng, lens, h, page_size, max_blocks, dtype):
    rows, pages, tables = _paged_latent(rng, lens, page_size, max_blocks)
    q = rng.standard_normal((len(lens), h, RANK)).astype(np.float32)
    qr = rng.standard_normal((len(lens), h, ROPE)).astype(np.float32)
    cast = lambda x: jnp.asarray(x).astype(dtype)
    return cast(q), cast(qr), cast(pages), jnp.asarray(tables), jnp.asarray(np.asarray(lens, np.int32))


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def _oracle(q, qr, pages, tables, lens, scale):
    f32 = lambda x: x.astype(jnp.float32)
    return mla.mla_decode_reference(*_call(f32(q), f32(qr), f32(pages), tables, lens, scale=scale))


@pytest.mark.parametrize("splits, block_n", [(1, None), (8, 128), (3, 32)])
def test_pallas_interpret_matches_reference(rng, splits, block_n):
    """Mixed lengths (1, page edges, empty splits), random page permutation, holes after each sequence;
    one page per step, 128 rows gathered across two pages per step, or half a page per step."""
    from kvjax.pallas.mla.decode import mla_decode_pallas

    lens = [1, 63, 64, 65, 190, 0]
    args = _random_decode(rng, lens, h=5, page_size=64, max_blocks=4, dtype=jnp.bfloat16)
    scale = 0.06
    if block_n is None:
        got = mla.mla_decode(*args, scale=scale, num_kv_splits=splits, impl="interpret")
    else:
        got = mla_decode_pallas(*_call(*args, scale=scale, splits=splits), tiles=Tiles(block_n=block_n),
                                interpret=True)
    assert got.dtype == jnp.bfloat16 and got.shape == (6, 5, RANK)
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[-1], 0.0)  # seq_len 0: padding row
    want = _oracle(*args, scale)
    assert _rel_err(got[:-1], want[:-1]) <= 2e-2


def _split_tables(tables, lens, page_size, splits):
    """Per split: block tables keeping only the split's pages (same rule as the kernels), others -1."""
    out = []
    n_pages = -(-np.asarray(lens) // page_size)
    per = -(-n_pages // splits)
    for s in range(splits):
        t = np.full_like(tables, -1)
        for b in range(tables.shape[0]):
            lo, hi = s * per[b], min((s + 1) * per[b], n_pages[b])
            t[b, 0, lo:hi] = tables[b, 0, lo:hi]
        out.append(t)
    return out


def test_lse_merge_is_exact_and_stage1_matches(rng):
    from kvjax.pallas.mla.decode import _stage1_call
    from kvjax.pallas.split_kv import merge_splits

    lens, page_size, splits, scale = [7, 130, 64, 1], 32, 3, 0.05
    q, qr, pages, tables, lens_a = _random_decode(rng, lens, h=16, page_size=page_size, max_blocks=5,
                                                  dtype=jnp.float32)
    full_o, full_lse = mla.mla_decode_reference(*_call(q, qr, pages, tables, lens_a, scale=scale), return_lse=True)
    parts = [mla.mla_decode_reference(*_call(q, qr, pages, jnp.asarray(t), lens_a, scale=scale), return_lse=True)
             for t in _split_tables(np.asarray(tables), lens, page_size, splits)]
    o_parts = jnp.stack([p[0] for p in parts], 1)  # [B, S, H, R]
    lse_parts = jnp.stack([p[1] for p in parts], 1)  # [B, S, H]
    assert np.isneginf(np.asarray(lse_parts)[3, 1:]).all()  # length 1: two empty splits
    merged = merge_splits(o_parts, lse_parts, axis=1)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(full_o), rtol=2e-6, atol=2e-6)

    o1, lse1 = _stage1_call(q, qr, pages, tables[:, 0], lens_a, scale=scale, num_splits=splits, block_h=16,
                            num_warps=4, num_stages=2, interpret=True)
    np.testing.assert_allclose(np.asarray(lse1), np.asarray(lse_parts), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o_parts), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(merge_splits(o1, lse1, axis=1)), np.asarray(full_lse[..., None] * 0 + full_o),
                               rtol=1e-4, atol=1e-4)


def test_num_kv_splits_choice_is_static():
    from kvjax.pallas.split_kv import choose_num_kv_splits

    assert choose_num_kv_splits(128, 1, 64, 132) == 2
    assert choose_num_kv_splits(128, 4, 64, 132) == 2
    assert choose_num_kv_splits(8, 1, 64, 132) == 16
    assert choose_num_kv_splits(1, 1, 2, 132) == 1  # never more splits than token blocks allow
    assert choose_num_kv_splits(2, 1, 512, 132) == 64  # capped


def test_mosaic_interpret_matches_reference(rng, monkeypatch):
    """The Mosaic GPU kernel in the Mosaic GPU interpreter (one compilation per kernel, not per CTA:
    ``helpers.mosaic_interpret``): mixed lengths (0, 1, a tile edge, empty splits), a hole inside a sequence, 70
    heads (two head groups, the second padded), one split (final dtype written by the kernel) and three (f32 split
    outputs merged)."""
    from kvjax.pallas.mla.decode_mgpu import mla_decode_mgpu

    cache_thread_programs(monkeypatch)
    lens, h = [1, 65, 190, 0], 70
    q, qr, pages, tables, lens_a = _random_decode(rng, lens, h=h, page_size=64, max_blocks=3, dtype=jnp.bfloat16)
    tables = tables.at[2, 0, 1].set(-1)  # tokens 64..127 of row 2 are not attendable
    want = np.asarray(_oracle(q, qr, pages, tables, lens_a, 0.06))
    for splits in (1, 3):
        got = mla_decode_mgpu(*_call(q, qr, pages, tables, lens_a, scale=0.06, splits=splits), interpret=True)
        assert got.dtype == jnp.bfloat16 and got.shape == (4, h, RANK)
        got = np.asarray(got, np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got[-1], 0.0)
        assert _rel_err(got[:-1], want[:-1]) <= 2e-2, splits


def test_mosaic_rejects_unsupported_shapes(rng):
    from kvjax.pallas.mla.decode_mgpu import mla_decode_mgpu, shape_limits, unsupported

    q, qr, pages, tables, lens = _random_decode(rng, [5], h=4, page_size=32, max_blocks=2, dtype=jnp.bfloat16)
    assert shape_limits(q, qr, pages) == "page_size a multiple of 64, got 32"
    assert "R = 512 and r = 64" in shape_limits(q[..., :256], qr, pages)
    pages64 = pages.reshape(-1, 64, RANK + ROPE)
    assert shape_limits(q, qr, pages64) is None
    assert shape_limits(q, qr, pages64.astype(jnp.float32)) == "a bf16 or f16 latent cache, got float32"
    with pytest.raises(ValueError, match="page_size a multiple of 64, got 32"):
        mla_decode_mgpu(*_call(q, qr, pages, tables, lens, scale=0.1))
    # the backend table's check: the same limits, and at most 16 heads declined (the Pallas kernel is faster)
    assert unsupported(*_call(q, qr, pages, tables, lens, scale=0.1)) == "needs page_size a multiple of 64, got 32"
    assert "H = 4 <= 16 heads" in unsupported(*_call(q, qr, pages64, tables, lens, scale=0.1))
    q17, qr17 = jnp.zeros((1, 17, RANK), jnp.bfloat16), jnp.zeros((1, 17, ROPE), jnp.bfloat16)
    assert unsupported(*_call(q17, qr17, pages64, tables, lens, scale=0.1)) is None


def test_mosaic_num_kv_splits_choice():
    from kvjax.pallas.split_kv import choose_num_kv_splits

    def choose(*a):
        return choose_num_kv_splits(*a, one_cta_per_sm=True)

    assert choose(128, 2, 64, 132) == 1  # 256 CTAs already fill the SMs
    assert choose(128, 1, 64, 132) == 1
    assert choose(8, 1, 64, 132) == 16
    assert choose(1, 1, 2, 132) == 1  # never more splits than 4-tile chunks allow
    assert choose(2, 1, 512, 132) == 64  # capped


def _decode_call(h, page_size=64, dtype=jnp.bfloat16, b=128, context=4096):
    return mla.example_call(b, h, context, page_size=page_size, dtype=dtype)


def test_table_chooses_as_documented():
    """``auto`` on a Hopper GPU: the Mosaic kernel above 16 heads (where it was measured 2.1x faster), the Pallas
    Triton-lowered kernel at 16 (where Mosaic lost) and where Mosaic cannot take the shapes; the Pallas kernel on
    any other GPU; the reference on a CPU. The jax-triton kernel is never ``auto``'s choice."""
    table = mla.TABLE
    assert table.names() == ["reference", "mosaic", "pallas", "triton"]

    def auto(h, device, **kw):
        reasons = table.explain(*_decode_call(h, **kw), NAMED[device])
        return next(name for name, why in reasons if why is None), dict(reasons)

    choice, why = auto(128, "h100")
    assert choice == "mosaic"
    choice, why = auto(16, "h100")
    assert choice == "pallas" and "H = 16 <= 16 heads" in why["mosaic"]
    assert auto(32, "h200")[0] == "mosaic"
    choice, why = auto(128, "h100", page_size=16)
    assert choice == "pallas" and "page_size a multiple of 64" in why["mosaic"]
    assert auto(128, "h100", dtype=jnp.float32, page_size=64)[0] == "pallas"
    for h in (16, 128):
        choice, why = auto(h, "a100")
        assert choice == "pallas" and "needs a Hopper GPU" in why["mosaic"]
        choice, why = auto(h, "cpu")
        assert choice == "reference" and "needs a GPU" in why["pallas"] and "needs a GPU" in why["triton"]
        args, kwargs = _decode_call(h)
        assert table.choose("auto", args, kwargs, NAMED["h100"])[0] in ("mosaic", "pallas")
    for name, ex in table.examples.items():  # the examples are valid normalised calls
        args, kwargs = ex()
        want = ("reference",) if "not a Triton tile" in name else ("mosaic", "pallas")
        assert table.choose("auto", args, kwargs, NAMED["h100"])[0] in want


def test_explicit_impl_that_cannot_take_the_call_raises(rng):
    args = _random_decode(rng, [3, 70], h=4, page_size=64, max_blocks=2, dtype=jnp.bfloat16)
    with pytest.raises(UnknownImplError, match="H = 4 <= 16 heads"):
        mla.mla_decode(*args, scale=0.1, impl="mosaic:interpret")
    with pytest.raises(UnknownImplError, match="no interpret mode"):
        mla.mla_decode(*args, scale=0.1, impl="triton:interpret")
    with pytest.raises(UnknownImplError, match="no implementation 'cuda'"):
        mla.mla_decode(*args, scale=0.1, impl="cuda")
    call = _call(*args, scale=0.1)
    with pytest.raises(UnknownImplError, match="needs a Hopper GPU"):
        mla.TABLE.choose("mosaic", call, {}, NAMED["a100"])
    with pytest.raises(UnknownImplError, match="needs a GPU"):
        mla.TABLE.choose("pallas", call, {}, NAMED["cpu"])
    # 64 heads: the Mosaic kernel's interpreter may take the call (same contract as the Pallas kernel)
    q64 = jnp.zeros((2, 64, RANK), jnp.bfloat16), jnp.zeros((2, 64, ROPE), jnp.bfloat16)
    assert mla.TABLE.choose("mosaic:interpret", _call(*q64, *args[2:], scale=0.1), {})[0] == "mosaic:interpret"
    assert mla.TABLE.choose("interpret", call, {})[0] == "interpret"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "triton", "mosaic"])
@pytest.mark.parametrize("h", [16, 128])
def test_kernels_gpu_long_mixed(rng, impl, h):
    if impl == "triton":
        pytest.importorskip("jax_triton", reason="optional dependency: the 'triton' extra")
    if impl == "mosaic" and not current_device().hopper:
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    lens = [1, 8192, 64, 4097, 777, 8000, 65, 3]
    args = _random_decode(rng, lens, h=h, page_size=64, max_blocks=128, dtype=jnp.bfloat16)
    want = _oracle(*args, 0.07)
    for splits in (None, 1, 5):
        if impl == "mosaic" and h <= 16:  # the table declines it there (slower); the kernel itself takes it
            from kvjax.pallas.mla.decode_mgpu import mla_decode_mgpu

            with pytest.raises(UnknownImplError, match="heads"):
                mla.mla_decode(*args, scale=0.07, num_kv_splits=splits, impl=impl)
            got = mla_decode_mgpu(*_call(*args, scale=0.07, splits=splits))
        else:
            got = mla.mla_decode(*args, scale=0.07, num_kv_splits=splits, impl=impl)
        assert np.isfinite(np.asarray(got, np.float32)).all()
        assert _rel_err(got, want) <= 2e-2, (impl, h, splits)
    if impl == "mosaic":
        return
    if impl == "pallas":
        from kvjax.pallas.mla.decode import mla_decode_pallas as fn
    else:
        from kvjax.triton.mla_decode import mla_decode_triton as fn
    got = fn(*_call(*args, scale=0.07, splits=3), tiles=Tiles(block_n=32))
    assert _rel_err(got, want) <= 2e-2, (impl, h, 32)
    # 128 rows across two pages per step; 2 stages and fewer heads per program to fit shared memory
    got = fn(*_call(*args, scale=0.07, splits=3), tiles=Tiles(block_n=128, block_h=16 if h == 16 else 32,
                                                               num_warps=4 if h == 16 else 8, num_stages=2))
    assert _rel_err(got, want) <= 2e-2, (impl, h, 128)


def test_decode_after_latent_cache_writes(rng):
    """Two steps through kvjax.state: prefill rows written by slot mapping, then one decode token each;
    the kernel (interpret) and the reference read what the writer put, against dense attention in float64."""
    from kvjax.state.latent_cache import write_latent

    page_size, max_blocks, h, scale = 16, 4, 3, 0.07
    prompt = np.array([20, 5], np.int32)
    num_pages = 9
    perm = rng.permutation(num_pages).astype(np.int32)
    tables = np.full((2, 1, max_blocks), -1, np.int32)
    tables[0, 0, :2], tables[1, 0, :1] = perm[:2], perm[2:3]
    pages = jnp.asarray(rng.standard_normal((num_pages, page_size, RANK + ROPE)), jnp.float32)

    def slots(b, positions):
        return tables[b, 0, positions // page_size] * page_size + positions % page_size

    kv_c = rng.standard_normal((int(prompt.sum()) + 2, RANK)).astype(np.float32)
    k_pe = rng.standard_normal((int(prompt.sum()) + 2, ROPE)).astype(np.float32)
    mapping = np.concatenate([slots(0, np.arange(20)), slots(1, np.arange(5)), [-1, -1]]).astype(np.int32)
    pages = write_latent(pages, jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(mapping))
    new_c = rng.standard_normal((2, RANK)).astype(np.float32)
    new_pe = rng.standard_normal((2, ROPE)).astype(np.float32)
    step_map = np.array([slots(0, np.array(20)), slots(1, np.array(5))], np.int32)
    pages = write_latent(pages, jnp.asarray(new_c), jnp.asarray(new_pe), jnp.asarray(step_map))

    lens = prompt + 1
    q = rng.standard_normal((2, h, RANK)).astype(np.float32)
    qr = rng.standard_normal((2, h, ROPE)).astype(np.float32)
    args = (jnp.asarray(q), jnp.asarray(qr), pages, jnp.asarray(tables), jnp.asarray(lens))
    got_ref = np.asarray(mla.mla_decode(*args, scale=scale, impl="reference"))
    got_ker = np.asarray(mla.mla_decode(*args, scale=scale, num_kv_splits=2, impl="interpret"))
    starts = [0, 20]
    for b in range(2):
        rows = np.concatenate([
            np.concatenate([kv_c[starts[b]:starts[b] + prompt[b]], new_c[b:b + 1]]),
            np.concatenate([k_pe[starts[b]:starts[b] + prompt[b]], new_pe[b:b + 1]]),
        ], -1).astype(np.float64)
        k = np.broadcast_to(rows, (h,) + rows.shape)
        want = _dense_mha(np.concatenate([q[b], qr[b]], -1).astype(np.float64), k, k[..., :RANK], scale)
        np.testing.assert_allclose(got_ref[b], want, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(got_ker[b], want, rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------------------------------------
# Head dims the Triton tiles cannot take (issue #17 item 8): auto falls back to the reference, with the reason.


@pytest.mark.parametrize("rank,rope,page_size", [(96, 64, 16), (512, 48, 16), (512, 64, 24)])
def test_triton_tiles_decline_other_head_dims(rng, rank, rope, page_size):
    """R, r or a page (a step's rows) that is not a power of two >= 16: the Pallas kernel declines with the reason
    (``kvjax info`` shows it), ``auto`` runs the reference on a GPU, and an explicit ``impl`` raises it."""
    from kvjax.base.device import NAMED
    from kvjax.errors import UnknownImplError

    lens = np.asarray([5, 40], np.int32)
    mb = -(-40 // page_size)
    pages = jnp.asarray(rng.standard_normal((2 * mb, page_size, rank + rope)), jnp.float32)
    tables = jnp.asarray(np.arange(2 * mb, dtype=np.int32).reshape(2, 1, mb))
    q = jnp.asarray(rng.standard_normal((2, 4, rank)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((2, 4, rope)), jnp.float32)
    args = (q, qr, pages, tables, jnp.asarray(lens))
    why = dict(mla.TABLE.explain(_call(*args, scale=0.1), {}, NAMED["h100"]))
    assert "power-of-two" in why["pallas"] and why["mosaic"] is not None and why["triton"] is not None
    assert mla.TABLE.choose("auto", _call(*args, scale=0.1), {}, NAMED["h100"])[0] == "reference"
    for impl in ("interpret", "pallas"):  # off a GPU "pallas" names the device first
        with pytest.raises(UnknownImplError, match="power-of-two" if impl == "interpret" else "power-of-two|GPU"):
            mla.mla_decode(*args, scale=0.1, impl=impl)
    want = mla.mla_decode(*args, scale=0.1, impl="reference")
    np.testing.assert_array_equal(np.asarray(mla.mla_decode(*args, scale=0.1)), np.asarray(want))
    topk = jnp.asarray([[0, 3, -1, 4], [39, 1, 2, 7]], jnp.int32)
    from kvjax.ops import dsa

    for impl in ("interpret", "pallas") if (rank, rope) != (RANK, ROPE) else ():  # sparse steps gather 64 rows
        with pytest.raises(UnknownImplError, match="power-of-two" if impl == "interpret" else "power-of-two|GPU"):
            dsa.sparse_mla_decode(*args, topk, scale=0.1, impl=impl)
