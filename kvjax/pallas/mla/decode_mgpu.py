"""Split-KV MLA decode over a paged latent cache as a Mosaic GPU kernel (Hopper: TMA page copies, wgmma).

Same contract as :mod:`kvjax.pallas.mla.decode` (the Pallas Triton kernel), built the FlashMLA way. One CTA per
(group of 64 query heads, KV split, sequence) runs three warpgroups over the split's 64-token tiles of the
latent cache:

- a producer copies each tile ``[64, 576]`` of the latent cache into a ring of shared-memory slots (three TMA
  copies per tile: ``kv_c[:, :256]``, ``kv_c[:, 256:]``, ``k_pe``), reading the page id from the block table
  and skipping ``-1`` holes (the slot is only signalled);
- consumer 0 computes the logits ``q · k^T`` (64 heads x 64 tokens, K = 576) with wgmma, runs the base-2
  online softmax, hands the probabilities ``P`` (bf16) and the rescale factor to consumer 1 through shared
  memory (``P`` over the slot's ``k_pe`` tile, which the logits have finished reading, so each slot has its own
  and consumer 0 never waits for consumer 1), and accumulates ``P · kv_c[:, :256]``;
- consumer 1 rescales and accumulates ``P · kv_c[:, 256:]``.

Each consumer owns half of the 512-wide f32 accumulator (128 registers per thread), so the latent row is read
from global memory once and serves as key (all 576 values) and value (the first 512). Consumer 1's product of
tile ``i`` overlaps consumer 0's logits of tile ``i + 1``.

Like the Mosaic GPU prefill kernel, the copy engine moves whole 64-row tiles: rows of a page past ``seq_lens``
are read (their logits are masked, their probability is exactly 0), so they must hold finite values. kvjax's
latent caches start zeroed and hold only written rows, so they satisfy this.

Needs a Hopper GPU (or the Mosaic GPU interpreter), ``R = 512``, ``r = 64``, pages a multiple of 64 tokens,
a bf16 or f16 latent cache (:func:`shape_limits`). :func:`unsupported`, the backend table's check, also declines
16 heads or fewer, where 48 of the 64 rows of the head tile are padding and the Pallas Triton kernel is faster
(RESULTS.md, "MLA decode"). The host side (head padding, split choice, merge) is
:func:`kvjax.pallas.split_kv.split_kv_inputs` / :func:`~kvjax.pallas.split_kv.split_kv_output`, with one split
once the CTAs fill the SMs. The interpreter runs each warpgroup as a computation on XLA's CPU thread pool and
blocks those threads in barrier waits: it needs ``NPROC >= 4`` (:func:`kvjax.pallas.mgpu_common.interpret_params`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas.mgpu_common import cast, interpret_params, iota, produce_ring, swizzled
from kvjax.pallas.split_kv import LN2, LOG2E, split_kv_inputs, split_kv_output

BLOCK_H = 64  # query heads per CTA (one wgmma M tile)
BLOCK_N = 64  # latent rows per tile
RANK = 512  # kv_lora_rank: the value width
ROPE = 64
_HALF = RANK // 2  # value columns per consumer
MIN_HEADS = 17  # fewer heads: the Pallas Triton kernel is faster (module doc)


def _kernel(
    ql_ref,  # [B, Hp, R]  (Hp: heads padded to a multiple of 64)
    qr_ref,  # [B, Hp, r]
    lat_ref,  # [P, page_size, R + r]
    bt_ref,  # i32[B * max_blocks]
    lens_ref,  # i32[B]
    o_ref,  # [B, S, Hp, R]: the final dtype with one split, f32 split outputs otherwise
    lse_ref,  # f32[B, S, Hp]
    q_smem,  # (q[:, :256], q[:, 256:], q_rope): [64, 256], [64, 256], [64, 64]
    ring,  # RefUnion: (k_lo, k_hi, k_pe) [stages, 64, 256 | 256 | 64] during the walk, then
    #        (out [2, 64, 256] in o_ref's dtype, f32[2, 64]: row sums, lse)
    alpha_smem,  # f32[stages, 64]: consumer 0's rescale factors of the tile in each slot
    q_full,  # barrier: the three q copies landed
    k_full,  # barriers [stages]: a tile's three copies landed (or the hole was signalled)
    k_free,  # barriers [stages]: both consumers are done with the slot
    p_full,  # barriers [stages]: consumer 0 wrote the slot's P (over its k_pe, read by then) and alpha
    walked,  # barrier: consumer 1 finished its walk (the ring may be reused)
    fin_full,  # barrier: consumer 0 wrote the row sums
    *,
    scale: float,
    num_splits: int,
    page_size: int,
    max_blocks: int,
    stages: int,
    interpret: bool,
):
    (k_lo, k_hi, k_pe), (out_smem, fin_smem) = ring
    q_lo, q_hi, q_pe = q_smem
    g = lax.axis_index("g")
    split = lax.axis_index("s")
    b = lax.axis_index("b")
    wg = lax.axis_index("wg")
    dtype = q_lo.dtype
    seq_len = lens_ref[b]
    n_tiles = lax.div(seq_len + (BLOCK_N - 1), jnp.int32(BLOCK_N))
    per_split = lax.div(n_tiles + (num_splits - 1), jnp.int32(num_splits))
    start = jnp.minimum(split * per_split, n_tiles)
    n_steps = jnp.minimum(start + per_split, n_tiles) - start
    heads = pl.ds(pl.multiple_of(g * BLOCK_H, BLOCK_H), BLOCK_H)
    row = plgpu.Layout.WGMMA.reduce(1)

    def tile_page(i):  # page id and first row of step i's tile
        first = (start + i) * BLOCK_N
        page = bt_ref[b * max_blocks + lax.div(first, jnp.int32(page_size))]
        return page, lax.rem(first, jnp.int32(page_size))

    def computes(page):  # whether the consumers work on this tile (holes: no)
        return page >= 0

    def pv(acc, p, v_ref):  # acc + p @ v (p: registers or a shared-memory ref), accumulated in place
        if interpret:  # the interpreter's wgmma takes no register operand: the same product in jnp
            return acc + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

        def body(acc_ref):
            plgpu.wgmma(acc_ref, p, v_ref)

        return pl.run_state(body)(plgpu.ACC.init(acc))

    def store_out(acc, l, half_ref, half: int):
        l_safe = jnp.where(l > 0, l, 1.0)  # an empty split gives 0
        out_smem.at[half][...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[half], half_ref)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 0)
    def _consumer0():
        plgpu.set_max_registers(232, action="increase")
        plgpu.copy_gmem_to_smem(ql_ref.at[b, heads, pl.ds(0, _HALF)], q_lo, q_full)
        plgpu.copy_gmem_to_smem(ql_ref.at[b, heads, pl.ds(_HALF, _HALF)], q_hi, q_full)
        plgpu.copy_gmem_to_smem(qr_ref.at[b, heads], q_pe, q_full)
        plgpu.barrier_wait(q_full)
        col = iota((BLOCK_H, BLOCK_N), 1, interpret)
        qk_scale = scale * LOG2E
        pairs = ((q_lo, k_lo), (q_hi, k_hi), (q_pe, k_pe))

        def qk(slot):  # logits of the tile in `slot`
            if interpret:  # no transposed wgmma operand in the interpreter: the same product in jnp
                return sum(jnp.dot(a[...], kt.at[slot][...].T, preferred_element_type=jnp.float32)
                           for a, kt in pairs)

            def body(acc_ref):
                for a, kt in pairs:
                    plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(kt.at[slot], (1, 0)))
                return acc_ref[...]

            return pl.run_scoped(body, plgpu.ACC((BLOCK_H, BLOCK_N), jnp.float32))

        def finish(i, carry, s):  # softmax of step i's logits s, P handed over, P @ kv_c[:, :256]; frees the slot
            acc, m_i, l_i = carry
            slot = lax.rem(i, jnp.int32(stages))
            page, _ = tile_page(i)
            ok = jnp.logical_and((start + i) * BLOCK_N + col < seq_len, page >= 0)
            s = jnp.where(ok, s * qk_scale, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no visible key yet
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)

            def publish(acc):
                k_pe.at[slot][...] = p16  # the slot's k_pe was last read by this tile's logits
                alpha_smem.at[slot][...] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_full.at[slot])
                return pv(acc, p16, k_lo.at[slot])

            acc = lax.cond(computes(page), publish, lambda a: a, acc)
            plgpu.barrier_arrive(k_free.at[slot])
            return acc, m_new, l_i

        def wait_tile(i):
            plgpu.barrier_wait(k_full.at[lax.rem(i, jnp.int32(stages))])

        m_i = cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), row, interpret)
        l_i = cast(jnp.full((BLOCK_H,), 0.0, jnp.float32), row, interpret)
        acc = cast(jnp.full((BLOCK_H, _HALF), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)

        def step(i, carry):
            wait_tile(i)
            return finish(i, carry, qk(lax.rem(i, jnp.int32(stages))))

        acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))
        plgpu.barrier_wait(walked)  # consumer 1 finished its last product: the ring is free
        fin_smem.at[0][...] = l_i
        l_safe = jnp.where(l_i > 0, l_i, 1.0)
        fin_smem.at[1][...] = jnp.where(l_i > 0, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)
        plgpu.commit_smem()
        plgpu.barrier_arrive(fin_full)
        plgpu.copy_smem_to_gmem(fin_smem.at[1], lse_ref.at[b, split, heads])
        store_out(acc, l_i, o_ref.at[b, split, heads, pl.ds(0, _HALF)], 0)

    @pl.when(wg == 1)
    def _consumer1():
        plgpu.set_max_registers(232, action="increase")

        def step(i, acc):
            slot = lax.rem(i, jnp.int32(stages))
            page, _ = tile_page(i)
            plgpu.barrier_wait(k_full.at[slot])

            def compute(acc):
                plgpu.barrier_wait(p_full.at[slot])
                if interpret:
                    alpha, p = alpha_smem[slot], k_pe.at[slot][...]
                else:
                    alpha, p = plgpu.load(alpha_smem.at[slot], (), layout=row), k_pe.at[slot]
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                return pv(acc, p, k_hi.at[slot])

            acc = lax.cond(computes(page), compute, lambda a: a, acc)
            plgpu.barrier_arrive(k_free.at[slot])
            return acc

        acc = cast(jnp.full((BLOCK_H, _HALF), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)
        acc = lax.fori_loop(0, n_steps, step, acc)
        plgpu.barrier_arrive(walked)
        plgpu.barrier_wait(fin_full)  # consumer 0 is done: row sums written
        l_i = fin_smem[0] if interpret else plgpu.load(fin_smem.at[0], (), layout=row)
        store_out(acc, l_i, o_ref.at[b, split, heads, pl.ds(_HALF, _HALF)], 1)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def issue(i, slot):
            page, row0 = tile_page(i)
            rows = pl.ds(row0, BLOCK_N)

            @pl.when(page >= 0)
            def _():
                plgpu.copy_gmem_to_smem(lat_ref.at[page, rows, pl.ds(0, _HALF)], k_lo.at[slot], k_full.at[slot])
                plgpu.copy_gmem_to_smem(lat_ref.at[page, rows, pl.ds(_HALF, _HALF)], k_hi.at[slot],
                                        k_full.at[slot])
                plgpu.copy_gmem_to_smem(lat_ref.at[page, rows, pl.ds(RANK, ROPE)], k_pe.at[slot],
                                        k_full.at[slot])

            @pl.when(page < 0)
            def _():  # a hole: the slot is signalled, nothing is read
                for _ in range(3):
                    plgpu.barrier_arrive(k_full.at[slot])

        produce_ring(n_steps, stages, issue, (k_free,))


def shape_limits(
    q_latent: jax.Array,  # [B, H, R]
    q_rope: jax.Array,  # [B, H, r]
    latent_pages: jax.Array,  # [P, page_size, R + r]
) -> str | None:
    """What this kernel cannot compute in these shapes / dtypes (``"R = 512 ..., got 256 ..."``), or None."""
    if q_latent.shape[-1] != RANK or q_rope.shape[-1] != ROPE:
        return f"R = {RANK} and r = {ROPE}, got {q_latent.shape[-1]} and {q_rope.shape[-1]}"
    if latent_pages.shape[1] % BLOCK_N:
        return f"page_size a multiple of {BLOCK_N}, got {latent_pages.shape[1]}"
    if latent_pages.dtype not in (jnp.bfloat16, jnp.float16):
        return f"a bf16 or f16 latent cache, got {latent_pages.dtype}"
    return None


def unsupported(
    call,  # kvjax.ops.mla.MLADecodeCall (dense): q_latent [B, H, R], q_rope [B, H, r], ...
    latent_pages: jax.Array,  # [P, page_size, R + r]
) -> str | None:
    """The backend table's check of :func:`kvjax.ops.mla.mla_decode`'s call: :func:`shape_limits`, and at most
    16 heads declined (the Pallas Triton kernel is faster there, module doc)."""
    why = shape_limits(call.q_latent, call.q_rope, latent_pages)
    if why:
        return f"needs {why}"
    if call.q_latent.shape[1] < MIN_HEADS:
        return (f"H = {call.q_latent.shape[1]} <= {MIN_HEADS - 1} heads: the Pallas Triton kernel is faster there "
                f"(RESULTS.md, MLA decode)")
    return None


@functools.partial(jax.jit, static_argnames=("stages", "interpret"))
def mla_decode_mgpu(
    call,  # kvjax.ops.mla.MLADecodeCall (dense): q_latent [B, H, R], q_rope [B, H, r],
    #        block_tables i32[B, 1, max_blocks], seq_lens i32[B]; static scale, num_kv_splits
    latent_pages: jax.Array,  # [P, page_size, R + r]
    *,
    stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [B, H, R]
    """Split-KV MLA decode (Mosaic GPU, see the module doc); same contract as
    :func:`kvjax.pallas.mla.decode.mla_decode_pallas` (dense) except that rows of a page past ``seq_lens`` are
    read (they must be finite). Any head count (padded to 64); ``ValueError`` outside :func:`shape_limits`.
    ``stages``: shared-memory tile slots (2 fit beside q in 227 KB). Reads only.
    """
    b = call.q_latent.shape[0]
    page_size = latent_pages.shape[1]
    max_blocks = call.block_tables.shape[-1]
    reason = shape_limits(call.q_latent, call.q_rope, latent_pages)
    if reason:
        raise ValueError(f"mla_decode_mgpu needs {reason}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    dtype = latent_pages.dtype

    def stage1(ql, qr, splits, out_dtype):
        hp = ql.shape[1]
        scratch = (
            tuple(plgpu.SMEM((BLOCK_H, w), dtype, transforms=swizzled(dtype)) for w in (_HALF, _HALF, ROPE)),
            (plgpu.RefUnion if not interpret else lambda *groups: groups)(  # the interpreter has no RefUnion
                tuple(plgpu.SMEM((stages, BLOCK_N, w), dtype, transforms=swizzled(dtype))
                      for w in (_HALF, _HALF, ROPE)),
                (plgpu.SMEM((2, BLOCK_H, _HALF), out_dtype, transforms=swizzled(out_dtype)),
                 plgpu.SMEM((2, BLOCK_H), jnp.float32)),
            ),
            plgpu.SMEM((stages, BLOCK_H), jnp.float32),
            plgpu.Barrier(num_arrivals=3),
            plgpu.Barrier(num_arrivals=3, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(),
            plgpu.Barrier(),
        )
        kernel = functools.partial(_kernel, scale=call.scale, num_splits=splits, page_size=page_size,
                                   max_blocks=max_blocks, stages=stages, interpret=interpret)
        return plgpu.kernel(
            kernel,
            out_type=(jax.ShapeDtypeStruct((b, splits, hp, RANK), out_dtype),
                      jax.ShapeDtypeStruct((b, splits, hp), jnp.float32)),
            scratch_types=scratch,
            # Mosaic GPU launches the last grid axis fastest: the head groups of a (sequence, split) run side by
            # side and share each tile through L2 (groups first made the second group re-read it from HBM)
            grid=(b, splits, hp // BLOCK_H),
            grid_names=("b", "s", "g"),
            num_threads=3,
            thread_name="wg",
            # row reductions stay inside a warp: the 2 KB cross-warp reduction scratch would not fit beside the ring
            compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
            interpret=interpret_params() if interpret else None,
        )(ql, qr, latent_pages, call.block_tables.reshape(-1), call.seq_lens)

    q, qr, splits, stage_dtype = split_kv_inputs(call, dtype=dtype, block_h=BLOCK_H,
                                                 max_steps=max_blocks * page_size // BLOCK_N, one_cta_per_sm=True)
    return split_kv_output(*stage1(q, qr, splits, stage_dtype), call)
