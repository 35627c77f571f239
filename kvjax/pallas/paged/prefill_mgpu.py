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

Variants (:class:`Variant`, ``paged_prefill_mgpu(call, variant=...)``; each compiles under its own kernel name; the
default is the kernel RESULTS.md measures). *Persistent programs* (``programs=n``): ``n`` CTAs (one per SM) walk the
(tile, head) items in rounds, program ``p`` taking item ``p`` of even rounds and ``n - 1 - p`` of odd ones, the tiles
ordered with tokens last to first (a row's longest walks first), empty ones last. The producer runs one ring walk
over all of a program's items, so the next item's first slots load while the consumers finish the current one; a
consumer copies the next item's q box into its staging rows as soon as it has swizzled the current one, and writes a
full 64-row output box through its q tile (free by then) without waiting for the copy, a ragged box through the
staging rows as before. What a one-CTA-per-item kernel pays per item (launch, barrier setup, the first page and q
loads, the last store's wait) then overlaps the previous item, where only one CTA fits an SM (192 KiB of shared
memory). *Overlap* (``overlap=True``, bf16 / f16 pages): FlashAttention-3's intra-warpgroup pipelining over the steps
of a full head's walk that every token of the warpgroup sees whole (``[0, (pa + 1) // 128)``, up to the first hole:
no mask, no skip): step ``j`` issues ``q K_j^T`` and step ``j - 1``'s ``P V`` together, waits for the first only,
runs its softmax while ``P V`` is in flight, then rescales the accumulator; step 0 has no ``P V`` and the last one's
follows the range; the rest of the walk (diagonal, window edges, holes) takes the plain steps. Each step keeps its
two schedule barriers, so the consumers stay paired whatever mix of steps each runs. ``P V`` of step ``j - 1`` now
releases its V slot during step ``j``, after the wait for ``K_{j+1}``: the producer must refill K and V on their own
releases (``split_release``, implied), or the two would wait on each other. The others: the registers of the
warpgroups (``setmaxnreg``), the lowering's semantics, the mask's position grids recomputed per masked step instead
of kept live over the walk, an ``optimization_barrier`` before ``P V``.

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

import dataclasses
import functools
import math
from typing import NamedTuple

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


_SEMANTICS = {"default": None, "lane": plgpu.LoweringSemantics.Lane, "warpgroup": plgpu.LoweringSemantics.Warpgroup}
_MASK_IOTAS = ("hoisted", "inner")


