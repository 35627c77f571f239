"""Head-wise paged attention, split-KV decode, as a Mosaic GPU kernel (Hopper: TMA page copies, wgmma) over fp8
(e4m3) or bf16 / f16 pages. A candidate for issue #35 goal 1, not in the backend table until measured on a GPU.

Same contract as :func:`kvjax.pallas.paged.decode.paged_decode` for decode batches (one query token per span:
every token of ``q`` is a span of its own, the tokens of no row attend to nothing and get 0): head-wise block
tables with ``-1`` holes never read, per-KV-head windows and sinks walked as the virtual page list of
:mod:`kvjax.pallas.paged.common` (sink pages, then window pages), the walk cut into ``num_splits`` equal parts
whose f32 partial outputs and log-sum-exps :func:`kvjax.pallas.split_kv.merge_splits` merges.

Design. One CTA per (split, KV head, token) runs two warpgroups: a producer streams the split's pages into a
ring of ``stages`` shared-memory slots of :data:`BLOCK_K` = 128 keys (K and V, one TMA copy per page and
operand: 8 pages of 16, 2 of 64, 1 of 128 a slot), the consumer computes with the GQA group's G query heads.
A decode token has G (4 in the goal shape) query rows, and wgmma's M is 64, so the products are transposed, with
the keys as M and the query heads as N (padded to :data:`GROUP_PAD` = 16, the narrowest N whose f16 operand tile
has a supported swizzle):

- ``S^T = K q^T`` (M = 128 keys, N = 16, K-dim = D): over fp8 pages on e4m3 tensor cores straight from the ring
  slot (K-major, as copied); q, split outside the kernel into two e4m3 tiles ``s (h + l)`` with a power-of-two
  scale ``s`` per query head (:func:`kvjax.pallas.paged.prefill_mgpu.q_row_scales`, the prefill's
  ``"e4m3x2_qk"``: exact for bf16 q wherever ``|q| >= 2**-2 s``, within ``2**-10 s`` elsewhere), is the B operand
  (``[16, D]`` e4m3, K-major). Over bf16 / f16 pages the same product in q's dtype with q itself.
- ``O^T += V^T P^T`` (M = D, N = 16, K-dim = 128 keys): V converted e4m3 -> f16 (exact) by the consumer into one
  shared f16 buffer (32-byte swizzle, read transposed as the A operand: wgmma takes 16-bit operands MN-major),
  ``P^T`` (f16, ``[128, 16]``, 32-byte swizzle) stored from registers as B. bf16 / f16 pages: V from the ring slot
  itself (the V ring then uses the 32-byte swizzle), no conversion.

Why tensor cores and not CUDA-core math for G = 4: per key the CTA moves 2 D = 256 bytes (fp8) and does
``2 * 2 G D = 2048`` FLOPs (``q.k`` and ``p v``); at 4.8 TB/s that is 38 TFLOP/s of f32 FMA work plus a conversion
per byte, about the CUDA cores' whole rate, where the measured CUDA-core decode was 0.51-0.82x the tensor-core
one (HISTORY.md). Transposed, a slot of 128 keys is 2 e4m3 and one f16 wgmma of N = 16 (the tensor cores idle),
its softmax touches ``128 x 16`` logits (16 a thread; 4 of them real), and the V conversion is 128 cvt per key, a
thread doing 128 a slot: the consumer's work per byte stays well below the copy's, the ring keeps
``stages x 32 KiB`` of copies in flight per CTA. Shared memory at D = 128 over fp8 pages (planned sizes, not
measured): 32 KiB a stage, the f16 V buffer 32 KiB, q / P^T / output tiles 4 + 4 + 12 KiB: about 116 KiB at 2
stages, so one CTA an SM (a second would need the V buffer or the output tile to shrink or alias the ring). The
softmax reduces over keys, i.e. over the accumulator's rows, which span the warpgroup's four warps: the compiler's
cross-warp reduction (a shared-memory round trip) per slot.

Masks and scales per key row, computed per slot from the slot's pages (scalars read from the block table and the
scale vectors): a key is visible iff its page is not a hole, it lies in the walk of this split, ``kpos <= pos`` and
(``window == 0`` or ``pos - kpos < window`` or ``kpos < sinks``); its logit is multiplied by its page's key scale,
the query head's q scale and ``scale * log2(e)`` (all powers of two but the last), its probability by its page's
value scale relative to the running reference (the largest value scale so far, as in prefill_mgpu), so a
probability is never scaled down into f16's subnormals. A slot half whose page is a hole or past the walk gets a
copy of another page of the slot (finite data, never visible); a slot with no page at all is only signalled and
skipped. As in prefill_mgpu the copy engine moves whole pages: the unwritten tail of a row's last page is read,
masked, and must hold finite values (kvjax pools start zeroed).

The interpreter (``interpret=True``) runs each warpgroup as a computation on XLA's CPU thread pool
(``mgpu_common.INTERPRET_MIN_THREADS``); it has no transposed wgmma operand, so there the products are the same
products in jnp over the same shared-memory tiles, everything else (ring, barriers, masks, scales) as compiled.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.base.device import next_pow2
from kvjax.base.fp8 import FP8_DTYPE
from kvjax.pallas.mgpu_common import SWIZZLE, cast, interpret_params, iota, produce_ring
from kvjax.pallas.paged import common, decode
from kvjax.pallas.paged.prefill_mgpu import q_row_scales
from kvjax.pallas.split_kv import LN2, merge_splits

BLOCK_K = 128  # keys per ring slot: the M of S^T = K q^T (two wgmma M groups)
GROUP_PAD = 16  # N of both products: the GQA group padded (f16 B tile of 16 x 2 bytes: the 32-byte swizzle)
P_SWIZZLE = 2 * GROUP_PAD  # bytes: swizzle of P^T and of the f16 V operand (lhs and rhs swizzles must match)
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128)
_Q_PARTS = 2  # e4m3 tiles q is split into over fp8 pages (prefill_mgpu's "e4m3x2_qk")
_LOG2E = math.log2(math.e)
_LSE_ROWS = 8  # rows of the output tile that carry the log-sum-exp (one copy with the partial output)
_TARGET_CTAS = 1024  # splits until about this many CTAs (untuned: the Triton decode's target; to measure)


def _kernel(
    *refs,  # common.operands (q [T*Hkv, parts, 16, D] e4m3 (fp8 pages) or [T*Hkv, 1, 16, D] in q's dtype; K / V
    #         pages [P, page_size, D]; spans: row, token, length, position i32[T]), then q_scale f32[T*Hkv, 16],
    #         o_ref f32[T*Hkv*S, D + 8, 16] (rows D..D+7: the lse) and the scratch: smem (q tiles, K ring, V ring,
    #         [f16 V buffer (fp8),] P^T tile, output tile), barriers (q loaded, K / V slot loaded: one arrival per
    #         page; K / V slot free: one arrival)
    scale: float,
    group: int,
    page_size: int,
    max_blocks: int,
    num_kv_heads: int,
    num_splits: int,
    stages: int,
    fp8: bool,
    interpret: bool,
):
    (q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref), (row_ref, _, _, pos_ref), walk, rest = \
        common.kernel_refs(refs, num_spans=4)
    qs_ref, o_ref, smem, (q_bar, k_full, v_full), (k_free, v_free) = rest
    q_smem, k_smem, v_smem, *v16, p_smem, out_smem = smem
    s = lax.axis_index("split")
    h = lax.axis_index("head")
    t = lax.axis_index("token")
    wg = lax.axis_index("wg")
    th = t * num_kv_heads + h
    b = row_ref[t]
    pos = pos_ref[t]
    lo, n_sink, n_pages, w, sk = common.walk_at(walk, th, h)
    bt_base = (b * num_kv_heads + h) * max_blocks
    per_slot = BLOCK_K // page_size
    per_split = lax.div(n_pages + num_splits - 1, jnp.int32(num_splits))
    start = s * per_split
    end = jnp.minimum(n_pages, start + per_split)
    n_steps = lax.div(jnp.maximum(end - start, 0) + per_slot - 1, jnp.int32(per_slot))
    head_dim = k_smem.shape[-1]
    p_dtype = jnp.float16 if fp8 else k_smem.dtype

    def page_at(v):  # (first key position, page id or -1) of virtual page v; -1 for a hole and past the split
        col = lax.select(v < n_sink, v, lo + v - n_sink)
        page = bt_ref[bt_base + jnp.clip(col, 0, max_blocks - 1)]
        return col * page_size, jnp.where(v < end, page, -1)

    def slot_pages(j):  # the per_slot (first key position, page id or -1) of step j
        return [page_at(start + j * per_slot + i) for i in range(per_slot)]

    @pl.when(wg == 0)
    def _consumer():
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        col_layout = plgpu.Layout.WGMMA.reduce(0)
        plgpu.copy_gmem_to_smem(q_ref.at[th], q_smem, q_bar)
        gcol = iota((GROUP_PAD,), 0, interpret) if interpret else plgpu.broadcasted_iota(
            jnp.int32, (GROUP_PAD,), 0, layout=col_layout)
        q_fac = jnp.full((GROUP_PAD,), 0.0, jnp.float32)
        if not interpret:
            q_fac = plgpu.layout_cast(q_fac, col_layout)
        for g in range(group):  # each query head's q scale times the softmax scale in base 2
            q_fac = jnp.where(gcol == g, qs_ref[th, g] * (scale * _LOG2E), q_fac)
        krow = iota((BLOCK_K,), 0, interpret) if interpret else plgpu.broadcasted_iota(
            jnp.int32, (BLOCK_K,), 0, layout=row_layout)
        k_page = lax.div(krow, jnp.int32(page_size))  # the slot page of each key row
        k_off = lax.rem(krow, jnp.int32(page_size))
        plgpu.barrier_wait(q_bar)

        def per_row(values):  # each key row's value of its slot page (values: per_slot scalars); a scalar if 1
            out = values[0]
            for i in range(1, per_slot):
                out = jnp.where(k_page == i, values[i], out)
            return out

        def rows2(x):  # [BLOCK_K] -> [BLOCK_K, GROUP_PAD] (a scalar stays one)
            return x if jnp.ndim(x) == 0 else lax.broadcast_in_dim(x, (BLOCK_K, GROUP_PAD), [0])

        def cols2(x, m):  # [GROUP_PAD] -> [m, GROUP_PAD]
            return lax.broadcast_in_dim(x, (m, GROUP_PAD), [1])

        def step(j, carry):
            slot = lax.rem(j, jnp.int32(stages))
            pages = slot_pages(j)
            valid = [page >= 0 for _, page in pages]
            needed = functools.reduce(jnp.logical_or, valid)
            plgpu.barrier_wait(k_full.at[slot])
            plgpu.barrier_wait(v_full.at[slot])

            def compute(carry):
                acc, m_i, l_i, v_ref_sc = carry
                k_op = k_smem.at[slot]
                if interpret:
                    q_eff = sum(q_smem[part].astype(jnp.float32) for part in range(q_smem.shape[0]))
                    st = jnp.dot(k_op[...].astype(jnp.float32), q_eff.T, preferred_element_type=jnp.float32)
                else:
                    def qk(acc_ref):
                        for part in range(q_smem.shape[0]):
                            plgpu.wgmma(acc_ref, k_op, plgpu.transpose_ref(q_smem.at[part], (1, 0)))
                        return acc_ref[...]

                    st = pl.run_scoped(qk, plgpu.ACC((BLOCK_K, GROUP_PAD), jnp.float32))
                if fp8:  # V e4m3 -> f16 into the shared buffer (the previous slot's P V has completed)
                    src, dst = v_smem.at[slot], v16[0]
                    if interpret:
                        dst[...] = src[...].astype(jnp.float16)
                    else:
                        x = plgpu.load(src, (), layout=plgpu.Layout.WGMMA_UPCAST_2X)
                        dst[...] = plgpu.layout_cast(x.astype(jnp.float16), plgpu.Layout.WGMMA)
                    v_op = dst
                else:
                    v_op = v_smem.at[slot]
                k0 = per_row([jnp.where(ok, k0, 0) for ok, (k0, _) in zip(valid, pages)])
                ok = per_row([ok.astype(jnp.int32) for ok in valid]) > 0
                kpos = k0 + k_off
                vis = ok & (kpos <= pos) & ((w == 0) | (pos - kpos < w) | (kpos < sk))
                if fp8:
                    k_sc = [jnp.where(ok, ks_ref[jnp.maximum(page, 0)], 0.0) for ok, (_, page) in zip(valid, pages)]
                    v_sc = [jnp.where(ok, vs_ref[jnp.maximum(page, 0)], 0.0) for ok, (_, page) in zip(valid, pages)]
                    logits = st * rows2(per_row(k_sc)) * cols2(q_fac, BLOCK_K)
                else:
                    logits = st * cols2(q_fac, BLOCK_K)
                logits = jnp.where(rows2(vis), logits, -jnp.inf)
                m_new = jnp.maximum(m_i, logits.max(axis=0))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(logits - cols2(m_use, BLOCK_K))
                l_i = l_i * alpha + p.sum(axis=0)
                if fp8:  # value scales relative to the running reference (module doc)
                    ref_new = functools.reduce(jnp.maximum, v_sc, v_ref_sc)
                    ref_safe = jnp.where(ref_new > 0, ref_new, 1.0)
                    p = p * rows2(per_row(v_sc) / ref_safe)
                    alpha = alpha * (v_ref_sc / ref_safe)
                    v_ref_sc = ref_new
                acc = acc * cols2(alpha, head_dim)
                p_smem[...] = p.astype(p_dtype)
                if interpret:
                    acc = acc + jnp.dot(v_op[...].T, p_smem[...], preferred_element_type=jnp.float32)
                else:
                    plgpu.commit_smem()

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, plgpu.transpose_ref(v_op, (1, 0)), p_smem)

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                return acc, m_new, l_i, v_ref_sc

            carry = lax.cond(needed, compute, lambda c: c, carry)
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            return carry

        m_i = cast(jnp.full((GROUP_PAD,), -jnp.inf, jnp.float32), col_layout, interpret)
        l_i = cast(jnp.full((GROUP_PAD,), 0.0, jnp.float32), col_layout, interpret)
        acc = cast(jnp.full((head_dim, GROUP_PAD), 0.0, jnp.float32), plgpu.Layout.WGMMA, interpret)
        acc, m_i, l_i, v_ref_sc = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i, jnp.float32(0.0)))
        seen = l_i > 0  # a split (or a padding token) that saw no key: output 0, lse -inf
        l_safe = jnp.where(seen, l_i, 1.0)
        lse = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)  # m_i in base 2
        if fp8:  # the accumulator is in units of the reference scale, > 0 once a page was visited
            l_safe = l_safe / jnp.where(v_ref_sc > 0, v_ref_sc, 1.0)
        out = acc / cols2(l_safe, head_dim)
        out_smem.at[pl.ds(0, head_dim)][...] = out
        out_smem.at[pl.ds(head_dim, 64)][...] = cols2(lse, 64)
        if not interpret:
            plgpu.commit_smem()
        part = (th * num_splits + s)
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, head_dim + _LSE_ROWS)], o_ref.at[part])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        def issue(j, slot):
            pages = [page for _, page in slot_pages(j)]
            sub = functools.reduce(lambda a, o: jnp.where(a >= 0, a, o), pages)  # a page of the slot, or -1
            srcs = [jnp.where(page >= 0, page, sub) for page in pages]

            @pl.when(sub >= 0)
            def _():
                for i, src in enumerate(srcs):
                    keys = pl.ds(i * page_size, page_size)
                    plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot, keys], k_full.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot, keys], v_full.at[slot])

            @pl.when(sub < 0)
            def _():  # only holes: the slot is signalled, nothing is read
                for _ in range(per_slot):
                    plgpu.barrier_arrive(k_full.at[slot])
                    plgpu.barrier_arrive(v_full.at[slot])

        produce_ring(n_steps, stages, issue, (k_free, v_free))


def shape_reason(call) -> str | None:  # kvjax.ops.attention.PagedAttentionCall
    """What this kernel cannot take (``"needs ..., got ..."``), or None: page sizes :data:`SUPPORTED_PAGE_SIZES`,
    head_dim 64 / 128, a GQA group of at most :data:`GROUP_PAD`, bf16 / f16 q with pages of q's dtype or
    float8_e4m3fn, one token a row (``T <= B`` rows' tokens: a decode batch)."""
    q, k_pages, v_pages = call.q, call.k_pages, call.v_pages
    page_size, d = call.page_size, q.shape[-1]
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"needs page_size in {SUPPORTED_PAGE_SIZES}, got {page_size}"
    if d not in SUPPORTED_HEAD_DIMS:
        return f"needs head_dim in {SUPPORTED_HEAD_DIMS}, got {d}"
    group = q.shape[1] // call.num_kv_heads
    if group > GROUP_PAD:
        return f"needs a GQA group of at most {GROUP_PAD} query heads, got {group}"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype not in (q.dtype, FP8_DTYPE) or (
            v_pages.dtype != k_pages.dtype):
        return (f"needs bf16 or f16 q with K/V pages of q's dtype or float8_e4m3fn, got {q.dtype}, {k_pages.dtype}, "
                f"{v_pages.dtype}")
    if call.max_query_len is not None and call.max_query_len > 1:
        return f"needs a decode batch (max_query_len 1), got max_query_len={call.max_query_len}"
    return None


def default_num_splits(num_tokens: int, num_kv_heads: int, max_blocks: int, page_size: int) -> int:
    """Static split count: about :data:`_TARGET_CTAS` CTAs, never more splits than ring slots of the longest walk
    (at most 64)."""
    splits = next_pow2(pl.cdiv(_TARGET_CTAS, max(1, num_tokens * num_kv_heads)))
    return int(max(1, min(splits, pl.cdiv(max_blocks * page_size, BLOCK_K), 64)))


def _q_operands(call, fp8: bool) -> tuple[jax.Array, jax.Array]:
    """q as the kernel's B operand ``[T*Hkv, parts, 16, D]`` (fp8 pages: the two e4m3 tiles ``h``, ``l`` of
    ``q / s``; else q itself) and the q scales ``f32[T*Hkv, 16]`` (``s``; 1 for float pages), padded heads 0."""
    t_total, hq, d = call.q.shape
    hkv = call.num_kv_heads
    group = hq // hkv
    q = call.q.reshape(t_total * hkv, group, d)
    pad = ((0, 0), (0, GROUP_PAD - group), (0, 0))
    if not fp8:
        return jnp.pad(q, pad)[:, None], jnp.ones((t_total * hkv, GROUP_PAD), jnp.float32)
    x = q.astype(jnp.float32)
    s, inv = q_row_scales(jnp.abs(x).max(axis=-1))  # f32[T*Hkv, G] each
    y = x * inv[..., None]
    parts = []
    for part in range(_Q_PARTS):
        hi = y.astype(FP8_DTYPE)
        parts.append(jnp.pad(hi, pad))
        if part + 1 < _Q_PARTS:
            y = y - hi.astype(jnp.float32)
    return jnp.stack(parts, axis=1), jnp.pad(s, ((0, 0), (0, GROUP_PAD - group)))


@functools.partial(jax.jit, static_argnames=("num_splits", "stages", "interpret"))
def paged_decode_mgpu(
    call,  # kvjax.ops.attention.PagedAttentionCall (checked by the op)
    *,
    num_splits: int | None = None,
    stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D] in q's dtype
    """Split-KV paged decode (one query token per row) as a Mosaic GPU kernel: the contract of
    :func:`kvjax.pallas.paged.decode.paged_decode` for decode batches (module doc), except that a page's
    unwritten tail is read (finite values needed, as prefill_mgpu). fp8 pages read as ``page * scale``.

    ``num_splits`` (default :func:`default_num_splits`), ``stages`` ring slots of 128 keys (default 2).
    ``interpret`` runs the Mosaic GPU interpreter on the CPU. Reads only; tokens of no row get 0. ``ValueError``
    for what :func:`shape_reason` rejects and for ``stages`` / ``num_splits`` below 1.
    """
    q, k_pages = call.q, call.k_pages
    t_total, hq, d = q.shape
    hkv, page_size = call.num_kv_heads, call.page_size
    reason = shape_reason(call)
    if reason:
        raise ValueError(f"paged_decode_mgpu {reason}")
    stages = 2 if stages is None else stages
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if num_splits is None:
        num_splits = default_num_splits(t_total, hkv, call.max_blocks, page_size)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    fp8, k_scale, v_scale = common.page_scales(call)
    q_op, q_scale = _q_operands(call, fp8)
    spans, walks = decode.spans_and_walks(call, 1)
    kv_dtype = k_pages.dtype
    k_swizzle = min(SWIZZLE, d * kv_dtype.itemsize)
    k_tiles = (plgpu.TilingTransform((8, k_swizzle // kv_dtype.itemsize)), plgpu.SwizzleTransform(k_swizzle))
    half = (plgpu.TilingTransform((8, P_SWIZZLE // 2)), plgpu.SwizzleTransform(P_SWIZZLE))  # f16 / bf16 tiles
    per_slot = BLOCK_K // page_size
    p_dtype = jnp.float16 if fp8 else kv_dtype
    scratch = (
        (
            plgpu.SMEM(q_op.shape[1:], q_op.dtype, transforms=k_tiles),
            plgpu.SMEM((stages, BLOCK_K, d), kv_dtype, transforms=k_tiles),
            plgpu.SMEM((stages, BLOCK_K, d), kv_dtype, transforms=k_tiles if fp8 else half),
            *([plgpu.SMEM((BLOCK_K, d), jnp.float16, transforms=half)] if fp8 else []),
            plgpu.SMEM((BLOCK_K, GROUP_PAD), p_dtype, transforms=half),
            plgpu.SMEM((d + 64, GROUP_PAD), jnp.float32),
        ),
        (
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=per_slot, num_barriers=stages),
            plgpu.Barrier(num_arrivals=per_slot, num_barriers=stages),
        ),
        (plgpu.Barrier(num_barriers=stages),) * 2,
    )
    kernel = functools.partial(
        _kernel, scale=call.scale, group=hq // hkv, page_size=page_size, max_blocks=call.max_blocks,
        num_kv_heads=hkv, num_splits=num_splits, stages=stages, fp8=fp8, interpret=interpret,
    )
    n_part = t_total * hkv * num_splits
    res = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((n_part, d + _LSE_ROWS, GROUP_PAD), jnp.float32),
        scratch_types=scratch,
        grid=(num_splits, hkv, t_total),
        grid_names=("split", "head", "token"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None,
    )(*common.operands(call, (q_op, k_pages, call.v_pages, k_scale, v_scale), spans, walks), q_scale)
    group = hq // hkv
    res = res.reshape(t_total, hkv, num_splits, d + _LSE_ROWS, GROUP_PAD)[..., :group]
    o_part = jnp.swapaxes(res[..., :d, :], -1, -2)  # f32[T, Hkv, S, G, D]
    lse = res[..., d, :]  # f32[T, Hkv, S, G]
    out = o_part[:, :, 0] if num_splits == 1 else merge_splits(o_part, lse, axis=2)
    return out.reshape(t_total, hq, d).astype(q.dtype)
