"""The ops reject bad host input (issue #17 item 5): the gaps ``mla_decode`` and the GDN ops had closed, now closed
in every op through the shared helpers of :mod:`kvjax.base.checks`.

Host (``np.ndarray``) values are checked: ``cu_seqlens`` non-decreasing within ``[0, T]``, ``seq_lens`` within
what the block table covers (``[0, max_blocks * page_size]``), static ints and integer options that must fit
int32 (a larger ``window`` / ``sinks`` wrapped to a negative value and zeroed every output). Traced values cannot
be checked: under ``jit`` the same calls run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.base import checks
from kvjax.ops import dsa, mla
from kvjax.ops.attention import paged_attention


def _paged(rng, t=5, hq=4, hkv=2, d=16, p=6, ps=4, b=2, mb=3):
    """A valid paged-attention call: rows of 3 and 2 new tokens (contexts 3 and 6 of the 12 positions covered)."""
    args = (jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32),
            jnp.asarray(rng.standard_normal((p, ps, d)), jnp.float32),
            jnp.asarray(rng.standard_normal((p, ps, d)), jnp.float32),
            np.asarray(rng.integers(0, p, (b, hkv, mb)), np.int32),
            np.asarray([3, 6], np.int32))
    return args, dict(cu_seqlens=np.asarray([0, 3, 5], np.int32))


@pytest.mark.parametrize("cu, match", [
    ([0, 4, 3], "non-decreasing"),  # non-monotone
    ([0, 3, 6], "non-decreasing"),  # past T = 5
    ([-1, 3, 5], "non-decreasing"),
])
def test_paged_attention_rejects_bad_host_cu_seqlens(rng, cu, match):
    args, kw = _paged(rng)
    for impl in ("reference", "interpret"):
        with pytest.raises(ValueError, match=match):
            paged_attention(*args, cu_seqlens=np.asarray(cu, np.int32), impl=impl)


@pytest.mark.parametrize("lens", [[3, 13], [-1, 2]])
def test_paged_attention_rejects_seq_lens_beyond_the_table(rng, lens):
    args, kw = _paged(rng)
    args = args[:4] + (np.asarray(lens, np.int32),)
    with pytest.raises(ValueError, match=r"seq_lens must be in \[0, max_blocks \* page_size = 12\]"):
        paged_attention(*args, **kw, impl="reference")


@pytest.mark.parametrize("kw, match", [
    (dict(window=2**31), "window must fit int32"),
    (dict(sinks=np.int64(2**32 + 1)), "sinks must fit int32"),
    (dict(window=np.asarray([4, 2**31], np.int64)), "window entries must fit int32"),
    (dict(sinks=[0, 2**33]), "sinks entries must fit int32"),
])
def test_paged_attention_rejects_window_and_sinks_beyond_int32(rng, kw, match):
    args, base = _paged(rng)
    with pytest.raises(ValueError, match=match):
        paged_attention(*args, **base, **kw, impl="reference")


def test_paged_attention_valid_edges_and_traced_values_pass(rng):
    """Full coverage (seq_lens = 12), the largest int32 window and empty rows are fine; traced values (under jit)
    cannot be checked and run."""
    args, kw = _paged(rng)
    full = args[:4] + (np.asarray([3, 12], np.int32),)
    o = paged_attention(*full, **kw, window=2**31 - 1, impl="reference")
    assert np.all(np.isfinite(np.asarray(o)))
    empty = paged_attention(*args[:4], np.asarray([0, 0], np.int32), cu_seqlens=np.zeros(3, np.int32),
                            impl="reference")
    assert np.all(np.asarray(empty) == 0)
    f = jax.jit(lambda sl, cu: paged_attention(*args[:4], sl, cu_seqlens=cu, impl="reference"))
    f(jnp.asarray([3, 13], jnp.int32), jnp.asarray([0, 4, 3], jnp.int32))  # not checkable: no error


def _latent(rng, b=2, h=2, rank=16, rope=8, ps=4, mb=3):
    return (jnp.asarray(rng.standard_normal((b, h, rank)), jnp.float32),
            jnp.asarray(rng.standard_normal((b, h, rope)), jnp.float32),
            jnp.asarray(rng.standard_normal((b * mb, ps, rank + rope)), jnp.float32),
            np.arange(b * mb, dtype=np.int32).reshape(b, 1, mb))


def test_mla_decode_rejects_num_kv_splits_beyond_int32(rng):
    q, qr, pages, table = _latent(rng)
    with pytest.raises(ValueError, match="num_kv_splits"):
        mla.mla_decode(q, qr, pages, table, np.asarray([3, 12], np.int32), scale=0.1, num_kv_splits=2**31,
                       impl="reference")
    with pytest.raises(ValueError, match="seq_lens must be in"):  # the check mla_decode already had
        mla.mla_decode(q, qr, pages, table, np.asarray([3, 13], np.int32), scale=0.1, impl="reference")


def test_mla_prefill_reference_rejects_bad_host_lengths(rng):
    _, _, pages, table = _latent(rng)
    table = jnp.asarray(table)
    qn = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
    qpe = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
    w_uk = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32)
    lens, cu = np.asarray([3, 6], np.int32), np.asarray([0, 3, 5], np.int32)
    mla.mla_prefill_reference(qn, qpe, pages, table, lens, w_uk, w_uv, cu_seqlens=cu, scale=0.1)
    with pytest.raises(ValueError, match="non-decreasing"):
        mla.mla_prefill_reference(qn, qpe, pages, table, lens, w_uk, w_uv, cu_seqlens=np.asarray([0, 4, 3], np.int32),
                                  scale=0.1)
    with pytest.raises(ValueError, match="seq_lens must be in"):
        mla.mla_prefill_reference(qn, qpe, pages, table, np.asarray([3, 13], np.int32), w_uk, w_uv, cu_seqlens=cu,
                                  scale=0.1)


def test_dsa_ops_reject_bad_host_lengths(rng):
    q, qr, pages, table = _latent(rng)
    iq = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 2)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((6, 4, 16)), jnp.float32)
    lens, cu = np.asarray([3, 6], np.int32), np.asarray([0, 3, 5], np.int32)
    dsa.indexer_scores(iq, w, keys, None, table, lens, cu_seqlens=cu, scale=0.25, impl="reference")
    with pytest.raises(ValueError, match="non-decreasing"):
        dsa.indexer_scores(iq, w, keys, None, table, lens, cu_seqlens=np.asarray([0, 6, 5], np.int32), scale=0.25)
    with pytest.raises(ValueError, match="seq_lens must be in"):
        dsa.indexer_scores(iq, w, keys, None, table, np.asarray([13, 2], np.int32), cu_seqlens=cu, scale=0.25)
    topk = np.asarray([[0, 1, -1], [2, 5, 11]], np.int32)
    with pytest.raises(ValueError, match="seq_lens must be in"):
        dsa.sparse_mla_decode(q, qr, pages, table, np.asarray([3, 13], np.int32), topk, scale=0.1)
    with pytest.raises(ValueError, match="topk"):
        dsa.index_topk(jnp.zeros((2, 4), jnp.float32), 2**31)


def test_shared_helpers():
    assert checks.check_static_int("n", np.int64(7)) == 7
    for bad in (True, 1.0, "3", -1, 2**31):
        with pytest.raises(ValueError, match="n must"):
            checks.check_static_int("n", bad)
    checks.check_cu_seqlens(jnp.asarray([0, 4, 3], jnp.int32), 5)  # device values: not read (no sync)
    with pytest.raises(ValueError, match="seq_lens"):
        checks.check_seq_lens(jnp.asarray([5], jnp.int32), 4, device=True)
    checks.check_seq_lens(jnp.asarray([5], jnp.int32), 4)  # device values only when asked


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), np.float32("nan")])
def test_paged_attention_rejects_a_non_finite_scale(rng, scale):
    """Issue 31: ``scale=nan`` was accepted and gave NaN outputs."""
    args, kw = _paged(rng)
    with pytest.raises(ValueError, match=r"scale must be a finite.*nan|scale must be a finite.*inf"):
        paged_attention(*args, **kw, scale=scale, impl="reference")
