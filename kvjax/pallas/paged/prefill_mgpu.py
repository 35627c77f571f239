"""Head-wise paged attention, prefill / extend path, as a Mosaic GPU kernel (Hopper: TMA page copies, wgmma).

Same contract and tile map as :mod:`kvjax.pallas.paged.prefill` (the Pallas Triton kernel), built the
FlashAttention-3 way. One CTA per (query tile of up to 128 tokens of one row, query head) runs three
warpgroups: two consumers own 64 query tokens each, one producer streams the tile's K/V walk (the virtual page
list of :mod:`kvjax.pallas.paged.common`: sink pages, then window pages) into a ring of 128-key shared-memory
slots, one TMA copy per page (a slot holds one page of 128 or two consecutive walk pages of 64), reading each
page id from the block table. A ``-1`` entry is never copied: a slot half whose page is a hole (or past the
walk) gets a copy of the slot's other page, whose keys there are never visible; a slot with no page at all is
only signalled, and every consumer skips it. The consumers alternate their tensor-core products (a schedule
barrier), so one warpgroup's softmax overlaps the other's ``QK^T`` / ``PV``; ``PV`` accumulates into the
running accumulator, and the wait for the next K slot overlaps it.

Per slot and consumer a run-time test picks one of three paths: *skip* (no key of the slot is visible to the
warpgroup's tokens: holes, the causal future, pages only the other warpgroup's window needs), *full* (every
key is visible to every token: no mask), or *masked* (causal / window / sink mask per element, keys placed by
their page). Every consumer still waits on and releases every slot, so the barrier phases stay in step.

Ragged query tiles are read and written in place: each warpgroup copies the 64-row box of ``q`` that holds its
tokens (at any row offset, pulled back inside ``q`` at its end) into plain shared-memory rows, swizzles it for
wgmma through registers, and writes back exactly its own rows (one 64-row copy, or two overlapping copies of
``2^k`` rows), so no tile's box ever writes another tile's rows.

Unlike the Triton kernel, the copy engine moves whole pages: the unwritten tail of a row's last page is read
(every such key is masked, its probability is exactly 0), so it must hold finite values. kvjax's pools start
zeroed and only ever hold written K/V, so they satisfy this; NaN there would propagate (``0 * NaN``).

Needs a Hopper GPU (or the Mosaic GPU interpreter), ``head_dim`` 64 or 128, pages of 64 or 128 tokens, bf16
or f16 q/K/V, or fp8 K/V pages (float8_e4m3fn with ``k_scale`` / ``v_scale`` ``f32[P]``, one scale per page) with
bf16 or f16 q. fp8 pages: the TMA copies land the e4m3 bytes in the ring (half the bytes of bf16 pages) and
``q K^T`` runs on e4m3 tensor cores (twice the f16 rate; wgmma takes e4m3 operands K-major, which the q tile and
the K ring slot as copied are), so K is never converted: each q row gets a power-of-two scale
``s = 2**(floor(log2 max|q|) - 7)`` (:func:`q_row_scales`), folded into the logits with the page's key scale.
``fp8_products="e4m3x2_qk"`` (the default): q as two e4m3 tiles ``s (h + l)``, ``l`` the e4m3 rounding of the
residual ``q / s - h``, two products into one accumulator (the tensor time of one f16 product): exact for bf16 q
wherever ``|q| >= 2**-2 s`` (the residual then lies in e4m3's normal range), within ``2**-10 s`` elsewhere.
``"e4m3_qk"``: q rounded to one e4m3 tile (``|q - q_eff| <= 2**-4 |q| + 2**-10 s``), faster and an order of
magnitude less exact (RESULTS.md, "fp8 (e4m3) pages"). V is converted e4m3 -> f16 (every e4m3 value is exact in
f16) once per slot, not once per consumer: each consumer converts its half of the slot (64 keys), while its
``q K^T`` product runs, into one of two shared f16 buffers used in turn, releases the ring slot, and waits for the
other half (a barrier per buffer, one arrival per consumer) before ``P V`` in f16, accumulating in f32; a consumer
that skips the slot still converts its half. Two buffers suffice: the schedule barrier keeps the consumers within
a step of each other, so when one writes a buffer, both have finished the products that read it two steps
before. The value scales reach the probabilities relative to a running reference scale (the largest value scale
of the walk so far, a power of two like them, so a probability is never multiplied by a tiny scale before its f16
cast), the accumulator being kept in units of that reference and rescaled, exactly, when it grows. The backend
table takes this path for fp8 pages where the shapes allow it. A third form, converting K and V to f16 in each
consumer with f16 products, was as exact as ``"e4m3x2_qk"`` and 1.27-1.31x slower; it is deleted (HISTORY.md).

The interpreter runs each warpgroup as a computation on XLA's CPU thread pool and blocks those
threads in barrier waits, so it needs a pool of at least ``mgpu_common.INTERPRET_MIN_THREADS`` threads (the pool
is sized by the ``NPROC`` environment variable, else the CPU count, when JAX creates its CPU client; with 2 it can
deadlock).

It is the ``"mosaic"`` backend of ``kvjax.ops.paged_attention``, first choice on Hopper where :func:`unsupported`
accepts the call: those shapes and on average at least one 64-token box of queries per row (``T >= 64 B``: rows
of a few tokens would waste most of a tile). Speed against cuDNN: benchmarks/RESULTS.md, "Paged attention
prefill".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.base.fp8 import FP8_DTYPE
from kvjax.pallas.paged import common
from kvjax.pallas.mgpu_common import SWIZZLE, cast, interpret_params, iota, produce_ring, swizzled

BLOCK_Q = 64  # query tokens per consumer warpgroup (one wgmma M tile)
BLOCK_K = 128  # keys per step: one page of 128 or two pages of 64 (one shared-memory slot)
_CONSUMERS = 2
TILE_TOKENS = BLOCK_Q * _CONSUMERS
_LOG2E = math.log2(math.e)
_FAR = 1 << 30  # key position given to a slot half that holds no page of the walk: never visible
SUPPORTED_PAGE_SIZES = (64, 128)
SUPPORTED_HEAD_DIMS = (64, 128)
_V16_BUFFERS = 2  # e4m3 q: shared f16 V buffers, used in turn (module doc)
_Q_PARTS = {"e4m3x2_qk": 2, "e4m3_qk": 1}  # e4m3 tiles that q is split into over fp8 pages
FP8_PRODUCTS = tuple(_Q_PARTS)  # the products over fp8 pages (module doc)
_EXP_MASK = 0x7F800000  # an f32's exponent bits
_Q_SHIFT = 7 << 23  # q row scale: 2**-7 times the largest power of two <= the row's max |q|
_TINY = 2.0 ** -100  # rows below it (zeros) get scale 2**-7


def q_row_scales(
    amax: jax.Array,  # f32[rows]: max |q| of each row
) -> tuple[jax.Array, jax.Array]:  # (s, 1 / s), f32[rows] each: powers of two with amax / s in [128, 256)
    """The e4m3 scale of each q row: ``s = 2**(floor(log2 amax) - 7)``, so ``|q| / s < 256 <= 448`` and ``q / s``
    keeps q's bits (a power of two); exact bit arithmetic, the same in the kernel and in numpy."""
    amax = jnp.where(amax >= _TINY, amax, 1.0)
    bits = lax.bitcast_convert_type(amax, jnp.int32) & jnp.int32(_EXP_MASK)
    scale_bits = bits - jnp.int32(_Q_SHIFT)
    inv_bits = jnp.int32(254 << 23) - scale_bits
    return lax.bitcast_convert_type(scale_bits, jnp.float32), lax.bitcast_convert_type(inv_bits, jnp.float32)


