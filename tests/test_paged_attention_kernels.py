"""Pallas head-wise paged attention (decode split-KV + ragged prefill) against the float32 reference, and the
backend table that chooses between them.

Inputs are built so that a kernel that reads anything it must not read fails: pages a SWA head can no longer
attend are either holes (-1) or still in the table but filled with NaN, the unwritten tail of every last page
and every unused page are NaN. CPU runs use interpret mode on small shapes; the ``gpu`` grid covers random
page permutations, holes, windows straddling page edges, sinks, GQA 1/4/8, page sizes 16/64 (and 128 for the
prefill load paths), lengths 1..8k.

fp8 pages (float8_e4m3fn, one power-of-two f32 scale per page): the same batches quantised page by page, NaN pages
keeping a NaN scale, so a kernel that reads a scale it must not read fails too. Kernel and reference read the same
fp8 values, so the tolerance is that of the kernel's bf16 compute, not e4m3's (:func:`helpers.paged.fp8_bound`).
The Mosaic GPU prefill kernel over fp8 pages (e4m3 products) is tested in ``test_paged_prefill_fp8``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.mosaic_interpret import cache_thread_programs
from helpers.paged import (build_batch, check_fp8, checked_call, poison_hole, quantise_pages, reference_f32,
                           reference_fp8, rel_err)
from kvjax.base.device import NAMED
from kvjax.base.fp8 import FP8_DTYPE
from kvjax.errors import UnknownImplError
from kvjax.ops import attention
from kvjax.ops.attention import PagedAttentionCall
from kvjax.pallas.paged import common as paged_common
from kvjax.pallas.paged import decode
from kvjax.pallas.paged import prefill as paged_prefill
from kvjax.pallas.paged import prefill_mgpu


# ---------------------------------------------------------------- CPU (interpret mode)

def test_decode_interpret_matches_reference(rng):
    args, kw = build_batch(rng, hq=8, hkv=2, d=32, page_size=16, ctx=[40, 70, 5, 33], new=[1, 1, 1, 1],
                           window=[0, 20], sinks=[0, 4])
    ref = reference_f32(args, kw)
    for splits, block_k in ((1, 32), (3, 16)):
        out = decode.paged_decode(checked_call(args, kw), interpret=True, num_splits=splits, block_k=block_k)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    assert float(jnp.abs(out[-2:]).max()) == 0.0  # padding tokens


def test_few_token_rows_equal_the_reference_through_the_op(rng):
    # a verification step's batch (rows of 1..5 new tokens, max_query_len=5) through the op's decode kernel
    args, kw = build_batch(rng, hq=8, hkv=2, d=32, page_size=16, ctx=[40, 70, 5, 33], new=[5, 1, 3, 2],
                           window=[0, 20], sinks=[0, 4])
    out = attention.paged_attention(*args, **kw, max_query_len=5, impl="pallas:interpret")
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference_f32(args, kw)), atol=2e-5, rtol=2e-5)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="max_query_len must be None or a positive Python int"):
            attention.paged_attention(*args, **kw, max_query_len=bad)


def test_prefill_interpret_mixed_batch(rng):
    # chunked prefill with a cached prefix, pure prefill, decode rows, an empty padding row, GQA 2.
    args, kw = build_batch(rng, hq=4, hkv=2, d=32, page_size=8, ctx=[45, 13, 30, 9, 0], new=[19, 13, 1, 1, 0],
                           window=[11, 0], sinks=[3, 0])
    ref = reference_f32(args, kw)
    out = paged_prefill.paged_prefill(checked_call(args, kw), interpret=True, block_q=32, block_k=16)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    # the per-token decode kernel is exact on any batch too
    out_d = decode.paged_decode(checked_call(args, kw), interpret=True, block_k=16, num_splits=2)
    np.testing.assert_allclose(np.asarray(out_d), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_load", ["page", "gather"])
def test_prefill_interpret_kv_load_modes(rng, kv_load):
    # both K/V load paths, 2 pages per key block (2 sub-products per block in "page" mode), windows and sinks,
    # GQA 2, split or fused loop over the masked / unmasked key blocks; holes inside
    # the walk of a full head (poisoned with NaN, in an unmasked middle block), recycled pages below a window.
    args, kw = build_batch(rng, hq=4, hkv=2, d=16, page_size=8, ctx=[61, 24, 90, 9, 0], new=[21, 24, 3, 1, 0],
                           window=[0, 13], sinks=[0, 5])
    q, k, v, table, ctx = args
    table = np.asarray(table).copy()
    for b, col in ((0, 2), (2, 5)):  # full head 0: tile positions 40.. see columns 0..3 unmasked
        k = k.at[table[b, 0, col]].set(jnp.nan)
        v = v.at[table[b, 0, col]].set(jnp.nan)
        table[b, 0, col] = -1
    assert (table[:3, 1, 1:9] == -1).any()  # some dead window pages were recycled
    args = (q, k, v, jnp.asarray(table), ctx)
    ref = reference_f32(args, kw)
    assert np.isfinite(np.asarray(ref)).all()
    for fused_loop in (False, True):
        out = paged_prefill.paged_prefill(checked_call(args, kw), interpret=True, block_q=16, block_k=16,
                                          kv_load=kv_load, fused_loop=fused_loop)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    if kv_load == "page":  # page ids one step ahead, 2 pages per key block
        out = paged_prefill.paged_prefill(checked_call(args, kw), interpret=True, block_q=16, block_k=16,
                                          kv_load=kv_load, page_ids="carry")
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="kv_load"):
        paged_prefill.paged_prefill(checked_call(args, kw), interpret=True, kv_load="tma")
    with pytest.raises(ValueError, match="page_ids"):
        paged_prefill.paged_prefill(checked_call(args, kw), interpret=True, kv_load="gather", page_ids="carry")


def test_prefill_interpret_page_128(rng):
    # 128-token pages, block_k = page_size (one contiguous [128, D] load per step), a window straddling pages
    args, kw = build_batch(rng, hq=2, hkv=1, d=16, page_size=128, ctx=[300, 140], new=[45, 140], window=[150],
                           sinks=[4])
    ref = reference_f32(args, kw)
    for cfg in (dict(), dict(page_ids="load", fused_loop=False)):  # default: ids one step ahead
        out = paged_prefill.paged_prefill(checked_call(args, kw), interpret=True, block_q=64, **cfg)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    assert float(jnp.abs(out[-2:]).max()) == 0.0


# The Mosaic GPU prefill kernel's persistent programs walk the (tile, head) items in rounds, item p of even rounds and
# n - 1 - p of odd ones, each copying the next item's q box while it finishes the current one. The batch below has 8
# tiles of 4 heads (32 items, 20 with tokens): pages of 64 run the interpreter's default 2 programs (16 rounds each),
# pages of 128 run 3 (11 rounds, one program idle in the last); the fp8 test runs more programs than items.
_MOSAIC_PROGRAMS = {64: None, 128: 3}


@pytest.mark.parametrize("page_size", [64, 128])
def test_prefill_mosaic_interpret(rng, monkeypatch, page_size):
    # the Mosaic GPU kernel under the Mosaic GPU interpreter (its products in jnp, everything else as compiled:
    # TMA page copies, two pages per 128-key slot at pages of 64, K and V refilled on their own releases, barriers,
    # per-slot skip/full/masked paths, ragged tiles read and written in place, the end-of-array box, several items
    # per program). Chunked prefill over a cached prefix spanning two tiles, decode rows, a padding row; a full head
    # with a poisoned hole in its walk next to a SWA head with sinks; finite tails (read, weight 0); GQA 2. Full
    # boxes at rows 0 and 64 leave through their q tiles (the next box copied ahead), row 1's full box at row 131 (not
    # a multiple of 8: a TMA store from the swizzled tile would drop rows, run 150) through the staging rows. The
    # interpreter copies rows exactly, so only the GPU grid tests see such dropped rows; here, both routes' handoffs.
    cache_thread_programs(monkeypatch)
    args, kw = build_batch(rng, hq=4, hkv=2, d=64, page_size=page_size, ctx=[520, 140, 9, 0], new=[131, 69, 1, 0],
                           window=[0, 70], sinks=[0, 4], dtype=jnp.bfloat16, tail_fill=300.0)
    args = poison_hole(args, block=512 // page_size - 1)  # in the fourth 128-key slot of row 0's full head
    ref = reference_f32(args, kw)
    out = prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw), programs=_MOSAIC_PROGRAMS[page_size], interpret=True)
    out = np.asarray(out, np.float32)
    assert rel_err(out, ref) <= 1e-2
    cu = np.asarray(kw["cu_seqlens"])
    assert cu[1] % 8 and cu[2] - cu[1] >= 64  # row 1 starts with a full box off the 8-row grid
    for b in range(3):  # every row with tokens, not only the batch as a whole
        seg = slice(cu[b], cu[b + 1])
        assert np.linalg.norm(out[seg] - ref[seg]) <= 1e-2 * np.linalg.norm(ref[seg]), b
    assert np.all(out[-2:] == 0)  # tokens of no row
    with pytest.raises(ValueError, match="page_size"):
        small_pages = dataclasses.replace(checked_call(args, kw), k_pages=args[1][:, :32], v_pages=args[2][:, :32])
        prefill_mgpu.paged_prefill_mgpu(small_pages, interpret=True)


@pytest.mark.slow
def test_prefill_mosaic_interpret_fp8_programs(rng, monkeypatch):
    # fp8 pages (e4m3 q K^T, V converted into the shared f16 buffers by the producer warpgroup; no q box copied
    # ahead), pages of 64 (two a slot, per-column scales), 6 tiles of 2 heads: the default 2 programs (6 rounds each)
    # and 16 programs (4 idle) give the same output bit for bit (the same arithmetic per item, whichever program runs
    # it), both against the float32 reference over the same fp8 pages (the bound is test_paged_prefill_fp8's business:
    # here, 2e-2)
    cache_thread_programs(monkeypatch)
    args, kw = build_batch(rng, hq=2, hkv=2, d=64, page_size=64, ctx=[140, 9, 0], new=[70, 1, 0], window=[0, 70],
                           sinks=[0, 4], dtype=jnp.bfloat16, tail_fill=300.0)
    args, scales = quantise_pages(poison_hole(args))
    ref, _, _ = reference_fp8(args, scales, kw)
    out = np.asarray(prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw, scales), interpret=True), np.float32)
    assert rel_err(out, ref) <= 2e-2
    assert np.all(out[-2:] == 0)
    out_16 = prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw, scales), programs=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(out_16, np.float32), out)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="programs must be None or a positive int"):
            prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw, scales), programs=bad, interpret=True)
    for bad in (0, -2):  # not silently the default
        with pytest.raises(ValueError, match="stages must be >= 1"):
            prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw, scales), stages=bad, interpret=True)


def test_prefill_mosaic_lowers_for_cuda():
    # the kernel compiles to Mosaic GPU without a GPU (Lane lowering, its one schedule): bf16 and fp8 pages of 64
    # and 128, the default programs (2 here, where the device is the CPU) and 132 (an H100's SMs: its own kernel
    # name), token counts that are not a multiple of 8 (a full box's store through the swizzled q tile tiles o's
    # rows by 8: the kernel pads T) and below one box; once with Pallas's automatic barriers (off by default: its
    # own kernel name). The GPU tests compile it under jax 0.11 too.
    from jax import export

    sds = jax.ShapeDtypeStruct
    names = set()
    cases = [(None, 128, False, 512, False), (None, 64, False, 627, False), (None, 128, True, 512, False),
             (None, 64, True, 627, False), (132, 64, False, 512, False), (132, 128, True, 40, False),
             (None, 64, True, 627, True)]
    for programs, page_size, fp8, tokens, barriers in cases:
        def fn(q, kp, vp, bt, sl, cu, ks, vs):
            scales = dict(k_scale=ks, v_scale=vs) if fp8 else {}
            call = PagedAttentionCall(q, kp, vp, bt, sl, cu, window=jnp.array([0, 100], jnp.int32),
                                      sinks=jnp.array([0, 4], jnp.int32), **scales)
            return prefill_mgpu.paged_prefill_mgpu(attention.check_call(call), programs=programs,
                                                   auto_barriers=barriers)

        pages = sds((64, page_size, 128), FP8_DTYPE if fp8 else jnp.bfloat16)
        module = export.export(jax.jit(fn), platforms=["cuda"])(
            sds((tokens, 4, 128), jnp.bfloat16), pages, pages, sds((1, 2, 16), jnp.int32), sds((1,), jnp.int32),
            sds((2,), jnp.int32), sds((64,), jnp.float32), sds((64,), jnp.float32)).mlir_module()
        name = (f"kvjax_paged_prefill_mgpu_{'float8_e4m3fn_e4m3x2_qk' if fp8 else 'bfloat16'}_page{page_size}_d128_s2"
                f"{f'_p{programs}' if programs else ''}{'_autobar' if barriers else ''}")
        assert "mosaic_gpu" in module and name in module, (programs, page_size, fp8)
        names.add(name)
    assert len(names) == len(cases)


def test_prefill_mosaic_interpret_refuses_small_thread_pool(rng, monkeypatch):
    # with fewer XLA CPU threads than warpgroups + 1 the interpreter can deadlock: a clear error instead
    args, kw = build_batch(rng, hq=2, hkv=1, d=64, page_size=64, ctx=[3], new=[3], window=[0], sinks=[0],
                           dtype=jnp.bfloat16)
    monkeypatch.setenv("NPROC", "2")
    with pytest.raises(RuntimeError, match="NPROC=8"):
        prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw), interpret=True)


def test_prefill_interpret_padding_tokens_written_as_zero(rng):
    # tokens before cu_seqlens[0] and after cu_seqlens[-1] belong to no row: the prefill kernel itself writes
    # their zeros (no select afterwards), even when their queries are NaN
    args, kw = build_batch(rng, hq=2, hkv=1, d=16, page_size=8, ctx=[29, 12], new=[11, 12], window=[0], sinks=[0],
                           extra_tokens=0)
    q, k, v, table, ctx = args
    pad_front, pad_back = 3, 21
    nan = jnp.full((pad_front, 2, 16), jnp.nan, q.dtype)
    q = jnp.concatenate([nan, q, jnp.full((pad_back, 2, 16), jnp.nan, q.dtype)])
    kw = dict(kw, cu_seqlens=kw["cu_seqlens"] + pad_front)
    args = (q, k, v, table, ctx)
    out = np.asarray(paged_prefill.paged_prefill(checked_call(args, kw), interpret=True, block_q=16, block_k=16))
    ref = np.asarray(reference_f32(args, kw))
    assert np.all(out[:pad_front] == 0) and np.all(out[-pad_back:] == 0)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_empty_splits_and_single_token_never_nan(rng):
    # far more splits than pages: most splits are empty; a 1-token sequence; GQA 8 (>16 padded rows not needed)
    args, kw = build_batch(rng, hq=8, hkv=1, d=16, page_size=16, ctx=[1, 3], new=[1, 1], window=[2], sinks=[1])
    ref = reference_f32(args, kw)
    out = decode.paged_decode(checked_call(args, kw), interpret=True, num_splits=8)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_decode_longest_first_writes_the_grid_orders_bits(rng):
    # rows of very different lengths, a SWA head beside a full head, float and fp8 pages: launched longest walk
    # first, every program computes what it computes in the grid order, so the output is the same to the bit
    args, kw = build_batch(rng, hq=8, hkv=2, d=32, page_size=16, ctx=[300, 5, 140, 33], new=[1, 1, 1, 1],
                           window=[0, 20], sinks=[0, 4])
    ref = reference_f32(args, kw)
    args8, scales = quantise_pages(args)
    for call in (checked_call(args, kw), checked_call(args8, kw, scales)):
        for splits in (1, 3):
            first = decode.paged_decode(call, interpret=True, num_splits=splits, longest_first=True)
            grid = decode.paged_decode(call, interpret=True, num_splits=splits, longest_first=False)
            np.testing.assert_array_equal(np.asarray(first), np.asarray(grid))
    check_fp8(grid, *reference_fp8(args8, scales, kw), args[0].dtype)  # the last: fp8 pages, 3 splits
    first = decode.paged_decode(checked_call(args, kw), interpret=True, num_splits=2, longest_first=True)
    np.testing.assert_allclose(np.asarray(first), np.asarray(ref), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="longest_first needs one-token programs.*tokens_per_program 2"):
        decode.paged_decode(checked_call(args, kw), interpret=True, tokens_per_program=2, longest_first=True)


def test_longest_walks_first_is_a_stable_descending_order(rng):
    n_pages = rng.integers(0, 41, size=(37, 4)).astype(np.int32)  # many ties
    n_pages[rng.random(n_pages.shape) < 0.3] = 40
    order = np.asarray(decode.longest_walks_first(jnp.asarray(n_pages)))
    np.testing.assert_array_equal(order, np.argsort(-n_pages.reshape(-1), kind="stable"))


def test_longest_first_default_takes_long_one_token_parts_only():
    # (tokens, max_blocks pages, pages per block, splits): the decode benchmark's batch (32 blocks a part), the
    # engine-sized one (2 blocks), a verification step's rows
    assert decode.default_longest_first(1, 256, 4, 2)
    assert decode.default_longest_first(1, 8 * decode.LONG_PART_BLOCKS, 1, 8)
    assert not decode.default_longest_first(1, 8 * (decode.LONG_PART_BLOCKS - 1), 1, 8)
    assert not decode.default_longest_first(1, 32, 1, 16)
    assert not decode.default_longest_first(4, 256, 4, 1)


def _auto_kernel_jaxpr(args, kw, device):
    """The table's ``auto`` choice on ``device`` for this call, and the jaxpr of that backend interpreted."""
    call = checked_call(args, kw)
    name, _ = attention.TABLE.choose("auto", (call,), {}, device)
    _, fn = attention.TABLE.choose(f"{name}:interpret", (call,), {}, device)
    return name, str(jax.make_jaxpr(fn)(call))


