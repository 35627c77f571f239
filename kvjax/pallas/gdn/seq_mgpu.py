"""Sequential (state-passing) pass of the chunked gated delta rule as a Mosaic GPU kernel (Hopper: TMA, wgmma), in
FlashQLA's layout: on ``prep_mgpu_call(outputs="inverse")``'s ``Tb = T diag(beta)`` and row factor ``kr`` rather
than the default preparation's ``w`` / ``u`` (``seq="fused"`` of :mod:`kvjax.pallas.gdn.chunk`, backend
``"mosaic-fused"``). Per sequence row, value head and block of ``block_v`` value columns, the row's chunks in order
with the state slice ``S: f32[K, block_v]`` as registers in the wgmma accumulator layout::

    v_new = Tb (v - kr * (k S));   o = qf * (q S) + A v_new;   S = exp(g_last) S + k^T (kf * v_new)

One CTA per (row, value head, ``warpgroups * block_v`` value columns). A ring of ``stages`` shared-memory slots holds
the chunk operands (``q``, ``k``, each consumer's ``block_v`` columns of raw ``v``, ``Tb``, ``A`` and the row factors
``qf``, ``kf``, ``gl``, ``kr``, stacked by the preparation), each slot filled by TMA copies that complete on its
barrier. One warpgroup (``warpgroups=1``) issues the copies itself, or leaves them to a producer warpgroup
(``producer=True``); with more, each consumer warpgroup walks its own value block through the shared ring. A producer
warpgroup refills a slot once every consumer released it (``produce_ring``), registers move from the producer to the
consumers (``setmaxnreg``: 40 / 232; without, the two-consumer pass was 1.36x slower), and the f32 initial / final
state tiles share the ring's memory (a ``RefUnion``: the state is read before the first copy and written after the
last chunk), so two 64-column consumers fit two slots (211 KB at ``K = 128``).
Loading each chunk's q, k, Tb and A once for both halves of ``V`` made the pass 1.40x faster at 8192 x 4 sequences, 32
value heads (H200, RESULTS.md). Per chunk three rounds of wgmma: ``k S`` (the state written to shared memory in bf16
once per chunk, the right operand), then ``X = v - kr * (k S)`` (f32, rounded to bf16 into ``v_new``'s tile) and ``v_new
= Tb X`` beside ``q S`` (the state tile still holds the chunk's start state), then ``A v_new`` and ``k^T (kf v_new)``
(``k``'s tile read transposed as the left operand; ``v_new`` and ``kf v_new`` in bf16 tiles) accumulated onto ``qf * (q
S)`` and ``exp(g_last) S`` (``pl.run_state`` with initialised accumulators). The row factors multiply f32 accumulators
rather than bf16 operands (``qf`` the rows of ``q S``, ``kf`` the rows of ``v_new``), an equal product up to the bf16
roundings of the Triton kernel's ``qf * q`` and ``kf * k``. Before, ``q S`` was formed in the first round and carried
through the loop beside ``k S``, and the last round's products were added to ``qf (q S)`` and ``exp(g) S`` afterwards:
the two-warpgroup pass was 1.45-1.50x slower at 8192 x 4 sequences, 32 value heads, the one-warpgroup pass the same
(H200, RESULTS.md; a reading, not profiled: fewer f32 tiles live in a consumer thread's registers). Per chunk and CTA at
``K = 128``, ``block_v = 64``: reads 32 KB (q, k) + 8 KB (v) + 8 KB (Tb) + 8 KB (A) + 1 KB = 57 KB (the default
preparation's operands: 32 + 16 (w) + 8 (u) + 8 + 0.75 = 64.75 KB); products 1 + 1 + 0.5 + 0.5 + 1 MFLOP (k S, q S, Tb
X, A v_new, k^T v_new: 4.2 MFLOP) in three dependent rounds.

``overlap=True`` (the default): a step finishes chunk ``c`` (``v_new``, the later rounds, the new state), refills
chunk ``c``'s slot with chunk ``c + stages`` and issues chunk ``c + 1``'s first round, and while that product runs
writes chunk ``c``'s outputs; every loaded chunk is ``stages - 1`` steps ahead of its use. ``overlap=False``: a step
is one chunk, every round and the output copies in order, the copies of chunk ``c + stages - 1`` issued at its start.

Ragged rows: a chunk may hold the tail of one sequence and the head of the next. Each CTA writes the output rows
its row owns (the first and last rows also own the tokens outside every sequence, written as zeros): a chunk it
owns whole is one 64-row TMA copy, a shared one is written by two overlapping copies of ``2^j`` rows (the largest
power of two not above its own row count) from the chunk's output tile, so no copy touches another row's tokens.
The initial state is read from the pool by a TMA copy; the final states go to ``f32[N, Hv, K, V]`` and reach the
pool by one scatter outside the kernel (live rows only).

Shared memory at ``K = 128``, ``block_v = 64``, 2 stages, one warpgroup: 114 KB of ring, 72 KB of state / operand /
output tiles (:func:`smem_bytes`).
Needs a Hopper GPU (or the Mosaic GPU interpreter, which runs the same data flow with ``jnp.dot`` products: it has
no transposed wgmma operand), bf16 operands, ``K`` and ``V`` in ``SUPPORTED_HEAD_DIMS``, chunks of 64.

Synchronisation: the kernel orders its own shared-memory accesses, so it compiles without Pallas's automatic barriers
(``unsafe_no_auto_barriers``; a warpgroup barrier before and after every store and before every copy issue: a ring
refill's copies are q, k, Tb, each consumer's v, A and the stacked row factors; nine copies before the stacking). No
thread reads what another wrote except through an async read (wgmma, TMA store) after ``commit_smem``; a slot is
refilled only after ``commit_smem`` (one warpgroup) or every consumer's mbarrier arrive (release semantics) follows its
last read of it; the output tile is rewritten only after its copies have read it (``wait_smem_to_gmem``, which
synchronises the warpgroup); with several warpgroups the state tiles in the ring's memory are read before ``st_read``
and written after ``walked``. Without the automatic barriers the pass was 1.03-1.04x faster (H200, the same errors;
``auto_barriers=True`` restores them, to check a change against them). Where the one-warpgroup pass's ~1.8 us a chunk
goes (Nsight Compute at 1 x 8192 tokens, 32 value heads, before that change): the ring refill's nine TMA issues (each
with its expect-tx arrive, uniform-register moves and a barrier) and the wait for the next slot took 41% of the stall
samples, the wgmma instructions and waits 14%; the time is the same at 32, 64 and 128 CTAs, so it is this per-chunk
chain, not the L2 traffic. The row factors stacked by the preparation (one copy instead of four: six a refill) made the
one-warpgroup pass 1.19x faster (0.2331 -> 0.1966 ms at 1 x 8192 tokens, 32 value heads; the same bits); the
two-warpgroup pass, whose producer issues the copies, did not change. A producer warpgroup beside the one consumer
(the default with ``overlap``), which takes the six remaining copy issues off the consumer's chain, made it 1.09x
faster again at 2 slots and 1.10x at 3 (0.1972 -> 0.1811 / 0.1786 ms there; 1 x 32768 tokens: 0.7642 -> 0.6929 /
0.6736, 1.13x; 2 x 8192 tokens at 64 columns: 0.2749 -> 0.2543 / 0.2630; the same bits, H200). Forming ``W = Tb
diag(kr) k`` beside the last round (two rounds a chunk instead of three) and cutting each product's reduction into
independent wgmma chains were both slower (benchmarks/RESULTS.md).

This kernel also had a plain mode on the default preparation's ``w`` / ``u`` (two rounds a chunk; backend
``"mosaic-seq"``), deleted once this one was measured faster where that one ran (benchmarks/RESULTS.md, GDN chunked
prefill).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas.gdn.common import FLAG_HAS_INITIAL, FLAG_LIVE
from kvjax.pallas.mgpu_common import SWIZZLE, interpret_params, iota, produce_ring

CHUNK = 64  # tokens per chunk: one wgmma M tile of one warpgroup
SUPPORTED_HEAD_DIMS = (64, 128)
BLOCK_VS = (32, 64, 128)  # value columns per CTA
SMEM_BYTES = 232448  # shared memory a Hopper CTA may take (227 KB)
MANY_CTAS = 128  # block_v=None: 64 value columns per CTA where that gives this many CTAs, else 32
_ROW = plgpu.Layout.WGMMA.reduce(1)  # f32[C] indexed by row, broadcast along columns
_POW2_ROWS = (32, 16, 8, 4, 2, 1)  # partial chunks: the output copies' row counts
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232  # warpgroups > 1: a thread's registers (64K a CTA of 3)


def _swizzled(block_v: int) -> tuple:
    """Shared-memory transforms of every bf16 tile: the widest swizzle that a row of ``block_v`` values fills
    (wgmma wants one swizzle for both operands of a product)."""
    swizzle = min(SWIZZLE, block_v * 2)
    return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)


def auto_block_v(num_rows: int, hv: int, vd: int) -> int:
    """``block_v=None`` with one warpgroup: 64 value columns per CTA where ``num_rows * Hv * V / 64 >= MANY_CTAS``,
    else 32 (more, narrower CTAs: the pass is latency-bound, one chunk after another, so idle SMs are lost time)."""
    return 64 if num_rows * hv * (vd // 64) >= MANY_CTAS else 32


def auto_layout(num_rows: int, hv: int, vd: int) -> tuple[int, int]:
    """``block_v=None, warpgroups=None``: ``(block_v, warpgroups)``. Where the (row, head) pairs alone fill
    ``MANY_CTAS`` CTAs and ``V = 128``: one CTA per pair, two 64-column consumer warpgroups sharing one ring (each
    chunk's q, k, Tb and A loaded once; 1.40x one 64-column warpgroup a CTA at 8192 x 4, 32 value heads on an H200,
    RESULTS.md "GDN chunked prefill"); else one warpgroup of :func:`auto_block_v` columns."""
    if num_rows * hv >= MANY_CTAS and vd == 2 * 64:
        return 64, 2
    return auto_block_v(num_rows, hv, vd), 1


def shape_reason(q: jax.Array, tb: jax.Array, v: jax.Array, *, block_v: int) -> str | None:
    """What this kernel cannot take (``"needs ..., got ..."``), or None: bf16 q / Tb / v, ``K`` and ``V`` in
    ``SUPPORTED_HEAD_DIMS``, chunks of ``CHUNK`` tokens, ``block_v`` in ``BLOCK_VS`` dividing ``V``."""
    if not (q.dtype == tb.dtype == v.dtype == jnp.bfloat16):
        return f"needs bf16 operands, got {q.dtype}, {tb.dtype}, {v.dtype}"
    kd, vd = q.shape[-1], v.shape[-1]
    if kd not in SUPPORTED_HEAD_DIMS or vd not in SUPPORTED_HEAD_DIMS:
        return f"needs K and V in {SUPPORTED_HEAD_DIMS}, got K={kd}, V={vd}"
    if tb.shape[2] != CHUNK:
        return f"needs chunks of {CHUNK}, got {tb.shape[2]}"
    if block_v not in BLOCK_VS or vd % block_v:
        return f"needs block_v in {BLOCK_VS} dividing V={vd}, got {block_v}"
    return None


def smem_bytes(kd: int, block_v: int, stages: int, warpgroups: int = 1, producer: bool | None = None) -> int:
    """Shared memory of one CTA: ``stages`` ring slots (q, k, a ``v`` block per warpgroup, Tb, A, four row factors)
    and per warpgroup the state, ``v_new``, ``kf v_new`` and output tiles (two output tiles for rows of fewer than
    128 bytes) and an f32 state tile; with a producer warpgroup (``None``: ``warpgroups > 1``) the f32 state tiles
    share the ring's memory."""
    c, w = CHUNK, warpgroups
    producer = w > 1 if producer is None else producer
    slot = 2 * (2 * c * kd + w * c * block_v + 2 * c * c) + 4 * 4 * c
    out = (2 if block_v * 2 < SWIZZLE else 1) * (c + 2) * block_v
    ring, state = stages * slot, w * 4 * kd * block_v
    return (max(ring, state) if producer else ring + state) + w * 2 * (kd * block_v + 2 * c * block_v + out)