@dataclasses.dataclass(frozen=True)
class Variant:
    """The kernel's schedule knobs (module doc, "Variants"). The defaults are the kernel RESULTS.md measures.

    ``programs``: 0 launches one CTA per (query tile, query head); ``n > 0`` launches ``n`` persistent CTAs (one
    per SM: ``jax.Device.core_count``) that walk those items in rounds, heaviest tiles first. ``registers``:
    ``setmaxnreg`` of (each consumer, the producer) warpgroup, multiples of 8 in [24, 256] with
    ``256 c + 128 p <= 65536``. ``semantics``: the Mosaic GPU lowering (``"default"``: jax's own, Lane up to jax 0.10
    and Warpgroup from 0.11; ``"lane"``; ``"warpgroup"``). ``mask_iota``: where the masked path's position grids
    come from (``"hoisted"``: computed once per tile and kept live over the walk; ``"inner"``: recomputed in each
    masked step). ``pv_barrier``: an ``optimization_barrier`` over the softmax's results before the ``P V`` barriers
    (JAX's ``attention_mgpu`` ordering). ``split_release``: the producer copies a slot's K pages once both consumers
    released its K, then its V pages once they released its V (JAX's ``attention_mgpu``), instead of both once both
    are released. ``overlap`` (bf16 / f16 pages; implies ``split_release``): the unmasked steps of a full head's
    walk software-pipelined, FlashAttention-3's intra-warpgroup overlap (module doc).
    """

    programs: int = 0
    registers: tuple[int, int] = (232, 40)
    semantics: str = "default"
    mask_iota: str = "hoisted"
    pv_barrier: bool = False
    split_release: bool = False
    overlap: bool = False

    def __post_init__(self):
        c, p = self.registers
        if self.programs < 0:
            raise ValueError(f"Variant.programs must be >= 0, got {self.programs}")
        if any(r % 8 or not 24 <= r <= 256 for r in (c, p)) or 2 * 128 * c + 128 * p > 65536:
            raise ValueError(f"Variant.registers must be multiples of 8 in [24, 256] with 256 c + 128 p <= 65536, "
                             f"got {self.registers}")
        if self.semantics not in _SEMANTICS:
            raise ValueError(f"Variant.semantics must be one of {tuple(_SEMANTICS)}, got {self.semantics!r}")
        if self.mask_iota not in _MASK_IOTAS:
            raise ValueError(f"Variant.mask_iota must be one of {_MASK_IOTAS}, got {self.mask_iota!r}")

    def tag(self) -> str:
        """The knobs that differ from the defaults, as a kernel-name suffix (``""`` for the default schedule)."""
        base = Variant()
        parts = [f"p{self.programs}" if self.programs != base.programs else "",
                 "r{}_{}".format(*self.registers) if self.registers != base.registers else "",
                 self.semantics if self.semantics != base.semantics else "",
                 f"iota_{self.mask_iota}" if self.mask_iota != base.mask_iota else "",
                 "pvbar" if self.pv_barrier else "", "split" if self.split_release else "",
                 "overlap" if self.overlap else ""]
        return "".join(f"_{part}" for part in parts if part)


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
    variant: Variant,
    interpret: bool,
):
    (q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref), tile_refs, walk, rest = common.kernel_refs(refs, num_spans=4)
    tile_row_ref, tile_tok_ref, tile_len_ref, tile_pos_ref = tile_refs
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
    persistent = variant.programs > 0
    out_from_q = persistent and not fp8  # full boxes leave through the q tile, so q can be copied a tile ahead
    split = variant.split_release or variant.overlap  # the producer refills K and V on their own releases

    def item_at(tile, head, live=None) -> _Item:
        kvh = lax.div(head, jnp.int32(group))
        lo, n_sink, n_pages, w, sk = common.walk_at(walk, tile * num_kv_heads + kvh, kvh)
        n_tok = tile_len_ref[tile]
        if live is not None:
            n_tok, n_pages = jnp.where(live, n_tok, 0), jnp.where(live, n_pages, 0)
        bt_base = (tile_row_ref[tile] * num_kv_heads + kvh) * max_blocks
        n_steps = lax.div(n_pages + per_slot - 1, jnp.int32(per_slot))
        return _Item(head, kvh, tile_tok_ref[tile], n_tok, tile_pos_ref[tile], lo, n_sink, n_pages, w, sk, bt_base,
                     n_steps)

    if persistent:  # program p takes item p of even rounds and item P - 1 - p of odd ones (the tiles come heaviest
        programs = variant.programs  # first, empty last: paged_prefill_mgpu orders them)
        num_items = num_tiles * hq
        rounds = -(-num_items // programs)
        prog = lax.axis_index("prog")

        def round_item(r) -> _Item:
            idx = r * programs + jnp.where(lax.rem(r, 2) == 0, prog, programs - 1 - prog)
            live = idx < num_items
            idx = jnp.minimum(idx, num_items - 1)
            return item_at(lax.div(idx, jnp.int32(hq)), lax.rem(idx, jnp.int32(hq)), live)
    else:
        tile = lax.axis_index("tile")
        the_item = item_at(num_tiles - 1 - tile, lax.axis_index("head"))  # the last (longest-walk) tiles launch first

    def page_at(it: _Item, s):  # (first key position, page id or -1) of virtual page s; -1 for a hole and past the walk
        col = lax.select(s < it.n_sink, s, it.lo + s - it.n_sink)
        page = bt_ref[it.bt_base + jnp.minimum(col, max_blocks - 1)]
        return col * page_size, jnp.where(s < it.n_pages, page, -1)

    def page_scale(ref, page):  # f32 scale of an fp8 page; 0 for a hole (never read)
        return jnp.where(page >= 0, ref[jnp.maximum(page, 0)], 0.0)

    def sync_schedule():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    stage = io_smem.at[wg]  # a consumer's q / out staging rows

    def box(it: _Item):  # the warpgroup's tokens of item it: (rows, first row x, 64-row box at x0 inside q)
        first = wg * BLOCK_Q  # first token of this warpgroup inside the tile
        n_rows = jnp.clip(it.n_tok - first, 0, BLOCK_Q)
        x = it.tok0 + first  # rows [x, x + n_rows) of q / o
        return n_rows, x, jnp.minimum(x, num_tokens - BLOCK_Q)

    def copy_q(it: _Item, x0):
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(x0, BLOCK_Q), it.head], stage, q_full.at[wg])

    def consume(it: _Item, g0, q_copied, nxt: _Item | None):
        """The consumer's part of item ``it``; its ring steps are ``g0 ..`` of the program's walk. ``q_copied``: the
        q box was copied ahead (persistent kernels). Returns whether the next item's box is being copied."""
        n_rows, x, x0 = box(it)
        r0 = x - x0  # the warpgroup's tokens sit at rows [r0, r0 + n_rows) of the box
        pa = it.i0 + wg * BLOCK_Q  # positions [pa, pb] of the warpgroup's tokens
        pb = pa + n_rows - 1
        w, sk = it.w, it.sk
        n_steps = it.n_steps

        def load_q():  # q rows at any offset: a plain-row TMA copy, then swizzled for wgmma through registers
            if persistent:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's output has left its buffer
                pl.when(q_copied == 0)(lambda: copy_q(it, x0))
            else:
                copy_q(it, x0)
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
        if out_from_q:  # the staging rows are free until this item's end: the next item's q box lands there
            n_next, _, x0_next = box(nxt)
            copying = ((n_rows == BLOCK_Q) & (n_next > 0)).astype(jnp.int32)
            pl.when(copying == 1)(lambda: copy_q(nxt, x0_next))

        def mask_iotas():  # (position of each box row, key column of the slot)
            return (pa - r0) + iota((BLOCK_Q, BLOCK_K), 0, interpret), iota((BLOCK_Q, BLOCK_K), 1, interpret)

        hoisted = mask_iotas() if variant.mask_iota == "hoisted" else None
        qk_scale = scale * _LOG2E

        def wait_next_k(j):  # every consumer waits each K phase once, one step ahead (overlaps PV)
            @pl.when(j + 1 < n_steps)
            def _():
                plgpu.barrier_wait(k_full.at[lax.rem(g0 + j + 1, jnp.int32(stages))])

        def key_columns():
            return hoisted[1] if hoisted else iota((BLOCK_Q, BLOCK_K), 1, interpret)

        def per_column(values):  # f32[BLOCK_Q, BLOCK_K]: each key column's value of its slot half's page
            if per_slot == 1:
                return jnp.full((BLOCK_Q, BLOCK_K), values[0], jnp.float32) if interpret else values[0]
            return jnp.where(key_columns() < page_size, values[0], values[1])

        def convert_v_half(slot, buf):  # fp8: this consumer's half of the V slot as f16 into shared buffer buf
            plgpu.barrier_wait(v_full.at[slot])
            keys = pl.ds(pl.multiple_of(wg * BLOCK_Q, BLOCK_Q), BLOCK_Q)
            src, dst = v_smem.at[slot, keys], kv16_smem[0].at[buf, keys]
            if interpret:
                dst[...] = src[...].astype(dtype)
            else:
                xv = plgpu.load(src, (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
                dst[...] = plgpu.layout_cast(xv.astype(dtype), plgpu.Layout.WGMMA)
                plgpu.commit_smem()
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(v_conv[0].at[buf])

        def softmax(qk, m_i, l_i):  # the online softmax's step: (m, alpha, p, l) after the logits qk
            m_new = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_use, qk.shape, [0]))
            return m_new, alpha, p, l_i * alpha + p.sum(axis=1)

        def end_softmax(slot):  # the second schedule barrier of a step, with the wait for its V slot
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(v_full.at[slot])
            plgpu.barrier_wait(sched)

        def overlapped(carry):
            """``variant.overlap``: the steps of a full head's walk that every token of the warpgroup sees whole
            (``[0, (pa + 1) // BLOCK_K)``, up to the first hole), software-pipelined as FlashAttention-3 does: step
            j issues ``q K_j^T`` and step j - 1's ``P V`` together and runs its softmax while ``P V`` is in flight.
            Returns the carry after them (the same values as the plain loop's) and the first step they left."""
            acc, m_i, l_i = carry
            f = jnp.where((w == 0) & (n_rows > 0), jnp.clip(lax.div(pa + 1, jnp.int32(BLOCK_K)), 0, n_steps), 0)

            def whole(j):  # step j is in that range and reads no hole
                ok = j < f
                for i in range(per_slot):
                    ok = ok & (page_at(it, j * per_slot + i)[1] >= 0)
                return ok

            def qk_of(slot):  # q K^T into a scoped accumulator, the schedule barrier while it runs
                def body(s_ref):
                    plgpu.wgmma(s_ref, q_smem.at[wg], plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    sync_schedule()
                    return s_ref[...]

                return pl.run_scoped(body, plgpu.ACC((BLOCK_Q, BLOCK_K), jnp.float32))

            def first(_):  # step 0: q K^T and the softmax; its P V goes with step 1's q K^T
                slot = lax.rem(g0, jnp.int32(stages))
                if interpret:
                    qk = jnp.dot(q_smem[wg], k_smem.at[slot][...].T, preferred_element_type=jnp.float32)
                    sync_schedule()
                else:
                    qk = qk_of(slot)
                wait_next_k(jnp.int32(0))
                plgpu.barrier_arrive(k_free.at[slot])
                m_new, alpha, p, l_new = softmax(qk, m_i, l_i)
                acc_new = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                end_softmax(slot)
                return acc_new, m_new, l_new, p.astype(dtype)

            def iterate(c):  # step j: q K_j^T and P_{j-1} V_{j-1} in flight; the softmax of j meanwhile
                j, acc, m_i, l_i, p_prev = c
                slot = lax.rem(g0 + j, jnp.int32(stages))
                prev = lax.rem(g0 + j - 1, jnp.int32(stages))
                if interpret:
                    qk = jnp.dot(q_smem[wg], k_smem.at[slot][...].T, preferred_element_type=jnp.float32)
                    o = acc + jnp.dot(p_prev, v_smem.at[prev][...], preferred_element_type=jnp.float32)
                    sync_schedule()
                    wait_next_k(j)
                    plgpu.barrier_arrive(k_free.at[slot])
                    m_new, alpha, p, l_new = softmax(qk, m_i, l_i)
                    plgpu.barrier_arrive(v_free.at[prev])
                    o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
                else:
                    def body(o_ref, s_ref):
                        o_ref[...] = acc
                        plgpu.wgmma(s_ref, q_smem.at[wg], plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                        plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
                        sync_schedule()
                        wait_next_k(j)
                        qk = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # P V may still run
                        plgpu.barrier_arrive(k_free.at[slot])
                        m_new, alpha, p, l_new = softmax(qk, m_i, l_i)
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(v_free.at[prev])
                        return o_ref[...] * lax.broadcast_in_dim(alpha, acc.shape, [0]), m_new, l_new, p

                    o, m_new, l_new, p = pl.run_scoped(body, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32),
                                                       plgpu.ACC((BLOCK_Q, BLOCK_K), jnp.float32))
                end_softmax(slot)
                return j + 1, o, m_new, l_new, p.astype(dtype)

            def last_pv(acc):  # the last overlapped step's P V
                prev = lax.rem(g0 + j_end - 1, jnp.int32(stages))
                if interpret:
                    acc = acc + jnp.dot(p16, v_smem.at[prev][...], preferred_element_type=jnp.float32)
                else:
                    acc = pl.run_state(lambda o_ref: plgpu.wgmma(o_ref, p16, v_smem.at[prev]))(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[prev])
                return acc

            go = whole(jnp.int32(0))
            none = cast(jnp.zeros((BLOCK_Q, BLOCK_K), dtype), plgpu.Layout.WGMMA, interpret)
            acc, m_i, l_i, p16 = lax.cond(go, first, lambda _: (acc, m_i, l_i, none), None)
            j_end, acc, m_i, l_i, p16 = lax.while_loop(lambda c: go & whole(c[0]), iterate,
                                                       (jnp.int32(1), acc, m_i, l_i, p16))
            j_end = jnp.where(go, j_end, 0)
            acc = lax.cond(go, last_pv, lambda a: a, acc)
            return (acc, m_i, l_i), j_end

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
                    qk = qk * (rows[0] if per_slot == 1 else jnp.where(key_columns() < page_size, rows[0], rows[1]))

                def mask(s):
                    qpos, kcol = hoisted if hoisted else mask_iotas()
                    kpos = kcol + k0s[0]
                    if per_slot == 2:
                        kpos = kcol + jnp.where(kcol < page_size, k0s[0], k0s[1] - page_size)
                    diff = qpos - kpos
                    vis = (diff >= 0) & ((w == 0) | (diff < w) | (kpos < sk))
                    return jnp.where(vis, s, -jnp.inf)

                qk = lax.cond(full, lambda s: s, mask, qk)
                m_new, alpha, p, l_i = softmax(qk, m_i, l_i)
                if fp8:  # value scales relative to the running reference (module doc)
                    v_scales = [page_scale(vs_ref, page) for page in pages]
                    ref_new = functools.reduce(jnp.maximum, v_scales, v_ref[0])
                    ref_safe = jnp.where(ref_new > 0, ref_new, 1.0)
                    p = p * (per_column(v_scales) / ref_safe)
                    alpha = alpha * (v_ref[0] / ref_safe)
                    v_ref = [ref_new]
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                if variant.pv_barrier:  # JAX's attention_mgpu: the softmax's values fixed before the barriers
                    acc, l_i, m_new, p16, *v_ref = lax.optimization_barrier((acc, l_i, m_new, p16, *v_ref))
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
            plgpu.barrier_wait(k_full.at[lax.rem(g0, jnp.int32(stages))])

        pl.when(wg == 1)(sync_schedule)  # warpgroup 0 issues its products first
        j0 = 0
        if variant.overlap:
            (acc, m_i, l_i), j0 = overlapped((acc, m_i, l_i))
        acc, m_i, l_i, *v_ref = lax.fori_loop(j0, n_steps, step, (acc, m_i, l_i, *v_ref))
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

        def write_from_q():  # a full box through the (free) q tile, while the next box lands in the staging rows
            q_smem.at[wg][...] = out
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[pl.ds(x0, BLOCK_Q), it.head])

        if out_from_q:
            pl.when(n_rows == BLOCK_Q)(write_from_q)
            pl.when((n_rows > 0) & (n_rows < BLOCK_Q))(write_staged)
        else:
            @pl.when(n_rows > 0)
            def _():
                write_staged()
                if not persistent:
                    plgpu.wait_smem_to_gmem(0)
        return copying

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(variant.registers[0], action="increase")
        if persistent:
            def item(r, carry):
                g0, q_copied = carry
                it = round_item(r)
                return g0 + it.n_steps, consume(it, g0, q_copied, round_item(r + 1))

            lax.fori_loop(0, rounds, item, (jnp.int32(0), jnp.int32(0)))
            plgpu.wait_smem_to_gmem(0)
        else:
            consume(the_item, jnp.int32(0), None, None)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(variant.registers[1], action="decrease")

        def slot_sources(it: _Item, j):
            # a slot half whose page is a hole or past the walk gets a copy of the other half's page (finite data,
            # never visible), so that every slot takes the same bytes; a slot with no page is only signalled
            pages = [page_at(it, j * per_slot + i)[1] for i in range(per_slot)]
            return [functools.reduce(lambda a, o: jnp.where(a >= 0, a, o), pages[i:] + pages[:i])
                    for i in range(per_slot)]

        def fill(srcs, slot, kinds):  # copy the slot's pages of each (gmem, smem ring, full barriers) of kinds
            @pl.when(srcs[0] >= 0)
            def _():
                for i, src in enumerate(srcs):
                    keys = pl.ds(i * page_size, page_size)
                    for gmem, ring, full in kinds:
                        plgpu.copy_gmem_to_smem(gmem.at[src], ring.at[slot, keys], full.at[slot])

            @pl.when(srcs[0] < 0)
            def _():  # only holes: the slot is signalled, nothing is read
                for _ in range(per_slot):
                    for _, _, full in kinds:
                        plgpu.barrier_arrive(full.at[slot])

        k_kind, v_kind = (k_ref, k_smem, k_full), (v_ref, v_smem, v_full)

        def issue(it: _Item, j, slot):
            fill(slot_sources(it, j), slot, (k_kind, v_kind))

        def walk(it: _Item, g0):  # the item's steps are steps g0 .. of the program's ring walk; returns the next
            @pl.loop(0, it.n_steps)
            def _(j):
                g = g0 + j
                slot = lax.rem(g, jnp.int32(stages))
                srcs = slot_sources(it, j)
                for kinds, frees in (((k_kind,), (k_free,)), ((v_kind,), (v_free,))) if split else (
                        ((k_kind, v_kind), (k_free, v_free)),):
                    @pl.when(g >= stages)  # step g - stages released the slot
                    def _(frees=frees):
                        for free in frees:
                            plgpu.barrier_wait(free.at[slot])

                    fill(srcs, slot, kinds)

            return g0 + it.n_steps

        def drain(total):  # the last releases, so every phase of the free barriers is observed
            @pl.loop(jnp.maximum(total - stages, 0), total)
            def _(g):
                for free in (k_free, v_free):
                    plgpu.barrier_wait(free.at[lax.rem(g, jnp.int32(stages))])

        if persistent:
            drain(lax.fori_loop(0, rounds, lambda r, g0: walk(round_item(r), g0), jnp.int32(0)))
        elif split:
            drain(walk(the_item, jnp.int32(0)))
        else:
            produce_ring(the_item.n_steps, stages, functools.partial(issue, the_item), (k_free, v_free))


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