def test_routing_is_static_on_shapes(rng):
    # on a non-Hopper GPU the table sends T <= B to the decode kernel and T > B to the Triton prefill kernel
    args, kw = build_batch(rng, hq=2, hkv=1, d=16, page_size=16, ctx=[20, 9], new=[1, 1], window=[0], sinks=[0],
                           extra_tokens=0)
    name, text = _auto_kernel_jaxpr(args, kw, NAMED["a100"])
    assert name == "pallas"
    assert "kvjax_paged_decode" in text and "kvjax_paged_prefill" not in text
    args, kw = build_batch(rng, hq=2, hkv=1, d=16, page_size=16, ctx=[20, 9], new=[3, 1], window=[0], sinks=[0])
    name, text = _auto_kernel_jaxpr(args, kw, NAMED["a100"])
    assert name == "prefill"
    assert "kvjax_paged_prefill" in text and "kvjax_paged_decode" not in text


def _shapes(t, b, *, page_size, d=128, hq=32, hkv=8, max_blocks=64, dtype=jnp.bfloat16):
    """A checked call ``((call,), {})``, its arrays ``jax.ShapeDtypeStruct`` s (what the table's checks read)."""
    sds = jax.ShapeDtypeStruct
    pages = sds((b * hkv * max_blocks, page_size, d), dtype)
    call = PagedAttentionCall(sds((t, hq, d), dtype), pages, pages, sds((b, hkv, max_blocks), jnp.int32),
                              sds((b,), jnp.int32), sds((b + 1,), jnp.int32), sds((hkv,), jnp.int32),
                              sds((hkv,), jnp.int32), scale=d ** -0.5)
    return (call,), {}