def auto_stages(kd: int, block_v: int, warpgroups: int, producer: bool) -> int:
    """``stages=None``: 3 ring slots for one 32-column consumer beside a producer (1.01-1.03x 2 slots at 1 x 8192
    and 1 x 32768 tokens, 32 value heads, H200), else 2; fewer where they do not fit (:func:`smem_bytes`)."""
    want = 3 if producer and warpgroups == 1 and block_v == 32 else 2
    return next((s for s in range(want, 1, -1) if smem_bytes(kd, block_v, s, warpgroups, producer) <= SMEM_BYTES), 1)


def _kernel(*refs, group: int, block_v: int, stages: int, overlap: bool, warpgroups: int, producer: bool,
            interpret: bool):
    """``refs``: the inputs, outputs and scratch below; ``producer``: warpgroup ``W`` issues the ring's copies."""
    (cu_ref,  # i32[N+1]
     rows_ref,  # i32[N]
     flags_ref,  # i32[N]
     q_ref,  # bf16[Tp, Hk, K]  raw q
     k_ref,  # bf16[Tp, Hk, K]  raw k
     tb_ref,  # bf16[NC, Hv, C, C]  Tb = T diag(beta)
     v_ref,  # bf16[Tp, Hv, V]  raw v
     a_ref,  # bf16[NC, Hv, C, C]
     rowf_ref,  # f32[NC, Hv, 4, C]  the row factors qf, kf, gl, kr
     pool_ref,  # f32[R, Hv, K, V]  initial states at rows
     o_ref,  # bf16[Tp, Hv, V]
     fin_ref,  # f32[N, Hv, K, V]  final states
     ring,  # (q_s, k_s, tb_s, v_s, a_s, vec_s) and st_s; with a producer a RefUnion of the two
     h_s,  # bf16[W, K, BV]  swizzled: the state as the right operand
     vn_s,  # bf16[W, C, BV]  swizzled: first v - kr * (k S), then v_new
     vk_s,  # bf16[W, C, BV]  swizzled: kf * v_new
     o_s,  # bf16[W * B, C + 2, BV]  the chunk's output rows: at rows 0.. (B = 1) and, narrow, also at rows 1.. (B = 2)
     ready,  # barriers [S]: slot loaded (5 + W arrivals)
     st_bar,  # barriers [W]: initial state loaded
     *shared,  # producer: free [S] (W arrivals: every consumer is done with the slot), st_read and walked
     #           (W arrivals each: every consumer read its initial state / finished its walk)
     ) = refs
    (q_s,  # bf16[S, C, K]  swizzled ring
     k_s,  # bf16[S, C, K]  swizzled ring
     tb_s,  # bf16[S, C, C]  swizzled ring: Tb
     v_s,  # bf16[S * W, C, BV]  swizzled ring: v, one block per consumer
     a_s,  # bf16[S, C, C]  swizzled ring
     vec_s,  # f32[S, 4, C]  ring: qf, kf, gl, kr
     ), (st_s,  # f32[W, K, BV]  initial / final state (shares the ring's memory with a producer)
         ) = ring
    wgs = warpgroups
    wg = lax.axis_index("wg") if producer else 0
    n, hd, vb = lax.axis_index("rows"), lax.axis_index("heads"), lax.axis_index("vblocks")
    num_seqs = rows_ref.shape[0]
    num_tokens = o_ref.shape[0]
    chunk = CHUNK
    hk = lax.div(hd, jnp.int32(group))
    cons = jnp.minimum(wg, wgs - 1)  # this consumer (the producer warpgroup, wg == W, uses none of it)

    def value_cols(j):  # consumer j's block_v value columns
        return pl.ds(pl.multiple_of((vb * wgs + j) * block_v, block_v), block_v)

    vs = value_cols(cons)
    h_w, vn_w, vk_w, st_w = h_s.at[cons], vn_s.at[cons], vk_s.at[cons], st_s.at[cons]
    f32, bf16 = jnp.float32, jnp.bfloat16
    start, end, flags, row = cu_ref[n], cu_ref[n + 1], flags_ref[n], rows_ref[n]
    live = (flags & FLAG_LIVE) != 0
    read = live & ((flags & FLAG_HAS_INITIAL) != 0)
    lo = jnp.where(n == 0, 0, start)
    hi = jnp.where(n == num_seqs - 1, num_tokens, end)
    c_lo, c_hi = lax.div(lo, jnp.int32(chunk)), lax.div(hi + chunk - 1, jnp.int32(chunk))

    def issue(c, slot):
        rs = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        bar = ready.at[slot]
        plgpu.copy_gmem_to_smem(q_ref.at[rs, hk], q_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(k_ref.at[rs, hk], k_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(tb_ref.at[c, hd], tb_s.at[slot], bar)
        for j in range(wgs):
            plgpu.copy_gmem_to_smem(v_ref.at[rs, hd, value_cols(j)], v_s.at[slot * wgs + j], bar)
        plgpu.copy_gmem_to_smem(a_ref.at[c, hd], a_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(rowf_ref.at[c, hd], vec_s.at[slot], bar)

    def tile(ref):  # a bf16 tile of shared memory in the wgmma layout
        return ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)

    def vec(ref):  # a per-token f32 vector of shared memory as a row vector
        return ref[...] if interpret else plgpu.load(ref, (), layout=_ROW, optimized=False)

    def bc_row(x):  # row vector -> [C, BV]
        return lax.broadcast_in_dim(x, (chunk, block_v), [0])

    def products(*pairs, init=None, during=None):
        """f32 ``a @ b`` (``init + a @ b``) for each (a ref, maybe read transposed, b ref), issued together;
        ``during()`` runs while they do."""
        if interpret:  # the interpreter has no transposed wgmma operand: the same products in jnp
            if during is not None:
                during()
            out = [jnp.dot(a[...].T if trans else a[...], b[...], preferred_element_type=f32)
                   for a, trans, b in pairs]
            return out if init is None else [x + y for x, y in zip(init, out)]

        def issue(accs):
            for acc, (a, trans, b) in zip(accs, pairs):
                plgpu.wgmma(acc, plgpu.transpose_ref(a, (1, 0)) if trans else a, b)
            if during is not None:
                during()

        if init is not None:  # the accumulators start from ``init``: no second f32 tile live beside each
            return list(pl.run_state(issue)(tuple(plgpu.ACC.init(x) for x in init)))

        def body(*accs):
            issue(accs)
            return tuple(acc[...] for acc in accs)

        shapes = [(a.shape[1] if trans else a.shape[0], b.shape[1]) for a, trans, b in pairs]
        return list(pl.run_scoped(body, *[plgpu.ACC(s, f32) for s in shapes]))

    ri = iota((chunk, block_v), 0, interpret)

    nb = o_s.shape[0] // wgs
    narrow = nb == 2  # rows of fewer than 128 bytes: a copy's shared-memory start must be 128-aligned

    def write_rows(c, o):  # the chunk's output rows that this row owns, o: f32[C, BV]
        c0 = c * chunk
        r0 = jnp.clip(lo - c0, 0, chunk)
        r1 = jnp.clip(hi - c0, 0, chunk)
        count = r1 - r0
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's output copies have read o_s
        o_s.at[cons * nb, pl.ds(0, chunk)][...] = o.astype(o_s.dtype)
        if narrow:  # a copy from an odd row reads the second buffer, which holds row r at r + 1 (even)
            @pl.when(count < chunk)
            def _():
                o_s.at[cons * nb + 1, pl.ds(1, chunk)][...] = o.astype(o_s.dtype)
        plgpu.commit_smem()

        @pl.when(count == chunk)
        def _():
            plgpu.copy_smem_to_gmem(o_s.at[cons * nb, pl.ds(0, chunk)],
                                    o_ref.at[pl.ds(pl.multiple_of(c0, chunk), chunk), hd, vs])

        for size in _POW2_ROWS:
            @pl.when((count >= size) & (count < 2 * size))
            def _(size=size):
                for r in (r0, r1 - size):
                    b = lax.rem(r, 2) if narrow else 0
                    plgpu.copy_smem_to_gmem(o_s.at[cons * nb + b, pl.ds(r + b, size)],
                                            o_ref.at[pl.ds(c0 + r, size), hd, vs])

    nc = a_ref.shape[0]

    def slot_of(c):
        return lax.rem(c - c_lo, jnp.int32(stages))

    def second_half(c, s, kh):  # chunk c from its k S (S still in h_w): (o, the next state), the slot read
        slot = slot_of(c)
        r = c * chunk + ri
        in_seq = (r >= start) & (r < end) & live
        v_in = tile(v_s.at[slot * wgs + cons]).astype(f32)
        vn_w[...] = (v_in - kh * bc_row(vec(vec_s.at[slot, 3]))).astype(bf16)
        plgpu.commit_smem()
        tx, qh = products((tb_s.at[slot], False, vn_w), (q_s.at[slot], False, h_w))  # v_new = Tb (v - kr (k S))
        v_new = jnp.where(in_seq, tx, 0.0)
        vn_w[...] = v_new.astype(bf16)
        vk_w[...] = (v_new * bc_row(vec(vec_s.at[slot, 1]))).astype(bf16)
        plgpu.commit_smem()
        c0 = c * chunk
        any_in = live & (start < end) & (c0 < end) & (c0 + chunk > start)
        first = jnp.clip(jnp.maximum(start, c0) - c0, 0, chunk - 1)
        decay = jnp.where(any_in, jnp.exp(vec_s[slot, 2, first]), 1.0)
        o, s = products((a_s.at[slot], False, vn_w), (k_s.at[slot], True, vk_w),
                        init=(qh * bc_row(vec(vec_s.at[slot, 0])), s * decay))
        return jnp.where(in_seq, o, 0.0), s

    def step(c, s):  # s: f32[K, BV] (one warpgroup: it issues the copies itself)
        nxt = c + stages - 1
        h_w[...] = s.astype(bf16)
        plgpu.commit_smem()  # also: every thread is done reading the slot that the next copies refill

        @pl.when(nxt < c_hi)
        def _():
            issue(nxt, slot_of(nxt))

        o, s = second_half(c, s, first_half(c))
        write_rows(c, o)
        return s

    def first_half(c, during=None):  # k S of chunk c (S in h_w); ``during()`` runs while it does
        slot = slot_of(c)
        plgpu.barrier_wait(ready.at[slot])
        return products((k_s.at[slot], False, h_w), during=during)[0]

    def release(c):  # chunk c's slot may be refilled: a lone warpgroup issues the refill, else signal the producer
        if producer:
            plgpu.barrier_arrive(shared[0].at[slot_of(c)])
            return

        @pl.when(c + stages <= c_hi)
        def _():
            issue(jnp.minimum(c + stages, nc - 1), slot_of(c))

    def step_overlap(c, carry):  # chunk c from its k S; then chunk c + 1's, its output copies meanwhile
        s, kh = carry
        o, s = second_half(c, s, kh)
        h_w[...] = s.astype(bf16)
        plgpu.commit_smem()  # also: every thread is done reading chunk c's slot, which the copies refill
        release(c)
        kh = first_half(c + 1, during=lambda: write_rows(c, o))
        return s, kh

    def walk(s0):  # the overlap loop over chunks c_lo .. c_hi - 1 from state s0 (the ring's first chunks issued)
        h_w[...] = s0.astype(bf16)
        plgpu.commit_smem()
        s, _ = lax.fori_loop(c_lo, c_hi, step_overlap, (s0, first_half(c_lo)))
        return s

    def initial_state():
        plgpu.copy_gmem_to_smem(pool_ref.at[jnp.clip(row, 0, pool_ref.shape[0] - 1), hd, :, vs], st_w,
                                st_bar.at[cons])
        plgpu.barrier_wait(st_bar.at[cons])
        s0 = st_w[...] if interpret else plgpu.load(st_w, (), layout=plgpu.Layout.WGMMA, optimized=False)
        return jnp.where(read, s0, 0.0)

    def final_state(s):
        st_w[...] = s
        plgpu.commit_smem()

        @pl.when(live)
        def _():
            plgpu.copy_smem_to_gmem(st_w, fin_ref.at[n, hd, :, vs])

        plgpu.wait_smem_to_gmem(0)

    @pl.when(live | (lo < hi))  # a padding row that owns no token (most of an engine step's row bucket): no work
    def _row():
        if producer:  # a producer warpgroup fills the ring; W consumers, one value block each, share it
            free, st_read, walked = shared

            @pl.when(wg == wgs)
            def _producer():
                if not interpret and PRODUCER_REGISTERS:
                    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
                plgpu.barrier_wait(st_read)  # the ring's memory held the initial states until every consumer read them
                produce_ring(c_hi - c_lo + 1, stages, lambda i, slot: issue(jnp.minimum(c_lo + i, nc - 1), slot),
                             (free,))

            @pl.when(wg < wgs)
            def _consumer():
                if not interpret and CONSUMER_REGISTERS:
                    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
                s0 = initial_state()
                plgpu.barrier_arrive(st_read)
                s = walk(s0)
                release(c_hi)  # the last (clamped) chunk: its k S formed and unused
                plgpu.barrier_arrive(walked)
                plgpu.barrier_wait(walked)  # no consumer reads the ring any more: its memory takes the final states
                final_state(s)
            return

        if overlap:  # chunks c_lo .. c_hi are loaded and their k S formed: the last (clamped) one unused
            s0 = initial_state()
            for j in range(stages):
                @pl.when(c_lo + j <= c_hi)
                def _(j=j):
                    issue(jnp.minimum(c_lo + j, nc - 1), j)

            s = walk(s0)
        else:
            for j in range(stages - 1):
                @pl.when(c_lo + j < c_hi)
                def _(j=j):
                    issue(c_lo + j, j)

            s = lax.fori_loop(c_lo, c_hi, step, initial_state())
        final_state(s)


def seq_mgpu_fused_call(
    q: jax.Array,  # bf16[Tp, Hk, K]
    k: jax.Array,  # bf16[Tp, Hk, K]
    v: jax.Array,  # bf16[Tp, Hv, V]  raw v, padded as q
    tb: jax.Array,  # bf16[NC, Hv, C, C]  T diag(beta)
    a: jax.Array,  # bf16[NC, Hv, C, C]
    rowf: jax.Array,  # f32[NC, Hv, 4, C]  the row factors qf, kf, gl, kr
    pool: jax.Array,  # f32[R, Hv, K, V]
    cu_seqlens: jax.Array,  # i32[N+1]
    rows: jax.Array,  # i32[N]
    flags: jax.Array,  # i32[N]
    *,
    out_dtype,
    block_v: int | None = None,
    stages: int | None = None,
    overlap: bool = True,
    warpgroups: int | None = None,
    producer: bool | None = None,
    auto_barriers: bool = False,
    semantics: plgpu.LoweringSemantics = plgpu.LoweringSemantics.Lane,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (o [Tp, Hv, V] in out_dtype, pool f32[R, Hv, K, V])
    """The sequential pass on ``prep_mgpu_call(outputs="inverse")``'s operands, as ``chunk._chunk_call``: the
    outputs of every token and the pool with each live row's final state at its index, ``v_new = tb (v - kr * (k
    S))`` formed from raw ``v`` (module docstring). ``ValueError`` for what :func:`shape_reason` rejects, a
    non-bf16 ``out_dtype`` or ``stages`` below 1 or over the shared memory (:func:`smem_bytes`).
    ``block_v`` value columns per consumer warpgroup and ``warpgroups`` consumer warpgroups a CTA (module
    docstring); both ``None``: :func:`auto_layout`; ``block_v`` alone: one warpgroup; ``warpgroups`` alone: at most 64
    columns each (one warpgroup: :func:`auto_block_v`). ``stages``: ring slots (shared memory at ``K = 128``: about 57
    KB a slot at ``block_v = 64``, 53 KB at 32, within 227 KB with the other tiles, :func:`smem_bytes`).
    ``overlap``: the loop form (module docstring; a producer warpgroup needs it).
    ``auto_barriers``: Pallas's automatic warpgroup barriers around every shared-memory store and copy issue (module
    docstring, "Synchronisation"); off by default. ``semantics``: the Mosaic GPU lowering (Lane: the register layouts
    the kernel names). ``ValueError`` also for ``warpgroups`` not a positive int or ``warpgroups * block_v`` not
    dividing ``V``. ``producer``: a producer warpgroup issues the ring's copies beside the consumers (``None``: with
    ``overlap``, compiled; several consumers need it; with one it takes the refill's copy issues off the consumer's
    chain of dependent steps: 1.09-1.13x, module docstring; in the interpreter one consumer issues its own copies
    unless ``producer=True``, which doubles the interpreter's time). ``ValueError`` for a non-bool, ``False`` with
    several consumers, or a producer without ``overlap``. ``stages=None``: :func:`auto_stages`."""
    tp, hk, kd = q.shape
    nc, hv, chunk, _ = a.shape
    vd = v.shape[-1]
    wgs = warpgroups

    def bad_warpgroups():
        return ValueError(f"seq_mgpu warpgroups must be a positive int with warpgroups * block_v dividing V={vd}, "
                          f"got {warpgroups} (block_v={block_v})")

    if wgs is not None and (isinstance(wgs, bool) or not isinstance(wgs, int) or wgs < 1):
        raise bad_warpgroups()
    if block_v is None and wgs is None:
        block_v, wgs = auto_layout(rows.shape[0], hv, vd)
    elif block_v is None:  # warpgroups given: one warpgroup's own pick, else V shared out (at most 64 columns each)
        block_v = min(64, vd // wgs) if wgs > 1 else auto_block_v(rows.shape[0], hv, vd)
    wgs = wgs or 1
    if producer is None:  # the interpreter runs a second warpgroup as a second blocked computation: twice as slow
        producer = wgs > 1 or (overlap and not interpret)
    if not isinstance(producer, bool) or (wgs > 1 and not producer):
        raise ValueError(f"seq_mgpu producer must be a bool (True with warpgroups > 1) or None, got {producer!r} "
                         f"(warpgroups={wgs})")
    reason = shape_reason(q, tb, v, block_v=block_v)
    if reason:
        raise ValueError(f"seq_mgpu {reason}")
    if jnp.dtype(out_dtype) != jnp.bfloat16:
        raise ValueError(f"seq_mgpu needs bf16 outputs, got {jnp.dtype(out_dtype)}")
    if vd % (wgs * block_v):
        raise bad_warpgroups()
    if producer and not overlap:
        raise ValueError(f"seq_mgpu a producer warpgroup (warpgroups={wgs}) needs overlap=True")
    if stages is None:
        stages = auto_stages(kd, block_v, wgs, producer)
    if stages < 1 or smem_bytes(kd, block_v, stages, wgs, producer) > SMEM_BYTES:
        raise ValueError(f"seq_mgpu stages must be >= 1 and fit {SMEM_BYTES} bytes of shared memory, got {stages} "
                         f"({smem_bytes(kd, block_v, stages, wgs, producer)} bytes at K={kd}, block_v={block_v}, "
                         f"warpgroups={wgs}, producer={producer})")
    num_seqs = rows.shape[0]
    bf16 = jnp.bfloat16
    swz = _swizzled(block_v)
    ring = (
        plgpu.SMEM((stages, chunk, kd), bf16, transforms=swz),
        plgpu.SMEM((stages, chunk, kd), bf16, transforms=swz),
        plgpu.SMEM((stages, chunk, chunk), bf16, transforms=swz),
        plgpu.SMEM((stages * wgs, chunk, block_v), bf16, transforms=swz),
        plgpu.SMEM((stages, chunk, chunk), bf16, transforms=swz),
        plgpu.SMEM((stages, 4, chunk), jnp.float32),
    ), (plgpu.SMEM((wgs, kd, block_v), jnp.float32),)
    union = plgpu.RefUnion if producer and not interpret else lambda *groups: groups  # the interpreter has none
    scratch = (
        union(*ring),
        plgpu.SMEM((wgs, kd, block_v), bf16, transforms=swz),
        plgpu.SMEM((wgs, chunk, block_v), bf16, transforms=swz),
        plgpu.SMEM((wgs, chunk, block_v), bf16, transforms=swz),
        plgpu.SMEM((wgs * (2 if block_v * 2 < SWIZZLE else 1), chunk + 2, block_v), bf16),
        plgpu.Barrier(num_arrivals=5 + wgs, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=wgs),
    )
    threads = {}
    if producer:
        scratch += (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages), plgpu.Barrier(num_arrivals=wgs),
                    plgpu.Barrier(num_arrivals=wgs))
        threads = dict(num_threads=wgs + 1, thread_name="wg")
    kernel = functools.partial(_kernel, group=hv // hk, block_v=block_v, stages=stages, overlap=overlap,
                               warpgroups=wgs, producer=producer, interpret=interpret)
    o, fin = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((tp, hv, vd), bf16),
                  jax.ShapeDtypeStruct((num_seqs, hv, kd, vd), jnp.float32)),
        scratch_types=scratch,
        grid=(num_seqs, hv, vd // (block_v * wgs)),
        grid_names=("rows", "heads", "vblocks"),
        **threads,
        kernel_name="gdn_seq_mgpu_fused" + (f"_w{wgs}" if wgs > 1 else "_p" if producer else ""),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=semantics,
                                             unsafe_no_auto_barriers=not auto_barriers),
        interpret=interpret_params() if interpret else None,
    )(cu_seqlens, rows, flags, q, k, tb, v, a, rowf, pool)
    live = (flags & FLAG_LIVE) != 0
    pool = pool.at[jnp.where(live, rows, pool.shape[0])].set(fin, mode="drop")
    return o, pool
