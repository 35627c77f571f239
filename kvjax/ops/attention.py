"""Paged attention over head-wise block tables: the public op and its float32 reference.

Semantics (DESIGN.md, "Pages and head-wise block tables", "Masks", "Ragged batches"):

- ``q: [T, Hq, D]`` holds the new tokens of every sequence, token-major; row ``b`` owns tokens
  ``cu_seqlens[b] .. cu_seqlens[b+1]-1`` (padding rows have length 0; tokens past ``cu_seqlens[-1]`` are
  padding and get output 0).
- ``seq_lens[b]`` is the context length *including* this step's tokens, so the ``n = cu[b+1] - cu[b]`` new
  tokens of row ``b`` sit at positions ``seq_lens[b] - n .. seq_lens[b] - 1`` and are causal among themselves
  (prefill, chunked prefill, decode and speculative verification are the same case).
- Key position ``p`` of KV head ``h`` of row ``b`` lives in page ``block_tables[b, h, p // page_size]`` at
  offset ``p % page_size``. A ``-1`` entry is a hole: its positions are treated as **not attendable** and the
  hole is never dereferenced as a real page (the reference gathers a safe page index and masks it).
- Query head ``i`` uses KV head ``i // (Hq // Hkv)``. Query position ``i`` attends key ``j`` iff ``j <= i`` and
  (``i - j < window[h]`` or ``j < sinks[h]``), ``window[h] == 0`` meaning full attention.
- A query with no visible key (impossible for a valid plan) gets output 0, never NaN.

Kernel contract. :func:`paged_attention` builds one :class:`PagedAttentionCall` from its arguments, checks and
normalises it once (:func:`check_call`: ``scale`` a Python float, default ``D**-0.5``; ``window`` / ``sinks``
i32[Hkv]) and runs the implementation that :data:`TABLE` (its backend table) chooses for ``impl``, with exactly
``fn(call[, interpret=...]) -> o: [T, Hq, D]`` in q's dtype (``interpret``: kernels only, bound by the table);
every backend's ``unsupported(call)`` check reads the same call.

fp8 pages (``float8_e4m3fn``, :mod:`kvjax.state.kv_cache`'s fill rule) come with one f32 scale per page,
``k_scale`` / ``v_scale`` ``f32[P]`` (a page is one KV head's block, so per page = per page and KV head); the
pages read as ``page * scale``. The call carries ``k_scale`` / ``v_scale`` only for fp8 pages (``None`` for float
pages). The two Triton kernels (``"prefill"``, ``"pallas"``) read fp8 pages:
they load the page bytes, convert them to q's dtype, multiply each logit by its page's key scale and each
probability by its page's value scale before ``P V`` (f32 accumulation); the Mosaic GPU kernel converts them to f16
for its products.
The reference dequantises the gathered pages and attends in float32.

Backends, in the order ``impl="auto"`` tries them (all exact on any batch they accept;
the order only chooses speed: RESULTS.md, "Paged attention decode" and "Paged attention prefill"):

- ``"mosaic"``: the Mosaic GPU prefill kernel (:mod:`kvjax.pallas.paged.prefill_mgpu`), Hopper only; pages of
  64 / 128 tokens, head_dim 64 / 128, bf16 / f16 pages or fp8 pages with bf16 / f16 q, and ``T >= 64 B``. It
  reads whole pages, so the unwritten tail of a row's last page must hold finite values (kvjax pools start
  zeroed), never NaN;
- ``"prefill"``: the ragged prefill kernel in the Pallas Triton lowering (:mod:`kvjax.pallas.paged.prefill`),
  any GPU, power-of-two head_dim >= 16 and page_size, more tokens than rows (``T > B``) and not a verification
  step's handful of tokens (a static ``max_query_len`` of at most ``FEW_TOKENS``, or ``T <= FEW_TOTAL``); float
  or fp8 pages;
- ``"pallas"``: the split-KV decode kernel (:mod:`kvjax.pallas.paged.decode`), any GPU, any batch with those
  power-of-two shapes, float or fp8 pages; what ``impl="interpret"`` runs. With a static ``max_query_len`` it runs
  its *row mode* (one program per row of up to ``decode.MAX_TOKENS_PER_PROGRAM`` tokens, each page read once for
  all of them, a causal mask per token), else one program per token. Verification rule: the ``"prefill"`` backend
  declines exactly the calls this one should take, so the table's decision sits in one place, the two constants
  ``FEW_TOKENS`` / ``FEW_TOTAL`` (``benchmarks/verify_attn.py`` times the row mode, the one-token programs and the
  prefill kernel side by side to set them);
- ``"reference"``: :func:`paged_attention_reference`, always.

fp8 pages on a GPU need the Triton lowering's e4m3 conversion, which it has from sm_89 (Ada, Hopper) on; on an
older GPU (A100) compiling a Triton kernel over fp8 pages raises ``NotImplementedError`` ("cannot cast from
float8_e4m3fn"): use ``impl="reference"`` there.

Page ids outside ``[0, P)`` other than ``-1`` are a caller bug (the scheduler's debug path validates plans);
device code cannot raise, so the reference clamps them like any XLA gather.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.base.checks import INT32_MAX, check_array, check_cu_seqlens, check_float, check_int32, check_seq_lens
from kvjax.base.fp8 import FP8_DTYPE
from kvjax.base.ragged import token_rows
from kvjax.ops.backends import Backend, BackendTable, on_gpu, on_hopper
from kvjax.pallas.paged import decode, prefill, prefill_mgpu

_TOKENS_PER_MAP_STEP = 32  # tokens gathered at once by the reference (bounds its memory)
_HIGHEST = jax.lax.Precision.HIGHEST  # true f32 matmuls (no TF32 on GPU): the reference is the oracle


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionCall:
    """One paged-attention call: built once by the public op (:func:`paged_attention`) from its arguments,
    normalised by :func:`check_call` and handed unchanged to the backend table's ``unsupported(call)`` checks and
    to the chosen implementation (:func:`paged_attention_reference` or a kernel of :mod:`kvjax.pallas.paged`).
    A pytree: the arrays are leaves (``k_scale`` / ``v_scale`` ``None`` for float pages), ``scale`` static.
    Before :func:`check_call`, ``scale`` may be ``None`` (``D**-0.5``) and ``window`` / ``sinks`` ints."""

    q: jax.Array  # [T, Hq, D] bf16 / f16 / f32: the new tokens of every row, token-major
    k_pages: jax.Array  # [P, page_size, D] float, or float8_e4m3fn with k_scale
    v_pages: jax.Array  # [P, page_size, D] k_pages' dtype
    block_tables: jax.Array  # i32[B, Hkv, max_blocks]; -1 = hole (not attendable, never read)
    seq_lens: jax.Array  # i32[B] context length including this step's tokens
    cu_seqlens: jax.Array  # i32[B+1] query start offsets
    window: jax.Array | int = 0  # i32[Hkv] (0 = full attention)
    sinks: jax.Array | int = 0  # i32[Hkv]
    k_scale: jax.Array | None = None  # f32[P] per-page scales of fp8 k_pages; None for float pages
    v_scale: jax.Array | None = None  # f32[P] the same for v_pages
    scale: float | None = dataclasses.field(default=None, metadata=dict(static=True))  # softmax scale
    max_query_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # a bound on every row's tokens (None: unknown); few tokens a row choose the split-KV decode kernel's row mode

    @property
    def page_size(self) -> int:
        """Tokens per page (``k_pages.shape[1]``)."""
        return self.k_pages.shape[1]

    @property
    def num_kv_heads(self) -> int:
        """``Hkv``, the block tables' KV heads."""
        return self.block_tables.shape[1]

    @property
    def max_blocks(self) -> int:
        """Table columns per (row, KV head)."""
        return self.block_tables.shape[2]