def test_table_chooses_as_documented():
    decode_call = _shapes(64, 64, page_size=64)  # T <= B
    prefill_call = _shapes(4096, 2, page_size=64)  # T >= 64 B, pages and head_dim the Mosaic kernel takes
    mixed_call = _shapes(300, 16, page_size=64)  # T > B but T < 64 B
    page16_call = _shapes(4096, 2, page_size=16)

    def choice(call, device):
        reasons = attention.TABLE.explain(*call, NAMED[device])
        return next(name for name, why in reasons if why is None), dict(reasons)

    name, why = choice(decode_call, "h100")
    assert name == "pallas"
    assert "T >= 64 B" in why["mosaic"] and "decode-shaped" in why["prefill"]
    assert choice(prefill_call, "h100") == ("mosaic", {"mosaic": None, "prefill": None, "pallas": None,
                                                        "reference": None})
    name, why = choice(mixed_call, "h100")
    assert name == "prefill" and "T >= 64 B" in why["mosaic"]
    name, why = choice(page16_call, "h100")
    assert name == "prefill" and "page_size in (64, 128), got 16" in why["mosaic"]
    assert choice(decode_call, "a100")[0] == "pallas"
    name, why = choice(prefill_call, "a100")
    assert name == "prefill" and "needs a Hopper GPU" in why["mosaic"]
    for call in (decode_call, prefill_call):
        name, why = choice(call, "cpu")
        assert name == "reference"
        assert "needs a GPU" in why["prefill"] and "needs a GPU" in why["pallas"]
    # f32 pages: no Mosaic kernel; head_dim 24: no Triton kernel either, auto falls back to the reference
    assert choice(_shapes(4096, 2, page_size=64, dtype=jnp.float32), "h100")[0] == "prefill"
    name, why = choice(_shapes(4096, 2, page_size=64, d=24), "h100")
    assert name == "reference" and "power-of-two head_dim" in why["pallas"]
    # a verification step's rows (a static bound of a few tokens a row): the split-KV decode kernel
    (verify_call,), _ = _shapes(32, 16, page_size=64)
    name, why = choice(((dataclasses.replace(verify_call, max_query_len=paged_prefill.FEW_TOKENS),), {}), "h100")
    assert name == "pallas" and "max_query_len" in why["prefill"]
    (one_row,), _ = _shapes(paged_prefill.FEW_TOTAL, 1, page_size=64)
    assert choice(((dataclasses.replace(one_row, max_query_len=paged_prefill.FEW_TOTAL),), {}), "h100")[0] == "pallas"
    (many,), _ = _shapes(80, 16, page_size=64)
    assert choice(((dataclasses.replace(many, max_query_len=paged_prefill.FEW_TOKENS + 1),), {}),
                  "h100")[0] == "prefill"
    assert choice(((dataclasses.replace(verify_call, max_query_len=paged_prefill.FEW_TOKENS + 1),), {}),
                  "h100")[0] == "prefill"
    assert attention.TABLE.available(NAMED["cpu"]) == [
        "reference", "mosaic:interpret", "prefill:interpret", "pallas:interpret"]
    assert attention.TABLE.available(NAMED["a100"])[:3] == ["reference", "prefill", "pallas"]


