"""The all-reduce op (:mod:`kvjax.ops.allreduce`) and its Mosaic GPU kernel (:mod:`kvjax.pallas.allreduce_mgpu`).

CPU: the table's decisions and errors; the op on an 8-CPU-device ``("data", "model")`` mesh (in a subprocess with
``--xla_force_host_platform_device_count=8``, like ``test_sharding``) against a numpy sum of the partials; the
kernel lowered for CUDA under ``shard_map`` (the whole Pallas -> Mosaic GPU lowering, no GPU); a sharded
model's ``set_all_reduce`` reaching every row-parallel layer. GPU (``>= 2`` GPUs): the kernel against ``psum``
on random inputs, 50 calls in a ``lax.scan`` (the semaphores across launches).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.base.device import DeviceKind
from kvjax.errors import UnknownImplError
from kvjax.models.common.parallel import TensorParallel
from kvjax.ops.allreduce import ALL_REDUCE_TABLE, all_reduce
from kvjax.pallas.allreduce_mgpu import all_reduce_mgpu, allreduce_unsupported, plan

INNER = os.environ.get("KVJAX_ALLREDUCE_INNER") == "1"
inner = pytest.mark.skipif(not INNER, reason="runs in the 8-device subprocess of test_allreduce_on_8_cpu_devices")
H100 = DeviceKind("gpu", "9.0")
A100 = DeviceKind("gpu", "8.0")
CPU = DeviceKind("cpu")
SDS = jax.ShapeDtypeStruct


def _call(shape=(64, 4096), dtype=jnp.bfloat16, size=4):
    return (SDS(shape, dtype), "model", size), {}


def test_table_decisions():
    args, kw = _call()
    assert ALL_REDUCE_TABLE.choose("auto", args, kw, device=CPU)[0] == "reference"
    assert ALL_REDUCE_TABLE.choose("auto", args, kw, device=H100)[0] == "xla"  # never the kernel by itself
    assert ALL_REDUCE_TABLE.choose("mosaic", args, kw, device=H100)[0] == "mosaic"
    with pytest.raises(UnknownImplError, match="Hopper"):
        ALL_REDUCE_TABLE.choose("mosaic", args, kw, device=A100)
    with pytest.raises(UnknownImplError, match="needs a GPU"):
        ALL_REDUCE_TABLE.choose("xla", args, kw, device=CPU)
    for bad, why in [(_call(size=1), ">= 2 devices"), (_call(dtype=jnp.float64), "not bfloat16"),
                     (_call(shape=(3, 100)), "not a multiple of 1024"), (_call(shape=(2048, 4096)), "past the")]:
        with pytest.raises(UnknownImplError, match=why):
            ALL_REDUCE_TABLE.choose("mosaic", *bad, device=H100)
    assert allreduce_unsupported(SDS((48, 2560), jnp.float32), "model", 2) is None
    assert allreduce_unsupported(SDS((512, 4096), jnp.bfloat16), "model", 8) is None  # 4 MB: the cap
    with pytest.raises(UnknownImplError):
        ALL_REDUCE_TABLE.validate_impl("nccl")
    with pytest.raises(UnknownImplError, match="interpret"):
        ALL_REDUCE_TABLE.validate_impl("mosaic:interpret")


def test_plan_covers_every_element():
    for n, dtype in [(64 * 4096, jnp.bfloat16), (48 * 2560, jnp.float32), (1024, jnp.bfloat16),
                     (32 * 1024 * 1024 // 2, jnp.bfloat16)]:
        chunk, grid = plan(n, dtype)
        assert n % chunk == 0 and chunk % (128 * 16 // jnp.dtype(dtype).itemsize) == 0
        assert 1 <= grid <= 128 and grid <= n // chunk


def test_tensor_parallel_checks_the_impl():
    assert TensorParallel("model", 2, 10).all_reduce == "auto"
    assert TensorParallel("model", 2, 10, all_reduce="mosaic").all_reduce == "mosaic"
    with pytest.raises(UnknownImplError):
        TensorParallel("model", 2, 10, all_reduce="nccl")


def test_errors_outside_a_bound_axis():
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="not a mesh axis bound here"):
        all_reduce(x, "model")
    with pytest.raises(ValueError, match="axis must be"):
        all_reduce(x, 3)
    with pytest.raises(ValueError, match="float dtype"):
        all_reduce(jnp.ones((4, 8), jnp.int32), "model")
    with pytest.raises(ValueError, match="must be an array"):
        all_reduce([1.0], "model")


def test_allreduce_on_8_cpu_devices():
    if INNER:
        pytest.skip("already inside the 8-device run")
    env = {**os.environ, "KVJAX_ALLREDUCE_INNER": "1",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                       env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(__file__))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def _mesh(d: int, m: int) -> Mesh:
    return Mesh(np.asarray(jax.devices()[: d * m]).reshape(d, m), ("data", "model"))


def _sum_over_model(fn, mesh: Mesh):
    """``fn(partial [R, H]) -> [R, H]`` per device of ``mesh`` on partials ``[D, M, R, H]``, jitted."""
    from kvjax.models.sharding import shard_map

    def local(x):
        return fn(x[0, 0])[None, None]

    return jax.jit(shard_map(local, mesh, P("data", "model"), P("data", "model")))


@inner
@pytest.mark.parametrize("d,m", [(1, 8), (2, 4), (4, 2)])
def test_op_sums_over_model_on_cpu_mesh(d, m):
    rng = np.random.default_rng(d * 10 + m)
    x = rng.standard_normal((d, m, 5, 24)).astype(np.float32)
    for impl in ("auto", "reference"):
        got = np.asarray(_sum_over_model(lambda p, impl=impl: all_reduce(p, "model", impl=impl), _mesh(d, m))(x))
        want = np.broadcast_to(x.sum(axis=1, keepdims=True), x.shape)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)  # f32 sums of m terms
    with pytest.raises(UnknownImplError, match="Hopper"):  # a call it takes, on a CPU
        _sum_over_model(lambda p: all_reduce(p, "model", impl="mosaic"), _mesh(d, m))(np.ones((d, m, 8, 512),
                                                                                              np.float32))
    fell_back = _sum_over_model(lambda p: all_reduce(p, "model", impl="mosaic", fallback=True), _mesh(d, m))(x)
    np.testing.assert_allclose(np.asarray(fell_back), want, rtol=1e-6, atol=1e-5)  # 120 elements: auto's psum


@inner
@pytest.mark.parametrize("shape,dtype", [((64, 4096), jnp.bfloat16), ((48, 2560), jnp.float32),
                                         ((16, 1024), jnp.float16)])
def test_kernel_lowers_for_cuda_under_shard_map(shape, dtype):
    """The whole Pallas -> Mosaic GPU lowering on this CPU host (2x4 mesh, the sum over "model"): one Mosaic custom
    call that uses XLA's collective metadata (peer pointers) over all 8 devices."""
    fn = _sum_over_model(lambda p: all_reduce_mgpu(p, "model", 4), _mesh(2, 4))
    text = fn.trace(SDS((2, 4) + shape, dtype)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and "uses_xla_collective_metadata = true" in text
    assert 'xla_replica_ids = "0,1,2,3,4,5,6,7"' in text


@inner
def test_set_all_reduce_reaches_every_row_parallel_layer():
    from helpers.models import mesh_qwen_model
    from kvjax.models.sharding import shard_model

    sharded = shard_model(mesh_qwen_model(), _mesh(1, 2))
    impls = {getattr(mod, "reduce_impl", None) for _, mod in _row_parallel(sharded.local)}
    assert impls == {"auto"} and sharded.local.tp.all_reduce == "auto"
    sharded.set_all_reduce("mosaic")
    rows = _row_parallel(sharded.local)
    assert rows and {mod.reduce_impl for _, mod in rows} == {"mosaic"}
    assert sharded.local.tp.all_reduce == "mosaic" and sharded.plan.tp.all_reduce == "mosaic"
    from flax import nnx

    rebuilt = nnx.merge(sharded.graphdef, sharded.params)
    assert {mod.reduce_impl for _, mod in _row_parallel(rebuilt)} == {"mosaic"}


def _row_parallel(model):
    from flax import nnx

    return [(p, mod) for p, mod in nnx.iter_modules(model) if getattr(mod, "reduce_axis", None) is not None]


# ------------------------------------------------------------------------------------------------ GPU


def _gpu_mesh() -> Mesh:
    n = jax.device_count()
    if jax.default_backend() != "gpu" or n < 2:
        pytest.skip("needs >= 2 GPUs")
    m = 4 if n >= 4 else 2
    return _mesh(1, m)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,tol", [((64, 4096), jnp.bfloat16, 1e-2), ((40, 2560), jnp.bfloat16, 1e-2),
                                             ((64, 4096), jnp.float32, 1e-5)])
