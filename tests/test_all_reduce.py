"""The all-reduce op (issue 34): :func:`kvjax.ops.collective.all_reduce` and its one-shot Mosaic GPU kernel.

- The backend table: ``auto`` takes the kernel on Hopper over two devices up to 32 MiB a device (where it was
  measured ahead) and XLA's ``psum`` elsewhere; the kernel's refusals name the value; its tiling covers every
  element once.
- On 4 CPU devices (a subprocess): ``auto`` / ``reference`` equal numpy's sum over the axis (alone and over the
  ``"model"`` axis of a 2x2 mesh), ``auto``'s rule declines the kernel on a mesh wider than the axis, the kernel
  lowers for CUDA at 2 and 4 devices (bf16, f32, a 2-axis mesh), and a sharded model's row-parallel projections,
  MoE and embedding carry the ``all_reduce`` implementation asked for.
- On two or more GPUs (``gpu``): the kernel's sum is numpy's float32 sum in device order rounded once, the same
  bits on every device, also when one device's input is written by a long computation just before the call (the
  kernel reads its peers' inputs without a handshake of its own) and inside a ``lax.scan``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.procs import pytest_on_cpu_devices
from helpers.tables import assert_auto_choices
from kvjax.base.device import NAMED
from kvjax.errors import UnknownImplError
from kvjax.ops.collective import MOSAIC_MAX_BYTES, TABLE, all_reduce, prefer_mosaic
from kvjax.pallas.collective import allreduce_mgpu

INNER = os.environ.get("KVJAX_ALL_REDUCE_INNER") == "1"
inner = pytest.mark.skipif(not INNER, reason="runs in the 4-device subprocess of test_on_4_cpu_devices")
HERE = os.path.dirname(os.path.abspath(__file__))
P = jax.sharding.PartitionSpec


def test_table_chooses_as_documented():
    h100 = NAMED["h100"]
    want = {"decode T=64 hidden 4096 bf16 over 2": "mosaic", "decode T=64 hidden 4096 bf16 over 4": "reference",
            "decode T=16 hidden 1024 f32 over 2": "mosaic", "prefill T=2048 hidden 4096 bf16 over 2": "mosaic",
            "prefill T=8192 hidden 4096 bf16 over 2": "reference"}
    assert_auto_choices(TABLE, want)
    args, kwargs = TABLE.examples["prefill T=8192 hidden 4096 bf16 over 2"]()
    assert TABLE.choose("mosaic", args, kwargs, h100)[0] == "mosaic"  # declined by auto only, reachable by name
    assert args[0].size * 2 > MOSAIC_MAX_BYTES
    args, kwargs = TABLE.examples["decode T=64 hidden 4096 bf16 over 4"]()
    assert "measured ahead of psum on two only" in TABLE.explain(args, kwargs, h100)[0][1]


@pytest.mark.parametrize("shape, dtype, size, needle", [
    ((64, 4096), jnp.int32, 2, "dtype int32"),
    ((64, 4096), jnp.float8_e4m3fn, 2, "dtype float8_e4m3fn"),
    ((64, 4096), jnp.bfloat16, 1, "of 1 devices"),
    ((64, 4096), jnp.bfloat16, 9, "of 9 devices"),
    ((64, 4096), jnp.bfloat16, True, "of True devices"),
    ((3, 100), jnp.bfloat16, 2, "300 elements, not a positive multiple of 1024"),
    ((0, 4096), jnp.float32, 2, "0 elements"),
])
def test_kernel_refusals_name_the_value(shape, dtype, size, needle):
    x = jax.ShapeDtypeStruct(shape, dtype)
    why = allreduce_mgpu.unsupported(x, axis="model", size=size)
    assert why is not None and needle in why, why
    with pytest.raises(UnknownImplError, match="cannot take this call"):
        TABLE.choose("mosaic", (x,), {"axis": "model", "size": size}, NAMED["h100"])


@given(units=st.integers(1, 4096), dtype=st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32]))
def test_tiling_covers_every_element_once(units, dtype):
    vec = allreduce_mgpu.vector(dtype)
    n = units * allreduce_mgpu.LANES * vec
    assert allreduce_mgpu.unsupported(jax.ShapeDtypeStruct((n,), dtype), axis="model", size=2) is None
    blocks, unroll, steps = allreduce_mgpu.tiling(n, dtype)
    assert blocks * steps * unroll * allreduce_mgpu.LANES * vec == n  # contiguous, disjoint tiles: each element once
    assert 1 <= blocks <= allreduce_mgpu.MAX_BLOCKS and 1 <= unroll <= allreduce_mgpu.MAX_UNROLL and steps >= 1
    assert blocks == min(allreduce_mgpu.MAX_BLOCKS, np.gcd(units, allreduce_mgpu.MAX_BLOCKS))


def test_off_a_mesh_and_bad_impls(rng):
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    assert all_reduce(x, None) is x
    with pytest.raises(UnknownImplError, match="no implementation 'nccl'"):
        all_reduce(x, None, impl="nccl")  # refused before anything, even where there is nothing to sum
    with pytest.raises(UnknownImplError, match="needs a Hopper GPU"):
        TABLE.choose("mosaic", (x,), {"axis": "model", "size": 2}, NAMED["cpu"])
    with pytest.raises(UnknownImplError):
        TABLE.validate_impl("mosaic:interpret")  # no interpreter form (cross-device semaphores)
    with pytest.raises(NotImplementedError, match="no interpreter form"):
        allreduce_mgpu.all_reduce_mgpu(x, axis="model", size=2, interpret=True)


@pytest.mark.slow
def test_on_4_cpu_devices():
    if INNER:
        pytest.skip("already inside the 4-device run")
    out = pytest_on_cpu_devices([__file__], inner="KVJAX_ALL_REDUCE_INNER", devices=4, cwd=HERE,
                                flags=("-k", "inner_"))
    assert "4 passed" in out, out[-6000:]


def _mesh(d: int, m: int) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[: d * m]).reshape(d, m), ("data", "model"))


def _summed(fn, mesh: jax.sharding.Mesh):
    """``fn`` under shard_map over ``mesh``: inputs ``[D, M, ...]`` split over both axes, outputs likewise."""
    spec = P("data", "model")
    return jax.jit(jax.shard_map(lambda x: fn(x[0, 0])[None, None], mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


@inner
def test_inner_sums_equal_numpy(rng):
    for d, m in [(1, 2), (1, 4), (2, 2)]:
        mesh = _mesh(d, m)
        x = rng.standard_normal((d, m, 16, 256)).astype(np.float32)
        want = np.broadcast_to(x.astype(np.float64).sum(1, keepdims=True), x.shape)
        for impl in ("auto", "reference"):
            got = np.asarray(_summed(lambda v: all_reduce(v, "model", impl=impl), mesh)(x))
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{d}x{m} {impl}")


@inner
def test_inner_auto_takes_the_kernel_only_on_a_mesh_of_the_axis_alone():
    seen = {}
    for d, m in [(1, 2), (2, 2), (1, 4)]:
        def fn(v, key=(d, m)):  # auto's rule as the op sees it, inside shard_map (the mesh known)
            seen[key] = prefer_mosaic(v, axis="model", size=m)
            return v
        _summed(fn, _mesh(d, m)).trace(jax.ShapeDtypeStruct((d, m, 64, 4096), jnp.bfloat16))
    assert seen[(1, 2)] is None
    assert "a mesh of 4 devices ({'data': 2, 'model': 2})" in seen[(2, 2)]
    assert "an axis of 4 devices" in seen[(1, 4)]


@inner
def test_inner_kernel_lowers_for_cuda():
    for d, m, dtype in [(1, 2, jnp.bfloat16), (1, 4, jnp.float32), (2, 2, jnp.bfloat16)]:
        mesh = _mesh(d, m)
        fn = _summed(lambda v: allreduce_mgpu.all_reduce_mgpu(v, axis="model", size=m), mesh)
        x = jax.ShapeDtypeStruct((d, m, 64, 4096), dtype)
        text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()  # the GPU lowering, built on any host
        assert text.count("custom_call @mosaic_gpu") == 1, (d, m, dtype)
        assert "stablehlo.all_reduce" not in text  # no XLA collective beside the kernel
        psum = _summed(lambda v: all_reduce(v, "model", impl="reference"), mesh)
        assert "stablehlo.all_reduce" in psum.trace(x).lower(lowering_platforms=("cuda",)).as_text()


@inner
def test_inner_sharded_model_carries_the_impl():
    from flax import nnx

    import kvjax.cli.run as cli_run
    from kvjax.models.sharding import ShardedModel

    p = cli_run.PRESETS["cpu"]
    for impl in ("reference", "mosaic"):
        sharded = cli_run.build_model(p, seed=0, mesh=_mesh(1, 2), all_reduce=impl)
        assert isinstance(sharded, ShardedModel) and sharded.local.tp.all_reduce == impl
        impls = {module.reduce_impl for _, module in nnx.iter_modules(sharded.local)
                 if getattr(module, "reduce_axis", None) is not None}
        assert impls == {impl}
    with pytest.raises(UnknownImplError, match="no implementation 'nccl'"):
        cli_run.build_model(p, seed=0, mesh=_mesh(1, 2), all_reduce="nccl")


# ---------------------------------------------------------------------------------------------- GPUs

def _gpu_mesh() -> jax.sharding.Mesh:
    if jax.device_count() < 2:
        pytest.skip("needs two or more GPUs")
    return jax.sharding.Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))


def _order_sum(x: np.ndarray) -> np.ndarray:  # [M, ...] -> float32 sum in device order 0 .. M-1
    acc = x[0].astype(np.float32)
    for part in x[1:]:
        acc = acc + part.astype(np.float32)
    return acc


@pytest.mark.gpu
@pytest.mark.parametrize("rows, hidden, dtype", [(64, 4096, jnp.bfloat16), (16, 4096, jnp.bfloat16),
                                                  (256, 4096, jnp.bfloat16), (64, 1024, jnp.float32)])
def test_gpu_sum_is_the_device_order_sum_on_every_device(rows, hidden, dtype, rng):
    mesh = _gpu_mesh()
    m = mesh.shape["model"]
    x = jnp.asarray(rng.standard_normal((1, m, rows, hidden)), dtype)
    got = np.asarray(_summed(lambda v: all_reduce(v, "model", impl="mosaic"), mesh)(x).astype(jnp.float32))
    want = _order_sum(np.asarray(x.astype(jnp.float32))[0]).astype(jnp.dtype(dtype)).astype(np.float32)
    for dev in range(m):
        np.testing.assert_array_equal(got[0, dev], want, err_msg=f"device {dev}")


@pytest.mark.gpu
def test_gpu_reads_inputs_written_just_before_and_runs_in_a_scan(rng):
    # device 1's input is the end of 200 dependent matmuls started just before the kernel (~0 after them, ~N(0, 1)
    # before); without the barrier XLA puts in front of the kernel the other devices would read it unwritten
    mesh = _gpu_mesh()
    m = mesh.shape["model"]
    x = jnp.asarray(rng.standard_normal((1, m, 64, 4096)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4096, 4096)) / 256.0, jnp.bfloat16)  # a contraction: no chaos

    def late(v):
        def slow(u):
            u = jax.lax.fori_loop(0, 200, lambda _, a: jnp.tanh(a @ w), u)
            return u
        return jax.lax.cond(jax.lax.axis_index("model") == 1, slow, lambda u: u, v)

    def steps(v, impl):
        def body(c, _):
            c = all_reduce(late(c), "model", impl=impl) * jnp.bfloat16(1.0 / m)
            return c, c
        return jax.lax.scan(body, v, None, length=3)[0]

    got, want = (np.asarray(_summed(lambda v, i=impl: steps(v, i), mesh)(x).astype(jnp.float32))
                 for impl in ("mosaic", "reference"))
    assert np.isfinite(got).all()
    for dev in range(m):
        np.testing.assert_array_equal(got[0, dev], got[0, 0])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)  # psum's own bf16 rounding order may differ