def test_explicit_impl_that_cannot_take_the_call_raises(rng):
    # a decode-shaped batch (T <= B): the prefill kernels decline it by name, with their reason
    args, kw = build_batch(rng, hq=4, hkv=2, d=16, page_size=16, ctx=[37, 20], new=[1, 1], window=[0, 0], sinks=[0, 0],
                           extra_tokens=0)
    call = dict(cu_seqlens=kw["cu_seqlens"], window=kw["window"], sinks=kw["sinks"])
    with pytest.raises(UnknownImplError, match=r"impl='prefill:interpret' cannot take.*decode-shaped"):
        attention.paged_attention(*args, **call, impl="prefill:interpret")
    with pytest.raises(UnknownImplError, match=r"mosaic:interpret.*needs T >= 64 B tokens"):
        attention.paged_attention(*args, **call, impl="mosaic:interpret")
    with pytest.raises(UnknownImplError, match="no implementation 'triton'"):
        attention.paged_attention(*args, **call, impl="triton")
    if jax.default_backend() == "cpu":
        with pytest.raises(UnknownImplError, match="needs a GPU"):
            attention.paged_attention(*args, **call, impl="pallas")
    # head_dim 24: no kernel takes it, so even the decode kernel declines by name
    args24, kw24 = build_batch(rng, hq=2, hkv=1, d=24, page_size=16, ctx=[5], new=[1], window=[0], sinks=[0])
    with pytest.raises(UnknownImplError, match="power-of-two head_dim >= 16, got 24"):
        attention.paged_attention(*args24, cu_seqlens=kw24["cu_seqlens"], impl="interpret")