def check_call(call: PagedAttentionCall) -> PagedAttentionCall:
    """Host-side (trace-time) check of a call; returns it normalised: ``scale`` a Python float (``None``:
    ``D**-0.5``), ``window`` / ``sinks`` i32[Hkv]. ``ValueError`` naming the argument for shapes and dtypes
    (:func:`check_pages` for the pages and their scales), and for host (``np.ndarray``) values: ``cu_seqlens``
    non-decreasing within ``[0, T]``, ``seq_lens`` within ``[0, max_blocks * page_size]``, ``window`` / ``sinks``
    in ``[0, 2**31 - 1]`` (traced values cannot be checked)."""
    if not isinstance(call, PagedAttentionCall):
        raise ValueError(f"call must be a PagedAttentionCall, got {type(call).__name__}")
    q, k_pages, block_tables = call.q, call.k_pages, call.block_tables
    check_float("q", q, rank=3)
    check_pages(k_pages, call.v_pages, call.k_scale, call.v_scale)
    check_int32("block_tables", block_tables, rank=3)
    num_rows, hkv, _ = block_tables.shape
    check_int32("seq_lens", call.seq_lens, shape=(num_rows,))
    check_int32("cu_seqlens", call.cu_seqlens, shape=(num_rows + 1,))
    t_total, hq, d = q.shape
    check_cu_seqlens(call.cu_seqlens, t_total)
    check_seq_lens(call.seq_lens, block_tables.shape[2] * k_pages.shape[1])
    if k_pages.shape[2] != d:
        raise ValueError(f"k_pages head_dim {k_pages.shape[2]} != q head_dim {d} (q shape {tuple(q.shape)})")
    if hkv < 1 or hq % hkv:
        raise ValueError(
            f"q heads Hq={hq} must be a multiple of block_tables KV heads Hkv={hkv} "
            f"(block_tables shape {tuple(block_tables.shape)})"
        )
    mql = call.max_query_len
    if mql is not None and (isinstance(mql, bool) or not isinstance(mql, (int, np.integer)) or mql < 1):
        raise ValueError(f"max_query_len must be None or a positive Python int (static), got {mql!r}")
    return dataclasses.replace(call, scale=_normalise_scale(call.scale, d),
                               window=_per_kv_head("window", call.window, hkv),
                               sinks=_per_kv_head("sinks", call.sinks, hkv))