def _kernel(
    *refs,  # common.operands (q [T, Hq, D] with T >= 64, K / V pages [P, page_size, D] in q's dtype or
    #         float8_e4m3fn; spans: row, first token, length, first position i32[NT] per tile), then o_ref
    #         [T, Hq, D] and the scratch: smem (q tiles (swizzled; e4m3 q: q_parts per consumer), q / out staging
    #         (plain rows), K ring, V ring[, two shared f16 V buffers (fp8 pages)]), full barriers (K slot loaded,
    #         V slot loaded, q staged: a slot takes one arrival per page), free barriers (K slot free, V slot free:
    #         one arrival per consumer), the consumer schedule barrier[, V buffer converted (fp8 pages: one
    #         arrival per consumer)]
    scale: float,
    group: int,
    page_size: int,
    max_blocks: int,
    num_kv_heads: int,
    stages: int,
    fp8: bool,
    q_parts: int,
    interpret: bool,
):
    (q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref), tile_refs, walk, rest = common.kernel_refs(refs, num_spans=4)
    tile_row_ref, tile_tok_ref, tile_len_ref, tile_pos_ref = tile_refs
    o_ref, smem, full_barriers, free_barriers, sched, *v_conv = rest
    q_smem, io_smem, k_smem, v_smem, *kv16_smem = smem
    k_full, v_full, q_full = full_barriers
    k_free, v_free = free_barriers
    tile = lax.axis_index("tile")
    tile = tile_row_ref.shape[0] - 1 - tile  # the last (longest-walk) tiles launch first
    head = lax.axis_index("head")
    wg = lax.axis_index("wg")
    kvh = lax.div(head, jnp.int32(group))
    th = tile * num_kv_heads + kvh
    b = tile_row_ref[tile]
    tok0 = tile_tok_ref[tile]
    n_tok = tile_len_ref[tile]
    i0 = tile_pos_ref[tile]
    lo, n_sink, n_pages, w, sk = common.walk_at(walk, th, kvh)
    bt_base = (b * num_kv_heads + kvh) * max_blocks
    num_tokens = q_ref.shape[0]
    head_dim = q_smem.shape[-1]
    dtype = jnp.float16 if fp8 else q_smem.dtype  # the P V operands: q's dtype, f16 over fp8 pages
    out_dtype = io_smem.dtype
    per_slot = BLOCK_K // page_size  # pages per slot
    n_steps = lax.div(n_pages + per_slot - 1, jnp.int32(per_slot))

    def page_at(s):  # (first key position, page id or -1) of virtual page s; -1 for a hole and past the walk
        col = lax.select(s < n_sink, s, lo + s - n_sink)
        page = bt_ref[bt_base + jnp.minimum(col, max_blocks - 1)]
        return col * page_size, jnp.where(s < n_pages, page, -1)

    def page_scale(ref, page):  # f32 scale of an fp8 page; 0 for a hole (never read)
        return jnp.where(page >= 0, ref[jnp.maximum(page, 0)], 0.0)

    def sync_schedule():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        first = wg * BLOCK_Q  # first token of this warpgroup inside the tile
        n_rows = jnp.clip(n_tok - first, 0, BLOCK_Q)
        x = tok0 + first  # the warpgroup's tokens: rows [x, x + n_rows) of q / o
        x0 = jnp.minimum(x, num_tokens - BLOCK_Q)  # a 64-row box inside q holding them, at rows [r0, r0 + n_rows)
        r0 = x - x0
        pa = i0 + first  # positions [pa, pb] of the warpgroup's tokens
        pb = pa + n_rows - 1
        stage = io_smem.at[wg]

        row_layout = plgpu.Layout.WGMMA.reduce(1)

        def load_q():  # q rows at any offset: a plain-row TMA copy, then swizzled for wgmma through registers
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(x0, BLOCK_Q), head], stage, q_full.at[wg])
            plgpu.barrier_wait(q_full.at[wg])
            if interpret:
                q_rows = stage[...]
            else:
                q_rows = plgpu.load(stage, (), layout=plgpu.Layout.WGMMA, optimized=False)
            if fp8:  # e4m3 tiles q = s (h + l): h = e4m3(q / s), l = e4m3(q / s - h) (q_parts 2); s per row
                x = q_rows.astype(jnp.float32)
                q_scale, inv = q_row_scales(jnp.abs(x).max(axis=1))
                y = x * lax.broadcast_in_dim(inv, x.shape, [0])
                for part in range(q_parts):
                    h = y.astype(FP8_DTYPE)
                    q_smem.at[wg * q_parts + part][...] = h
                    if part + 1 < q_parts:
                        y = y - h.astype(jnp.float32)
            else:
                q_smem.at[wg][...] = q_rows
                q_scale = None
            if not interpret:
                plgpu.commit_smem()
            return q_scale

        if fp8:  # the row scales of q, carried in registers (1 for a warpgroup without tokens: never used)
            q_scale = lax.cond(n_rows > 0, load_q,
                               lambda: cast(jnp.full((BLOCK_Q,), 1.0, jnp.float32), row_layout, interpret))
        else:
            pl.when(n_rows > 0)(load_q)

        qpos = (pa - r0) + iota((BLOCK_Q, BLOCK_K), 0, interpret)  # position of each box row
        kcol = iota((BLOCK_Q, BLOCK_K), 1, interpret)
        qk_scale = scale * _LOG2E

        def wait_next_k(j):  # every consumer waits each K phase once, one step ahead (overlaps PV)
            @pl.when(j + 1 < n_steps)
            def _():
                plgpu.barrier_wait(k_full.at[lax.rem(j + 1, jnp.int32(stages))])

        def per_column(values):  # f32[BLOCK_Q, BLOCK_K]: each key column's value of its slot half's page
            if per_slot == 1:
                return jnp.full((BLOCK_Q, BLOCK_K), values[0], jnp.float32) if interpret else values[0]
            return jnp.where(kcol < page_size, values[0], values[1])

        def convert_v_half(slot, buf):  # fp8: this consumer's half of the V slot as f16 into shared buffer buf
            plgpu.barrier_wait(v_full.at[slot])
            keys = pl.ds(pl.multiple_of(wg * BLOCK_Q, BLOCK_Q), BLOCK_Q)
            src, dst = v_smem.at[slot, keys], kv16_smem[0].at[buf, keys]
            if interpret:
                dst[...] = src[...].astype(dtype)
            else:
                x = plgpu.load(src, (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
                dst[...] = plgpu.layout_cast(x.astype(dtype), plgpu.Layout.WGMMA)
                plgpu.commit_smem()
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(v_conv[0].at[buf])

        def step(j, carry):
            slot = lax.rem(j, jnp.int32(stages))
            buf = lax.rem(j, jnp.int32(_V16_BUFFERS))
            k0s, needs, fulls, pages = [], [], [], []
            for i in range(per_slot):
                k0, page = page_at(j * per_slot + i)
                k1 = k0 + page_size - 1
                valid = page >= 0
                needs.append(valid & (k0 <= pb) & ((w == 0) | (k1 > pa - w) | (k0 < sk)))
                fulls.append(valid & (k1 <= pa) & ((w == 0) | (k0 > pb - w) | (k1 < sk)))
                k0s.append(jnp.where(valid, k0, _FAR))
                pages.append(page)
            needed = (n_rows > 0) & functools.reduce(jnp.logical_or, needs)
            full = functools.reduce(jnp.logical_and, fulls)

            def compute(carry):
                acc, m_i, l_i, *v_ref = carry
                k_op = k_smem.at[slot]

                def qk_product(acc_ref):  # fp8: e4m3 x e4m3 straight from the ring; V converted meanwhile
                    for part in range(max(q_parts, 1)):
                        plgpu.wgmma(acc_ref, q_smem.at[wg * max(q_parts, 1) + part], plgpu.transpose_ref(k_op, (1, 0)))
                    if fp8:
                        convert_v_half(slot, buf)
                    sync_schedule()
                    return acc_ref[...]

                if interpret:  # the interpreter has no transposed wgmma operand: the same product in jnp
                    if fp8:
                        q_rows = sum(q_smem[wg * q_parts + part].astype(jnp.float32) for part in range(q_parts))
                        qk = jnp.dot(q_rows, k_op[...].astype(jnp.float32).T, preferred_element_type=jnp.float32)
                    else:
                        qk = jnp.dot(q_smem[wg], k_op[...].T, preferred_element_type=jnp.float32)
                    if fp8:
                        convert_v_half(slot, buf)
                    sync_schedule()
                else:
                    qk = pl.run_scoped(qk_product, plgpu.ACC((BLOCK_Q, BLOCK_K), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if fp8:  # q's row scale times the key column's page scale
                    rows = [lax.broadcast_in_dim(q_scale * page_scale(ks_ref, page), qk.shape, [0]) for page in pages]
                    qk = qk * (rows[0] if per_slot == 1 else jnp.where(kcol < page_size, rows[0], rows[1]))

                def mask(x):
                    kpos = kcol + k0s[0]
                    if per_slot == 2:
                        kpos = kcol + jnp.where(kcol < page_size, k0s[0], k0s[1] - page_size)
                    diff = qpos - kpos
                    vis = (diff >= 0) & ((w == 0) | (diff < w) | (kpos < sk))
                    return jnp.where(vis, x, -jnp.inf)

                qk = lax.cond(full, lambda x: x, mask, qk)
                m_new = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_use, qk.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                if fp8:  # value scales relative to the running reference (module doc)
                    v_scales = [page_scale(vs_ref, page) for page in pages]
                    ref_new = functools.reduce(jnp.maximum, v_scales, v_ref[0])
                    ref_safe = jnp.where(ref_new > 0, ref_new, 1.0)
                    p = p * (per_column(v_scales) / ref_safe)
                    alpha = alpha * (v_ref[0] / ref_safe)
                    v_ref = [ref_new]
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                plgpu.barrier_arrive(sched)
                if fp8:  # both halves converted
                    plgpu.barrier_wait(v_conv[0].at[buf])
                    v_op = kv16_smem[0].at[buf]
                else:
                    plgpu.barrier_wait(v_full.at[slot])
                    v_op = v_smem.at[slot]
                plgpu.barrier_wait(sched)

                if interpret:  # the interpreter's wgmma takes no register operand and has no run_state
                    acc = acc + jnp.dot(p16, v_op[...], preferred_element_type=jnp.float32)
                    wait_next_k(j)
                else:
                    def pv_product(acc_ref):  # accumulates into the running accumulator
                        plgpu.wgmma(acc_ref, p16, v_op)
                        wait_next_k(j)

                    acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
                if not fp8:
                    plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i, *v_ref

            def skip(carry):  # fp8: the other consumer may need the slot: this one still converts its half
                plgpu.barrier_arrive(k_free.at[slot])
                if fp8:
                    convert_v_half(slot, buf)
                sync_schedule()
                plgpu.barrier_wait(v_conv[0].at[buf] if fp8 else v_full.at[slot])
                sync_schedule()
                wait_next_k(j)
                if not fp8:
                    plgpu.barrier_arrive(v_free.at[slot])
                return carry

            return lax.cond(needed, compute, skip, carry)

        m_i = cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout, interpret)
        l_i = cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32), row_layout, interpret)
        acc = cast(jnp.full((BLOCK_Q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)
        v_ref = [jnp.float32(0.0)] if fp8 else []  # fp8: the largest value scale so far (the accumulator's unit)

        @pl.when(n_steps > 0)
        def _():
            plgpu.barrier_wait(k_full.at[0])

        pl.when(wg == 1)(sync_schedule)  # warpgroup 0 issues its products first
        acc, m_i, l_i, *v_ref = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i, *v_ref))
        pl.when(wg == 0)(sync_schedule)
        l_safe = jnp.where(l_i > 0, l_i, 1.0)  # tokens that see no key (padding spans) get 0
        if fp8:
            l_safe = l_safe / v_ref[0]  # l_i > 0 implies a visited page, so a reference scale > 0
        out = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(out_dtype)

        @pl.when(n_rows > 0)
        def _():  # exactly the warpgroup's rows: one 64-row copy, or two overlapping copies of 2^k rows
            stage[...] = out
            plgpu.commit_smem()

            @pl.when(n_rows == BLOCK_Q)
            def _():
                plgpu.copy_smem_to_gmem(stage, o_ref.at[pl.ds(x0, BLOCK_Q), head])

            rows = BLOCK_Q // 2
            while rows:
                @pl.when((n_rows >= rows) & (n_rows < 2 * rows))
                def _(rows=rows):
                    for off in (0, n_rows - rows):
                        plgpu.copy_smem_to_gmem(stage.at[pl.ds(r0 + off, rows)], o_ref.at[pl.ds(x + off, rows), head])

                rows //= 2
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def issue(j, slot):
            pages = [page_at(j * per_slot + i)[1] for i in range(per_slot)]
            # a slot half whose page is a hole or past the walk gets a copy of the other half's page (finite data,
            # never visible), so that every slot takes the same bytes; a slot with no page is only signalled
            srcs = [functools.reduce(lambda a, o: jnp.where(a >= 0, a, o), pages[i:] + pages[:i])
                    for i in range(per_slot)]

            @pl.when(srcs[0] >= 0)
            def _():
                for i, src in enumerate(srcs):
                    keys = pl.ds(i * page_size, page_size)
                    plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot, keys], k_full.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot, keys], v_full.at[slot])

            @pl.when(srcs[0] < 0)
            def _():  # only holes: the slot is signalled, nothing is read
                for _ in range(per_slot):
                    plgpu.barrier_arrive(k_full.at[slot])
                    plgpu.barrier_arrive(v_full.at[slot])

        produce_ring(n_steps, stages, issue, (k_free, v_free))


