"""Head-wise paged attention, prefill / extend path, as a Mosaic GPU kernel (Hopper: TMA page copies, wgmma).

Same contract and tile map as :mod:`kvjax.pallas.paged.prefill` (the Pallas Triton kernel), built the
FlashAttention-3 way. One CTA per (query tile of up to 128 tokens of one row, query head) runs three
warpgroups: two consumers own 64 query tokens each, one producer streams the tile's K/V walk (the virtual page
list of :mod:`kvjax.pallas.paged.common`: sink pages, then window pages) page by page into a ring of shared
memory slots with one TMA copy per page, reading each page id from the block table. A ``-1`` entry is never
copied: the producer only signals the slot, and every consumer skips the page. The consumers alternate their
tensor-core products (a schedule barrier), so one warpgroup's softmax overlaps the other's ``QK^T`` / ``PV``.

Per page and consumer a run-time test picks one of three paths: *skip* (no key of the page is visible to the
warpgroup's tokens: a hole, the causal future, a page only the other warpgroup's window needs), *full* (every
key is visible to every token: no mask), or *masked* (causal / window / sink mask per element). Every
consumer still waits on and releases every slot, so the barrier phases stay in step.

Ragged query tiles are laid out in 128-token boxes (an XLA gather before the kernel, one after): a TMA copy into
swizzled shared memory needs 8-row aligned offsets, and a box never spills into another tile's output rows.

Unlike the Triton kernel, the copy engine moves whole pages: the unwritten tail of a row's last page is read
(every such key is masked, its probability is exactly 0), so it must hold finite values. kvjax's pools start
zeroed and only ever hold written K/V, so they satisfy this; NaN there would propagate (``0 * NaN``).

Needs a Hopper GPU (or the Mosaic GPU interpreter), ``head_dim`` 64 or 128, pages of 64 or 128 tokens, bf16
or f16 q/K/V. The interpreter runs each warpgroup as a computation on XLA's CPU thread pool and blocks those
threads in barrier waits, so it needs a pool of at least ``mgpu_common.INTERPRET_MIN_THREADS`` threads (the pool
is sized by the ``NPROC`` environment variable, else the CPU count, when JAX creates its CPU client; with 2 it can
deadlock).

It is the ``"mosaic"`` backend of ``kvjax.ops.paged_attention``, first choice on Hopper where :func:`unsupported`
accepts the call: those shapes and on average at least one 64-token box of queries per row (``T >= 64 B``: rows
of a few tokens would waste most of a tile). Measured 1.25-1.43x faster than the Triton prefill kernel in the
same runs (one causal sequence, T=4096, H=32, D=128, bf16, pages of 64 and 128, H200; benchmarks/HISTORY.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas.paged import common
from kvjax.pallas.mgpu_common import cast, interpret_params, iota, produce_ring, swizzled

BLOCK_Q = 64  # query tokens per consumer warpgroup (one wgmma M tile)
_CONSUMERS = 2
TILE_TOKENS = BLOCK_Q * _CONSUMERS
_LOG2E = math.log2(math.e)
SUPPORTED_PAGE_SIZES = (64, 128)
SUPPORTED_HEAD_DIMS = (64, 128)


def _kernel(
    q_ref,  # [NT*128, Hq, D]: tile t's tokens at rows t*128 .. (box layout)
    k_ref,  # [P, page_size, D]
    v_ref,  # [P, page_size, D]
    bt_ref,  # i32[B*Hkv*max_blocks]
    tile_row_ref,  # i32[NT]
    tile_len_ref,  # i32[NT]
    tile_pos_ref,  # i32[NT]
    lo_ref,  # i32[NT*Hkv]
    nsink_ref,  # i32[NT*Hkv]
    npages_ref,  # i32[NT*Hkv]
    win_ref,  # i32[Hkv]
    sink_ref,  # i32[Hkv]
    o_ref,  # [NT*128, Hq, D] (box layout)
    smem,  # (q / out tiles, K ring, V ring)
    full_barriers,  # (K slot loaded, V slot loaded, q loaded)
    free_barriers,  # (K slot free, V slot free): one arrival per consumer
    sched,  # consumer schedule barrier
    *,
    scale: float,
    group: int,
    page_size: int,
    max_blocks: int,
    num_kv_heads: int,
    stages: int,
    interpret: bool,
):
    q_smem, k_smem, v_smem = smem
    k_full, v_full, q_full = full_barriers
    k_free, v_free = free_barriers
    tile = lax.axis_index("tile")
    tile = tile_row_ref.shape[0] - 1 - tile  # the last (longest-walk) tiles launch first
    head = lax.axis_index("head")
    wg = lax.axis_index("wg")
    kvh = lax.div(head, jnp.int32(group))
    th = tile * num_kv_heads + kvh
    b = tile_row_ref[tile]
    n_tok = tile_len_ref[tile]
    i0 = tile_pos_ref[tile]
    lo = lo_ref[th]
    n_sink = nsink_ref[th]
    n_pages = npages_ref[th]
    w = win_ref[kvh]
    sk = sink_ref[kvh]
    bt_base = (b * num_kv_heads + kvh) * max_blocks
    head_dim = q_smem.shape[-1]
    dtype = q_smem.dtype

    def column(s):  # table column of virtual page s
        return lax.select(s < n_sink, s, lo + s - n_sink)

    def sync_schedule():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        first = wg * BLOCK_Q  # first token of this warpgroup inside the tile
        n_rows = jnp.clip(n_tok - first, 0, BLOCK_Q)
        pa = i0 + first  # positions [pa, pb] of the warpgroup's tokens
        pb = pa + n_rows - 1

        box = pl.ds(pl.multiple_of(tile * TILE_TOKENS + first, BLOCK_Q), BLOCK_Q)  # aligned: TMA into tiles

        @pl.when(n_rows > 0)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[box, head], q_smem.at[wg], q_full.at[wg])
            plgpu.barrier_wait(q_full.at[wg])

        qpos = pa + iota((BLOCK_Q, page_size), 0, interpret)
        kcol = iota((BLOCK_Q, page_size), 1, interpret)
        qk_scale = scale * _LOG2E

        def step(s, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(s, jnp.int32(stages))
            col = column(s)
            page = bt_ref[bt_base + col]
            k0 = col * page_size
            k1 = k0 + page_size - 1
            needed = (n_rows > 0) & (page >= 0) & (k0 <= pb) & ((w == 0) | (k1 > pa - w) | (k0 < sk))
            full = (k1 <= pa) & ((w == 0) | (k0 > pb - w) | (k1 < sk))
            plgpu.barrier_wait(k_full.at[slot])

            def compute(carry):
                acc, m_i, l_i = carry

                def qk_product(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    sync_schedule()
                    return acc_ref[...]

                if interpret:  # the interpreter has no transposed wgmma operand: the same product in jnp
                    qk = jnp.dot(q_smem[wg], k_smem[slot].T, preferred_element_type=jnp.float32)
                    sync_schedule()
                else:
                    qk = pl.run_scoped(qk_product, plgpu.ACC((BLOCK_Q, page_size), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])

                def mask(x):
                    diff = qpos - (k0 + kcol)
                    vis = (diff >= 0) & ((w == 0) | (diff < w) | (k0 + kcol < sk))
                    return jnp.where(vis, x, -jnp.inf)

                qk = lax.cond(full, lambda x: x, mask, qk)
                m_new = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_use, qk.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_wait(sched)

                def pv_product(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    return acc_ref[...]

                if interpret:  # the interpreter's wgmma takes no register operand
                    pv = jnp.dot(p16, v_smem[slot], preferred_element_type=jnp.float32)
                else:
                    pv = pl.run_scoped(pv_product, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32))
                acc = acc + pv
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            def skip(carry):
                plgpu.barrier_arrive(k_free.at[slot])
                sync_schedule()
                plgpu.barrier_wait(v_full.at[slot])
                sync_schedule()
                plgpu.barrier_arrive(v_free.at[slot])
                return carry

            return lax.cond(needed, compute, skip, carry)

        row_layout = plgpu.Layout.WGMMA.reduce(1)
        m_i = cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout, interpret)
        l_i = cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32), row_layout, interpret)
        acc = cast(jnp.full((BLOCK_Q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)
        pl.when(wg == 1)(sync_schedule)  # warpgroup 0 issues its products first
        acc, m_i, l_i = lax.fori_loop(0, n_pages, step, (acc, m_i, l_i))
        pl.when(wg == 0)(sync_schedule)
        l_safe = jnp.where(l_i > 0, l_i, 1.0)  # tokens that see no key (padding spans) get 0
        out = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)

        @pl.when(n_rows > 0)
        def _():  # the whole box: rows past the tile's tokens are never gathered back
            q_smem.at[wg][...] = out
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[box, head])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def issue(s, slot):
            page = bt_ref[bt_base + column(s)]

            @pl.when(page >= 0)
            def _():
                plgpu.copy_gmem_to_smem(k_ref.at[page], k_smem.at[slot], k_full.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[page], v_smem.at[slot], v_full.at[slot])

            @pl.when(page < 0)
            def _():  # a hole: the slot is signalled, nothing is read
                plgpu.barrier_arrive(k_full.at[slot])
                plgpu.barrier_arrive(v_full.at[slot])

        produce_ring(n_pages, stages, issue, (k_free, v_free))


def shape_reason(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, D]
    v_pages: jax.Array,  # [P, page_size, D]
) -> str | None:
    """What this kernel cannot take in these shapes / dtypes (``"needs page_size in ..., got ..."``), or None."""
    page_size, d = k_pages.shape[1], q.shape[-1]
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"needs page_size in {SUPPORTED_PAGE_SIZES}, got {page_size}"
    if d not in SUPPORTED_HEAD_DIMS:
        return f"needs head_dim in {SUPPORTED_HEAD_DIMS}, got {d}"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        return f"needs bf16 or f16 q/K/V of one dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
    return None


def unsupported(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, D]
    v_pages: jax.Array,  # [P, page_size, D]
    block_tables: jax.Array,  # i32[B, Hkv, max_blocks]
    seq_lens: jax.Array,  # i32[B]
    **static,  # cu_seqlens, scale, window, sinks: any value is fine
) -> str | None:
    """Why the ``"mosaic"`` backend declines this normalised call, or None: :func:`shape_reason`, and fewer
    than ``BLOCK_Q`` tokens per row on average (``T < 64 B``)."""
    t_total, num_rows = q.shape[0], block_tables.shape[0]
    if t_total < BLOCK_Q * num_rows:
        return f"needs T >= {BLOCK_Q} B tokens (one {BLOCK_Q}-token box per row), got T={t_total}, B={num_rows}"
    return shape_reason(q, k_pages, v_pages)


def _to_boxes(
    q: jax.Array,  # [T, Hq, D]
    t_tok: jax.Array,  # i32[NT]: first token of each tile
    t_len: jax.Array,  # i32[NT]: tokens in each tile
) -> tuple[jax.Array, jax.Array]:
    """Box layout: tile ``t``'s tokens at rows ``t*128 ..``, zeros past them, so that every TMA copy of a
    64-token box starts at an aligned row and never spills into another tile (a TMA copy into swizzled tiles
    needs 8-row aligned offsets; ragged rows start anywhere). Returns ``(q_box: [NT*128, Hq, D], token_box:
    i32[T])``, the box row of every token (every token is in exactly one tile)."""
    num_tokens = q.shape[0]
    r = jnp.arange(TILE_TOKENS, dtype=jnp.int32)
    src = jnp.where(r[None, :] < t_len[:, None], t_tok[:, None] + r[None, :], num_tokens).reshape(-1)
    q_box = jnp.take(q, src, axis=0, mode="fill", fill_value=0)
    token_box = jnp.zeros((num_tokens,), jnp.int32).at[src].set(
        jnp.arange(src.shape[0], dtype=jnp.int32), mode="drop")
    return q_box, token_box


@functools.partial(jax.jit, static_argnames=("scale", "stages", "interpret"))
def paged_prefill_mgpu(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, D]
    v_pages: jax.Array,  # [P, page_size, D]
    block_tables: jax.Array,  # i32[B, Hkv, max_blocks], -1 = hole
    seq_lens: jax.Array,  # i32[B]
    *,
    cu_seqlens: jax.Array,  # i32[B+1]
    scale: float,
    window: jax.Array,  # i32[Hkv]
    sinks: jax.Array,  # i32[Hkv]
    stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """Ragged causal paged attention (any batch) as a Mosaic GPU kernel; same contract as
    :func:`kvjax.pallas.paged.prefill.paged_prefill`, except that a page's unwritten tail is read (it must hold
    finite values, see the module doc). ``stages``: shared-memory K/V slots (default 2 for 128-token pages,
    3 for 64). ``interpret`` runs the Mosaic GPU interpreter on the CPU. Reads only; tokens of no row get 0.
    """
    t_total, hq, d = q.shape
    page_size = k_pages.shape[1]
    hkv, max_blocks = block_tables.shape[1:]
    reason = shape_reason(q, k_pages, v_pages)
    if reason:
        raise ValueError(f"paged_prefill_mgpu {reason}")
    stages = stages or (2 if page_size >= 128 else 3)
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    t_row, t_tok, t_len, t_pos, lo, n_sink, n_pages = common.tile_walks(
        cu_seqlens, seq_lens, window, sinks, num_tokens=t_total, tokens_per_tile=TILE_TOKENS,
        page_size=page_size, max_blocks=max_blocks,
    )
    num_tiles = t_row.shape[0]
    tiled = swizzled(q.dtype)
    scratch = (
        (
            plgpu.SMEM((_CONSUMERS, BLOCK_Q, d), q.dtype, transforms=tiled),
            plgpu.SMEM((stages, page_size, d), q.dtype, transforms=tiled),
            plgpu.SMEM((stages, page_size, d), q.dtype, transforms=tiled),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=_CONSUMERS),
        ),
        (plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=_CONSUMERS),
    )
    kernel = functools.partial(
        _kernel, scale=scale, group=hq // hkv, page_size=page_size, max_blocks=max_blocks, num_kv_heads=hkv,
        stages=stages, interpret=interpret,
    )
    q_box, token_box = _to_boxes(q, t_tok, t_len)
    o_box = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_box.shape, q.dtype),
        scratch_types=scratch,
        grid=(num_tiles, hq),
        grid_names=("tile", "head"),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None,
    )(
        q_box, k_pages, v_pages, block_tables.reshape(-1), t_row, t_len, t_pos,
        lo.reshape(-1), n_sink.reshape(-1), n_pages.reshape(-1), window, sinks,
    )
    return jnp.take(o_box, token_box, axis=0)
