"""A one-shot all-reduce over one mesh axis in Pallas Mosaic GPU (NVLink peer stores, no multicast).

Called inside ``shard_map`` in ONE process driving several GPUs: XLA hands the kernel the peers' pointers of its
buffers ("collective metadata"), so :func:`plgpu.remote_ref` of an output is a peer's copy of it.

Design (one-shot push, chosen by counting at ``bf16[64, 4096]`` = 512 KB over ``n = 4`` GPUs): every device
stores its partial into slot ``me`` of every device's ``scratch [n, E]`` (an extra output used as the landing
buffer: ``(n - 1) x 512 KB`` = 1.5 MB leaves each GPU over NVLink, ~4 us at ~400 GB/s), signals every device once,
waits for ``n`` signals, then sums its own ``n`` slots in float32 in device order (local reads at HBM rate) and
writes its output. One cross-GPU round trip. A two-shot (reduce-scatter by peer stores, then all-gather by peer
stores) moves half the bytes (0.75 MB) but needs two round trips (~1-2 us each): at this latency-bound size the
one-shot's single barrier wins; the two-shot pays from a few MB on.

Every device sums the same slots in the same order, so every device's output holds the same bits. Push rather
than pull (peers reading each other's inputs): peers touch only an output of the kernel (like jax's collective
matmul's scratch), never the input, which XLA would otherwise have to place in peer-visible memory (the "fake
modify the input" note of jax's ``all_gather_mgpu``) and keep alive until every peer has read it (an exit barrier).

Grid: ``blocks`` CTAs (one warpgroup each, at most one per SM so all are resident); the flattened ``E`` elements
are cut into ``chunk``-element pieces dealt round-robin to the CTAs (:func:`plgpu.nd_loop`). Each CTA has its own
semaphore (a per-block scratch semaphore), so CTA ``b`` waits only for the pieces of CTA ``b`` on every device.

Barrier protocol (balanced, per launch): CTA ``b`` of every device sends exactly one signal to CTA ``b``'s
semaphore on every device (itself included) after its stores, then waits for ``n`` and decrements by ``n``: each
semaphore ends every launch at 0 and no CTA waits on a CTA that waits first (signals precede waits), so with all
CTAs resident nothing can deadlock. Across calls (a ``lax.scan`` too): the semaphores and ``scratch`` are fresh
zeroed / allocated buffers of each launch, and jax's Mosaic GPU runtime (jaxlib >= 0.9.1,
``jaxlib/mosaic/gpu/custom_call.cc``: ``LaunchMultiGpuBarrier`` before every kernel that uses collective
metadata) holds each launch until every device's stream reaches it. So a peer's stores and signals of launch
``k + 1`` cannot land before this device has finished launch ``k`` and zeroed launch ``k + 1``'s semaphores (the
race that made jax's own tests flaky before that barrier). Nothing of a device is touched remotely after its wait
returns (peers only store into its ``scratch`` and signal it, both before its wait ends; its input is read only
locally), so no exit barrier is needed and its buffers may be reused as soon as the kernel ends.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
LANES = 128  # threads of the one warpgroup per CTA
BLOCKS = 128  # CTAs by default: at most the SM count (132 on H100 SXM / H200), all resident
MAX_BYTES = 4 << 20  # largest partial taken: past it a ring (XLA / NCCL) moves fewer bytes (a guess, unmeasured)


def vector(dtype) -> int:
    """Elements per thread per access (16 bytes)."""
    return 16 // jnp.dtype(dtype).itemsize


def allreduce_unsupported(x, axis: str, size: int) -> str | None:
    """Why :func:`all_reduce_mgpu` cannot take ``x`` over an axis of ``size`` devices (``None``: it can)."""
    if size < 2:
        return f"needs a mesh axis of >= 2 devices, {axis!r} has {size}"
    if jnp.dtype(x.dtype) not in DTYPES:
        return f"dtype {jnp.dtype(x.dtype).name} is not bfloat16 / float16 / float32"
    n = 1
    for d in x.shape:
        n *= d
    unit = LANES * vector(x.dtype)
    if n % unit:
        return f"{n} elements is not a multiple of {unit} (128 threads x 16 bytes)"
    if n * jnp.dtype(x.dtype).itemsize > MAX_BYTES:
        return (f"{n * jnp.dtype(x.dtype).itemsize} bytes is past the one-shot's {MAX_BYTES} (it sends n - 1 "
                f"copies of the partial; a ring sends 2 (n - 1) / n)")
    return None


def plan(n: int, dtype, blocks: int = BLOCKS) -> tuple[int, int]:
    """``(chunk, grid)``: elements per piece and CTAs for ``n`` elements (pieces of 1..4 16-byte accesses per
    thread, the largest that still gives every CTA a piece)."""
    unit = LANES * vector(dtype)
    units = n // unit
    per = next(u for u in (4, 2, 1) if units % u == 0 and (units // u >= blocks or u == 1))
    chunk = unit * per
    return chunk, max(1, min(blocks, n // chunk))


def all_reduce_mgpu(
    x: jax.Array,  # [...] bf16 / f16 / f32: this device's partial
    axis: str,
    size: int,
    *,
    blocks: int = BLOCKS,
    interpret: bool = False,
) -> jax.Array:  # [...] like x: the sum over ``axis`` (the same bits on every device)
    """Sum of ``x`` over the mesh axis ``axis`` (``size`` devices), inside ``shard_map``; every device gets it.
    float32 accumulation in device order, rounded once to x's dtype. No multicast: peer stores only."""
    if interpret:
        raise NotImplementedError("the all-reduce kernel has no interpret mode (cross-device semaphores)")
    why = allreduce_unsupported(x, axis, size)
    if why is not None:
        raise ValueError(f"all_reduce_mgpu: {why}")
    n = x.size
    chunk, grid = plan(n, x.dtype, blocks)
    pieces = n // chunk
    layout = plgpu.Layout.WG_STRIDED((chunk,), vec_size=vector(x.dtype))
    kernel = functools.partial(_kernel, axis=axis, size=size, pieces=pieces, layout=layout)
    out, _ = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((pieces, chunk), x.dtype),  # the sum
                  jax.ShapeDtypeStruct((size, pieces, chunk), x.dtype)),  # landing slots, one per source device
        grid=(grid,),
        grid_names=("blocks",),
        scratch_types=[plgpu.SemaphoreType.REGULAR],  # one per CTA
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x.reshape(pieces, chunk))
    return out.reshape(x.shape)


def _kernel(x_ref, out_ref, slots_ref, sem, *, axis: str, size: int, pieces: int, layout):
    # x_ref [pieces, chunk]; out_ref [pieces, chunk]; slots_ref [size, pieces, chunk]; sem: this CTA's semaphore
    me = lax.axis_index(axis)

    @plgpu.nd_loop((pieces,), collective_axes="blocks")
    def _push(info):
        (c,) = info.index
        part = plgpu.layout_cast(x_ref[c], layout)
        for dev in range(size):
            plgpu.remote_ref(slots_ref, {axis: dev}).at[me, c][...] = part

    for dev in range(size):  # after this CTA's stores (a warpgroup barrier, then a release at system scope)
        pl.semaphore_signal(sem, 1, device_id={axis: dev})
    pl.semaphore_wait(sem, size)  # CTA b of every device has stored its pieces here

    @plgpu.nd_loop((pieces,), collective_axes="blocks")
    def _sum(info):
        (c,) = info.index
        acc = plgpu.layout_cast(slots_ref[0, c], layout).astype(jnp.float32)
        for src in range(1, size):
            acc = acc + plgpu.layout_cast(slots_ref[src, c], layout).astype(jnp.float32)
        out_ref[c] = acc.astype(out_ref.dtype)
