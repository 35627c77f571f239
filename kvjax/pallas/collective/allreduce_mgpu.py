"""One-shot all-reduce over a mesh axis as a Mosaic GPU kernel: every device reads its peers' partial sums over
NVLink and adds them itself, in one kernel and one synchronisation.

The tensor-parallel decode step sums two ``[rows, hidden]`` partial products per layer (the row-parallel
projections). At decode widths these are a few hundred KB: an all-reduce that moves them is latency-bound, not
bandwidth-bound (XLA's ring kernel: ~12-15 us for 512 KB over two H200s). Here each of the ``D`` devices of the
axis loads the same tile of every device's input (``remote_ref``: a peer's buffer read directly, no copy
engine, no NVLink multicast), sums the ``D`` tiles in float32 in device order ``0 .. D-1`` (so every replica
holds the same bits) and stores its output. ``grid`` blocks split the elements; each block then signals its
counterpart block on every peer and waits for their signals: nobody leaves while a peer may still read its
input (the input buffer may be reused by the next op once the kernel returns).

No "ready" handshake precedes the reads: XLA launches a multi-GPU barrier kernel before every Mosaic GPU kernel
that communicates through its collective metadata (one process driving several GPUs), so when the kernel starts
every peer has finished the ops that wrote its input. The GPU test that produces one device's input after a long
computation checks this (``tests/test_all_reduce.py``).

Ordering of the signals: ``semaphore_signal_parallel`` issues one release fence for all of a block's signals,
after its loads have returned (the loaded values were stored to the output first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LANES = 128  # threads of the one warpgroup a block runs
MAX_BLOCKS = 64  # blocks of the grid at most (measured: 64 beat 16 and 32 at 512 KB, tied 128; RESULTS.md)
MAX_UNROLL = 4  # 16-byte vectors a thread loads from each device per loop step
MAX_DEVICES = 8  # peers one NVLink-switched host holds
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def vector(dtype) -> int:
    """Elements of ``dtype`` in one 16-byte vector (what one thread loads at a time)."""
    return 16 // jnp.dtype(dtype).itemsize


def tiling(n: int, dtype) -> tuple[int, int, int]:
    """``(blocks, unroll, steps)`` for ``n`` elements of ``dtype``: ``blocks`` grid blocks each own ``steps``
    tiles of ``LANES * vector * unroll`` contiguous elements. Assumes :func:`unsupported` accepted ``n``."""
    units = n // (LANES * vector(dtype))  # 16-byte vectors per thread of one block, summed over blocks
    blocks = next(b for b in (MAX_BLOCKS, 32, 16, 8, 4, 2, 1) if units % b == 0)
    per = units // blocks
    unroll = next(u for u in (MAX_UNROLL, 2, 1) if per % u == 0)
    return blocks, unroll, per // unroll


def unsupported(x, *, axis: str, size: int) -> str | None:
    """Why :func:`all_reduce_mgpu` cannot take this call (``None``: it can): 16- or 32-bit floats, a whole
    number of 16-byte vectors per lane of a warpgroup, 2..8 devices."""
    if jnp.dtype(x.dtype) not in DTYPES:
        return f"dtype {jnp.dtype(x.dtype).name} (bfloat16, float16 or float32 only)"
    if isinstance(size, bool) or not isinstance(size, int) or not 2 <= size <= MAX_DEVICES:
        return f"axis {axis!r} of {size!r} devices (2..{MAX_DEVICES} only)"
    n, unit = x.size, LANES * vector(x.dtype)
    if n == 0 or n % unit:
        return f"{n} elements, not a positive multiple of {unit} ({LANES} lanes x one 16-byte vector)"
    return None


def all_reduce_mgpu(
    x: jax.Array,  # [...]: this device's partial sum (inside shard_map over ``axis``)
    *,
    axis: str,
    size: int,
    interpret: bool = False,
) -> jax.Array:  # [...] in x's dtype: the sum over the axis, the same bits on every device
    """Sum ``x`` over mesh axis ``axis`` of ``size`` devices: one Mosaic GPU kernel, peer loads over NVLink,
    float32 accumulation in device order. Runs only compiled, under ``shard_map`` with ``axis`` bound (the
    Mosaic GPU interpreter of jax 0.10 has no cross-device semaphores)."""
    if interpret:
        raise NotImplementedError("all_reduce_mgpu has no interpreter form (cross-device semaphores)")
    why = unsupported(x, axis=axis, size=size)
    if why is not None:
        raise ValueError(f"all_reduce_mgpu cannot take this call: {why}")
    flat = x.reshape(-1)  # [n]
    vec = vector(x.dtype)
    blocks, unroll, steps = tiling(flat.size, x.dtype)
    tile = LANES * vec * unroll
    per_block = steps * tile
    layout = plgpu.Layout.WG_STRIDED((tile,), vec_size=vec)

    def all_reduce_one_shot(x_ref, o_ref, done):  # x_ref, o_ref: [n] in GMEM; done: this block's semaphore
        me = lax.axis_index(axis)
        block = lax.axis_index("blocks")
        sources = [plgpu.remote_ref(x_ref, {axis: d}) for d in range(size)]  # device d's input, d = 0 .. D-1

        @pl.loop(0, steps)
        def _(t):
            sl = pl.ds(block * per_block + t * tile, tile)
            acc = plgpu.load(sources[0].at[sl], (), layout=layout).astype(jnp.float32)
            for src in sources[1:]:
                acc = acc + plgpu.load(src.at[sl], (), layout=layout).astype(jnp.float32)
            o_ref[sl] = acc.astype(o_ref.dtype)

        peers = [lax.rem(me + i, size) for i in range(1, size)]
        plgpu.semaphore_signal_parallel(*[plgpu.SemaphoreSignal(done, device_id={axis: p}) for p in peers])
        pl.semaphore_wait(done, size - 1)

    out = plgpu.kernel(
        all_reduce_one_shot,  # the kernel's name in profiles: all_reduce_one_shot_mosaic_gpu_kernel
        out_type=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        grid=(blocks,),
        grid_names=("blocks",),
        scratch_types=[plgpu.SemaphoreType.REGULAR],
    )(flat)
    return out.reshape(x.shape)
