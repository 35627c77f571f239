"""Split-KV paged decode on CUDA cores (Pallas, Triton lowering), written for fp8 pages and small GQA groups: a
candidate beside the tensor-core kernel of :mod:`.decode` for issue #35 (timed side by side by
``benchmarks/fp8_decode.py``; the backend table does not choose it).

Same grid, page walk, masks, scales and split outputs as the tensor-core kernel of :mod:`.decode` (one program
per (query token, KV head, split); ``-1`` holes and invisible keys masked at the load, so never read); only the
products differ. With ``G = Hq / Hkv`` query heads a KV head (4 at the common shapes), a tensor-core tile of 16
rows is mostly padding, and its ``P V`` operand needs V transposed, which 8-bit pages cannot do with ``ldmatrix``.
Here each key block is loaded as ``n_sub`` sub-blocks of ``slots`` keys x ``D``, laid out so that a thread holds
one 16-byte vector of one key, converted to f32 in that load layout (no shared-memory round trip), and:

- ``q . k``: for each of the ``G`` query heads, the elementwise product with the broadcast query row summed over
  ``D`` (the thread's part in registers, then a few warp shuffles), times the key's page scale;
- the online softmax runs per *slot*: key ``j`` of a block belongs to slot ``j % slots``, and each slot keeps its
  own running max, sum and ``f32[D]`` accumulator per query head, so a block needs no reduction over keys at all
  (``P V`` is ``acc += p[:, None] * v`` elementwise in the load layout: V is never transposed); the slots are
  merged once, after the walk, by the same log-sum-exp rule as the splits.

``prefetch=True`` issues the next block's loads (page ids, K, V, scales) before this block's arithmetic and carries
them in registers, a two-buffer pipeline within a program. Everything runs in f32 (the query scaled once by the
softmax scale times ``log2 e`` for exp2); only the output is rounded to q's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.base.device import is_pow2
from kvjax.pallas.paged import common, decode
from kvjax.pallas.split_kv import LN2, LOG2E

_NEG_INF = float("-inf")
_VECTOR_BYTES = 16  # one 128-bit load a thread and sub-block


def default_slots(head_dim: int, itemsize: int, num_warps: int) -> int:
    """Keys a sub-block: as many as give every thread exactly one 16-byte vector of one key (``num_warps * 32``
    threads, ``16 / itemsize`` values each), at least 1."""
    return max(1, num_warps * 32 * (_VECTOR_BYTES // itemsize) // head_dim)


def _fma_kernel(
    *refs,  # common.operands (spans: row, pos i32[T] per token), then o_ref (num_splits == 1: [T*Hq, D] in q's
    #         dtype; else f32[T*Hkv*S*G, D]) and, for num_splits > 1, lse_ref f32[T*Hkv*S*G]
    scale: float,
    group: int,
    slots: int,
    n_sub: int,
    page_size: int,
    max_blocks: int,
    num_kv_heads: int,
    num_splits: int,
    fp8: bool,
    prefetch: bool,
):
    (q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref), (row_ref, pos_ref), walk, (o_ref, *lse_refs) = \
        common.kernel_refs(refs, num_spans=2)
    t = pl.program_id(0)
    h = pl.program_id(1)
    s = pl.program_id(2)
    th = t * num_kv_heads + h
    b = row_ref[t]
    i = pos_ref[t]
    lo, n_sink, n_pages, w, sk = common.walk_at(walk, th, h)
    block_k = slots * n_sub
    pages_per_block = block_k // page_size

    per_split = pl.cdiv(n_pages, num_splits)
    start = s * per_split
    end = jnp.minimum(n_pages, start + per_split)
    n_iter = pl.cdiv(jnp.maximum(end - start, 0), pages_per_block)

    head_dim = q_ref.shape[1]
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    q_rows = [th * group + g for g in range(group)]
    qs = [plgpu.load(q_ref.at[r, cols]).astype(jnp.float32) * (scale * LOG2E) for r in q_rows]  # f32[D] each

    r_idx = jnp.arange(slots, dtype=jnp.int32)
    bt_base = (b * num_kv_heads + h) * max_blocks

    def load_block(c):  # the block's n_sub sub-blocks: (ok bool[slots], k, v [slots, D] raw, k_sc, v_sc f32[slots])
        subs = []
        for u in range(n_sub):
            j = u * slots + r_idx
            vp = start + c * pages_per_block + j // page_size
            in_range = vp < end
            col = jnp.where(vp < n_sink, vp, lo + vp - n_sink)
            page = plgpu.load(bt_ref.at[jnp.where(in_range, bt_base + col, 0)], mask=in_range, other=-1)
            kpos = col * page_size + j % page_size
            visible = (kpos <= i) & ((w == 0) | (i - kpos < w) | (kpos < sk))
            ok = in_range & (page >= 0) & visible
            safe = jnp.where(ok, page, 0)
            kv_rows = safe * page_size + j % page_size
            k = plgpu.load(k_ref.at[kv_rows[:, None], cols[None, :]], mask=ok[:, None], other=0.0)
            v = plgpu.load(v_ref.at[kv_rows[:, None], cols[None, :]], mask=ok[:, None], other=0.0)
            if fp8:
                k_sc = plgpu.load(ks_ref.at[safe], mask=ok, other=0.0)  # f32[slots]: each key's page scale
                v_sc = plgpu.load(vs_ref.at[safe], mask=ok, other=0.0)
            else:
                k_sc = v_sc = None
            subs.append((ok, k, v, k_sc, v_sc))
        return subs

    def update(subs, ms, ls, accs):
        # sub-block by sub-block, so that one sub-block's K (then V) is live in f32 at a time
        sc = [[] for _ in range(group)]  # f32[slots] per (head, sub-block), log2 units
        for ok, k, _, k_sc, _ in subs:
            k = k.astype(jnp.float32)
            for g in range(group):
                x = jnp.sum(qs[g][None, :] * k, axis=1)
                sc[g].append(jnp.where(ok, x if k_sc is None else x * k_sc, _NEG_INF))
        out_m, out_l, ps, out_acc = [], [], [], []
        for g in range(group):
            m_new = functools.reduce(jnp.maximum, sc[g], ms[g])
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            alpha = jnp.exp2(ms[g] - m_safe)
            ps.append([jnp.exp2(x - m_safe) for x in sc[g]])
            out_m.append(m_new)
            out_l.append(ls[g] * alpha + functools.reduce(jnp.add, ps[g]))
            out_acc.append(accs[g] * alpha[:, None])
        for u, (_, _, v, _, v_sc) in enumerate(subs):
            v = v.astype(jnp.float32)
            for g in range(group):
                pv = ps[g][u] if v_sc is None else ps[g][u] * v_sc  # the value scale on the probability (l unscaled)
                out_acc[g] = out_acc[g] + pv[:, None] * v
        return tuple(out_m), tuple(out_l), tuple(out_acc)

    state0 = (tuple(jnp.full((slots,), _NEG_INF, jnp.float32) for _ in range(group)),
              tuple(jnp.zeros((slots,), jnp.float32) for _ in range(group)),
              tuple(jnp.zeros((slots, head_dim), jnp.float32) for _ in range(group)))
    if prefetch:
        def body(c, carry):
            cur, state = carry
            nxt = load_block(c + 1)  # masked past the split's end: nothing read
            return nxt, update(cur, *state)

        _, (ms, ls, accs) = jax.lax.fori_loop(0, n_iter, body, (load_block(0), state0))
    else:
        ms, ls, accs = jax.lax.fori_loop(0, n_iter, lambda c, st: update(load_block(c), *st), state0)

    for g in range(group):  # merge the slots (log-sum-exp, base 2), then write the row
        m_all = jnp.max(ms[g])
        m_safe = jnp.where(m_all == _NEG_INF, 0.0, m_all)
        wgt = jnp.exp2(ms[g] - m_safe)  # f32[slots]: an empty slot weighs 0
        l_all = jnp.sum(wgt * ls[g])
        o = jnp.sum(wgt[:, None] * accs[g], axis=0) / jnp.where(l_all > 0, l_all, 1.0)  # f32[D]
        if num_splits == 1:
            plgpu.store(o_ref.at[q_rows[g], cols], o.astype(o_ref.dtype))
        else:
            (lse_ref,) = lse_refs
            part = (th * num_splits + s) * group + g
            plgpu.store(o_ref.at[part, cols], o)
            lse = jnp.where(l_all > 0, (m_all + jnp.log2(jnp.where(l_all > 0, l_all, 1.0))) * LN2, _NEG_INF)
            plgpu.store(lse_ref.at[pl.ds(part, 1)], jnp.full((1,), lse, jnp.float32))


def _fma_call(
    call,  # kvjax.ops.attention.PagedAttentionCall
    k_scale: jax.Array,  # f32[P] (fp8 pages) or f32[1] (float pages: unread)
    v_scale: jax.Array,  # f32[P] or f32[1]
    spans: tuple[jax.Array, jax.Array],  # (row, pos): i32[T] each
    walks: tuple[jax.Array, jax.Array, jax.Array],  # (lo, n_sink, n_pages): i32[T, Hkv] each
    *,
    num_splits: int,
    block_k: int,
    slots: int,
    num_warps: int,
    num_stages: int,
    prefetch: bool,
    fp8: bool,
    interpret: bool,
) -> jax.Array:  # [T, Hq, D] in q's dtype
    t_total, hq, _ = call.q.shape
    page_size, hkv = call.page_size, call.num_kv_heads
    group = hq // hkv
    kernel = functools.partial(
        _fma_kernel, scale=call.scale, group=group, slots=slots, n_sub=block_k // slots, page_size=page_size,
        max_blocks=call.max_blocks, num_kv_heads=hkv, num_splits=num_splits, fp8=fp8, prefetch=prefetch,
    )
    res = pl.pallas_call(
        kernel,
        out_shape=decode.split_outputs(call, num_splits),
        grid=(t_total, hkv, num_splits),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"kvjax_paged_decode_fma{'_fp8' if fp8 else ''}_s{num_splits}_bk{block_k}_r{slots}"
             f"{'_pf' if prefetch else ''}",
    )(*common.operands(call, decode.flat_operands(call, k_scale, v_scale), spans, walks))
    return decode.merged(call, res, num_splits)


def unsupported(call) -> str | None:  # kvjax.ops.attention.PagedAttentionCall
    """Why :func:`paged_decode_fma` cannot take this call, or None: the calls of the tensor-core decode kernel
    (:func:`kvjax.pallas.paged.decode.unsupported`)."""
    return decode.unsupported(call)


@functools.partial(jax.jit, static_argnames=("interpret", "num_splits", "block_k", "slots", "num_warps",
                                             "num_stages", "prefetch"))
def paged_decode_fma(
    call,  # kvjax.ops.attention.PagedAttentionCall (checked by the op)
    *,
    interpret: bool = False,
    num_splits: int | None = None,
    block_k: int | None = None,
    slots: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch: bool = False,
) -> jax.Array:  # [T, Hq, D] in q's dtype
    """Split-KV paged attention of every query token on CUDA cores (module doc): the contract of
    ``kvjax.ops.paged_attention`` and of :func:`kvjax.pallas.paged.decode.paged_decode`, which takes the same
    calls (:func:`kvjax.pallas.paged.decode.unsupported`).

    Knobs: ``num_splits`` (default :func:`kvjax.pallas.paged.decode.default_num_splits`), ``block_k`` keys per
    step (default 64, at least one page and one sub-block), ``slots`` keys a sub-block (default
    :func:`default_slots`, at most ``block_k``), ``num_warps`` 4, ``num_stages`` 1 (the loads are pipelined by
    ``prefetch``, not by Triton's shared-memory stages), ``prefetch``. ``ValueError`` for shapes the decode kernel
    rejects and a ``block_k`` or ``slots`` not a power of two. fp8 pages read as ``page * scale``. Reads only;
    tokens that belong to no row get output 0.
    """
    reason = unsupported(call)
    if reason:
        raise ValueError(f"pallas paged_decode_fma {reason}")
    t_total, _, d = call.q.shape
    page_size = call.page_size
    num_warps = num_warps or 4
    for name, val in (("block_k", block_k), ("slots", slots)):
        if val is not None and not is_pow2(val):
            raise ValueError(f"{name} must be a power of two, got {val}")
    slots = slots or default_slots(d, call.k_pages.dtype.itemsize, num_warps)
    block_k = max(block_k or 64, page_size, slots)
    fp8, k_scale, v_scale = common.page_scales(call)
    if num_splits is None:
        num_splits = decode.default_num_splits(t_total, call.num_kv_heads, call.max_blocks, block_k // page_size)
    row, pos, real = common.token_positions(call.cu_seqlens, call.seq_lens, t_total)
    walks = common.page_ranges(pos, pos, real, call.window, call.sinks, page_size=page_size,
                               max_blocks=call.max_blocks)
    return _fma_call(call, k_scale, v_scale, (row, pos), walks, num_splits=num_splits, block_k=block_k,
                     slots=slots, num_warps=num_warps, num_stages=num_stages or 1, prefetch=prefetch, fp8=fp8,
                     interpret=interpret)
