"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): lightning-indexer scores, causal top-k, sparse MLA decode.

Semantics follow Hugging Face's ``deepseek_v32`` modeling code (``DeepseekV32Indexer``):

- index score of query token ``t`` for key position ``j``: ``Σ_h w[t, h] · relu(q[t, h] · k[j]) · scale``
  (HF: ``weights = weights_proj(x) · n_heads**-0.5`` and ``scale = index_head_dim**-0.5``; ``relu(x·s) =
  relu(x)·s`` for ``s > 0``). The caller passes ``w`` with the ``n_heads**-0.5`` already applied.
- RoPE in the indexer is the **non-interleaved** (half-split, ``rotate_half``) form applied to the **first**
  ``rope_dim`` values of each indexer q/k (``[rot ‖ pass]``), unlike the main MLA attention, which uses the
  interleaved form on the **last** 64 values (``[nope ‖ rope]``). :func:`indexer_rope` implements it.
- top-k per query over the causally visible positions (``j <= pos(t)``), best first; where fewer than
  ``topk`` positions are visible the tail is ``-1`` (HF returns arbitrary masked indices there instead).
- sparse MLA decode attends only the selected positions (absorbed form, like :func:`kvjax.ops.mla.mla_decode`).

Cache layout (``kvjax.state.dsa_cache``): indexer keys ``f8e4m3[P, page_size, Di]`` with
``f32[P, page_size, Di // 128]`` scales; the latent key ``f8e4m3[P, page_size, R]`` + ``f32[P, page_size, R // 128]``
scales + ``bf16[P, page_size, r]`` rope key. Positions map to pages through ``block_tables i32[B, 1, max_blocks]``.

Each kernel op validates on the host and runs what its backend table chooses for ``impl``
(:mod:`kvjax.ops.backends`): :data:`INDEXER_TABLE`, :data:`SPARSE_TABLE`, :data:`SPARSE_FP8_TABLE`, each a
``"pallas"`` kernel of :mod:`kvjax.pallas.mla` (Triton lowering, any GPU) over the float32 reference. A named
kernel that cannot take the call raises :class:`~kvjax.errors.UnknownImplError` with the reason. The sparse
decode ops build one :class:`~kvjax.ops.mla.MLADecodeCall` (``topk_indices`` set) and hand it, with the cache,
to the chosen implementation: ``fn(call, latent_pages)`` / ``fn(call, key, key_scale, key_rope)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.base.checks import check_array, check_cu_seqlens, check_float, check_int32, check_seq_lens, check_static_int
from kvjax.base.fp8 import dequantize_fp8_blockwise
from kvjax.base.softmax import masked_softmax
from kvjax.ops.backends import Backend, BackendTable, on_gpu
from kvjax.ops.mla import MLADecodeCall, check_call, check_scale, example_call, page_of
from kvjax.pallas.mla import decode as mla_pallas
from kvjax.pallas.mla import dsa_indexer, dsa_sparse


def indexer_rope(
    x: jax.Array,  # [..., H, Di] indexer q (or [..., Di] key)
    cos: jax.Array,  # [..., rope_dim] = cat(freqs, freqs).cos() per token (HF's rotary embedding output)
    sin: jax.Array,  # [..., rope_dim]
    *,
    heads_axis: bool = True,
) -> jax.Array:
    """Non-interleaved RoPE on the first ``rope_dim`` values (HF ``apply_rotary_pos_emb`` on ``[rot ‖ pass]``).

    Returns an array of ``x``'s shape and dtype; raises ``ValueError`` for an odd ``rope_dim``, one wider than
    ``x``, or ``cos``/``sin`` of different shapes.
    """
    check_float("x", x)
    check_float("cos", cos)
    check_array("sin", sin, shape=tuple(cos.shape))
    r = cos.shape[-1]
    if r < 2 or r % 2 or r > x.shape[-1]:
        raise ValueError(f"rope_dim (cos.shape[-1] = {r}) must be even, >= 2 and <= x.shape[-1] = {x.shape[-1]}")
    if heads_axis:
        cos, sin = cos[..., None, :], sin[..., None, :]
    rot, rest = x[..., :r].astype(jnp.float32), x[..., r:]
    half = jnp.concatenate([-rot[..., r // 2:], rot[..., : r // 2]], axis=-1)
    rot = rot * cos.astype(jnp.float32) + half * sin.astype(jnp.float32)
    return jnp.concatenate([rot.astype(x.dtype), rest], axis=-1)


def _token_rows(cu_seqlens, seq_lens, t):
    """Row id i32[T], absolute position i32[T] and validity bool[T] of each of ``t`` token-major queries."""
    tok = jnp.arange(t)
    row = jnp.clip(jnp.searchsorted(cu_seqlens, tok, side="right", method="compare_all") - 1, 0, seq_lens.shape[0] - 1)
    valid = tok < cu_seqlens[-1]
    pos = seq_lens[row] - (cu_seqlens[row + 1] - tok)
    return row, pos, valid


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexerCall:
    """One lightning-indexer call: built once by :func:`indexer_scores` and handed unchanged to its backend table
    and the chosen implementation, the indexer cache (``index_k``, ``index_scale``) beside it. A pytree: the
    arrays are leaves, ``scale`` is static (checked here)."""

    q: jax.Array  # [T, Hi, Di] roped indexer queries
    weights: jax.Array  # f32[T, Hi] per-head weights (n_heads**-0.5 applied)
    block_tables: jax.Array  # i32[B, 1, max_blocks]
    seq_lens: jax.Array  # i32[B], context length including this step's tokens
    cu_seqlens: jax.Array  # i32[B+1]
    scale: float = dataclasses.field(metadata=dict(static=True))  # index_head_dim**-0.5 in DeepSeek-V3.2

    def __post_init__(self):
        object.__setattr__(self, "scale", check_scale(self.scale))


def indexer_scores_reference(
    call: IndexerCall,
    index_k: jax.Array,  # [P, page_size, Di] indexer keys (f8e4m3 with scales, or any float)
    index_scale: jax.Array | None,  # f32[P, page_size, Di // block] | None (no scaling)
) -> jax.Array:  # f32[T, max_blocks * page_size]
    """Float32 oracle of :func:`indexer_scores` (arguments already validated)."""
    t = call.q.shape[0]
    b = call.block_tables.shape[0]
    page_size = index_k.shape[1]
    length = call.block_tables.shape[-1] * page_size
    pos_all = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    page, off = page_of(call.block_tables, pos_all, page_size)
    keys = index_k[jnp.maximum(page, 0), off].astype(jnp.float32)  # [B, L, Di]
    if index_scale is not None:
        keys = dequantize_fp8_blockwise(keys, index_scale[jnp.maximum(page, 0), off])
    present = page >= 0
    keys = jnp.where(present[..., None], keys, 0.0)
    row, pos, valid = _token_rows(call.cu_seqlens, call.seq_lens, t)

    def one(qt, wt, r, p, ok):
        s = jnp.maximum(jnp.einsum("hd,ld->hl", qt.astype(jnp.float32), keys[r]), 0.0)
        score = jnp.einsum("h,hl->l", wt.astype(jnp.float32), s) * call.scale
        visible = present[r] & (jnp.arange(length) <= p) & ok
        return jnp.where(visible, score, -jnp.inf)

    return jax.lax.map(lambda a: one(*a), (call.q, call.weights, row, pos, valid))


def indexer_scores(
    q: jax.Array,  # [T, Hi, Di] roped indexer queries
    weights: jax.Array,  # f32[T, Hi] per-head weights (n_heads**-0.5 applied)
    index_k: jax.Array,  # [P, page_size, Di] indexer keys (f8e4m3 with scales, or any float)
    index_scale: jax.Array | None,  # f32[P, page_size, Di // block] | None (no scaling)
    block_tables: jax.Array,  # i32[B, 1, max_blocks]
    seq_lens: jax.Array,  # i32[B], context length including this step's tokens
    *,
    cu_seqlens: jax.Array,  # i32[B+1]
    scale: float,
    impl: str = "auto",
) -> jax.Array:
    """Float32 index scores ``f32[T, max_blocks * page_size]``; ``-inf`` where not causally visible.

    Token ``t`` of row ``b`` sits at position ``seq_lens[b] - n_b + i`` and sees positions ``<=`` its own.
    Padding tokens (past ``cu_seqlens[-1]``) get all ``-inf``. Reads nothing it changes. The Pallas kernel
    (``kvjax.pallas.mla.dsa_indexer``) multiplies bf16 queries by the exactly decoded fp8 keys with f32
    accumulation; the reference is f32 throughout. The kernel takes only fp8 keys whose page size and
    scale-group width are powers of two >= 16 (it would round other float keys to bf16): ``impl="auto"`` runs
    the reference for the others. Builds one :class:`IndexerCall`; the implementation gets
    ``(call, index_k, index_scale)``.
    """
    check_float("q", q, rank=3)
    t, hi, di = q.shape
    check_array("weights", weights, rank=2, shape=(t, hi))
    check_array("index_k", index_k, rank=3, shape=(None, None, di))
    if index_scale is not None:
        check_array("index_scale", index_scale, rank=3, shape=tuple(index_k.shape[:2]) + (None,))
        if di % index_scale.shape[-1]:
            raise ValueError(f"index_scale has {index_scale.shape[-1]} scales per token; {di} is not a multiple")
    check_int32("block_tables", block_tables, rank=3)
    b = block_tables.shape[0]
    check_int32("seq_lens", seq_lens, shape=(b,))
    check_int32("cu_seqlens", cu_seqlens, shape=(b + 1,))
    check_cu_seqlens(cu_seqlens, t)
    check_seq_lens(seq_lens, block_tables.shape[-1] * index_k.shape[1])
    call = IndexerCall(q, weights, block_tables, seq_lens, cu_seqlens, scale=scale)
    return INDEXER_TABLE.choose(impl, (call, index_k, index_scale), {})[1](call, index_k, index_scale)


def index_topk(scores: jax.Array, topk: int) -> jax.Array:
    """Top-``topk`` positions per query, best first: ``f32[T, L] -> i32[T, topk]``, ``-1`` where ``-inf``.

    If ``topk > L`` the result is padded with ``-1``. Ties resolve to the lower position (``lax.top_k``).
    """
    check_array("scores", scores, rank=2)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    check_static_int("topk", topk, low=1)
    t, length = scores.shape
    k = min(topk, length)
    vals, idx = jax.lax.top_k(scores.astype(jnp.float32), k)
    idx = jnp.where(jnp.isneginf(vals), -1, idx).astype(jnp.int32)
    if k < topk:
        idx = jnp.concatenate([idx, jnp.full((t, topk - k), -1, jnp.int32)], axis=1)
    return idx


def _selected(call: MLADecodeCall, page_size: int):
    """Where the call's selected positions ``i32[B, K]`` live: page i32[B, K] (0 where none), offset i32[B, K] and
    valid bool[B, K] (a page exists and the position is ``< seq_lens``)."""
    page, off = page_of(call.block_tables, call.topk_indices, page_size)
    valid = (page >= 0) & (call.topk_indices < call.seq_lens[:, None])
    return jnp.maximum(page, 0), off, valid


def _sparse_attend(call: MLADecodeCall, rows, valid):
    """The call's queries over rows f32[B, K, R+r] where valid bool[B, K] -> [B, H, R] in q_latent's dtype (float32
    math); no visible key -> 0."""
    q = jnp.concatenate([call.q_latent, call.q_rope], axis=-1).astype(jnp.float32)
    rows = jnp.where(valid[..., None], rows, 0.0)
    s = jnp.einsum("bhd,bkd->bhk", q, rows) * call.scale
    p, _ = masked_softmax(s, valid[:, None, :])
    return jnp.einsum("bhk,bkr->bhr", p, rows[..., :call.q_latent.shape[-1]]).astype(call.q_latent.dtype)


def sparse_mla_decode_reference(
    call: MLADecodeCall,  # topk_indices i32[B, K] set
    latent_pages: jax.Array,  # [P, page_size, R + r]
) -> jax.Array:  # [B, H, R] in q_latent's dtype
    """Float32 oracle of :func:`sparse_mla_decode`."""
    page, off, valid = _selected(call, latent_pages.shape[1])
    return _sparse_attend(call, latent_pages[page, off].astype(jnp.float32), valid)


def sparse_mla_decode(
    q_latent: jax.Array,  # [B, H, R]
    q_rope: jax.Array,  # [B, H, r]
    latent_pages: jax.Array,  # [P, page_size, R + r]
    block_tables: jax.Array,  # i32[B, 1, max_blocks]
    seq_lens: jax.Array,  # i32[B]
    topk_indices: jax.Array,  # i32[B, K] positions to attend; -1 = none
    *,
    scale: float,
    impl: str = "auto",
) -> jax.Array:
    """Absorbed MLA decode restricted to ``topk_indices`` (positions ``>= seq_lens`` or ``-1`` are ignored).

    Returns ``o: [B, H, R]`` in ``q_latent``'s dtype; a row with no selected position gives 0.
    Duplicate indices would count twice (top-k never produces them).
    """
    call = MLADecodeCall(q_latent, q_rope, block_tables, seq_lens, scale=scale, topk_indices=topk_indices)
    check_call(call)
    check_float("latent_pages", latent_pages, rank=3, shape=(None, None, q_latent.shape[-1] + q_rope.shape[-1]))
    check_seq_lens(seq_lens, block_tables.shape[-1] * latent_pages.shape[1])
    return SPARSE_TABLE.choose(impl, (call, latent_pages), {})[1](call, latent_pages)


def sparse_mla_decode_fp8_reference(
    call: MLADecodeCall,  # topk_indices i32[B, K] set
    key: jax.Array,  # f8e4m3[P, page_size, R]
    key_scale: jax.Array,  # f32[P, page_size, R // block]
    key_rope: jax.Array,  # bf16[P, page_size, r]
) -> jax.Array:  # [B, H, R] in q_latent's dtype
    """Float32 oracle of :func:`sparse_mla_decode_fp8` (arguments already validated)."""
    page, off, valid = _selected(call, key.shape[1])
    rows = jnp.concatenate([dequantize_fp8_blockwise(key[page, off], key_scale[page, off]),
                            key_rope[page, off].astype(jnp.float32)], axis=-1)  # f32[B, K, R+r]
    return _sparse_attend(call, rows, valid)


def sparse_mla_decode_fp8(
    q_latent: jax.Array,  # [B, H, R]
    q_rope: jax.Array,  # [B, H, r]
    key: jax.Array,  # f8e4m3[P, page_size, R]
    key_scale: jax.Array,  # f32[P, page_size, R // block]
    key_rope: jax.Array,  # bf16[P, page_size, r]
    block_tables: jax.Array,  # i32[B, 1, max_blocks]
    seq_lens: jax.Array,  # i32[B]
    topk_indices: jax.Array,  # i32[B, K]; -1 = none
    *,
    scale: float,
    impl: str = "auto",
) -> jax.Array:
    """Sparse MLA decode over the DSA ``key`` cache roles: gathers and dequantises only the selected rows.

    Same semantics as :func:`sparse_mla_decode` on the dequantised latent; returns ``o: [B, H, R]`` in
    ``q_latent``'s dtype. The ``"pallas"`` kernel (``kvjax.pallas.mla.dsa_sparse``: decodes the fp8 bytes
    exactly, applies the scales outside its bf16 products, f32 accumulation) takes fp8 keys with scale-group and
    rope widths that are powers of two >= 16, and at most 16 heads, where it beats the reference (RESULTS.md,
    "DSA sparse decode"), so ``impl="auto"`` runs it on a GPU exactly at <= 16 heads.
    """
    call = MLADecodeCall(q_latent, q_rope, block_tables, seq_lens, scale=scale, topk_indices=topk_indices)
    check_call(call)
    check_array("key", key, rank=3, shape=(None, None, q_latent.shape[-1]))
    check_array("key_scale", key_scale, rank=3, shape=tuple(key.shape[:2]) + (None,))
    if key.shape[-1] % key_scale.shape[-1]:
        raise ValueError(f"key_scale has {key_scale.shape[-1]} scales per token; {key.shape[-1]} is not a multiple")
    check_array("key_rope", key_rope, rank=3, shape=tuple(key.shape[:2]) + (q_rope.shape[-1],))
    check_seq_lens(seq_lens, block_tables.shape[-1] * key.shape[1])
    roles = (key, key_scale, key_rope)
    return SPARSE_FP8_TABLE.choose(impl, (call,) + roles, {})[1](call, *roles)


_SDS = jax.ShapeDtypeStruct


def _indexer_example(t: int, b: int, context: int, page_size: int = 64, key_dtype=jnp.float8_e4m3fn,
                     heads: int = 64, dim: int = 128) -> tuple[tuple, dict]:
    blocks = context // page_size
    pages = (b * blocks, page_size)
    scales = _SDS(pages + (dim // 128,), jnp.float32) if key_dtype == jnp.float8_e4m3fn else None
    call = IndexerCall(_SDS((t, heads, dim), jnp.bfloat16), _SDS((t, heads), jnp.float32), _SDS((b, 1, blocks),
                       jnp.int32), _SDS((b,), jnp.int32), _SDS((b + 1,), jnp.int32), scale=dim ** -0.5)
    return (call, _SDS(pages + (dim,), key_dtype), scales), {}


def _fp8_example(b: int, h: int, context: int, topk: int = 2048) -> tuple[tuple, dict]:
    """:func:`kvjax.ops.mla.example_call` (sparse) over the fp8 ``key`` roles instead of bf16 latent pages."""
    (call, pages), _ = example_call(b, h, context, topk=topk)
    rows = tuple(pages.shape[:2])
    return (call, _SDS(rows + (512,), jnp.float8_e4m3fn), _SDS(rows + (4,), jnp.float32),
            _SDS(rows + (64,), jnp.bfloat16)), {}


def _pallas_table(op: str, reference, kernel, unsupported, note: str, examples: dict) -> BackendTable:
    """A table of one ``"pallas"`` kernel (Triton lowering, any GPU) over the float32 reference."""
    return BackendTable(op, reference, (Backend("pallas", kernel, priority=10, device=on_gpu,
                                                unsupported=unsupported, note=note),), examples=examples)


INDEXER_TABLE = _pallas_table(
    "indexer_scores", indexer_scores_reference, dsa_indexer.indexer_scores_pallas, dsa_indexer.unsupported,
    "scores + top-k ahead of the jnp reference (RESULTS.md, DSA sparse decode and indexer)",
    {"decode B=32 L=8192 64x128 fp8 keys page 64": lambda: _indexer_example(32, 32, 8192),
     "prefill T=512 L=4096 64x128 f32 keys page 64": lambda: _indexer_example(512, 1, 4096, key_dtype=jnp.float32)},
)

SPARSE_TABLE = _pallas_table(
    "sparse_mla_decode", sparse_mla_decode_reference, mla_pallas.mla_decode_pallas, mla_pallas.unsupported,
    "top-k 2048: at least the jnp reference (RESULTS.md, DSA sparse decode and indexer)",
    {"decode B=32 L=32768 H=16 top-2048 page 64 bf16": lambda: example_call(32, 16, 32768, topk=2048),
     "decode B=32 L=32768 H=128 top-2048 page 64 bf16": lambda: example_call(32, 128, 32768, topk=2048)},
)

SPARSE_FP8_TABLE = _pallas_table(
    "sparse_mla_decode_fp8", sparse_mla_decode_fp8_reference, dsa_sparse.sparse_mla_decode_fp8_pallas,
    dsa_sparse.unsupported, "ahead of the jnp path at few heads (RESULTS.md, DSA sparse decode and indexer)",
    {"decode B=32 L=8192 H=16 top-2048 fp8 keys page 64": lambda: _fp8_example(32, 16, 8192),
     "decode B=32 L=8192 H=128 top-2048 fp8 keys page 64": lambda: _fp8_example(32, 128, 8192)},
)