@functools.partial(jax.jit, static_argnames=("stages", "fp8_products", "variant", "interpret"))
def paged_prefill_mgpu(
    call,  # kvjax.ops.attention.PagedAttentionCall (checked by the op)
    *,
    stages: int | None = None,
    fp8_products: str = "e4m3x2_qk",
    variant: Variant = Variant(),
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D] in q's dtype
    """Ragged causal paged attention (any batch) as a Mosaic GPU kernel; same contract as
    :func:`kvjax.pallas.paged.prefill.paged_prefill`, except that a page's unwritten tail is read (it must hold
    finite values, see the module doc). fp8 pages read as ``page * scale`` (module doc).
    ``stages``: shared-memory slots of 128 keys (default 2). ``fp8_products`` (fp8 pages only, module doc):
    ``"e4m3x2_qk"`` (q as two e4m3 tiles, ``q K^T`` on e4m3 tensor cores, V converted to f16 once per slot) or
    ``"e4m3_qk"`` (q rounded to one e4m3 tile). ``variant``: the schedule (:class:`Variant`; each variant compiles
    under its own kernel name). ``interpret`` runs the Mosaic GPU interpreter on the CPU. Reads only; tokens of no
    row get 0. ``ValueError`` for what :func:`shape_reason` rejects, for an unknown ``fp8_products`` and for
    ``variant.overlap`` over fp8 pages.
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
    if fp8 and variant.overlap:
        raise ValueError("Variant.overlap needs bf16 or f16 pages (its P V takes the ring's V slot as it is)")
    spans, walks = common.tile_walks(call, TILE_TOKENS)
    num_tiles = spans[0].shape[0]
    if variant.programs:  # persistent programs take the tiles in this order: the tiles with tokens last to first
        tile = jnp.arange(num_tiles, dtype=jnp.int32)  # (the longest walks of each row first), then the empty ones
        n_live = jnp.sum(spans[2] > 0, dtype=jnp.int32)
        order = jnp.where(tile < n_live, n_live - 1 - tile, tile)
        spans, walks = tuple(x[order] for x in spans), tuple(x[order] for x in walks)
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
        num_kv_heads=call.num_kv_heads, stages=stages, fp8=fp8, q_parts=q_parts, variant=variant, interpret=interpret,
    )
    if variant.programs:
        grid, grid_names = (variant.programs,), ("prog",)
    else:
        grid, grid_names = (num_tiles, hq), ("tile", "head")
    semantics = _SEMANTICS[variant.semantics]
    params = plgpu.CompilerParams(approx_math=True, **({"lowering_semantics": semantics} if semantics else {}))
    name = (f"kvjax_paged_prefill_mgpu_{jnp.dtype(k_pages.dtype).name}{'_' + fp8_products if fp8 else ''}"
            f"_page{page_size}_d{d}_s{stages}")
    q_in = q if t_total >= BLOCK_Q else jnp.pad(q, ((0, BLOCK_Q - t_total), (0, 0), (0, 0)))  # a box fits
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        kernel_name=name + variant.tag(),
        compiler_params=params,
        interpret=interpret_params() if interpret else None,
    )(*common.operands(call, (q_in, k_pages, call.v_pages, k_scale, v_scale), spans, walks))
    return out[:t_total]
