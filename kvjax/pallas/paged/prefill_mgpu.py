"""Head-wise paged attention, prefill / extend path, as a Mosaic GPU kernel (Hopper: TMA page copies, wgmma).

Same contract and tile map as :mod:`kvjax.pallas.paged.prefill` (the Pallas Triton kernel), built the
FlashAttention-3 way. The work is one item per (query tile of up to 128 tokens of one row, query head), walked by
persistent CTAs (``programs``, one per SM by default). Each CTA runs three warpgroups: two consumers own 64 query
tokens each, one producer streams each item's K/V walk (the virtual page list of :mod:`kvjax.pallas.paged.common`:
sink pages, then window pages) into a ring of 128-key shared-memory slots, one TMA copy per page (a slot holds one
page of 128 or two consecutive walk pages of 64), reading each page id from the block table. A ``-1`` entry is
never copied: a slot half whose page is a hole (or past the walk) gets a copy of the slot's other page, whose keys
there are never visible; a slot with no page at all is only signalled, and every consumer skips it. The consumers
alternate their tensor-core products (a schedule barrier), so one warpgroup's softmax overlaps the other's
``QK^T`` / ``PV``; ``PV`` accumulates into the running accumulator, and the wait for the next K slot overlaps it.

Per slot and consumer a run-time test picks one of three paths: *skip* (no key of the slot is visible to the
warpgroup's tokens: holes, the causal future, pages only the other warpgroup's window needs), *full* (every
key is visible to every token: no mask), or *masked* (causal / window / sink mask per element, keys placed by
their page). Every consumer still waits on and releases every slot, so the barrier phases stay in step.

The schedule (HISTORY.md, runs 140-143: on an H100 at T=4096, H=32, D=128, 1.07x cuDNN at pages of 128 and 1.03x at
64, where the one-CTA-per-item kernel it replaced ran at 0.97x and 0.94x; this kernel in run 151: 1.05x and 1.03x):

- *Persistent programs*: program ``p`` of ``n`` takes item ``p`` of even rounds and ``n - 1 - p`` of odd ones, the
  tiles ordered with tokens last to first (a row's longest walks first), empty ones last. The producer runs one
  ring walk over all of a program's items, so the next item's first slots load while the consumers finish the
  current one. A consumer whose box is full and starts at a multiple of 8 rows of ``o`` copies the next item's q box
  into its staging rows as soon as it has swizzled the current one, and writes its output through its q tile (free
  by then); any other box leaves through the staging rows, and the next box is then copied when its item starts
  (always so over fp8 pages, whose q tiles are e4m3). The 8 rows: a TMA store from the swizzled tile views ``o``'s
  rows as (row // 8, row % 8) and starts its box of 8 at ``x0 % 8`` there, so the last ``x0 % 8`` rows of every 8
  fall out of bounds and are never written; this (not their holes) made rows 1 and 2 of the GPU grid batch wrong
  (HISTORY run 150: their full boxes start at rows 1 and 301, and the unwritten rows of ``o`` kept stale memory;
  run 151: with this rule every row of that batch is right).
  What a CTA per item pays (launch, barrier setup, the first page and q loads, the last store's wait:
  idle time at each CTA's start and end, with only one CTA per SM at 192 KiB of shared memory) overlaps the
  previous item instead.
- *Split release*: the producer refills a slot's K pages once both consumers released its K (after ``q K^T``) and
  its V pages once they released its V (after ``P V``), as JAX's ``attention_mgpu`` does, so the next K lands
  while V is still read.
- *Per-step mask iotas*: the masked path's position grids are computed in each masked step rather than kept live
  over the walk, which frees the registers they held (the consumers get 232 registers a thread, the producer 40;
  over fp8 pages 224 and 56).

Deleted after the same runs: a CTA per item, K and V refilled together, hoisted mask iotas, FlashAttention-3's
intra-warpgroup overlap of the unmasked steps, an optimization barrier before ``P V`` and a (240, 24) register
split (slower, or no faster). The kernel always lowers with Mosaic GPU's Lane semantics (jax 0.10's default):
jax 0.11.2's default, the Warpgroup lowering, refuses it (``AssertionError: Shaped arrays must be represented by
ir.Values, got: 0`` in a ``mgpu.fori`` body, and ``assert len(op.indices) == len(multiple)`` in the layout
inference's ``_check_unsatisfiable_divisibility_constraints`` for the persistent walk).

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
f16) for ``P V`` in f16, accumulating in f32, 64 keys at a time (one wgmma-layout tile: 16 e4m3 and 32 f16 registers
a thread). The producer warpgroup converts each slot (two tiles) into two shared f16 buffers (64 KiB with
head_dim 128: 192 KiB of shared memory at 2 stages, 224 KiB at 3) used in turn, after issuing the next step's TMA
copies (the ring stays ahead); it releases the V slot itself (a V-free barrier of one arrival) and signals a "V
converted" barrier (one arrival per buffer); the consumers wait on it before ``P V`` (skipping or not) and release
the buffer after it (a "V16 free" barrier, one arrival per consumer), which the producer waits on before converting
into it again. A hole-only slot is converted too (stale bytes no consumer reads), so every phase stays in step. No
wait cycle: the consumers' step ``g`` needs K(g) loaded and V16(g) converted, which the producer does by its
iterations ``g`` and ``g + 1``; iteration ``g + 1`` waits on the K / V slot releases of step ``g + 1 - stages`` (the
V one its own, so ``stages >= 2``) and on the buffer release of step ``g - 2``. Registers (224, 56) over fp8 pages:
the producer holds up to one tile (48 registers) while converting, the consumers none. The consumers converting V
themselves (each its half of the slot while its ``q K^T`` ran, then waiting for the other's half; or each all of it
into its own buffer) were measured slower, 1.22-1.35x and 1.40-1.66x the producer's time, and are deleted (HISTORY
run 152).

The value scales reach the probabilities relative to a running reference scale (the largest value scale
of the walk so far, a power of two like them, so a probability is never multiplied by a tiny scale before its f16
cast), the accumulator being kept in units of that reference and rescaled, exactly, when it grows. No scale costs
an elementwise pass over a tile: each page of a slot (its column half at pages of 64) is a register slice of the
logits, its key scale joins the row's q scale and the softmax scale in one factor per row, and its value scale
``c`` enters the exponent (``p c = exp2(x f - m + log2 c)``; the row sum adds ``(p c) / c`` per page); ``P V`` runs
one product per page. Multiplying the logit and probability tiles by per-column scales instead cost 8-9% of the
kernel (HISTORY run 159). The backend
table takes this path for fp8 pages where the shapes allow it. A third form, converting K and V to f16 in each
consumer with f16 products, was as exact as ``"e4m3x2_qk"`` and 1.27-1.31x slower; it is deleted (HISTORY.md).

The interpreter runs each warpgroup as a computation on XLA's CPU thread pool and blocks those
threads in barrier waits, so it needs a pool of at least ``mgpu_common.INTERPRET_MIN_THREADS`` threads (the pool
is sized by the ``NPROC`` environment variable, else the CPU count, when JAX creates its CPU client; with 2 it can
deadlock). There, and off a GPU, ``programs`` defaults to :data:`INTERPRET_PROGRAMS` (2) persistent CTAs.

It is the ``"mosaic"`` backend of ``kvjax.ops.paged_attention``, first choice on Hopper where :func:`unsupported`
accepts the call: those shapes and on average at least one 64-token box of queries per row (``T >= 64 B``: rows
of a few tokens would waste most of a tile). Speed against cuDNN: benchmarks/RESULTS.md, "Paged attention
prefill".
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.base.device import current_device
from kvjax.base.fp8 import FP8_DTYPE
from kvjax.pallas.paged import common
from kvjax.pallas.mgpu_common import SWIZZLE, cast, interpret_params, iota, swizzled

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
_REGISTERS = (232, 40)  # setmaxnreg of each consumer and of the producer warpgroup (256 c + 128 p <= 65536)
_FP8_REGISTERS = (224, 56)  # fp8 pages: the producer converts V (2 x 128 x 224 + 128 x 56 <= 65536)
_CONVERT_KEYS = 64  # keys of V converted at a time (one 64-row wgmma-layout tile: 16 e4m3 + 32 f16 registers)
INTERPRET_PROGRAMS = 2  # the default persistent programs in the interpreter and off a GPU (module doc)
_ROW_TILE = 8  # o's rows per tile of a TMA store from a swizzled tile: such a store must start at a multiple of it


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


class _Item(NamedTuple):
    """One (query tile, query head) of the work, i32[] each: the tile's tokens, its KV head and page walk."""

    head: jax.Array
    kvh: jax.Array  # the head's KV head
    tok0: jax.Array  # first token of the tile (a row of q / o)
    n_tok: jax.Array  # tokens of the tile (0: nothing to read or write)
    i0: jax.Array  # position of its first token
    lo: jax.Array  # the walk (common.walk_at): first window page, sink pages, pages
    n_sink: jax.Array
    n_pages: jax.Array
    w: jax.Array  # window of the KV head (0: full)
    sk: jax.Array  # its sink tokens
    bt_base: jax.Array  # offset of the (row, KV head)'s block table in the flat table
    n_steps: jax.Array  # ring slots of the walk