def _visible(q_pos, key_pos, window, sinks):
    """bool[Hkv, L]: key position ``key_pos[l]`` visible to a query at ``q_pos`` for each KV head."""
    w, s = window[:, None], sinks[:, None]
    in_window = (w == 0) | (q_pos - key_pos[None, :] < w)
    return (key_pos[None, :] <= q_pos) & (in_window | (key_pos[None, :] < s))


def _attend_one(q_tok, k, v, mask, scale):
    """One query token over its KV heads: q_tok [Hq, D], k/v [Hkv, L, D], mask bool[Hkv, L] -> f32[Hq, D].

    Masked logits are replaced (not multiplied) and masked values zeroed, so garbage (even NaN) at masked
    positions cannot leak into the output.
    """
    hq, hkv = q_tok.shape[0], k.shape[0]
    group = hq // hkv
    v = jnp.where(mask[..., None], v.astype(jnp.float32), 0.0)
    qg = q_tok.astype(jnp.float32).reshape(hkv, group, -1)  # [Hkv, G, D]
    s = jnp.einsum("hgd,hld->hgl", qg, k.astype(jnp.float32), precision=_HIGHEST) * scale
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask[:, None, :], jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("hgl,hld->hgd", p, v, precision=_HIGHEST) / jnp.where(denom > 0, denom, 1.0)
    return o.reshape(hq, -1)