def test_public_op_dispatches_to_kernel(rng):
    args, kw = build_batch(rng, hq=4, hkv=2, d=16, page_size=16, ctx=[37, 20], new=[1, 1], window=[0, 0], sinks=[0, 0])
    ref = reference_f32(args, kw)
    out = attention.paged_attention(*args, cu_seqlens=kw["cu_seqlens"], window=0, impl="interpret")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_rejects_unsupported_shapes(rng):
    args, kw = build_batch(rng, hq=2, hkv=1, d=24, page_size=16, ctx=[5], new=[1], window=[0], sinks=[0])
    with pytest.raises(ValueError, match="head_dim"):
        decode.paged_decode(checked_call(args, kw), interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill.paged_prefill(checked_call(args, kw), interpret=True)


# ---------------------------------------------------------------- fp8 pages (CPU, interpret mode)

# head 0 full, head 1 SWA with sinks, head 2 SWA without (windows straddling pages of 16 and 64)
_FP8_HEADS = dict(hkv=3, window=[0, 40, 70], sinks=[0, 4, 0])


def _fp8_batch(rng, *, page_size, ctx, new, dtype, hq=6, d=32, **extra):
    """A :func:`_build` batch over fp8 pages with :data:`_FP8_HEADS`: (args, scales, kwargs, (ref, abs_v, v_max))."""
    args, kw = build_batch(rng, hq=hq, d=d, page_size=page_size, ctx=ctx, new=new, dtype=dtype, **_FP8_HEADS, **extra)
    args, scales = quantise_pages(args)
    return args, scales, kw, reference_fp8(args, scales, kw)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_interpret_fp8_pages(rng, page_size, dtype):
    # decode rows over fp8 pages: a long row whose SWA pages below the window are recycled (-1) or NaN, short rows,
    # a 1-token row; GQA 2; one split and several (empty ones included); padding tokens get 0
    args, scales, kw, (ref, abs_v, v_max) = _fp8_batch(rng, page_size=page_size, ctx=[300, 70, 1, 140],
                                                        new=[1, 1, 1, 1], dtype=dtype)
    table = np.asarray(args[3])
    dead = table[0, [1, 2], [1, 0]]  # SWA pages below the window: recycled (-1) or NaN, scale included
    assert ((dead == -1) | np.isnan(np.asarray(scales["k_scale"])[dead])).all() and (table[0, 0, :4] >= 0).all()
    assert (table[0] == -1).any() or page_size == 64
    assert args[1].dtype == FP8_DTYPE and np.isnan(np.asarray(scales["v_scale"])).any()  # poisoned scales exist
    for splits, block_k in ((1, 64), (5, page_size)):
        out = decode.paged_decode(checked_call(args, kw, scales), interpret=True, num_splits=splits, block_k=block_k)
        check_fp8(out, ref, abs_v, v_max, dtype)
    assert float(jnp.abs(out[-2:].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kv_load", ["page", "gather"])
def test_prefill_interpret_fp8_pages(rng, page_size, kv_load):
    # mixed batch over fp8 pages: chunked prefill over a cached prefix, a whole prompt, decode rows, an empty
    # padding row; full / SWA-with-sinks / SWA heads, NaN tails; both load paths, split and fused key loops,
    # two pages per key block at page 16, page ids one step ahead (bf16 q, as served)
    args, scales, kw, (ref, abs_v, v_max) = _fp8_batch(rng, page_size=page_size, ctx=[200, 30, 70, 9, 0],
                                                        new=[21, 30, 1, 1, 0], dtype=jnp.bfloat16)
    dead = np.asarray(args[3])[0, [1, 2], [1, 0]]  # SWA pages below the window: recycled (-1) or NaN, scale too
    assert ((dead == -1) | np.isnan(np.asarray(scales["k_scale"])[dead])).all()
    variants = [dict(fused_loop=False), dict(fused_loop=True)]
    if kv_load == "page":
        variants.append(dict(page_ids="carry"))
    for cfg in variants:
        out = paged_prefill.paged_prefill(checked_call(args, kw, scales), interpret=True, block_q=32,
                                          block_k=max(32, page_size), kv_load=kv_load, **cfg)
        check_fp8(out, ref, abs_v, v_max, jnp.bfloat16)
    assert float(jnp.abs(out[-2:].astype(jnp.float32)).max()) == 0.0


def test_prefill_interpret_fp8_pages_f32_is_exact(rng):
    # with f32 q the kernel converts e4m3 to f32: the reference's arithmetic up to summation order
    args, scales, kw, (ref, abs_v, v_max) = _fp8_batch(rng, page_size=16, ctx=[90, 33, 5], new=[29, 33, 1],
                                                        dtype=jnp.float32)
    out = paged_prefill.paged_prefill(checked_call(args, kw, scales), interpret=True, block_q=16, block_k=32)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)


def test_public_op_fp8_pages_runs_the_triton_kernels(rng):
    # through paged_attention: impl="interpret" (decode kernel) and "prefill:interpret" read the fp8 pages;
    # the Mosaic GPU kernel declines this batch by its shape rules (fewer than 64 tokens a row; fp8 or not)
    args, scales, kw, (ref, abs_v, v_max) = _fp8_batch(rng, page_size=16, ctx=[70, 20, 3], new=[9, 20, 1],
                                                        dtype=jnp.bfloat16)
    call = dict(cu_seqlens=kw["cu_seqlens"], window=kw["window"], sinks=kw["sinks"], **scales)
    for impl in ("interpret", "prefill:interpret"):
        check_fp8(attention.paged_attention(*args, **call, impl=impl), ref, abs_v, v_max, jnp.bfloat16)
    with pytest.raises(UnknownImplError, match="mosaic:interpret.*needs T >= 64 B"):
        attention.paged_attention(*args, **call, impl="mosaic:interpret")


def test_op_refuses_fp8_pages_without_scales_before_any_kernel(rng):
    # the kernels trust the call (the op checks it once): fp8 pages need both scales, float pages take none, K and V
    # agree; each impl that names a kernel is refused with the op's message, nothing is traced
    args, scales, kw, _ = _fp8_batch(rng, page_size=16, ctx=[20], new=[3], dtype=jnp.bfloat16)
    q, k8, v8, table, ctx = args
    bad = [(args, dict(k_scale=scales["k_scale"]), "fp8 pages need v_scale"),
           (args, dict(scales, k_scale=scales["k_scale"][:-1]), "k_scale must have shape"),
           ((q, k8.astype(jnp.bfloat16), v8.astype(jnp.bfloat16), table, ctx), scales,
            "k_scale and v_scale go with float8_e4m3fn pages"),
           ((q, k8, v8.astype(jnp.bfloat16), table, ctx), scales, "v_pages must have dtype")]
    for impl in ("interpret", "prefill:interpret"):
        for batch, given, match in bad:
            with pytest.raises(ValueError, match=match):
                attention.paged_attention(*batch, **kw, **given, impl=impl)


def test_shared_memory_fit_keeps_bf16_defaults_and_shrinks_wide_or_f32_tiles():
    # the tuned bf16 head_dim-128 defaults are what was measured: the fit must leave them; float32 pages and
    # head_dim 256 (a real Qwen3.5 head) must come under the budget by fewer stages, then smaller blocks
    fit, budget = paged_common.fit_shared_memory, paged_common.SMEM_BUDGET

    def planned(d, kv, q, bk, st, r):
        return st * 2 * bk * d * kv + r * d * q

    for bk, st in ((128, 3), (64, 3)):  # prefill gather / page defaults, bf16, D=128
        assert fit(head_dim=128, kv_itemsize=2, q_itemsize=2, block_k=bk, num_stages=st, rows=128,
                   min_block_k=16, min_rows=16) == (bk, st, 128)
    assert fit(head_dim=128, kv_itemsize=2, q_itemsize=2, block_k=64, num_stages=4, rows=16, min_block_k=16,
               min_rows=16) == (64, 4, 16)  # decode default
    for d, kv, q, bk, st, page in ((128, 4, 4, 128, 3, 16), (256, 2, 2, 128, 3, 64), (128, 4, 4, 64, 4, 16),
                                   (256, 4, 4, 64, 4, 64), (128, 4, 4, 128, 3, 128), (256, 2, 2, 128, 4, 128)):
        out = fit(head_dim=d, kv_itemsize=kv, q_itemsize=q, block_k=bk, num_stages=st, rows=128,
                  min_block_k=page, min_rows=16)
        assert planned(d, kv, q, *out) <= budget, (d, kv, out)
        assert out[0] >= page and out[1] >= 1 and out[2] >= 16
        assert out[1] < st or out[0] < bk  # it had to shrink something
        if out[1] == 1:  # pipelining goes last: only where the smallest block still does not fit two stages
            assert planned(d, kv, q, out[0], 2, out[2]) > budget and out[0] == page
    # a knob the caller set stays
    assert fit(head_dim=128, kv_itemsize=4, q_itemsize=4, block_k=128, num_stages=3, rows=128, min_block_k=16,
               min_rows=16, fixed=("num_stages",))[1] == 3
    # fp8 pages' prefill counts one bf16 tile of the conversion: its head_dim-128 defaults (gather, page, pages of
    # >= 128) stay; at head_dim 256 it shrinks where 2 stages of 128 keys compiled to 263680 B (tests/
    # test_triton_resources.py compiles both)
    for bk, st in ((128, 3), (64, 3)):
        assert fit(head_dim=128, kv_itemsize=1, q_itemsize=2, block_k=bk, num_stages=st, rows=128, min_block_k=16,
                   min_rows=16, convert_itemsize=2) == (bk, st, 128)
    assert fit(head_dim=256, kv_itemsize=1, q_itemsize=2, block_k=128, num_stages=3, rows=128, min_block_k=16,
               min_rows=16, convert_itemsize=2) == (64, 2, 128)
    assert fit(head_dim=256, kv_itemsize=1, q_itemsize=2, block_k=128, num_stages=3, rows=128, min_block_k=128,
               min_rows=16, convert_itemsize=2) == (128, 1, 128)
    assert fit(head_dim=256, kv_itemsize=1, q_itemsize=2, block_k=128, num_stages=3, rows=128, min_block_k=16,
               min_rows=16) == (128, 2, 128)  # without the tile: the plan that did not fit


# ---------------------------------------------------------------- GPU grid

_GPU_CTX = [1, 15, 16, 17, 300, 1000, 4099, 8192]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_decode_grid(rng, group, page_size):
    hkv = 2
    # head 0 full, head 1 SWA whose window (100 / 64+1) straddles page edges, with sinks
    args, kw = build_batch(rng, hq=group * hkv, hkv=hkv, d=128, page_size=page_size, ctx=_GPU_CTX,
                           new=[1] * len(_GPU_CTX), window=[0, 100 if page_size == 16 else 65], sinks=[0, 4],
                           dtype=jnp.bfloat16)
    ref = reference_f32(args, kw)
    for splits, block_k, first in ((None, None, None), (1, 128, None), (7, 64, None), (4, 64, True), (4, 64, False)):
        out = decode.paged_decode(checked_call(args, kw), num_splits=splits, block_k=block_k, longest_first=first)
        assert rel_err(out, ref) <= 2e-2
    assert float(jnp.abs(out[-2:].astype(jnp.float32)).max()) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_prefill_mixed_grid(rng, group, page_size):
    hkv = 2
    ctx = [8192, 300, 700, 17, 5000, 0, 64]
    new = [1, 300, 129, 1, 1, 0, 64]  # decode, prefill, chunked prefill, decode, decode, padding, prefill
    args, kw = build_batch(rng, hq=group * hkv, hkv=hkv, d=128, page_size=page_size, ctx=ctx, new=new,
                           window=[100, 0], sinks=[4, 0], dtype=jnp.bfloat16)
    ref = reference_f32(args, kw)
    # the Triton prefill kernel never reads past a row's last position: NaN tails must not matter (the Mosaic
    # kernel reads whole pages and is tested with finite tails in test_gpu_prefill_mosaic_grid)
    out = paged_prefill.paged_prefill(checked_call(args, kw))
    assert rel_err(out, ref) <= 2e-2
    # every real token of every row is right (none dropped or zero-filled)
    cu = np.asarray(kw["cu_seqlens"])
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    for b in range(len(ctx)):
        if new[b]:
            seg = slice(cu[b], cu[b + 1])
            assert np.linalg.norm(o[seg] - r[seg]) <= 2e-2 * np.linalg.norm(r[seg])


@pytest.mark.gpu
def test_gpu_public_op_auto_is_the_kernel(rng):
    args, kw = build_batch(rng, hq=8, hkv=2, d=128, page_size=16, ctx=[3000, 1], new=[1, 1], window=[0, 256],
                           sinks=[0, 4], dtype=jnp.bfloat16, extra_tokens=0)
    ref = reference_f32(args, kw)
    text = str(jax.make_jaxpr(lambda *a: attention.paged_attention(*a, cu_seqlens=kw["cu_seqlens"],
                                                                   window=kw["window"], sinks=kw["sinks"]))(*args))
    assert "kvjax_paged_decode" in text
    out = attention.paged_attention(*args, cu_seqlens=kw["cu_seqlens"], window=kw["window"], sinks=kw["sinks"],
                                    impl="pallas")
    assert rel_err(out, ref) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("kv_load", ["page", "gather"])
def test_gpu_prefill_kv_load_modes(rng, kv_load, page_size):
    # both K/V load paths at one and several pages per key block, GQA 4, holes inside a full head's walk
    hkv, group = 2, 4
    ctx, new = [4099, 300, 700, 17, 64], [1, 300, 129, 1, 64]
    args, kw = build_batch(rng, hq=group * hkv, hkv=hkv, d=128, page_size=page_size, ctx=ctx, new=new,
                           window=[0, 100], sinks=[0, 4], dtype=jnp.bfloat16)
    q, k, v, table, seq_lens = args
    table = np.asarray(table).copy()
    for b, col in ((1, 1), (2, 3)):  # poisoned holes in the unmasked middle of full head 0
        k = k.at[table[b, 0, col]].set(jnp.nan)
        v = v.at[table[b, 0, col]].set(jnp.nan)
        table[b, 0, col] = -1
    args = (q, k, v, jnp.asarray(table), seq_lens)
    ref = reference_f32(args, kw)
    variants = [dict(block_k=64, fused_loop=False), dict(block_k=128, fused_loop=True)]
    if kv_load == "page":  # page ids one step ahead; one or two pages per key block
        variants = variants[:1] + [dict(block_k=64, page_ids="carry")]
        if page_size == 64:
            variants += [dict(block_k=64, fused_loop=True), dict(block_k=128, page_ids="carry", num_warps=8)]
        if page_size == 128:  # block_k = page_size: one contiguous [128, D] load per step
            variants += [dict(), dict(page_ids="load", num_warps=8, fused_loop=False)]
    for cfg in variants:
        out = paged_prefill.paged_prefill(checked_call(args, kw), kv_load=kv_load, **cfg)
        assert rel_err(out, ref) <= 2e-2, cfg


MOSAIC_CTX = [8192, 300, 700, 17, 5000, 0, 64, 129]  # the Mosaic grids' batch: context and new tokens per row
MOSAIC_NEW = [1, 300, 129, 1, 1, 0, 64, 129]


def _mosaic_batch(rng, group: int, page_size: int):
    """The Mosaic GPU grids' batch: decode rows, prefill, chunked prefill with a cached prefix, a padding row, a SWA
    head with sinks next to a full head, poisoned (NaN) holes inside the full head's walk, large finite tails.
    Returns ``(q, k, v, table, seq_lens), kw``; ``table`` is numpy."""
    hkv = 2
    args, kw = build_batch(rng, hq=group * hkv, hkv=hkv, d=128, page_size=page_size, ctx=MOSAIC_CTX, new=MOSAIC_NEW,
                           window=[0, 100], sinks=[0, 4], dtype=jnp.bfloat16, tail_fill=300.0)
    q, k, v, table, seq_lens = args
    table = np.asarray(table).copy()
    for b, col in ((1, 1), (2, 3)):
        k = k.at[table[b, 0, col]].set(jnp.nan)
        v = v.at[table[b, 0, col]].set(jnp.nan)
        table[b, 0, col] = -1
    return (q, k, v, table, seq_lens), kw


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_gpu_prefill_mosaic_grid(rng, group, page_size):
    # the Mosaic GPU kernel (TMA page copies): mixed batch (decode rows, prefill, chunked prefill with a cached
    # prefix, a padding row), a SWA head with sinks next to a full head, poisoned holes inside the full head's
    # walk, pages below the window recycled or NaN, tails of last pages finite but large (read, weight 0)
    from kvjax.pallas.paged import prefill_mgpu as paged_prefill_mgpu

    ctx, new = MOSAIC_CTX, MOSAIC_NEW
    (q, k, v, table, seq_lens), kw = _mosaic_batch(rng, group, page_size)
    args = (q, k, v, jnp.asarray(table), seq_lens)
    ref = reference_f32(args, kw)
    cu = np.asarray(kw["cu_seqlens"])
    for stages in (None, 2) if page_size == 64 else (None,):
        out = paged_prefill_mgpu.paged_prefill_mgpu(checked_call(args, kw), stages=stages)
        assert rel_err(out, ref) <= 2e-2, stages
        o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        for b in range(len(ctx)):  # every real token of every row is right
            if new[b]:
                seg = slice(cu[b], cu[b + 1])
                assert np.linalg.norm(o[seg] - r[seg]) <= 2e-2 * np.linalg.norm(r[seg]), (b, stages)
        assert float(np.abs(o[cu[-1]:]).max()) == 0.0  # padding tokens after the last row
    assert len(q) >= 64 * len(ctx)  # the table's "auto" takes the Mosaic kernel for this batch on Hopper
    assert attention.TABLE.choose("auto", (checked_call(args, kw),), {})[0] == "mosaic"
    assert rel_err(attention.paged_attention(*args, **kw), ref) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 128])