def _kernel(
    *refs,  # common.operands (q [T, Hq, D] with T >= 64, K / V pages [P, page_size, D] in q's dtype or
    #         float8_e4m3fn; spans: row, first token, length, first position i32[NT] per tile, heaviest tiles
    #         first), then o_ref [T, Hq, D] and the scratch: smem (q tiles (swizzled; e4m3 q: q_parts per
    #         consumer), q / out staging (plain rows), K ring, V ring[, two f16 V buffers (fp8 pages)]), full
    #         barriers (K slot loaded, V slot loaded, q staged: a slot takes one arrival per page), free barriers
    #         (K slot free: one arrival per consumer; V slot free: one per consumer, fp8 pages: the producer's), the
    #         consumer schedule barrier[, fp8 pages: V buffer converted (by the producer), V buffer free (one arrival
    #         per consumer)]
    scale: float,
    group: int,
    page_size: int,
    max_blocks: int,
    num_kv_heads: int,
    stages: int,
    fp8: bool,
    q_parts: int,
    programs: int,
    interpret: bool,
):
    (q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref), tile_refs, walk, rest = common.kernel_refs(refs, num_spans=4)
    tile_row_ref, tile_tok_ref, tile_len_ref, tile_pos_ref = tile_refs
    # v_conv: fp8 pages [V buffer converted, V buffer free]; bf16 / f16 pages []
    o_ref, smem, full_barriers, free_barriers, sched, *v_conv = rest
    q_smem, io_smem, k_smem, v_smem, *kv16_smem = smem
    k_full, v_full, q_full = full_barriers
    k_free, v_free = free_barriers
    wg = lax.axis_index("wg")
    num_tiles = tile_row_ref.shape[0]
    num_tokens, hq, head_dim = q_ref.shape
    dtype = jnp.float16 if fp8 else q_smem.dtype  # the P V operands: q's dtype, f16 over fp8 pages
    out_dtype = io_smem.dtype
    per_slot = BLOCK_K // page_size  # pages per slot
    out_from_q = not fp8  # full boxes leave through the q tile, so q can be copied a tile ahead
    num_items = num_tiles * hq
    rounds = -(-num_items // programs)
    prog = lax.axis_index("prog")

    def round_item(r) -> _Item:  # program p takes item p of even rounds and item n - 1 - p of odd ones
        idx = r * programs + jnp.where(lax.rem(r, 2) == 0, prog, programs - 1 - prog)
        live = idx < num_items
        idx = jnp.minimum(idx, num_items - 1)
        tile, head = lax.div(idx, jnp.int32(hq)), lax.rem(idx, jnp.int32(hq))
        kvh = lax.div(head, jnp.int32(group))
        lo, n_sink, n_pages, w, sk = common.walk_at(walk, tile * num_kv_heads + kvh, kvh)
        n_tok, n_pages = jnp.where(live, tile_len_ref[tile], 0), jnp.where(live, n_pages, 0)
        bt_base = (tile_row_ref[tile] * num_kv_heads + kvh) * max_blocks
        n_steps = lax.div(n_pages + per_slot - 1, jnp.int32(per_slot))
        return _Item(head, kvh, tile_tok_ref[tile], n_tok, tile_pos_ref[tile], lo, n_sink, n_pages, w, sk, bt_base,
                     n_steps)

    def page_at(it: _Item, s):  # (first key position, page id or -1) of virtual page s; -1 for a hole and past the walk
        col = lax.select(s < it.n_sink, s, it.lo + s - it.n_sink)
        page = bt_ref[it.bt_base + jnp.minimum(col, max_blocks - 1)]
        return col * page_size, jnp.where(s < it.n_pages, page, -1)

    def page_scale(ref, page):  # f32 scale of an fp8 page; 0 for a hole (never read)
        return jnp.where(page >= 0, ref[jnp.maximum(page, 0)], 0.0)

    def sync_schedule():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    def convert_v(pairs):  # fp8: e4m3 V rows as f16 into shared memory; pairs of 64-row refs (e4m3 src, f16 dst)
        for src, dst in pairs:
            if interpret:
                dst[...] = src[...].astype(jnp.float16)
            else:
                xv = plgpu.load(src, (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
                dst[...] = plgpu.layout_cast(xv.astype(jnp.float16), plgpu.Layout.WGMMA)
        if not interpret:
            plgpu.commit_smem()

    def v_slot_rows(slot, buf):  # the V slot's rows and their f16 destination, _CONVERT_KEYS at a time
        return [(v_smem.at[slot, pl.ds(k0, _CONVERT_KEYS)], kv16_smem[0].at[buf, pl.ds(k0, _CONVERT_KEYS)])
                for k0 in range(0, BLOCK_K, _CONVERT_KEYS)]

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    stage = io_smem.at[wg]  # a consumer's q / out staging rows

    def box(it: _Item):  # the warpgroup's tokens of item it: (rows, first row x, 64-row box at x0 inside q)
        first = wg * BLOCK_Q  # first token of this warpgroup inside the tile
        n_rows = jnp.clip(it.n_tok - first, 0, BLOCK_Q)
        x = it.tok0 + first  # rows [x, x + n_rows) of q / o
        return n_rows, x, jnp.minimum(x, num_tokens - BLOCK_Q)

    def through_q(n_rows, x0):  # whether a box can leave through its q tile (out_from_q): full, 8-row aligned
        return (n_rows == BLOCK_Q) & (lax.rem(x0, jnp.int32(_ROW_TILE)) == 0)

    def copy_q(it: _Item, x0):
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(x0, BLOCK_Q), it.head], stage, q_full.at[wg])

    def consume(it: _Item, g0, q_copied, nxt: _Item):
        """The consumer's part of item ``it``; its ring steps are ``g0 ..`` of the program's walk. ``q_copied``: its
        q box was copied ahead (with the last item). Returns whether the next item ``nxt``'s box is being copied."""
        n_rows, x, x0 = box(it)
        r0 = x - x0  # the warpgroup's tokens sit at rows [r0, r0 + n_rows) of the box
        pa = it.i0 + wg * BLOCK_Q  # positions [pa, pb] of the warpgroup's tokens
        pb = pa + n_rows - 1
        w, sk = it.w, it.sk
        n_steps = it.n_steps

        def load_q():  # q rows at any offset: a plain-row TMA copy, then swizzled for wgmma through registers
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's output has left its buffer
            pl.when(q_copied == 0)(lambda: copy_q(it, x0))
            plgpu.barrier_wait(q_full.at[wg])
            if interpret:
                q_rows = stage[...]
            else:
                q_rows = plgpu.load(stage, (), layout=plgpu.Layout.WGMMA, optimized=False)
            if fp8:  # e4m3 tiles q = s (h + l): h = e4m3(q / s), l = e4m3(q / s - h) (q_parts 2); s per row
                xf = q_rows.astype(jnp.float32)
                q_scale, inv = q_row_scales(jnp.abs(xf).max(axis=1))
                y = xf * lax.broadcast_in_dim(inv, xf.shape, [0])
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
        copying = jnp.int32(0)
        via_q = through_q(n_rows, x0)
        if out_from_q:  # the staging rows are free until this item's end: the next item's q box lands there
            n_next, _, x0_next = box(nxt)
            copying = (via_q & (n_next > 0)).astype(jnp.int32)
            pl.when(copying == 1)(lambda: copy_q(nxt, x0_next))

        def mask_iotas():  # (position of each box row, key column of the slot)
            return (pa - r0) + iota((BLOCK_Q, BLOCK_K), 0, interpret), iota((BLOCK_Q, BLOCK_K), 1, interpret)

        qk_scale = scale * _LOG2E

        def wait_next_k(j):  # every consumer waits each K phase once, one step ahead (overlaps PV)
            @pl.when(j + 1 < n_steps)
            def _():
                plgpu.barrier_wait(k_full.at[lax.rem(g0 + j + 1, jnp.int32(stages))])

        def wait_v16(buf):  # fp8: the f16 V operand of P V, once the producer converted it
            plgpu.barrier_wait(v_conv[0].at[buf])
            return kv16_smem[0].at[buf]

        def softmax(qk, m_i, l_i):  # the online softmax's step: (m, alpha, p, l) after the logits qk
            m_new = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_use, qk.shape, [0]))
            return m_new, alpha, p, l_i * alpha + p.sum(axis=1)

        def fp8_softmax(qk, m_i, l_i, v_ref, pages):
            """The online softmax's step over fp8 pages: ``(m, alpha, [p16 per page], l, [v_ref])``. Each page's
            logits are its column half of ``qk`` times ``f = q_scale * k_scale * qk_scale`` per row; each page's
            value scale relative to the running reference (``c = v_scale / ref``, module doc) enters the exponent
            (``p c = exp2(x - m + log2 c)``), so the only elementwise work is the softmax's own; ``l`` sums
            ``p = (p c) / c`` per page. ``alpha`` rescales the accumulator (kept in units of the reference) too."""
            k_scales = [page_scale(ks_ref, page) for page in pages]
            v_scales = [page_scale(vs_ref, page) for page in pages]
            ref_new = functools.reduce(jnp.maximum, v_scales, v_ref)
            ref_safe = jnp.where(ref_new > 0, ref_new, 1.0)
            width = BLOCK_K // per_slot
            parts = [qk] if per_slot == 1 else [qk[:, i * width:(i + 1) * width] for i in range(per_slot)]
            f = [q_scale * (jnp.where(ks > 0, ks, 1.0) * qk_scale) for ks in k_scales]  # f32[BLOCK_Q]: holes masked
            row_max = functools.reduce(jnp.maximum, [x.max(axis=1) * fi for x, fi in zip(parts, f)])
            m_new = jnp.maximum(m_i, row_max)
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet
            alpha = jnp.exp2(m_i - m_use)
            l_new, p16 = l_i * alpha, []
            for x, fi, vs in zip(parts, f, v_scales):
                c = jnp.where(vs > 0, vs / ref_safe, 1.0)  # a hole's columns are masked: any c
                bias = m_use - jnp.log2(lax.broadcast_in_dim(c, m_use.shape, []))
                pc = jnp.exp2(x * lax.broadcast_in_dim(fi, x.shape, [0]) - lax.broadcast_in_dim(bias, x.shape, [0]))
                l_new = l_new + pc.sum(axis=1) / c
                p16.append(pc.astype(dtype))
            return m_new, alpha * (v_ref / ref_safe), p16, l_new, [ref_new]

        def step(j, carry):
            slot = lax.rem(g0 + j, jnp.int32(stages))
            buf = lax.rem(g0 + j, jnp.int32(_V16_BUFFERS))
            k0s, needs, fulls, pages = [], [], [], []
            for i in range(per_slot):
                k0, page = page_at(it, j * per_slot + i)
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

                def qk_product(acc_ref):  # fp8: e4m3 x e4m3 straight from the ring
                    for part in range(max(q_parts, 1)):
                        plgpu.wgmma(acc_ref, q_smem.at[wg * max(q_parts, 1) + part], plgpu.transpose_ref(k_op, (1, 0)))
                    sync_schedule()
                    return acc_ref[...]

                if interpret:  # the interpreter has no transposed wgmma operand: the same product in jnp
                    if fp8:
                        q_rows = sum(q_smem[wg * q_parts + part].astype(jnp.float32) for part in range(q_parts))
                        qk = jnp.dot(q_rows, k_op[...].astype(jnp.float32).T, preferred_element_type=jnp.float32)
                    else:
                        qk = jnp.dot(q_smem[wg], k_op[...].T, preferred_element_type=jnp.float32)
                    sync_schedule()
                else:
                    qk = pl.run_scoped(qk_product, plgpu.ACC((BLOCK_Q, BLOCK_K), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])

                def mask(s):
                    qpos, kcol = mask_iotas()
                    kpos = kcol + k0s[0]
                    if per_slot == 2:
                        kpos = kcol + jnp.where(kcol < page_size, k0s[0], k0s[1] - page_size)
                    diff = qpos - kpos
                    vis = (diff >= 0) & ((w == 0) | (diff < w) | (kpos < sk))
                    return jnp.where(vis, s, -jnp.inf)

                qk = lax.cond(full, lambda s: s, mask, qk)
                if fp8:  # the scales folded into the exponent, one page (a column half of the slot) at a time
                    m_new, alpha, p16, l_i, v_ref = fp8_softmax(qk, m_i, l_i, v_ref[0], pages)
                else:
                    m_new, alpha, p, l_i = softmax(qk, m_i, l_i)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if not fp8:
                    p16 = [p.astype(dtype)]
                plgpu.barrier_arrive(sched)
                if fp8:  # the f16 V converted
                    v_op = wait_v16(buf)
                else:
                    plgpu.barrier_wait(v_full.at[slot])
                    v_op = v_smem.at[slot]
                plgpu.barrier_wait(sched)

                width = BLOCK_K // len(p16)  # keys of each P part (a page of the slot over fp8 pages)
                if interpret:  # the interpreter's wgmma takes no register operand and has no run_state
                    for i, part in enumerate(p16):
                        v_rows = v_op[...] if len(p16) == 1 else v_op[i * width:(i + 1) * width]
                        acc = acc + jnp.dot(part, v_rows, preferred_element_type=jnp.float32)
                    wait_next_k(j)
                else:
                    def pv_product(acc_ref):  # accumulates into the running accumulator
                        for i, part in enumerate(p16):
                            plgpu.wgmma(acc_ref, part, v_op if len(p16) == 1 else v_op.at[pl.ds(i * width, width)])
                        wait_next_k(j)

                    acc = pl.run_state(pv_product)(plgpu.ACC.init(acc))
                if fp8:  # P V has finished reading the f16 buffer (the wgmma wait that ends pl.run_state)
                    plgpu.barrier_arrive(v_conv[1].at[buf])
                else:
                    plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i, *v_ref

            def skip(carry):  # every barrier phase of compute, in the same order
                plgpu.barrier_arrive(k_free.at[slot])
                sync_schedule()
                if fp8:
                    wait_v16(buf)
                else:
                    plgpu.barrier_wait(v_full.at[slot])
                sync_schedule()
                wait_next_k(j)
                if fp8:
                    plgpu.barrier_arrive(v_conv[1].at[buf])
                else:
                    plgpu.barrier_arrive(v_free.at[slot])
                return carry

            return lax.cond(needed, compute, skip, carry)

        m_i = cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row_layout, interpret)
        l_i = cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32), row_layout, interpret)
        acc = cast(jnp.full((BLOCK_Q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)
        v_ref = [jnp.float32(0.0)] if fp8 else []  # fp8: the largest value scale so far (the accumulator's unit)

        @pl.when(n_steps > 0)
        def _():
            plgpu.barrier_wait(k_full.at[lax.rem(g0, jnp.int32(stages))])

        pl.when(wg == 1)(sync_schedule)  # warpgroup 0 issues its products first
        acc, m_i, l_i, *v_ref = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i, *v_ref))
        pl.when(wg == 0)(sync_schedule)
        l_safe = jnp.where(l_i > 0, l_i, 1.0)  # tokens that see no key (padding spans) get 0
        if fp8:
            l_safe = l_safe / v_ref[0]  # l_i > 0 implies a visited page, so a reference scale > 0
        out = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(out_dtype)

        def write_staged():  # exactly the warpgroup's rows: one 64-row copy, or two overlapping copies of 2^k rows
            stage[...] = out
            plgpu.commit_smem()

            @pl.when(n_rows == BLOCK_Q)
            def _():
                plgpu.copy_smem_to_gmem(stage, o_ref.at[pl.ds(x0, BLOCK_Q), it.head])

            rows = BLOCK_Q // 2
            while rows:
                @pl.when((n_rows >= rows) & (n_rows < 2 * rows))
                def _(rows=rows):
                    for off in (0, n_rows - rows):
                        plgpu.copy_smem_to_gmem(stage.at[pl.ds(r0 + off, rows)],
                                                o_ref.at[pl.ds(x + off, rows), it.head])

                rows //= 2

        def write_from_q():  # a full box at a multiple of 8 rows through the (free) q tile, while the next box lands
            # in the staging rows
            q_smem.at[wg][...] = out
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[pl.ds(x0, BLOCK_Q), it.head])

        if out_from_q:
            pl.when(via_q)(write_from_q)
            pl.when((n_rows > 0) & jnp.logical_not(via_q))(write_staged)
        else:
            pl.when(n_rows > 0)(write_staged)
        return copying

    registers = _FP8_REGISTERS if fp8 else _REGISTERS

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(registers[0], action="increase")

        def item(r, carry):
            g0, q_copied = carry
            it = round_item(r)
            return g0 + it.n_steps, consume(it, g0, q_copied, round_item(r + 1))

        lax.fori_loop(0, rounds, item, (jnp.int32(0), jnp.int32(0)))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(registers[1], action="decrease")

        def slot_sources(it: _Item, j):
            # a slot half whose page is a hole or past the walk gets a copy of the other half's page (finite data,
            # never visible), so that every slot takes the same bytes; a slot with no page is only signalled
            pages = [page_at(it, j * per_slot + i)[1] for i in range(per_slot)]
            return [functools.reduce(lambda a, o: jnp.where(a >= 0, a, o), pages[i:] + pages[:i])
                    for i in range(per_slot)]

        def fill(srcs, slot, gmem, ring, full):  # copy the slot's pages from gmem into the ring's slot
            @pl.when(srcs[0] >= 0)
            def _():
                for i, src in enumerate(srcs):
                    plgpu.copy_gmem_to_smem(gmem.at[src], ring.at[slot, pl.ds(i * page_size, page_size)],
                                            full.at[slot])

            @pl.when(srcs[0] < 0)
            def _():  # only holes: the slot is signalled, nothing is read
                for _ in range(per_slot):
                    plgpu.barrier_arrive(full.at[slot])

        def walk(it: _Item, g0):  # the item's steps are steps g0 .. of the program's ring walk; returns the next
            @pl.loop(0, it.n_steps)
            def _(j):
                g = g0 + j
                slot = lax.rem(g, jnp.int32(stages))
                srcs = slot_sources(it, j)
                for kind in ((k_ref, k_smem, k_full, k_free), (v_ref, v_smem, v_full, v_free)):  # split release
                    @pl.when(g >= stages)  # step g - stages released the slot's K (V): refill it
                    def _(free=kind[3]):
                        plgpu.barrier_wait(free.at[slot])

                    fill(srcs, slot, *kind[:3])

                if fp8:  # step g's copies are issued: convert the step before (the ring stays ahead)
                    pl.when(g >= 1)(lambda: convert_step(g - 1))

            return g0 + it.n_steps

        def convert_step(g):  # fp8: step g's V slot into f16 buffer g % 2 (module doc); no wait
            # cycle: the consumers' step g needs K(g) loaded (issued by iteration g) and V16(g) converted (by
            # iteration g + 1, or after the walk for the last step); iteration g + 1 waits on the K and V slot
            # releases of step g + 1 - stages <= g - 1 (K: the consumers' q K^T; V: this warpgroup's own conversion,
            # done by iteration g + 2 - stages <= g, hence stages >= 2) and on the V16 buffer release of step
            # g - 2 (the consumers' P V), all of steps the consumers finish before step g. So the order
            # P(0) P(1) C(0) P(2) C(1) .. P(g + 1) C(g) .. meets every wait (P: producer iteration, C: consumer step;
            # the two consumers' schedule barrier only pairs their equal steps). A hole-only slot is converted too
            # (stale bytes, never read: both consumers skip it), so every phase stays in step.
            slot, buf = lax.rem(g, jnp.int32(stages)), lax.rem(g, jnp.int32(_V16_BUFFERS))

            @pl.when(g >= _V16_BUFFERS)
            def _():  # both consumers' P V of step g - 2 read the buffer
                plgpu.barrier_wait(v_conv[1].at[buf])

            plgpu.barrier_wait(v_full.at[slot])
            convert_v(v_slot_rows(slot, buf))
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(v_conv[0].at[buf])

        def drain(total):  # the last releases, so every phase of the free barriers is observed
            if fp8:
                pl.when(total >= 1)(lambda: convert_step(total - 1))

            @pl.loop(jnp.maximum(total - stages, 0), total)
            def _(g):
                for free in (k_free, v_free):
                    plgpu.barrier_wait(free.at[lax.rem(g, jnp.int32(stages))])

            if fp8:
                @pl.loop(jnp.maximum(total - _V16_BUFFERS, 0), total)
                def _(g):
                    plgpu.barrier_wait(v_conv[1].at[lax.rem(g, jnp.int32(_V16_BUFFERS))])

        drain(lax.fori_loop(0, rounds, lambda r, g0: walk(round_item(r), g0), jnp.int32(0)))



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