def shape_reason(call) -> str | None:  # kvjax.ops.attention.PagedAttentionCall
    """What this kernel cannot take in these shapes / dtypes (``"needs page_size in ..., got ..."``), or None:
    bf16 or f16 q with K/V pages of q's dtype or float8_e4m3fn."""
    q, k_pages, v_pages = call.q, call.k_pages, call.v_pages
    page_size, d = k_pages.shape[1], q.shape[-1]
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"needs page_size in {SUPPORTED_PAGE_SIZES}, got {page_size}"
    if d not in SUPPORTED_HEAD_DIMS:
        return f"needs head_dim in {SUPPORTED_HEAD_DIMS}, got {d}"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype not in (q.dtype, FP8_DTYPE) or (
            v_pages.dtype != k_pages.dtype):
        return (f"needs bf16 or f16 q with K/V pages of q's dtype or float8_e4m3fn, got {q.dtype}, {k_pages.dtype}, "
                f"{v_pages.dtype}")
    return None


def unsupported(call) -> str | None:  # kvjax.ops.attention.PagedAttentionCall
    """Why the ``"mosaic"`` backend declines this call, or None: :func:`shape_reason`, and fewer than ``BLOCK_Q``
    tokens per row on average (``T < 64 B``)."""
    t_total, num_rows = call.q.shape[0], call.block_tables.shape[0]
    if t_total < BLOCK_Q * num_rows:
        return f"needs T >= {BLOCK_Q} B tokens (one {BLOCK_Q}-token box per row), got T={t_total}, B={num_rows}"
    return shape_reason(call)


