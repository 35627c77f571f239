"""The SwiGLU up-projection op (:mod:`kvjax.ops.mlp`): the Pallas kernel (interpret mode on CPU, compiled on the
GPU) and the XLA reference against a float64 numpy ``silu(x @ w_gate) * (x @ w_up)``. Tolerance: relative L2
error <= 1e-2 for 16-bit outputs (one rounding of the result; the reference rounds both products too),
<= 1e-5 for float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.tables import assert_auto_choices
from kvjax.base.device import NAMED
from kvjax.errors import UnknownImplError
from kvjax.ops.mlp import SWIGLU_TABLE, swiglu


def numpy_swiglu(x, w_gate, w_up):
    x, wg, wu = (np.asarray(t, np.float64) for t in (x, w_gate, w_up))
    g = x @ wg
    return g / (1.0 + np.exp(-g)) * (x @ wu)


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make(rng, rows, hidden, inter, dtype):
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    w_gate = jnp.asarray(rng.standard_normal((hidden, inter)) * 2.0 / np.sqrt(hidden), dtype)
    w_up = jnp.asarray(rng.standard_normal((hidden, inter)) / np.sqrt(hidden), dtype)
    return x, w_gate, w_up


@pytest.mark.parametrize("rows,dtype", [(16, jnp.bfloat16), (32, jnp.float16), (64, jnp.bfloat16)])
def test_kernel_interpret(rng, rows, dtype):
    x, wg, wu = make(rng, rows, 256, 96, dtype)
    out = swiglu(x, wg, wu, impl="interpret")
    assert out.shape == (rows, 96) and out.dtype == dtype
    assert rel_err(out, numpy_swiglu(x, wg, wu)) <= 1e-2


def test_reference_and_leading_dims(rng):
    x, wg, wu = make(rng, 24, 48, 40, jnp.float32)
    out = swiglu(x.reshape(2, 12, 48), wg, wu, impl="reference")
    assert out.shape == (2, 12, 40)
    assert rel_err(out.reshape(24, 40), numpy_swiglu(x, wg, wu)) <= 1e-5


def test_table_chooses_as_documented():
    h100 = NAMED["h100"]
    want = {"decode T=64 H=1024 I=3072 bf16": "pallas", "decode T=16 H=1024 I=3072 bf16": "pallas",
            "T=256 H=1024 I=3072 bf16": "reference", "T=64 H=1024 I=3072 f32": "reference"}
    assert_auto_choices(SWIGLU_TABLE, want)
    args, _ = SWIGLU_TABLE.examples["T=256 H=1024 I=3072 bf16"]()
    assert "T=256" in dict(SWIGLU_TABLE.explain(args, {}, h100))["pallas"]
    args, _ = SWIGLU_TABLE.examples["T=64 H=1024 I=3072 f32"]()
    assert "float32" in dict(SWIGLU_TABLE.explain(args, {}, h100))["pallas"]


def test_bad_calls_name_the_argument(rng):
    x, wg, wu = make(rng, 16, 128, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="w_gate"):
        swiglu(x, wg[:64], wu)
    with pytest.raises(ValueError, match="w_up"):
        swiglu(x, wg, wu[:, :32])
    with pytest.raises(ValueError, match="w_gate"):
        swiglu(x, wg.astype(jnp.float32), wu)
    with pytest.raises(UnknownImplError, match="T=48"):
        swiglu(jnp.concatenate([x, x, x]), wg, wu, impl="interpret")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [16, 32, 64])
def test_kernel_gpu(rng, rows):
    """The compiled kernel at the gpu preset's MLP (H=1024, I=3072) and what ``auto`` takes there."""
    x, wg, wu = make(rng, rows, 1024, 3072, jnp.bfloat16)
    out = jax.jit(lambda *a: swiglu(*a, impl="pallas"))(x, wg, wu)
    assert rel_err(out, numpy_swiglu(x, wg, wu)) <= 1e-2
    assert SWIGLU_TABLE.choose("auto", (x, wg, wu), {})[0] == "pallas"