def test_gpu_prefill_mosaic_programs(rng, page_size):
    # the compiled kernel at other counts of persistent programs on the Mosaic grids' batch, GQA 4 (15 tiles of 8
    # heads: 120 items, so the default is 120 programs on an H100 or H200): one program walking every item, 7 (18
    # rounds, 6 programs idle in the last) and 200 (80 idle). Every real token of every row against the reference,
    # padding tokens 0, and the default's output within bf16 rounding (the same arithmetic per item)
    ctx, new = MOSAIC_CTX, MOSAIC_NEW
    (q, k, v, table, seq_lens), kw = _mosaic_batch(rng, 4, page_size)
    args = (q, k, v, jnp.asarray(table), seq_lens)
    call = checked_call(args, kw)
    ref = np.asarray(reference_f32(args, kw), np.float32)
    base = np.asarray(prefill_mgpu.paged_prefill_mgpu(call), np.float32)
    cu = np.asarray(kw["cu_seqlens"])
    for programs in (1, 7, 200):
        o = np.asarray(prefill_mgpu.paged_prefill_mgpu(call, programs=programs), np.float32)
        for b in range(len(ctx)):
            if new[b]:
                seg = slice(cu[b], cu[b + 1])
                assert np.linalg.norm(o[seg] - ref[seg]) <= 2e-2 * np.linalg.norm(ref[seg]), (b, programs)
        assert float(np.abs(o[cu[-1]:]).max()) == 0.0, programs
        np.testing.assert_allclose(o, base, rtol=2.0 ** -6, atol=2.0 ** -8, err_msg=str(programs))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_decode_fp8_grid(rng, group, page_size):
    # the compiled split-KV kernel over fp8 pages (e4m3 loads converted to bf16 on the GPU): lengths 1..8k, a full
    # head beside a SWA head with sinks whose dead pages are holes or NaN (scales too), against the f32 reference
    # over the same fp8 pages, per element within fp8_bound
    hkv = 2
    args, kw = build_batch(rng, hq=group * hkv, hkv=hkv, d=128, page_size=page_size, ctx=_GPU_CTX,
                           new=[1] * len(_GPU_CTX), window=[0, 100 if page_size == 16 else 65], sinks=[0, 4],
                           dtype=jnp.bfloat16)
    args, scales = quantise_pages(args)
    ref, abs_v, v_max = reference_fp8(args, scales, kw)
    for splits, block_k, first in ((None, None, None), (1, 128, None), (7, 64, None), (4, 64, True), (4, 64, False)):
        out = decode.paged_decode(checked_call(args, kw, scales), num_splits=splits, block_k=block_k,
                                  longest_first=first)
        check_fp8(out, ref, abs_v, v_max, jnp.bfloat16)
    assert float(jnp.abs(out[-2:].astype(jnp.float32)).max()) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("kv_load", ["page", "gather"])