def test_kernel_matches_psum_on_gpus(shape, dtype, tol):
    """50 calls in a ``lax.scan`` (its partials random per call): every call's sum against psum's (float32, rounded
    once like the kernel's; bf16: within one rounding), and every device holding the same bits."""
    mesh = _gpu_mesh()
    m = mesh.shape["model"]
    steps = 50
    rng = np.random.default_rng(0)
    parts = jnp.asarray(rng.standard_normal((steps, 1, m, *shape)), dtype)

    def run(fn):
        from kvjax.models.sharding import shard_map

        def local(parts):
            def body(carry, p):
                s = fn(p)
                return carry + s[0].astype(jnp.float32), s
            _, sums = jax.lax.scan(body, jnp.zeros(shape[1:], jnp.float32), parts[:, 0, 0])
            return sums[:, None, None]

        f = shard_map(local, mesh, P(None, "data", "model"), P(None, "data", "model"))
        return np.asarray(jax.jit(f)(parts).astype(jnp.float32))

    got = run(lambda p: all_reduce(p, "model", impl="mosaic"))
    want = run(lambda p: jax.lax.psum(p.astype(jnp.float32), "model").astype(p.dtype))
    for dev in range(1, m):
        np.testing.assert_array_equal(got[:, 0, dev], got[:, 0, 0])
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)  # sums of m N(0, 1): |s| ~ 2


def test_benchmark_smoke_on_cpu(tmp_path):
    """``benchmarks/allreduce.py --smoke`` on 8 host devices: psum (and XLA's one-shot option) rows at 64 KB and
    512 KB over 2 devices, sums within one bf16 rounding of float32's, no Mosaic row without a GPU."""
    import json

    out = tmp_path / "ar.json"
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                       " --xla_force_host_platform_device_count=8").strip()}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "allreduce.py"), "--smoke", "--gpus", "2",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=300, cwd=repo)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["kernels"]
    assert {(row["kb"], row["impl"]) for row in rows} == {(kb, impl) for kb in (64, 512)
                                                          for impl in ("psum", "psum-oneshot")}
    for row in rows:
        assert "error" not in row and row["us_per_call"] > 0
        assert row["max_abs_err"] <= 2 ** -7 * 4  # |sum| of 2 N(0, 1/4) < 4: one bf16 rounding