@functools.partial(jax.jit, static_argnames=("stages", "fp8_products", "interpret"))
def paged_prefill_mgpu(
    call,  # kvjax.ops.attention.PagedAttentionCall (checked by the op)
    *,
    stages: int | None = None,
    fp8_products: str = "e4m3x2_qk",
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D] in q's dtype
    """Ragged causal paged attention (any batch) as a Mosaic GPU kernel; same contract as
    :func:`kvjax.pallas.paged.prefill.paged_prefill`, except that a page's unwritten tail is read (it must hold
    finite values, see the module doc). fp8 pages read as ``page * scale`` (module doc).
    ``stages``: shared-memory slots of 128 keys (default 2). ``fp8_products`` (fp8 pages only, module doc):
    ``"e4m3x2_qk"`` (q as two e4m3 tiles, ``q K^T`` on e4m3 tensor cores, V converted to f16 once per slot) or
    ``"e4m3_qk"`` (q rounded to one e4m3 tile).
    ``interpret`` runs the Mosaic GPU interpreter on the CPU. Reads only; tokens of no row get 0. ``ValueError``
    for what :func:`shape_reason` rejects and for an unknown ``fp8_products``.
    """
    q, k_pages = call.q, call.k_pages
    t_total, hq, d = q.shape
    page_size = call.page_size
    reason = shape_reason(call)
    if reason:
        raise ValueError(f"paged_prefill_mgpu {reason}")
    fp8, k_scale, v_scale = common.page_scales(call)
    stages = stages or 2
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if fp8_products not in FP8_PRODUCTS:
        raise ValueError(f"fp8_products must be one of {FP8_PRODUCTS}, got {fp8_products!r}")
    q_parts = _Q_PARTS[fp8_products] if fp8 else 0
    spans, walks = common.tile_walks(call, TILE_TOKENS)
    num_tiles = spans[0].shape[0]
    dtype = jnp.float16 if fp8 else q.dtype  # the products' operands
    tiled = swizzled(dtype)
    ring_swizzle = min(SWIZZLE, d * k_pages.dtype.itemsize)  # fp8 rows of 64 values: 64-byte swizzle
    ring = (plgpu.TilingTransform((8, ring_swizzle // k_pages.dtype.itemsize)), plgpu.SwizzleTransform(ring_swizzle))
    per_slot = BLOCK_K // page_size
    if q_parts:  # e4m3 q tiles; f16 V buffers shared by the consumers
        q_tiles = plgpu.SMEM((_CONSUMERS * q_parts, BLOCK_Q, d), FP8_DTYPE, transforms=ring)
        kv16 = [plgpu.SMEM((_V16_BUFFERS, BLOCK_K, d), dtype, transforms=tiled)]
    else:
        q_tiles = plgpu.SMEM((_CONSUMERS, BLOCK_Q, d), dtype, transforms=tiled)
        kv16 = []
    scratch = (
        (
            q_tiles,
            plgpu.SMEM((_CONSUMERS, BLOCK_Q, d), q.dtype),  # plain rows: TMA copies at any row offset
            plgpu.SMEM((stages, BLOCK_K, d), k_pages.dtype, transforms=ring),
            plgpu.SMEM((stages, BLOCK_K, d), k_pages.dtype, transforms=ring),
            *kv16,
        ),
        (
            plgpu.Barrier(num_arrivals=per_slot, num_barriers=stages),
            plgpu.Barrier(num_arrivals=per_slot, num_barriers=stages),
            plgpu.Barrier(num_barriers=_CONSUMERS),
        ),
        (plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=_CONSUMERS),
        *([plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=_V16_BUFFERS)] if q_parts else []),  # V converted
    )
    kernel = functools.partial(
        _kernel, scale=call.scale, group=hq // call.num_kv_heads, page_size=page_size, max_blocks=call.max_blocks,
        num_kv_heads=call.num_kv_heads, stages=stages, fp8=fp8, q_parts=q_parts, interpret=interpret,
    )
    q_in = q if t_total >= BLOCK_Q else jnp.pad(q, ((0, BLOCK_Q - t_total), (0, 0), (0, 0)))  # a box fits
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
        scratch_types=scratch,
        grid=(num_tiles, hq),
        grid_names=("tile", "head"),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None,
    )(*common.operands(call, (q_in, k_pages, call.v_pages, k_scale, v_scale), spans, walks))
    return out[:t_total]