@jax.jit
def paged_attention_reference(call: PagedAttentionCall) -> jax.Array:  # [T, Hq, D] in q's dtype
    """Float32 pure-jnp oracle of :func:`paged_attention` (a call :func:`check_call` normalised).

    For each query token: find its row, gather that row's pages per KV head (holes read page 0 and are
    masked out; fp8 pages are dequantised with their pages' scales), apply the causal / window / sink mask and a
    masked softmax in float32.
    """
    q, k_pages, v_pages, block_tables = call.q, call.k_pages, call.v_pages, call.block_tables
    seq_lens, cu_seqlens, window, sinks = call.seq_lens, call.cu_seqlens, call.window, call.sinks
    k_scale, v_scale, scale = call.k_scale, call.v_scale, call.scale
    t_total = q.shape[0]
    num_rows, hkv, max_blocks = block_tables.shape
    page_size = k_pages.shape[1]
    key_pos = jnp.arange(max_blocks * page_size, dtype=jnp.int32)  # [L]

    present = block_tables >= 0  # bool[B, Hkv, max_blocks]
    safe_tables = jnp.where(present, block_tables, 0)

    tok = jnp.arange(t_total, dtype=jnp.int32)
    row = token_rows(cu_seqlens, t_total)
    n_new = cu_seqlens[row + 1] - cu_seqlens[row]
    q_pos = seq_lens[row] - n_new + (tok - cu_seqlens[row])  # absolute position of each query token
    is_real = (tok >= cu_seqlens[0]) & (tok < cu_seqlens[num_rows])

    def one_token(args):
        q_tok, b, pos, real = args
        pages = safe_tables[b]  # i32[Hkv, max_blocks]
        k, v = k_pages[pages], v_pages[pages]  # [Hkv, max_blocks, page_size, D]
        if k_scale is not None:
            k = k.astype(jnp.float32) * k_scale[pages][..., None, None]
            v = v.astype(jnp.float32) * v_scale[pages][..., None, None]
        k = k.reshape(hkv, max_blocks * page_size, -1)  # [Hkv, L, D]
        v = v.reshape(hkv, max_blocks * page_size, -1)
        block_ok = jnp.repeat(present[b], page_size, axis=-1)  # bool[Hkv, L]
        mask = _visible(pos, key_pos, window, sinks) & block_ok & real
        return _attend_one(q_tok, k, v, mask, scale)

    batch = max(1, min(t_total, _TOKENS_PER_MAP_STEP))
    out = jax.lax.map(one_token, (q, row, q_pos, is_real), batch_size=batch)
    return out.astype(q.dtype)


def dense_attention_reference(
    q: jax.Array,  # [Tq, Hq, D]: the last Tq positions of the sequence
    k: jax.Array,  # [Tk, Hkv, D]: keys of positions 0 .. Tk-1 (Tk >= Tq)
    v: jax.Array,  # [Tk, Hkv, D]
    *,
    scale: float | None = None,
    window: int | jax.Array = 0,  # int | i32[Hkv]
    sinks: int | jax.Array = 0,  # int | i32[Hkv]
) -> jax.Array:  # [Tq, Hq, D]
    """Masked attention of one sequence on contiguous K/V (same mask semantics as :func:`paged_attention`).

    Float32 inside, output in q's dtype. Handy for model prefill references and for checking the paged op.
    """
    check_float("q", q, rank=3)
    check_float("k", k, rank=3)
    check_float("v", v, shape=k.shape)
    tq, hq, d = q.shape
    tk, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k head_dim {dk} != q head_dim {d}")
    if hq % hkv:
        raise ValueError(f"q heads {hq} must be a multiple of k heads {hkv}")
    if tq > tk:
        raise ValueError(f"q has {tq} tokens but k only {tk} positions")
    window_arr = _per_kv_head("window", window, hkv)
    sinks_arr = _per_kv_head("sinks", sinks, hkv)
    scale = _normalise_scale(scale, d)
    return _dense_core(q, k, v, window_arr, sinks_arr, scale=scale)


@functools.partial(jax.jit, static_argnames=("scale",))
def _dense_core(q, k, v, window, sinks, *, scale):
    tq, tk = q.shape[0], k.shape[0]
    key_pos = jnp.arange(tk, dtype=jnp.int32)
    kh, vh = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)  # [Hkv, Tk, D]

    def one_token(q_tok, pos):
        return _attend_one(q_tok, kh, vh, _visible(pos, key_pos, window, sinks), scale)

    positions = jnp.arange(tk - tq, tk, dtype=jnp.int32)
    return jax.vmap(one_token)(q, positions).astype(q.dtype)


