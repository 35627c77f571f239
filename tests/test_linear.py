"""The projection op (:mod:`kvjax.ops.linear`) and the skinny kernels' tiles (:mod:`kvjax.pallas.skinny`): the
Pallas kernel (interpret mode on CPU, compiled on the GPU) and the XLA reference against a float64 numpy
``x @ w``. Tolerance: relative L2 error <= 1e-2 for 16-bit outputs (one rounding of a float32-accumulated
result: bf16 keeps 8 bits, ~4e-3 relative), <= 1e-5 for float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.tables import assert_auto_choices
from kvjax.base.device import NAMED
from kvjax.errors import UnknownImplError
from kvjax.ops.linear import LINEAR_TABLE, linear
from kvjax.pallas import skinny


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make(rng, rows, d_in, d_out, dtype):
    x = jnp.asarray(rng.standard_normal((rows, d_in)), dtype)
    w = jnp.asarray(rng.standard_normal((d_in, d_out)) / np.sqrt(d_in), dtype)
    return x, w


def numpy_linear(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("rows,dtype", [(16, jnp.bfloat16), (32, jnp.float16), (64, jnp.bfloat16)])
def test_kernel_interpret(rng, rows, dtype):
    x, w = make(rng, rows, 384, 2048, dtype)
    out = linear(x, w, impl="interpret")
    assert out.shape == (rows, 2048) and out.dtype == dtype
    assert rel_err(out, numpy_linear(x, w)) <= 1e-2


@pytest.mark.parametrize("tiles", [skinny.Tiles(16, 64, 2, 4), skinny.Tiles(64, 32, 3, 8)])
def test_other_tiles_interpret(rng, tiles):
    """Another tile set walks a different grid and K loop: the same product (matmul and SwiGLU epilogues)."""
    x, w = make(rng, 16, 256, 128, jnp.bfloat16)
    out = skinny.matmul_pallas(x, w, tiles=tiles, interpret=True)
    assert rel_err(out, numpy_linear(x, w)) <= 1e-2
    _, wu = make(rng, 16, 256, 128, jnp.bfloat16)
    g = numpy_linear(x, w)
    want = g / (1.0 + np.exp(-g)) * numpy_linear(x, wu)
    assert rel_err(skinny.swiglu_pallas(x, w, wu, tiles=tiles, interpret=True), want) <= 1e-2


def test_reference_and_leading_dims(rng):
    x, w = make(rng, 24, 48, 40, jnp.float32)
    out = linear(x.reshape(2, 12, 48), w, impl="reference")
    assert out.shape == (2, 12, 40)
    assert rel_err(out.reshape(24, 40), numpy_linear(x, w)) <= 1e-5


def test_table_chooses_as_documented():
    h100 = NAMED["h100"]
    want = {"decode T=64 4096->4096 bf16": "pallas", "decode T=16 12288->4096 bf16": "pallas",
            "T=256 4096->4096 bf16": "reference", "T=64 4096->4096 f32": "reference",
            "decode T=64 4096->1024 bf16": "reference", "decode T=64 LM head 4096->32768 bf16": "reference"}
    assert_auto_choices(LINEAR_TABLE, want)
    args, _ = LINEAR_TABLE.examples["T=256 4096->4096 bf16"]()
    assert "T=256" in dict(LINEAR_TABLE.explain(args, {}, h100))["pallas"]
    args, _ = LINEAR_TABLE.examples["decode T=64 4096->1024 bf16"]()
    assert "N=1024" in dict(LINEAR_TABLE.explain(args, {}, h100))["pallas"]


def test_mixed_dtypes_promote_as_matmul(rng):
    """A bf16 x with float32 weights (or the reverse) is XLA's promoted product, as ``jnp.matmul`` in ``Linear``
    always was; the kernel declines it."""
    x, w = make(rng, 16, 128, 2048, jnp.bfloat16)
    out = linear(x, w.astype(jnp.float32))
    assert out.dtype == jnp.float32
    assert rel_err(out, numpy_linear(x, w)) <= 1e-5
    assert "x's dtype" in dict(LINEAR_TABLE.explain((x, w.astype(jnp.float32)), {}, NAMED["h100"]))["pallas"]


def test_bad_calls_name_the_argument(rng):
    x, w = make(rng, 16, 128, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="'w'|w "):
        linear(x, w[:64])
    with pytest.raises(ValueError, match="'w'|w "):
        linear(x, w.astype(jnp.int32))
    with pytest.raises(ValueError, match="'x'|x "):
        linear(jnp.zeros((16, 128), jnp.int32), w)
    with pytest.raises(UnknownImplError, match="T=48"):
        linear(jnp.concatenate([x, x, x]), w, impl="interpret")
    with pytest.raises(UnknownImplError, match="N=64"):
        linear(x, w, impl="interpret")
    with pytest.raises(ValueError, match="N % 32"):
        skinny.matmul_pallas(x, w[:, :48], interpret=True)


@pytest.mark.parametrize("bad", [dict(block_n=24), dict(block_k=8), dict(num_warps=3), dict(num_stages=0),
                                 dict(block_n=True)])
def test_tiles_refuse_bad_values(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=f"Tiles.{field}|block_n and block_k"):
        skinny.Tiles(**bad)


def test_tile_sets_compile_under_their_own_names():
    a, b = skinny.Tiles(), skinny.Tiles(block_n=16)
    assert a.kernel_name("matmul") != b.kernel_name("matmul") != b.kernel_name("swiglu")
    x = jax.ShapeDtypeStruct((16, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)
    for tiles in (a, b):
        traced = jax.jit(lambda x, w, t=tiles: skinny.matmul_pallas(x, w, tiles=t)).trace(x, w)
        hlo = traced.lower(lowering_platforms=("cuda",)).as_text()  # the GPU lowering, built on any host
        assert tiles.kernel_name("matmul") in hlo


def test_wide_outputs_take_64_columns_a_program(rng):
    # N = 8192 (the tp preset's q / k / v): 64 columns a program; N a multiple of 32 only, or N <= 4096: 32
    assert skinny.matmul_tiles(8192) == skinny.WIDE_MATMUL_TILES and skinny.WIDE_MATMUL_TILES.block_n == 64
    assert skinny.matmul_tiles(4096) == skinny.matmul_tiles(4096 + 32) == skinny.MATMUL_TILES
    x, w = make(rng, 16, 128, skinny.WIDE_N + 64, jnp.bfloat16)
    hlo = jax.jit(skinny.matmul_pallas).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert skinny.WIDE_MATMUL_TILES.kernel_name("matmul") in hlo
    out = skinny.matmul_pallas(x, w, interpret=True)
    assert rel_err(out, numpy_linear(x, w)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 8192])
@pytest.mark.parametrize("rows", [16, 64])
def test_kernel_gpu(rng, rows, n):
    """The compiled kernel at the tp preset's output projection (4096 -> 4096) and its q / k / v (4096 -> 8192,
    64 columns a program), and what ``auto`` takes there."""
    x, w = make(rng, rows, 4096, n, jnp.bfloat16)
    out = jax.jit(lambda *a: linear(*a, impl="pallas"))(x, w)
    assert rel_err(out, numpy_linear(x, w)) <= 1e-2
    assert LINEAR_TABLE.choose("auto", (x, w), {})[0] == "pallas"


def test_tile_sweep_benchmark_runs():
    """``benchmarks/skinny_tiles.py --quick`` (the sweep behind the defaults) runs on CPU: every tile set and XLA
    timed at its shape, each kernel's error against XLA within the bf16 tolerance."""
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "skinny_tiles.py"
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {(r["kind"], r["variant"]) for r in rows} >= {("matmul", "xla"), ("swiglu", "xla"),
                                                          ("matmul", "kvjax_matmul_n16_k128_s4_w4")}
    kernels = [r for r in rows if r["variant"] != "xla"]
    assert len(kernels) == 4 and all(r["err"] <= 1e-2 and r["ms"] > 0 for r in kernels)
