"""Cache writes by slot mapping (GQA pages, MLA latent, DSA fp8) and blockwise fp8 quantisation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.state.dsa_cache import (
    FP8_MAX, dequantize_fp8_blockwise, gather_dsa_indexer, gather_dsa_key, quantize_fp8_blockwise,
    write_dsa_indexer, write_dsa_key,
)
from kvjax.state.kv_cache import gather_tokens, scatter_tokens, write_kv, write_kv_cache
from kvjax.state.latent_cache import gather_latent, write_latent, write_latent_cache
from kvjax.state.registry import DSACacheSpec, create_kv_cache

E4M3_REL = 2.0 ** -4  # half an ulp of a 3-bit mantissa, relative
E4M3_SUBNORMAL_ABS = 2.0 ** -10  # half the e4m3 subnormal spacing 2**-9, in units of the block scale


def _slot_mapping(rng, t, h, num_pages, page_size, skip_frac=0.3):
    """Distinct random slots (no slot written twice), some entries -1."""
    slots = rng.choice(num_pages * page_size, size=t * h, replace=False).astype(np.int32).reshape(t, h)
    slots[rng.random((t, h)) < skip_frac] = -1
    return slots


def _expected_scatter(pages, values, slots):
    want = pages.copy()
    ps = pages.shape[1]
    for idx in np.ndindex(slots.shape):
        if slots[idx] >= 0:
            want[slots[idx] // ps, slots[idx] % ps] = values[idx]
    return want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_lands_where_mapping_says(rng, dtype):
    p, ps, d, t, h = 9, 4, 8, 7, 3
    k_pages = jnp.asarray(rng.standard_normal((p, ps, d)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((p, ps, d)), dtype)
    k, v = (rng.standard_normal((t, h, d)).astype(np.float32) for _ in range(2))
    slots = _slot_mapping(rng, t, h, p, ps)
    assert (slots == -1).any() and (slots >= 0).any()
    new_k, new_v = jax.jit(write_kv)(k_pages, v_pages, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    assert new_k.dtype == dtype and new_k.shape == k_pages.shape
    for new, old, val in ((new_k, k_pages, k), (new_v, v_pages, v)):
        want = _expected_scatter(np.asarray(old, np.float32), np.asarray(jnp.asarray(val, dtype), np.float32), slots)
        np.testing.assert_array_equal(np.asarray(new, np.float32), want)


def test_skip_mapping_changes_nothing(rng):
    p, ps, d, t, h = 5, 4, 6, 4, 2
    pages = jnp.asarray(rng.standard_normal((p, ps, d)), jnp.float32)
    vals = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    for fill in (-1, -7):  # any negative slot is a skip (never wraps around to the pool's end)
        out = scatter_tokens(pages, vals, jnp.full((t, h), fill, jnp.int32))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(pages))
    cache = {"key": pages, "value": pages + 1.0}
    out = write_kv_cache(cache, vals, vals, jnp.full((t, h), -1, jnp.int32))
    for role in cache:
        np.testing.assert_array_equal(np.asarray(out[role]), np.asarray(cache[role]))


def test_gather_tokens_reads_back_and_zeros_negative(rng):
    p, ps, d = 6, 4, 5
    pages = jnp.asarray(rng.standard_normal((p, ps, d)), jnp.float32)
    slots = np.array([[3, -1], [23, 0]], np.int32)
    got = np.asarray(gather_tokens(pages, jnp.asarray(slots)))
    flat = np.asarray(pages).reshape(p * ps, d)
    np.testing.assert_array_equal(got[0, 0], flat[3])
    np.testing.assert_array_equal(got[1], flat[[23, 0]])
    np.testing.assert_array_equal(got[0, 1], 0.0)


def test_gather_tokens_zeros_slots_past_the_pool(rng):
    """A slot >= P * page_size reads zeros (like a negative one), not the clamped last row."""
    p, ps, d = 3, 4, 5
    pages = jnp.asarray(rng.standard_normal((p, ps, d)), jnp.float32)
    slots = jnp.asarray([p * ps - 1, p * ps, p * ps + 7], jnp.int32)
    got = np.asarray(gather_tokens(pages, slots))
    np.testing.assert_array_equal(got[0], np.asarray(pages)[-1, -1])
    np.testing.assert_array_equal(got[1:], 0.0)


@pytest.mark.parametrize("mapping_rank", [1, 2])
def test_write_latent(rng, mapping_rank):
    p, ps, r, rope, t = 7, 4, 16, 8, 6
    pages = jnp.asarray(rng.standard_normal((p, ps, r + rope)), jnp.bfloat16)
    kv_c = rng.standard_normal((t, r)).astype(np.float32)
    k_pe = rng.standard_normal((t, rope)).astype(np.float32)
    slots = _slot_mapping(rng, t, 1, p, ps)[:, 0]
    mapping = slots if mapping_rank == 1 else slots[:, None]
    new = write_latent_cache({"key": pages}, jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(mapping))["key"]
    rows = np.asarray(jnp.asarray(np.concatenate([kv_c, k_pe], -1), jnp.bfloat16), np.float32)
    want = _expected_scatter(np.asarray(pages, np.float32), rows, slots)
    np.testing.assert_array_equal(np.asarray(new, np.float32), want)
    back = np.asarray(gather_latent(new, jnp.asarray(slots)), np.float32)
    np.testing.assert_array_equal(back[slots >= 0], rows[slots >= 0])


def _assert_fp8_close(x, deq, scale, block):
    """|x - deq| <= rel * |x| + subnormal spacing * scale (per block), the e4m3 rounding bound."""
    xs = np.asarray(x, np.float64)
    bound = E4M3_REL * np.abs(xs) + E4M3_SUBNORMAL_ABS * np.repeat(np.asarray(scale), block, axis=-1) + 1e-30
    err = np.abs(xs - np.asarray(deq, np.float64))
    assert (err <= bound * (1 + 1e-6)).all(), float((err / bound).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_blockwise_round_trip(rng, dtype):
    block = 128
    # magnitudes spread over many octaves so the subnormal range is exercised too
    x = rng.standard_normal((3, 5, 4 * block)) * np.exp(rng.uniform(-8, 4, (3, 5, 4 * block)))
    x = jnp.asarray(x, dtype)
    x = x.at[1, 2, block:2 * block].set(0.0)  # one all-zero block: scale 0, zeros back, no NaN
    q, scale = jax.jit(quantize_fp8_blockwise, static_argnums=1)(x, block)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == (3, 5, 4)
    xf = np.asarray(x, np.float32).reshape(3, 5, 4, block)
    np.testing.assert_allclose(np.asarray(scale), np.abs(xf).max(-1) / FP8_MAX, rtol=1e-6)
    assert np.asarray(scale)[1, 2, 1] == 0.0
    deq = dequantize_fp8_blockwise(q, scale)
    assert deq.dtype == jnp.float32 and np.isfinite(np.asarray(deq)).all()
    _assert_fp8_close(np.asarray(x, np.float32), deq, scale, block)
    # the block maximum is representable exactly: |q| reaches 448 in every non-zero block
    qmax = np.abs(np.asarray(q, np.float32)).reshape(3, 5, 4, block).max(-1)
    np.testing.assert_array_equal(qmax[np.asarray(scale) > 0], FP8_MAX)
    # and the rounding is e4m3's own (ml_dtypes) of x / scale
    safe = np.where(np.asarray(scale) > 0, np.asarray(scale), 1.0)
    ref = (xf / safe[..., None]).astype(ml_dtypes.float8_e4m3fn).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(q, np.float32), ref.astype(np.float32))


def test_fp8_bad_block_raises(rng):
    with pytest.raises(ValueError, match="multiple of block=128"):
        quantize_fp8_blockwise(jnp.asarray(rng.standard_normal((2, 100)), jnp.float32))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_blockwise(jnp.zeros((2, 256), jnp.float8_e4m3fn), jnp.ones((2, 3)))


def test_dsa_writes_and_reads(rng):
    spec = DSACacheSpec(layer=0, page_size=4, kv_lora_rank=256, rope_dim=32, index_head_dim=128, quant_block=128)
    p, t = 6, 9
    cache = create_kv_cache(spec, p)
    cache = {role: (jnp.asarray(rng.standard_normal(a.shape), a.dtype)) for role, a in cache.items()}  # garbage
    kv_c = jnp.asarray(rng.standard_normal((t, 256)) * 3.0, jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((t, 32)), jnp.bfloat16)
    ik = jnp.asarray(rng.standard_normal((t, 128)), jnp.bfloat16)
    slots = _slot_mapping(rng, t, 1, p, spec.page_size)[:, 0]
    write_key, write_indexer = jax.jit(write_dsa_key), jax.jit(write_dsa_indexer)
    new = write_indexer(write_key(cache, kv_c, k_pe, jnp.asarray(slots)), ik, jnp.asarray(slots[:, None]))
    assert {r: (a.shape, a.dtype) for r, a in new.items()} == {r: (a.shape, a.dtype) for r, a in cache.items()}
    w = slots >= 0
    key = np.asarray(jax.jit(gather_dsa_key)(new, jnp.asarray(slots)))
    assert key.shape == (t, 256 + 32)
    np.testing.assert_array_equal(key[w, 256:], np.asarray(k_pe, np.float32)[w])  # rope is stored unquantised
    _, scale = quantize_fp8_blockwise(kv_c)
    _assert_fp8_close(np.asarray(kv_c)[w], key[w, :256], np.asarray(scale)[w], 128)
    idx = np.asarray(jax.jit(gather_dsa_indexer)(new, jnp.asarray(slots)))
    _, iscale = quantize_fp8_blockwise(ik)
    _assert_fp8_close(np.asarray(ik, np.float32)[w], idx[w], np.asarray(iscale)[w], 128)
    np.testing.assert_array_equal(key[~w], 0.0)
    # every array: untouched slots keep their old bits
    untouched = np.ones(p * spec.page_size, bool)
    untouched[slots[w]] = False
    for role in cache:
        old = np.asarray(cache[role]).reshape(p * spec.page_size, -1)
        got = np.asarray(new[role]).reshape(p * spec.page_size, -1)
        np.testing.assert_array_equal(got[untouched].view(np.uint8), old[untouched].view(np.uint8))
    # an all-skip mapping changes nothing at all
    skip = jnp.full((t,), -1, jnp.int32)
    same = write_indexer(write_key(cache, kv_c, k_pe, skip), ik, skip[:, None])
    for role in cache:
        np.testing.assert_array_equal(np.asarray(same[role]).view(np.uint8), np.asarray(cache[role]).view(np.uint8))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda z: write_kv(z(5, 4, 8), z(5, 4, 8), z(3, 2, 8), z(3, 2, 8), jnp.zeros((3, 2), jnp.float32)),
         "slot_mapping must have dtype"),
        (lambda z: write_kv(z(5, 4, 8), z(5, 4, 8), z(3, 2, 8), z(3, 2, 8), jnp.zeros((3, 3), jnp.int32)),
         r"k must have shape \(3, 3, 8\)"),
        (lambda z: write_kv(z(5, 4, 8), z(5, 4, 7), z(3, 2, 8), z(3, 2, 8), jnp.zeros((3, 2), jnp.int32)),
         "v_pages must have shape"),
        (lambda z: write_latent(z(5, 4, 24), z(3, 16), z(3, 4), jnp.zeros((3,), jnp.int32)), "latent width 24"),
        (lambda z: write_latent(z(5, 4, 24), z(3, 16), z(3, 8), jnp.zeros((3, 2), jnp.int32)),
         r"shape \(3,\) or \(3, 1\)"),
        (lambda z: write_kv_cache({"key": z(5, 4, 8)}, z(3, 2, 8), z(3, 2, 8), jnp.zeros((3, 2), jnp.int32)),
         "needs role 'value'"),
        (lambda z: write_dsa_indexer({"key": z(5, 4, 8)}, z(3, 128), jnp.zeros((3,), jnp.int32)),
         r"lacks roles \['indexer', 'indexer_scale'\]"),
    ],
)
def test_bad_write_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call(lambda *shape: jnp.zeros(shape, jnp.float32))
