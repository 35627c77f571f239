"""Head-wise paged attention, split-KV flash-decoding over single-head pages (Pallas, Triton lowering).

One program per (query span, KV head, split). A span is up to ``tokens_per_program`` (J) consecutive query tokens
of one row: the program holds those tokens x the GQA group of query heads of that KV head (``J * G`` rows,
token-major, padded to a power of two >= 16 for the tensor cores), so each K/V page is read once for all of them.
With J = 1 (a decode batch, the default without a bound) a span is one token. With a static ``max_query_len``
(a speculative verification step's ``K + 1``, at most :data:`MAX_TOKENS_PER_PROGRAM`) J = ``max_query_len``: the
*row mode*, one program per row where the one-token programs read a row's pages once per token. The spans are the
query tiles of :func:`kvjax.pallas.paged.common.tile_map`: a row's tokens are ``cu_seqlens[b] .. cu_seqlens[b+1]-1``
(contiguous by the op's contract, at positions ``seq_lens[b] - n ..`` in order), cut into spans of at most J;
so a row longer than J takes several spans and the kernel is exact for any batch, whatever the bound. The
padding tokens before and after the rows form spans of their own that attend to nothing and write 0. The span
count is a static bound (``ceil(T / J) + B + 2``), about twice a verification step's rows, and the spans that are
used come first (``tile_map`` puts the empty ones last); so that the empty ones cost no program, the row mode
launches ``B`` programs per KV head and split, program ``p`` taking spans ``p, p + B, ...`` up to the first
empty one (a verification step whose rows fill ``T``: one span each).

Each program walks only the virtual page list of :mod:`kvjax.pallas.paged.common` for its span's positions
``i0 .. i1`` and *its* KV head (sink pages + window pages), cut into ``num_splits`` equal parts; it loads only
keys some token of the span sees (``kpos <= i1``, in the window of ``i0`` or a sink), a ``-1`` table entry masked
at the load (a hole is never read), and masks each query token causally (token at ``pos`` sees keys ``<= pos``
within its own window, plus the sinks). Every split writes an f32 partial output and its log-sum-exp per query
token, merged by :func:`kvjax.pallas.split_kv.merge_splits` (an empty split, or a padding token, weighs 0, never
NaN).

Launch order (decode batches): one-token programs whose walk parts can be long go longest walk first
(:func:`default_longest_first`): the grid becomes 1-D over (rank, split), rank ``r`` taking the (token, KV head)
with the ``r``-th longest walk (:func:`longest_walks_first`, one sort of ``T * Hkv`` keys before the kernel). In
the grid order a batch of mixed walk lengths (short-window heads beside full ones, rows of different lengths)
launched long programs behind short ones, and the last long ones ran in a late wave with the GPU mostly idle: over
fp8 pages on an H200, where the kernel is latency-bound, head-wise SWA took 0.214 ms in the grid order and 0.154
longest first, a batch of rows of 8192 and 512 tokens 0.210 and 0.147; bf16 pages 1.03x / 1.10x. Uniform batches
pay the sort (1-3%). Cutting every walk in parts of one length (the longest walk's part) instead, alone or
with this order, was slower (RESULTS.md "Head-wise SWA decode").

fp8 pages (float8_e4m3fn with ``k_scale`` / ``v_scale`` ``f32[P]``): the kernel loads the page bytes (1 byte a
value; no dequantised copy of the cache exists anywhere), converts them to q's dtype, multiplies each logit of a
key by its page's key scale (folded with the softmax scale into one per-key factor) and each probability by its
page's value scale before the ``P V`` product; accumulation stays f32. A key's two scales are loaded with it,
per key like its page id, so a hole's or a masked key's scale is never read.

The kernel is exact for *any* ragged batch, so it is the ``"pallas"`` backend of ``kvjax.ops.paged_attention``:
the fallback on every GPU and what ``impl="interpret"`` runs; for prefill-shaped batches the table prefers the
prefill kernels (:mod:`kvjax.pallas.paged.prefill`, :mod:`kvjax.pallas.paged.prefill_mgpu`), except a
verification step's few tokens a row (the prefill kernel's ``FEW_TOKENS`` / ``FEW_TOTAL``, which send them here,
to the row mode; ``benchmarks/verify_attn.py`` measures the three).
Measured and not kept: fixed-size splits (``balanced``), tied on full heads and never ahead on SWA heads; a
manual register prefetch of the next block, block_k 32, 8 warps; over fp8 pages, products in f16 (one conversion
instruction per two e4m3 values instead of three) and e4m3 tensor-core products (q quantised per row, ``P V`` on
e4m3 or f16), each slower than the conversion to q's dtype, and a conversion by bit placement (no conversion
instructions) with V converted in its load layout so that ``P V`` reads it with transposed ``ldmatrix`` instead of a
byte-wise shared-memory gather: its SASS had neither, its time did not improve; a block's page ids read one block
ahead or in one layout for K and V (no synchronous page-id load before the next block's copies): slower; a
CUDA-core kernel (f32 broadcast products, a softmax per key slot, V never transposed): 0.51-0.82x this one over fp8
pages (RESULTS.md "fp8 (e4m3) pages"). Over fp8 pages a decode program (one 16-row tile) runs 2 warps and 4 stages:
with 4 warps and 2 stages it held 168 registers a thread (3 programs an SM) and its warps waited on the conversions'
results (Nsight Compute, ``benchmarks/ncu_probe.py``); 2 warps and 4 stages measured 1.14-1.18x faster on an H200
(block_k 32 with one warp 3% faster again at pages of 16, and within one stage of it 1.3x slower: not taken).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.base.device import next_pow2
from kvjax.pallas.paged import common
from kvjax.pallas.split_kv import merge_splits

_NEG_INF = float("-inf")
_TARGET_PROGRAMS = 1024  # split the KV walk until about this many programs run (132 SMs on H100/H200)
MAX_TOKENS_PER_PROGRAM = 8  # J_MAX: the most query tokens of a row one program holds (8 x G=8: 64 query rows)
LONG_PART_BLOCKS = 8  # walk parts of this many K/V blocks or more launch longest first (default_longest_first)


def _decode_kernel(
    *refs,  # common.operands (spans: row, first token, length, first position: i32[N] per span of at most
    #         `tokens` consecutive tokens of one row), then o_ref (num_splits == 1: [T*Hq, D] in q's dtype; else
    #         f32[T*Hkv*S*G, D]) and, for num_splits > 1, lse_ref f32[T*Hkv*S*G]
    scale: float,
    group: int,
    tokens: int,
    rows: int,
    programs: int,
    page_size: int,
    block_k: int,
    max_blocks: int,
    num_kv_heads: int,
    num_splits: int,
    fp8: bool,
    longest_first: bool,
):
    (q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref), (row_ref, tok_ref, len_ref, pos_ref), walk, rest = \
        common.kernel_refs(refs, num_spans=4)
    num_spans = row_ref.shape[0]
    if longest_first:  # a 1-D grid over (rank, split), splits fastest; rank r is (span, KV head) order_ref[r]
        order_ref, o_ref, *lse_refs = rest
        item = order_ref[pl.program_id(0) // num_splits]
        first, h, s = item // num_kv_heads, item % num_kv_heads, pl.program_id(0) % num_splits
    else:
        o_ref, *lse_refs = rest
        first, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pages_per_block = block_k // page_size
    cols = jnp.arange(q_ref.shape[1], dtype=jnp.int32)
    r = jnp.arange(rows, dtype=jnp.int32)  # query row r: token r // G of the span, query head h * G + r % G
    r_tok = r // group
    g = r % group
    j = jnp.arange(block_k, dtype=jnp.int32)
    j_page = j // page_size
    j_off = j % page_size

    def attend(t, n_tok):  # span t of this KV head and split, its n_tok tokens
        b = row_ref[t]
        i0 = pos_ref[t]
        i1 = i0 + jnp.maximum(n_tok, 1) - 1  # the span's last position
        lo, n_sink, n_pages, w, sk = common.walk_at(walk, t * num_kv_heads + h, h)

        per_split = pl.cdiv(n_pages, num_splits)  # every walk cut into num_splits equal parts
        start = s * per_split
        end = jnp.minimum(n_pages, start + per_split)
        n_iter = pl.cdiv(jnp.maximum(end - start, 0), pages_per_block)

        q_ok = (r < tokens * group) & (r_tok < n_tok)
        tok = tok_ref[t] + r_tok  # i32[rows]: each query row's token
        q_rows = (tok * num_kv_heads + h) * group + g
        q = plgpu.load(q_ref.at[jnp.where(q_ok, q_rows, 0)[:, None], cols[None, :]], mask=q_ok[:, None],
                       other=0.0)
        q_pos = (i0 + r_tok)[:, None]  # i32[rows, 1]: each query row's position
        bt_base = (b * num_kv_heads + h) * max_blocks

        def load_block(c):
            vp = start + c * pages_per_block + j_page
            in_range = vp < end
            col = jnp.where(vp < n_sink, vp, lo + vp - n_sink)
            page = plgpu.load(bt_ref.at[jnp.where(in_range, bt_base + col, 0)], mask=in_range, other=-1)
            kpos = col * page_size + j_off
            # keys that some query of the span (positions i0..i1) sees: the only ones loaded
            seen = (kpos <= i1) & ((w == 0) | (i0 - kpos < w) | (kpos < sk))
            ok = in_range & (page >= 0) & seen
            kv_rows = jnp.where(ok, page, 0) * page_size + j_off
            k = plgpu.load(k_ref.at[kv_rows[:, None], cols[None, :]], mask=ok[:, None], other=0.0)
            v = plgpu.load(v_ref.at[kv_rows[:, None], cols[None, :]], mask=ok[:, None], other=0.0)
            visible = ok[None, :]  # bool[1 or rows, block_k]
            if tokens > 1:  # each query token its own causal / window / sink mask
                kp = kpos[None, :]
                visible = visible & (kp <= q_pos) & ((w == 0) | (q_pos - kp < w) | (kp < sk))
            if not fp8:
                return k, v, visible, scale, None
            safe = jnp.where(ok, page, 0)
            k_sc = plgpu.load(ks_ref.at[safe], mask=ok, other=0.0)  # f32[block_k]: each key's page scale
            v_sc = plgpu.load(vs_ref.at[safe], mask=ok, other=0.0)
            return k.astype(q.dtype), v.astype(q.dtype), visible, (scale * k_sc)[None, :], v_sc[None, :]

        def update(k, v, visible, k_factor, v_factor, acc, m, l):
            sc = plgpu.dot(q, k, trans_b=True) * k_factor  # f32[rows, block_k]
            sc = jnp.where(visible, sc, _NEG_INF)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(sc - m_safe[:, None])
            l = l * alpha + jnp.sum(p, axis=1)
            pv = p if v_factor is None else p * v_factor  # fp8: the value scale on the probabilities (l unscaled)
            acc = acc * alpha[:, None] + plgpu.dot(pv.astype(v.dtype), v)
            return acc, m_new, l

        def body(c, carry):
            return update(*load_block(c), *carry)

        head_dim = q.shape[-1]
        acc = jnp.zeros((rows, head_dim), jnp.float32)
        m = jnp.full((rows,), _NEG_INF, jnp.float32)
        l = jnp.zeros((rows,), jnp.float32)
        acc, m, l = jax.lax.fori_loop(0, n_iter, body, (acc, m, l))
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        if num_splits == 1:
            plgpu.store(o_ref.at[q_rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=q_ok[:, None])
        else:
            (lse_ref,) = lse_refs
            part_rows = ((tok * num_kv_heads + h) * num_splits + s) * group + g  # the real rows only
            plgpu.store(o_ref.at[part_rows[:, None], cols[None, :]], out, mask=q_ok[:, None])
            lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), _NEG_INF)
            plgpu.store(lse_ref.at[part_rows], lse, mask=q_ok)

    if programs == num_spans:  # a program per span
        attend(first, len_ref[first])
        return

    def length(t):  # tokens of span t; 0 past the last span
        return jnp.where(t < num_spans, len_ref[jnp.minimum(t, num_spans - 1)], 0)

    def one_span(carry):  # spans p, p + programs, ... up to the first empty one: the spans left empty cost nothing
        t, n_tok = carry
        attend(t, n_tok)
        return t + programs, length(t + programs)

    jax.lax.while_loop(lambda carry: carry[1] > 0, one_span, (first, length(first)))


def query_rows(tokens: int, group: int) -> int:
    """Query rows of one program: its ``tokens x G`` (token-major), padded to a power of two >= 16 (a tensor-core
    tile)."""
    return max(16, next_pow2(tokens * group))


def _decode_call(
    call,  # kvjax.ops.attention.PagedAttentionCall
    k_scale: jax.Array,  # f32[P] (fp8 pages) or f32[1] (float pages: unread)
    v_scale: jax.Array,  # f32[P] or f32[1]
    spans: tuple[jax.Array, ...],  # (row, first token, length, first position): i32[N] each
    walks: tuple[jax.Array, jax.Array, jax.Array],  # (lo, n_sink, n_pages): i32[N, Hkv] each
    *,
    tokens: int,
    num_splits: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    fp8: bool,
    longest_first: bool,
    interpret: bool,
) -> jax.Array:  # [T, Hq, D]
    page_size, hkv, max_blocks = call.page_size, call.num_kv_heads, call.max_blocks
    group = call.q.shape[1] // hkv
    num_spans = spans[0].shape[0]
    programs = num_spans if tokens == 1 else max(1, min(num_spans, call.block_tables.shape[0]))
    kernel = functools.partial(
        _decode_kernel, scale=call.scale, group=group, tokens=tokens, rows=query_rows(tokens, group),
        programs=programs, page_size=page_size, block_k=block_k,
        max_blocks=max_blocks, num_kv_heads=hkv, num_splits=num_splits, fp8=fp8, longest_first=longest_first,
    )
    grid, order = (programs, hkv, num_splits), ()
    if longest_first:
        grid, order = (programs * hkv * num_splits,), (longest_walks_first(walks[2]),)
    res = pl.pallas_call(
        kernel,
        out_shape=split_outputs(call, num_splits),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"kvjax_paged_decode{'_fp8' if fp8 else ''}{f'_rows{tokens}' if tokens > 1 else ''}"
             f"_s{num_splits}_bk{block_k}",
    )(*common.operands(call, flat_operands(call, k_scale, v_scale), spans, walks), *order)
    return merged(call, res, num_splits)


def longest_walks_first(n_pages: jax.Array) -> jax.Array:  # i32[N*Hkv]
    """The (span, KV head) items ``span * Hkv + h`` ordered by their walk's length ``n_pages: i32[N, Hkv]``, longest
    first, ties in grid order (a stable sort; sorting packed int32 keys instead measured no faster)."""
    return jnp.argsort(-n_pages.reshape(-1), stable=True).astype(jnp.int32)


def default_longest_first(tokens: int, max_blocks: int, pages_per_block: int, num_splits: int) -> bool:
    """Whether a call launches its programs longest walk first: one-token programs (a decode batch) whose walk part
    can be :data:`LONG_PART_BLOCKS` K/V blocks or more, where a ragged batch or short-window heads leave long
    programs to a late, latency-bound wave (module doc). Shorter parts take the grid order: the order's sort (2.5-5
    us on an H200) would cost more than the imbalance."""
    return tokens == 1 and pl.cdiv(pl.cdiv(max_blocks, pages_per_block), num_splits) >= LONG_PART_BLOCKS


def flat_operands(call, k_scale: jax.Array, v_scale: jax.Array) -> tuple[jax.Array, ...]:
    """The decode kernels' data operands: q ``[T*Hq, D]``, K and V pages ``[P*page_size, D]`` and the two scales
    (f32[P], or f32[1] unread for float pages)."""
    t_total, hq, d = call.q.shape
    rows = call.k_pages.shape[0] * call.page_size
    return (call.q.reshape(t_total * hq, d), call.k_pages.reshape(rows, d), call.v_pages.reshape(rows, d), k_scale,
            v_scale)


def split_outputs(call, num_splits: int):
    """The decode kernels' outputs: ``[T*Hq, D]`` in q's dtype (one split), else the partial outputs
    ``f32[T*Hkv*S*G, D]`` and their log-sum-exps ``f32[T*Hkv*S*G]``."""
    t_total, hq, d = call.q.shape
    if num_splits == 1:
        return jax.ShapeDtypeStruct((t_total * hq, d), call.q.dtype)
    n_part = t_total * hq * num_splits
    return jax.ShapeDtypeStruct((n_part, d), jnp.float32), jax.ShapeDtypeStruct((n_part,), jnp.float32)


def merged(call, res, num_splits: int) -> jax.Array:  # [T, Hq, D] in q's dtype
    """The attention output from what a decode kernel wrote (:func:`split_outputs`): the splits merged by
    :func:`kvjax.pallas.split_kv.merge_splits`."""
    t_total, hq, d = call.q.shape
    if num_splits == 1:
        return res.reshape(t_total, hq, d)
    hkv = call.num_kv_heads
    o_part, lse = res
    o_part = o_part.reshape(t_total, hkv, num_splits, hq // hkv, d)
    lse = lse.reshape(t_total, hkv, num_splits, hq // hkv)
    return merge_splits(o_part, lse, axis=2).reshape(t_total, hq, d).astype(call.q.dtype)


def unsupported(call) -> str | None:  # kvjax.ops.attention.PagedAttentionCall
    """Why :func:`paged_decode` cannot take this call (shapes only), or None: it takes any batch with a
    power-of-two ``head_dim >= 16`` and a power-of-two ``page_size``, float or fp8 pages."""
    return common.triton_shape_reason(call)


def default_tokens_per_program(max_query_len: int | None) -> int:
    """Query tokens of a row one program holds: the call's static ``max_query_len`` (a verification step's
    ``K + 1``) up to :data:`MAX_TOKENS_PER_PROGRAM`, else one (a decode batch, or no bound given)."""
    return min(max_query_len, MAX_TOKENS_PER_PROGRAM) if max_query_len else 1


def default_num_splits(num_tokens: int, num_kv_heads: int, max_blocks: int, pages_per_block: int,
                       tokens_per_program: int = 1) -> int:
    """Static split count: enough programs to fill the GPU, never more splits than KV blocks (programs counted
    as ``ceil(T / tokens_per_program)`` spans x KV heads: the spans of a verification step's full rows)."""
    spans = pl.cdiv(num_tokens, tokens_per_program)
    splits = next_pow2(pl.cdiv(_TARGET_PROGRAMS, max(1, spans * num_kv_heads)))
    return int(max(1, min(splits, pl.cdiv(max_blocks, pages_per_block), 64)))


def spans_and_walks(call, tokens: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The kernel's spans ``(row, first token, length, first position): i32[N]`` each and their page walks
    ``(lo, n_sink, n_pages): i32[N, Hkv]`` each. One token: a span per token (``N = T``; tokens of no row attend to
    nothing and get 0). More: the query tiles of :func:`kvjax.pallas.paged.common.tile_map`, at most ``tokens``
    consecutive tokens of one row (a row's tokens are ``cu_seqlens[b] .. cu_seqlens[b+1]-1``, contiguous, at
    positions ``seq_lens[b] - n ..`` in order), the padding before and after the rows in spans of their own."""
    t_total = call.q.shape[0]
    if tokens > 1:
        return common.tile_walks(call, tokens)
    row, pos, real = common.token_positions(call.cu_seqlens, call.seq_lens, t_total)
    walks = common.page_ranges(pos, pos, real, call.window, call.sinks, page_size=call.page_size,
                               max_blocks=call.max_blocks)
    tok = jnp.arange(t_total, dtype=jnp.int32)
    return (row, tok, jnp.ones_like(tok), pos), walks


@functools.partial(jax.jit, static_argnames=("interpret", "num_splits", "block_k", "num_warps", "num_stages",
                                             "tokens_per_program", "longest_first"))
def paged_decode(
    call,  # kvjax.ops.attention.PagedAttentionCall (checked by the op)
    *,
    interpret: bool = False,
    num_splits: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tokens_per_program: int | None = None,
    longest_first: bool | None = None,
) -> jax.Array:  # [T, Hq, D] in q's dtype
    """Split-KV paged attention of every query token: the contract of ``kvjax.ops.paged_attention``.

    ``tokens_per_program`` (default :func:`default_tokens_per_program` of the call's ``max_query_len``): query
    tokens of one row a program holds (module doc); exact for any value and any batch. Tuning knobs, defaults the
    fastest measured (RESULTS.md, "Paged attention decode"): ``num_splits`` (default: :func:`default_num_splits`),
    ``block_k`` keys per step (64, at least one page), ``num_warps`` 4 and ``num_stages`` 4; over fp8 pages 2 warps
    and 4 stages where a program's query rows are one 16-row tile (a decode batch of up to 16 query heads per KV
    head), else 4 warps and 2 stages (RESULTS.md "Paged attention decode", "fp8 (e4m3) pages"); unset ones shrink
    where float32 pages or a wide head would not fit shared memory
    (:func:`kvjax.pallas.paged.common.fit_shared_memory`). ``longest_first`` (default
    :func:`default_longest_first`): launch the programs longest walk first (module doc); one-token programs only.
    ``ValueError`` for shapes :func:`unsupported` rejects, a ``block_k`` not a power of two, a
    ``tokens_per_program`` below 1 and ``longest_first`` with more than one token a program. fp8 pages read as
    ``page * scale`` (module doc). Reads only; tokens that belong to no row get output 0.
    """
    t_total = call.q.shape[0]
    page_size = call.page_size
    fixed = tuple(name for name, val in (("block_k", block_k), ("num_stages", num_stages)) if val is not None)
    block_k = max(block_k or 64, page_size)
    reason = unsupported(call)
    if reason:
        raise ValueError(f"pallas paged_decode {reason}")
    fp8, k_scale, v_scale = common.page_scales(call)
    if block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two, got {block_k}")
    tokens = default_tokens_per_program(call.max_query_len) if tokens_per_program is None else tokens_per_program
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens_per_program must be a positive int, got {tokens_per_program!r}")
    rows = query_rows(tokens, call.q.shape[1] // call.num_kv_heads)
    default_warps, default_stages = 4, 4
    if fp8:  # one 16-row tile: 2 warps, 4 stages; more rows: 4 warps, 2 stages (module doc)
        default_warps, default_stages = (2, 4) if rows == 16 else (4, 2)
    block_k, num_stages, _ = common.fit_shared_memory(
        head_dim=call.q.shape[-1], kv_itemsize=call.k_pages.dtype.itemsize, q_itemsize=call.q.dtype.itemsize,
        block_k=block_k, num_stages=num_stages or default_stages, rows=rows,
        min_block_k=max(page_size, 16), min_rows=rows, fixed=fixed)
    if num_splits is None:
        num_splits = default_num_splits(t_total, call.num_kv_heads, call.max_blocks, block_k // page_size, tokens)
    if longest_first is None:
        longest_first = default_longest_first(tokens, call.max_blocks, block_k // page_size, num_splits)
    elif longest_first and tokens > 1:
        raise ValueError("longest_first needs one-token programs (tokens_per_program 1), got "
                         f"tokens_per_program {tokens}")
    spans, walks = spans_and_walks(call, tokens)
    return _decode_call(
        call, k_scale, v_scale, spans, walks, tokens=tokens, num_splits=num_splits, block_k=block_k,
        num_warps=num_warps or default_warps, num_stages=num_stages, fp8=fp8, longest_first=longest_first,
        interpret=interpret,
    )
