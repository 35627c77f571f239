"""``benchmarks/triton_resources.py``: every Triton kernel of the backend tables' example calls, lowered for CUDA
and compiled by Triton 3.6 (the device machine's version) for sm_90 on this CPU host, fits a Hopper CTA's shared
memory; and the chunk-parallel GDN path's limit (:func:`kvjax.pallas.gdn.chunk.cp_unsupported`) against what the
compiler gives its scan kernel.

Triton's wheel is a test dependency on Linux x86-64 (pyproject.toml); elsewhere these tests skip with the reason.
"""

from __future__ import annotations

import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

from helpers.bench import bench_module
from helpers.gdn import GPU_LENS, make_inputs, public_kernel

pytest.importorskip("triton", reason="needs Triton's wheel (Linux x86-64: pip install triton==3.6.0)")


def test_every_table_kernel_fits_hopper_shared_memory():
    with bench_module("triton_resources") as tr:
        rows = tr.audit()
    compiled = [r for r in rows if "shared" in r]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r][:3]
    ops = {r["op"] for r in compiled}
    assert len(compiled) >= 100 and {"paged_attention", "chunk_gated_delta_rule", "mla_decode", "swiglu"} <= ops
    over = [(r["op"], r["kernel"], r["shared"]) for r in compiled if r["shared"] > tr.HOPPER_SMEM]
    assert not over, over
    assert all(0 < r["shared"] and r["registers"] <= 255 for r in compiled)


@pytest.mark.parametrize("kd, vd, dtype, fits", [(96, 80, jnp.float32, True), (192, 96, jnp.bfloat16, True),
                                                 (192, 96, jnp.float32, False)])
def test_chunk_parallel_limit_matches_the_compiled_scan(monkeypatch, rng, kd, vd, dtype, fits):
    """With the limit lifted, the scan kernel of the chunk-parallel path compiles to more shared memory than a
    Hopper CTA has exactly where ``cp_unsupported`` declines (float32 at K = 192: 256 KB), and within it where
    the path runs (the GPU test's length grid: one 4096-token row)."""
    from kvjax.pallas.gdn import chunk

    assert (chunk.cp_unsupported(kd, dtype) is None) == fits
    args = make_inputs(rng, GPU_LENS, 2, 4, kd, vd, dtype, pad_tokens=100)

    monkeypatch.setattr(chunk, "cp_unsupported", lambda *a: None)
    chunk.chunk_gated_delta_rule_pool.clear_cache()  # no trace of this shape made under the limit, nor kept past it
    try:
        with bench_module("triton_resources") as tr:
            kernels = tr.capture_kernels(public_kernel("chunk", kd), args, {})
            scans = [k for k in kernels if k["name"] == "gdn_chunk_scan"]
            assert len(scans) == 1
            with tempfile.TemporaryDirectory() as work:
                shared = tr.compile_sm90(scans[0], work)["shared"]
    finally:
        chunk.chunk_gated_delta_rule_pool.clear_cache()
    assert shared >= np.dtype(jnp.dtype(dtype)).itemsize * 128 * 128
    assert (shared <= tr.HOPPER_SMEM) == fits, shared


@pytest.mark.parametrize("page_size", [16, 128])
def test_fp8_prefill_at_head_dim_256_fits_with_the_conversion_tile(monkeypatch, page_size):
    """The Triton prefill over fp8 pages at head_dim 256 (the table's choice at pages of 16; at pages of 128 the
    Mosaic kernel declines this head size): planned without the bf16 conversion tile it compiled past a Hopper
    CTA's shared memory, planned with it (``fit_shared_memory(convert_itemsize=2)``) it fits."""
    from kvjax.ops import attention
    from kvjax.pallas.paged import common, prefill

    (call,), _ = attention._example(2048, 1, page_size, context=2048, hkv=8, d=256, fp8=True)
    fit = common.fit_shared_memory

    def shared() -> tuple[int, int]:  # the compiled kernel's shared memory, Hopper's limit
        with bench_module("triton_resources") as tr, tempfile.TemporaryDirectory() as work:
            (kernel,) = tr.capture_kernels(prefill.paged_prefill, (call,), {})
            return tr.compile_sm90(kernel, work)["shared"], tr.HOPPER_SMEM

    prefill.paged_prefill.clear_cache()  # no trace of this shape made elsewhere, nor kept past the patch
    try:
        now, limit = shared()
        monkeypatch.setattr(common, "fit_shared_memory", lambda **kw: fit(**dict(kw, convert_itemsize=0)))
        prefill.paged_prefill.clear_cache()
        before, _ = shared()
    finally:
        prefill.paged_prefill.clear_cache()
    assert now <= limit < before, (now, before)