def default_programs(num_items: int, interpret: bool = False) -> int:
    """The persistent programs ``paged_prefill_mgpu`` launches when not told: one per SM of the default device
    (``jax.Device.core_count``), :data:`INTERPRET_PROGRAMS` in the interpreter and off a GPU; never more than
    ``num_items`` (query tiles x query heads)."""
    device = current_device()
    n = device.num_sms if device.platform == "gpu" and not interpret else INTERPRET_PROGRAMS
    return max(1, min(n, num_items))


@functools.partial(jax.jit, static_argnames=("stages", "programs", "fp8_products", "auto_barriers", "interpret"))
def paged_prefill_mgpu(
    call,  # kvjax.ops.attention.PagedAttentionCall (checked by the op)
    *,
    stages: int | None = None,
    programs: int | None = None,
    fp8_products: str = "e4m3x2_qk",
    auto_barriers: bool = False,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D] in q's dtype
    """Ragged causal paged attention (any batch) as a Mosaic GPU kernel; same contract as
    :func:`kvjax.pallas.paged.prefill.paged_prefill`, except that a page's unwritten tail is read (it must hold
    finite values, see the module doc). fp8 pages read as ``page * scale`` (module doc).
    ``stages``: shared-memory slots of 128 keys (default 2; at least 2 over fp8 pages). ``programs``: persistent
    CTAs walking the (query tile, query head) items (default :func:`default_programs`: one per SM on a GPU, 2 in the
    interpreter; more than the items leaves some idle); a value other than the default compiles under its own kernel
    name. ``fp8_products``
    (fp8 pages only, module doc): ``"e4m3x2_qk"`` (q as two e4m3 tiles, ``q K^T`` on e4m3 tensor cores, V converted
    to f16 once per slot by the producer warpgroup) or ``"e4m3_qk"`` (q rounded to one e4m3 tile).
    ``auto_barriers``: Pallas's automatic warpgroup barriers around every shared-memory store and copy issue (off:
    the kernel orders its own accesses: a staged q box is read before the ``commit_smem`` that precedes the next
    box's copy into the same rows, an output tile is rewritten only after ``wait_smem_to_gmem``, the producer's
    V conversion ends in ``commit_smem`` before its release arrives, and every ring slot is refilled only after the
    mbarrier arrives of its readers; the same bits on the GPU, fp8 pages 1.01-1.02x faster). ``interpret`` runs the
    Mosaic GPU interpreter on the CPU. Reads only; tokens of no row get 0. ``ValueError`` for what
    :func:`shape_reason` rejects, for ``stages`` or ``programs`` below 1, for ``stages`` below 2 over fp8 pages and
    for an unknown ``fp8_products``.
    """
    q, k_pages = call.q, call.k_pages
    t_total, hq, d = q.shape
    page_size = call.page_size
    reason = shape_reason(call)
    if reason:
        raise ValueError(f"paged_prefill_mgpu {reason}")
    fp8, k_scale, v_scale = common.page_scales(call)
    stages = 2 if stages is None else stages
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be None or a positive int, got {programs!r}")
    if fp8_products not in FP8_PRODUCTS:
        raise ValueError(f"fp8_products must be one of {FP8_PRODUCTS}, got {fp8_products!r}")
    if fp8 and stages < 2:  # the producer converts V: it releases a V slot itself (module doc)
        raise ValueError(f"fp8 pages need stages >= 2 (the producer converts V), got {stages}")
    q_parts = _Q_PARTS[fp8_products] if fp8 else 0
    spans, walks = common.tile_walks(call, TILE_TOKENS)
    num_tiles = spans[0].shape[0]
    default = default_programs(num_tiles * hq, interpret)
    programs = programs or default
    tile = jnp.arange(num_tiles, dtype=jnp.int32)  # the programs take the tiles in this order: the tiles with tokens
    n_live = jnp.sum(spans[2] > 0, dtype=jnp.int32)  # last to first (each row's longest walks first), then the empty
    order = jnp.where(tile < n_live, n_live - 1 - tile, tile)  # ones
    spans, walks = tuple(x[order] for x in spans), tuple(x[order] for x in walks)
    dtype = jnp.float16 if fp8 else q.dtype  # the products' operands
    tiled = swizzled(dtype)
    ring_swizzle = min(SWIZZLE, d * k_pages.dtype.itemsize)  # fp8 rows of 64 values: 64-byte swizzle
    ring = (plgpu.TilingTransform((8, ring_swizzle // k_pages.dtype.itemsize)), plgpu.SwizzleTransform(ring_swizzle))
    per_slot = BLOCK_K // page_size
    if q_parts:  # e4m3 q tiles; two f16 V buffers, used in turn
        q_tiles = plgpu.SMEM((_CONSUMERS * q_parts, BLOCK_Q, d), FP8_DTYPE, transforms=ring)
        kv16 = [plgpu.SMEM((_V16_BUFFERS, BLOCK_K, d), dtype, transforms=tiled)]
    else:
        q_tiles = plgpu.SMEM((_CONSUMERS, BLOCK_Q, d), dtype, transforms=tiled)
        kv16 = []
    v_barriers = [  # fp8 pages: V buffer converted (by the producer), V buffer free (after both consumers' P V)
        plgpu.Barrier(num_arrivals=1, num_barriers=_V16_BUFFERS),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=_V16_BUFFERS),
    ] if q_parts else []
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
        (  # K slot free (one arrival per consumer), V slot free (per consumer; fp8 pages: the producer's)
            plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1 if fp8 else _CONSUMERS, num_barriers=stages),
        ),
        plgpu.Barrier(num_arrivals=_CONSUMERS),
        *v_barriers,
    )
    kernel = functools.partial(
        _kernel, scale=call.scale, group=hq // call.num_kv_heads, page_size=page_size, max_blocks=call.max_blocks,
        num_kv_heads=call.num_kv_heads, stages=stages, fp8=fp8, q_parts=q_parts,
        programs=programs, interpret=interpret,
    )
    # Lane semantics: jax 0.11's default (Warpgroup) lowering refuses this kernel (module doc)
    params = plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  unsafe_no_auto_barriers=not auto_barriers)
    name = (f"kvjax_paged_prefill_mgpu_{jnp.dtype(k_pages.dtype).name}{'_' + fp8_products if fp8 else ''}"
            f"_page{page_size}_d{d}_s{stages}{f'_p{programs}' if programs != default else ''}"
            f"{'_autobar' if auto_barriers else ''}")
    # a box fits, and T is a multiple of 8: a full box leaves through the swizzled q tile, whose TMA store tiles
    # o's rows by 8 (Mosaic GPU refuses the copy otherwise: HISTORY run 146)
    t_in = max(BLOCK_Q, -(-t_total // 8) * 8)
    q_in = q if t_in == t_total else jnp.pad(q, ((0, t_in - t_total), (0, 0), (0, 0)))
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
        scratch_types=scratch,
        grid=(programs,),
        grid_names=("prog",),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        kernel_name=name,
        compiler_params=params,
        interpret=interpret_params() if interpret else None,
    )(*common.operands(call, (q_in, k_pages, call.v_pages, k_scale, v_scale), spans, walks))
    return out[:t_total]