def test_gpu_prefill_fp8_grid(rng, kv_load, page_size):
    # the compiled Triton prefill kernel over fp8 pages: mixed batch (decode rows, prefill, chunked prefill, a
    # padding row), SWA head with sinks beside a full head, poisoned holes inside the full head's walk, NaN tails
    hkv, group = 2, 4
    ctx, new = [8192, 300, 700, 17, 5000, 0, 64], [1, 300, 129, 1, 1, 0, 64]
    args, kw = build_batch(rng, hq=group * hkv, hkv=hkv, d=128, page_size=page_size, ctx=ctx, new=new,
                           window=[100, 0], sinks=[4, 0], dtype=jnp.bfloat16)
    q, k, v, table, seq_lens = args
    table = np.asarray(table).copy()
    for b, col in ((1, 1), (2, 3)):  # poisoned holes in the unmasked middle of full head 1
        k = k.at[table[b, 1, col]].set(jnp.nan)
        v = v.at[table[b, 1, col]].set(jnp.nan)
        table[b, 1, col] = -1
    args, scales = quantise_pages((q, k, v, jnp.asarray(table), seq_lens))
    ref, abs_v, v_max = reference_fp8(args, scales, kw)
    # the split loops at 4 pages a key block at most in "page" mode: at pages of 16 a block of 128 keys (8 pages, each
    # its own sub-product in each loop) made a 290 KB Triton module that compiled for 42 s with pip's Triton 3.6 for
    # sm_90 on a CPU (12 s at 64 keys), and the test ran past its 150 s on an H200 (HISTORY run 252)
    split_k = 128 if kv_load == "gather" else min(128, 4 * page_size)
    variants = [dict(), dict(block_k=split_k, fused_loop=False)]
    if kv_load == "page":
        variants.append(dict(block_k=max(64, page_size), page_ids="carry"))
    for cfg in variants:
        out = paged_prefill.paged_prefill(checked_call(args, kw, scales), kv_load=kv_load, **cfg)
        check_fp8(out, ref, abs_v, v_max, jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_public_op_auto_fp8_kernels(rng):
    # paged_attention over fp8 pages on the GPU: auto takes the decode kernel for a decode batch and the Mosaic GPU
    # prefill kernel for a prefill batch with pages of 64 (as bf16 pages do on Hopper)
    hkv = 2
    for ctx, new, backend in (([3000, 1], [1, 1], "pallas"), ([4096, 200], [4096, 200], "mosaic")):
        args, kw = build_batch(rng, hq=8, hkv=hkv, d=128, page_size=64, ctx=ctx, new=new, window=[0, 256],
                               sinks=[0, 4], dtype=jnp.bfloat16, extra_tokens=0, tail_fill=0.0)
        args, scales = quantise_pages(args)
        ref, abs_v, v_max = reference_fp8(args, scales, kw)
        call = dict(cu_seqlens=kw["cu_seqlens"], window=kw["window"], sinks=kw["sinks"], **scales)
        assert attention.TABLE.choose("auto", (checked_call(args, kw, scales),), {})[0] == backend
        check_fp8(attention.paged_attention(*args, **call), ref, abs_v, v_max, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("d, dtype", [(128, jnp.float32), (256, jnp.bfloat16)])
def test_gpu_wide_or_f32_pages_launch(rng, d, dtype, page_size):
    # float32 pages at head_dim 128 and bf16 at 256 (Qwen3.5's head) through the public op, decode and prefill
    # batches: the tuned tiles would ask for more shared memory than a block has; the fitted ones run and agree
    hkv, group = 2, 4
    for ctx, new in (([1000, 17, 300], [1, 1, 1]), ([700, 0, 64], [129, 300, 64])):
        args, kw = build_batch(rng, hq=group * hkv, hkv=hkv, d=d, page_size=page_size, ctx=ctx, new=new,
                               window=[0, 100], sinks=[0, 4], dtype=dtype)
        out = attention.paged_attention(*args, cu_seqlens=kw["cu_seqlens"], window=kw["window"], sinks=kw["sinks"])
        assert rel_err(out, reference_f32(args, kw)) <= (2e-2 if dtype == jnp.bfloat16 else 5e-3)