def _per_kv_head(name: str, value, num_kv_heads: int) -> jax.Array:
    """Normalise ``window``/``sinks`` (int, sequence or i32[Hkv] array) to i32[Hkv]; reject bad values."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an int or an integer array of shape ({num_kv_heads},), got {value!r}")
    if isinstance(value, (int, np.integer)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        if value > INT32_MAX:
            raise ValueError(f"{name} must fit int32 (<= {INT32_MAX}), got {value}")
        return jnp.full((num_kv_heads,), value, jnp.int32)
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if not hasattr(value, "shape") or not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int or an integer array of shape ({num_kv_heads},), got {value!r}")
    if tuple(value.shape) != (num_kv_heads,):
        raise ValueError(f"{name} must have shape ({num_kv_heads},) (one entry per KV head), got {value.shape}")
    try:
        concrete = np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        concrete = None  # traced under jit: values cannot be checked here
    if concrete is not None and (concrete < 0).any():
        raise ValueError(f"{name} entries must be >= 0, got {concrete.tolist()}")
    if concrete is not None and (concrete > INT32_MAX).any():
        raise ValueError(f"{name} entries must fit int32 (<= {INT32_MAX}), got {concrete.tolist()}")
    return jnp.asarray(value, jnp.int32)


def _normalise_scale(scale, head_dim: int) -> float:
    if scale is None:
        return float(head_dim) ** -0.5
    try:
        value = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise ValueError(f"scale must be a Python float (static), got {scale!r}") from err
    if not math.isfinite(value):
        raise ValueError(f"scale must be a finite Python float, got {scale!r}")
    return value


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, D]
    v_pages: jax.Array,  # [P, page_size, D]
    block_tables: jax.Array,  # i32[B, Hkv, max_blocks], -1 = hole
    seq_lens: jax.Array,  # i32[B], context length including this step's tokens
    *,
    cu_seqlens: jax.Array,  # i32[B+1], query start offsets
    scale: float | None = None,
    window: int | jax.Array = 0,  # int | i32[Hkv]
    sinks: int | jax.Array = 0,  # int | i32[Hkv]
    k_scale: jax.Array | None = None,  # f32[P]: per-page scales of fp8 (float8_e4m3fn) k_pages, else None
    v_scale: jax.Array | None = None,  # f32[P]: the same for v_pages
    max_query_len: int | None = None,  # static bound on every row's tokens (None: unknown)
    impl: str = "auto",
) -> jax.Array:  # [T, Hq, D]
    """Ragged causal attention of new tokens over head-wise paged K/V (see the module docstring).

    Builds one :class:`PagedAttentionCall` and checks it (:func:`check_call`: shapes and dtypes, ``ValueError``
    naming the argument; host values of ``cu_seqlens``, ``seq_lens``, ``window`` and ``sinks``; ``scale`` a float,
    default ``D**-0.5``; ``window`` / ``sinks`` i32[Hkv]), then runs what :data:`TABLE` chooses for ``impl``:
    ``"auto"`` (the first backend that runs here and accepts the call, else the reference), ``"reference"``, a
    backend name (``"mosaic" | "prefill" | "pallas"``; :class:`UnknownImplError` naming the reason if it cannot
    take the call here), ``"interpret"`` (the ``"pallas"`` kernel in Pallas interpret mode) or
    ``"NAME:interpret"``. ``max_query_len``: a static bound on every row's tokens, a promise of the caller (a
    verification step's ``K + 1``); with at most ``kvjax.pallas.paged.prefill.FEW_TOKENS`` tokens a row, or
    ``FEW_TOTAL`` in all, the table takes the split-KV decode kernel in its row mode (one program per row of up to
    ``kvjax.pallas.paged.decode.MAX_TOKENS_PER_PROGRAM`` tokens: each page read once per row) over the prefill
    kernels. Every kernel stays exact if a row breaks the promise. Reads only; changes nothing. Jittable.
    On a Hopper GPU a prefill-shaped batch may run the Mosaic GPU kernel, which reads whole pages of a row's walk:
    the unwritten tail of a last page must hold finite values (kvjax pools start zeroed), never NaN.
    """
    call = check_call(PagedAttentionCall(q, k_pages, v_pages, block_tables, seq_lens, cu_seqlens, window, sinks,
                                         k_scale, v_scale, scale=scale, max_query_len=max_query_len))
    return TABLE.choose(impl, (call,), {})[1](call)


def check_pages(k_pages, v_pages, k_scale, v_scale) -> bool:
    """Whether the pages are fp8; ``ValueError`` naming the argument for pages of other shapes or dtypes, fp8
    pages other than float8_e4m3fn or without both scales, scales beside float pages, or scales not ``f32[P]``."""
    fp8 = hasattr(k_pages, "dtype") and jnp.dtype(k_pages.dtype).itemsize == 1
    if not fp8:
        check_float("k_pages", k_pages, rank=3)
        check_float("v_pages", v_pages, shape=k_pages.shape)
        given = [n for n, x in (("k_scale", k_scale), ("v_scale", v_scale)) if x is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} go with float8_e4m3fn pages, but k_pages are {k_pages.dtype}")
        return False
    check_array("k_pages", k_pages, rank=3, dtypes=[FP8_DTYPE])
    check_array("v_pages", v_pages, shape=k_pages.shape, dtypes=[FP8_DTYPE])
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            raise ValueError(f"fp8 pages need {name} (f32[P] per-page scales, P={k_pages.shape[0]}), got None")
        check_array(name, x, shape=(k_pages.shape[0],), dtypes=[jnp.float32])
    return True


def _example(tokens: int, rows: int, page_size: int, *, context: int, hq: int = 32, hkv: int = 8, d: int = 128,
             dtype=jnp.bfloat16, fp8: bool = False, max_query_len: int | None = None) -> tuple[tuple, dict]:
    """A checked call ``((call,), {})`` of ``rows`` rows of ``context`` positions (``tokens`` new tokens in all),
    its arrays ``jax.ShapeDtypeStruct`` s: what the backend table's ``unsupported()`` checks read."""
    max_blocks = -(-context // page_size)
    sds = jax.ShapeDtypeStruct
    num_pages = rows * hkv * max_blocks
    pages = sds((num_pages, page_size, d), FP8_DTYPE if fp8 else dtype)
    scales = sds((num_pages,), jnp.float32) if fp8 else None
    call = PagedAttentionCall(sds((tokens, hq, d), dtype), pages, pages, sds((rows, hkv, max_blocks), jnp.int32),
                              sds((rows,), jnp.int32), sds((rows + 1,), jnp.int32), sds((hkv,), jnp.int32),
                              sds((hkv,), jnp.int32), scales, scales, scale=d ** -0.5, max_query_len=max_query_len)
    return (call,), {}


TABLE = BackendTable(
    "paged_attention",
    paged_attention_reference,
    (
        Backend("mosaic", prefill_mgpu.paged_prefill_mgpu, priority=30, device=on_hopper,
                unsupported=prefill_mgpu.unsupported,
                note="prefill ahead of the Triton prefill kernel, pages 64/128 (RESULTS.md, Paged attention prefill)"),
        Backend("prefill", prefill.paged_prefill, priority=20, device=on_gpu,
                unsupported=prefill.unsupported,
                note="one program per (query tile, KV head): each page read once per tile, not once per token"),
        Backend("pallas", decode.paged_decode, priority=10, device=on_gpu,
                unsupported=decode.unsupported,
                note="split-KV decode, exact on any batch: the GPU fallback (RESULTS.md, Paged attention decode); "
                     "a static max_query_len: one program per row (verification)"),
    ),
    examples={
        "decode B=64 L=4096 Hq=32 Hkv=8 D=128 page 16 bf16": lambda: _example(64, 64, 16, context=4096),
        "prefill T=4096 H=32 D=128 page 64 bf16": lambda: _example(4096, 1, 64, context=4096, hkv=32),
        "prefill T=4096 H=32 D=128 page 16 bf16": lambda: _example(4096, 1, 16, context=4096, hkv=32),
        "mixed T=512 B=64 Hq=32 Hkv=8 D=128 page 64 bf16": lambda: _example(512, 64, 64, context=4096),
        "verify B=16 x 5 tokens L=4096 Hq=32 Hkv=8 D=128 page 16 bf16":
            lambda: _example(80, 16, 16, context=4096, max_query_len=5),
        "verify B=1 x 5 tokens L=4096 Hq=32 Hkv=8 D=128 page 16 bf16":
            lambda: _example(5, 1, 16, context=4096, max_query_len=5),
        "decode B=64 L=4096 Hq=32 Hkv=8 D=128 page 16 fp8": lambda: _example(64, 64, 16, context=4096, fp8=True),
        "decode B=64 L=4096 Hq=32 Hkv=8 D=128 page 64 fp8": lambda: _example(64, 64, 64, context=4096, fp8=True),
        "prefill T=4096 H=32 D=128 page 64 fp8": lambda: _example(4096, 1, 64, context=4096, hkv=32, fp8=True),
    },
)
