"""GDN decode step on the slot-addressed pool as a Mosaic GPU kernel (Hopper: TMA state tiles).

Same contract as :func:`kvjax.pallas.gdn_recurrent.recurrent_gated_delta_rule_slots` (one token per batch row,
row ``b`` continues the state at ``ssm[layer, slot_ids[b]]``, updated in place), built for the copy engine.
The work is a list of state tiles ``f32[K, block_v]``, one per (row, value head, value block), value blocks
fastest, so consecutive tiles are adjacent in the pool. Each CTA (one warpgroup) walks ``tiles_per_cta``
consecutive tiles through a ring of ``stages`` shared-memory buffers: a tile, its q, k and v arrive by TMA
(``stages - 1`` tiles ahead), are updated in registers, and the new tile and ``o`` leave by TMA. Several CTAs
share an SM, so one CTA's arithmetic overlaps the others' copies. Rows whose slot is not in ``1..S`` read and
write no state (their buffers are only signalled) and get ``o = 0``. The pool is passed as a ``jax.Ref``, so
under jit with a donated pool the update is in place.

Per tile, in the WGMMA register layout (rows = K, columns = value columns)::

    S' = exp(g) S + k (beta (v - exp(g) k^T S))^T          o = scale q^T S'

with ``q, k`` l2-normalised in the kernel when ``use_qk_l2norm``. The reductions over K cross warps (through
a small shared-memory scratch the compiler reserves).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas.mgpu_common import swizzled

L2NORM_EPS = 1e-6
SUPPORTED_K = (64, 128)
BLOCK_V = 64  # defaults: the fastest configuration measured (benchmarks/RESULTS.md)
TILES_PER_CTA = 2
SUPPORTED_BLOCK_V = (64, 128)  # a [block_v] bf16 TMA destination per stage must stay 128-byte aligned


def _kernel(
    slots_ref,  # i32[B]
    q_ref,  # [B, Hk, K]
    k_ref,  # [B, Hk, K]
    v_ref,  # [B, Hv, V]
    g_ref,  # f32[B * Hv]
    beta_ref,  # [B * Hv]
    pool_ref,  # f32[L, S+1, Hv, K, V]  a Ref: updated in place
    o_ref,  # [B, Hv, V]
    s_smem,  # f32[stages, K, block_v]
    q_smem,  # [stages, K]
    k_smem,  # [stages, K]
    v_smem,  # [stages, block_v]
    o_smem,  # [stages, block_v]
    loaded,  # barriers[stages], 4 arrivals each: state tile, q, k, v
    *,
    layer: int,
    group: int,
    scale: float,
    use_qk_l2norm: bool,
    block_v: int,
    tiles_per_cta: int,
    stages: int,
    copy_only: bool,
):
    batch, hv, vd = v_ref.shape
    nvb = vd // block_v
    n_tiles = batch * hv * nvb
    first = lax.axis_index("cta") * tiles_per_cta
    row = plgpu.Layout.WGMMA.reduce(1)  # a K vector, broadcast along the value columns
    col = plgpu.Layout.WGMMA.reduce(0)  # a value-column vector

    def coords(t):  # tile t: value block fastest, then head, then row (consecutive tiles are adjacent in the pool)
        vb, h, b = t % nvb, (t // nvb) % hv, t // (nvb * hv)
        slot = slots_ref[jnp.minimum(b, batch - 1)]
        live = (t < n_tiles) & (slot >= 1) & (slot < pool_ref.shape[1])
        return pl.ds(pl.multiple_of(vb * block_v, block_v), block_v), h, b, slot, live

    def issue(t, st):
        vs, h, b, slot, live = coords(t)

        @pl.when(live)
        def _():
            plgpu.copy_gmem_to_smem(pool_ref.at[layer, slot, h, :, vs], s_smem.at[st], loaded.at[st])
            plgpu.copy_gmem_to_smem(q_ref.at[b, h // group], q_smem.at[st], loaded.at[st])
            plgpu.copy_gmem_to_smem(k_ref.at[b, h // group], k_smem.at[st], loaded.at[st])
            plgpu.copy_gmem_to_smem(v_ref.at[b, h, vs], v_smem.at[st], loaded.at[st])

        @pl.when(jnp.logical_not(live))
        def _():  # nothing to read: the slot is only signalled
            for _ in range(4):
                plgpu.barrier_arrive(loaded.at[st])

    def update(t, st):
        vs, h, b, slot, live = coords(t)

        @pl.when(live)
        def _():
            if copy_only:  # the access pattern alone (benchmarks): the tile goes back unchanged, o = v
                plgpu.copy_smem_to_gmem(s_smem.at[st], pool_ref.at[layer, slot, h, :, vs])
                plgpu.copy_smem_to_gmem(v_smem.at[st], o_ref.at[b, h, vs])
                return
            decay = jnp.exp(g_ref[b * hv + h].astype(jnp.float32))
            beta = beta_ref[b * hv + h].astype(jnp.float32)
            q = plgpu.load(q_smem.at[st], layout=row, optimized=False).astype(jnp.float32)
            k = plgpu.load(k_smem.at[st], layout=row, optimized=False).astype(jnp.float32)
            v = plgpu.load(v_smem.at[st], layout=col, optimized=False).astype(jnp.float32)
            if use_qk_l2norm:
                q = q * lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS)
                k = k * lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
            s = plgpu.load(s_smem.at[st], layout=plgpu.Layout.WGMMA)
            kb = lax.broadcast_in_dim(k, s.shape, [0])
            delta = (v - decay * jnp.sum(s * kb, axis=0)) * beta
            s = s * decay + kb * lax.broadcast_in_dim(delta, s.shape, [1])
            s_smem.at[st][...] = s
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_smem.at[st], pool_ref.at[layer, slot, h, :, vs])
            o = jnp.sum(s * lax.broadcast_in_dim(q, s.shape, [0]), axis=0) * scale
            o_smem.at[st][...] = o.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[st], o_ref.at[b, h, vs])

        @pl.when(jnp.logical_not(live) & (t < n_tiles))
        def _():  # a padding row: o = 0
            o_smem.at[st][...] = plgpu.layout_cast(jnp.zeros((block_v,), o_smem.dtype), col)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[st], o_ref.at[b, h, vs])

    for j in range(min(stages - 1, tiles_per_cta)):
        issue(first + j, j)

    @pl.loop(0, tiles_per_cta)
    def _(i):
        st = lax.rem(i, stages)
        ahead = i + stages - 1

        @pl.when(ahead < tiles_per_cta)
        def _():  # prefetch once the stores that last read these buffers (tile i - 1's) are done reading
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            issue(first + ahead, lax.rem(ahead, stages))

        plgpu.barrier_wait(loaded.at[st])
        update(first + i, st)

    # the CTA may leave once its stores have read shared memory; the writes complete on their own
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def unsupported(
    q: jax.Array,  # [B, Hk, K]
    v: jax.Array,  # [B, Hv, V]
    block_v: int,
) -> str | None:
    """What this kernel cannot take (``"K in (64, 128), got 96"``), or None."""
    if jax.__version_info__ < (0, 11):  # jax 0.10 rejects Ref operands (the in-place pool) of Mosaic GPU kernels
        return f"jax >= 0.11 (Ref operands of Mosaic GPU kernels), got {jax.__version__}"
    kd, vd = q.shape[2], v.shape[2]
    if kd not in SUPPORTED_K:
        return f"K in {SUPPORTED_K}, got {kd}"
    if block_v not in SUPPORTED_BLOCK_V or vd % block_v:
        return f"block_v in {SUPPORTED_BLOCK_V} dividing V={vd}, got {block_v}"
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32) or v.dtype != q.dtype:
        return f"q/k/v of one dtype (bf16, f16 or f32), got {q.dtype}, {v.dtype}"
    return None


@functools.partial(
    jax.jit, static_argnames=("layer", "scale", "use_qk_l2norm", "block_v", "tiles_per_cta", "stages",
                     "_copy_only"),
    donate_argnames=("ssm",),
)
def gdn_decode_mgpu(
    q: jax.Array,  # [B, Hk, K]  one token per batch row
    k: jax.Array,  # [B, Hk, K]
    v: jax.Array,  # [B, Hv, V]
    g: jax.Array,  # f32[B, Hv]
    beta: jax.Array,  # [B, Hv]
    ssm: jax.Array,  # f32[L, S+1, Hv, K, V]  GDN pool, donated, updated in place
    *,
    slot_ids: jax.Array,  # i32[B]  0 (or out of range) = padding row
    layer: int,
    scale: float,
    use_qk_l2norm: bool = False,
    block_v: int = BLOCK_V,
    tiles_per_cta: int = TILES_PER_CTA,
    stages: int = 2,
    _copy_only: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Decode step straight on the GDN pool (Mosaic GPU): ``(o: [B, Hv, V], ssm)``; same contract as
    :func:`kvjax.pallas.gdn_recurrent.recurrent_gated_delta_rule_slots`. Needs a Hopper GPU.

    Tuning: ``block_v`` value columns per tile (64: 32 KB tiles, three CTAs per SM), ``tiles_per_cta``
    consecutive tiles per CTA, ``stages`` shared-memory buffers (``stages - 1`` tiles in flight).
    ``_copy_only`` (benchmarks) stores every live tile back unchanged and ``o = v``: the access pattern alone.
    """
    batch, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    reason = unsupported(q, v, block_v)
    if reason:
        raise ValueError(f"gdn_decode_mgpu needs {reason}")
    if slot_ids.shape != (batch,):
        raise ValueError(f"one token per row: q has {batch} tokens, slot_ids shape {slot_ids.shape}")
    if tiles_per_cta < 1:
        raise ValueError(f"tiles_per_cta must be >= 1, got {tiles_per_cta}")
    if stages < 2:
        raise ValueError(f"stages must be >= 2 (the tile updated + the next in flight), got {stages}")
    if not 0 <= layer < ssm.shape[0]:
        raise ValueError(f"layer must be in [0, {ssm.shape[0]}), got {layer}")
    tiled = swizzled(jnp.float32)
    kernel = functools.partial(
        _kernel, layer=layer, group=hv // hk, scale=scale, use_qk_l2norm=use_qk_l2norm, block_v=block_v,
        tiles_per_cta=tiles_per_cta, stages=stages, copy_only=_copy_only,
    )
    n_tiles = batch * hv * (vd // block_v)
    pool = jax.new_ref(ssm)
    o = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, hv, vd), v.dtype),
        scratch_types=(
            plgpu.SMEM((stages, kd, block_v), jnp.float32, transforms=tiled),
            plgpu.SMEM((stages, kd), q.dtype),
            plgpu.SMEM((stages, kd), k.dtype),
            plgpu.SMEM((stages, block_v), v.dtype),
            plgpu.SMEM((stages, block_v), v.dtype),
            plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        ),
        grid=(pl.cdiv(n_tiles, tiles_per_cta),),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(),
    )(slot_ids, q, k, v, g.reshape(-1), beta.reshape(-1), pool)
    return o, jax.freeze(pool)
