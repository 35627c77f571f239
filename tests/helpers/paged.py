"""Paged attention test inputs shared by the kernel test modules: random ragged batches over a permuted page pool
with holes and NaN poison where nothing may read (:func:`build_batch`), the same batch over fp8 pages
(:func:`quantise_pages`), the float32 references and the bounds a kernel over fp8 pages is held to."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.base.fp8 import FP8_DTYPE, pow2_scale
from kvjax.ops.attention import PagedAttentionCall, check_call, paged_attention_reference


def build_batch(rng, *, hq, hkv, d, page_size, ctx, new, window, sinks, dtype=jnp.float32, extra_tokens=2,
                tail_fill=np.nan):
    """Random ragged batch over a permuted page pool with holes and NaN poison where nothing may read.

    ``tail_fill``: the unwritten tail of every row's last page (NaN, or a large finite value for a kernel that
    may read the tail but must give its keys zero weight).
    """
    ctx = np.asarray(ctx, np.int32)
    new = np.asarray(new, np.int32)
    window = np.asarray(window, np.int32)
    sinks = np.asarray(sinks, np.int32)
    num_rows = len(ctx)
    max_blocks = int(max(1, (ctx.max() + page_size - 1) // page_size)) + 1
    num_pages = num_rows * hkv * max_blocks + 3
    perm = rng.permutation(num_pages)
    k = rng.standard_normal((num_pages, page_size, d)).astype(np.float32)
    v = rng.standard_normal((num_pages, page_size, d)).astype(np.float32)
    used = np.zeros(num_pages, bool)
    table = np.full((num_rows, hkv, max_blocks), -1, np.int32)
    nxt = 0
    for b in range(num_rows):
        n_blocks = (int(ctx[b]) + page_size - 1) // page_size
        first_q = int(ctx[b]) - int(new[b])
        for h in range(hkv):
            for p in range(n_blocks):
                page = perm[nxt]
                nxt += 1
                table[b, h, p] = page
                used[page] = True
                tail = int(ctx[b]) - p * page_size
                if tail < page_size:
                    k[page, tail:] = tail_fill
                    v[page, tail:] = tail_fill
                dead = window[h] > 0 and (p + 1) * page_size <= first_q - window[h] + 1 and p * page_size >= sinks[h]
                if dead:
                    if rng.random() < 0.5:
                        table[b, h, p] = -1  # recycled
                        used[page] = False
                    else:
                        k[page] = np.nan  # still listed, but a kernel must not visit it
                        v[page] = np.nan
    k[~used] = np.nan
    v[~used] = np.nan
    total = int(new.sum()) + extra_tokens
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((total, hq, d)).astype(np.float32)
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table), jnp.asarray(ctx))
    kwargs = dict(cu_seqlens=jnp.asarray(cu), scale=float(d) ** -0.5, window=jnp.asarray(window),
                  sinks=jnp.asarray(sinks))
    return args, kwargs


def poison_hole(args, row: int = 0, head: int = 0, block: int = 1):
    """``args`` with the page at ``table[row, head, block]`` filled with NaN (K and V) and that entry made a ``-1``
    hole: a kernel that reads a hole's page fails."""
    q, k, v, table, seq_lens = args
    table = np.asarray(table).copy()
    page = table[row, head, block]
    table[row, head, block] = -1
    return q, k.at[page].set(jnp.nan), v.at[page].set(jnp.nan), jnp.asarray(table), seq_lens


def e4m3_split_q(q, parts: int) -> np.ndarray:  # f32[T, H, D]: q as the Mosaic kernels multiply it over fp8 pages
    """q as ``parts`` e4m3 tiles, from numpy: per (token, head) row ``s = 2**(floor(log2 max|q|) - 7)`` (``2**-7``
    for a zero row, from ``frexp``: independent of the kernels' bit arithmetic), ``h = e4m3(q / s)``,
    ``l = e4m3(q / s - h)``; ``s (h [+ l])``."""
    q = np.asarray(q, np.float32)
    amax = np.abs(q).max(axis=-1, keepdims=True)
    _, k = np.frexp(np.where(amax > 0, amax, 1.0))  # amax = m 2**k, m in [0.5, 1): floor(log2 amax) = k - 1
    s = np.ldexp(np.float32(1.0), k - 8).astype(np.float32)
    y, total = q / s, np.zeros_like(q)
    for _ in range(parts):
        h = np.asarray(jnp.asarray(y).astype(FP8_DTYPE), np.float32)
        total, y = total + h, y - h
    return total * s


def checked_call(args, kwargs, scales=None) -> PagedAttentionCall:
    """The checked call of the batch ``args, kwargs`` (fp8 pages: with ``scales``), as the op hands it down."""
    return check_call(PagedAttentionCall(*args, **kwargs, **(scales or {})))


def reference_f32(args, kwargs):
    q, k, v, table, ctx = args
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return paged_attention_reference(checked_call((f32(q), f32(k), f32(v), table, ctx), kwargs))


def quantise_pages(args):
    """The batch of ``args`` over fp8 pages: ``(q, k8, v8, table, ctx)`` and ``dict(k_scale=, v_scale=)``.

    Each page is quantised with its power-of-two scale (:func:`kvjax.base.fp8.pow2_scale` of its finite max, as
    the cache write does); NaN stays NaN (an unwritten tail), and a page that is all NaN (unused, or below a window)
    gets scale NaN: reading its scale would poison the output.
    """
    q, k, v, table, ctx = args

    def quantise(x):
        x = np.asarray(x, np.float32)
        amax = np.where(np.isnan(x), 0.0, np.abs(x)).max(axis=(1, 2))  # f32[P]
        s = np.asarray(pow2_scale(jnp.asarray(amax)))
        page = jnp.asarray(x / np.where(s > 0, s, 1.0)[:, None, None]).astype(FP8_DTYPE)
        return page, jnp.asarray(np.where(np.isnan(x).all(axis=(1, 2)), np.nan, s), jnp.float32)

    (k8, k_scale), (v8, v_scale) = quantise(k), quantise(v)
    return (q, k8, v8, table, ctx), dict(k_scale=k_scale, v_scale=v_scale)


def reference_fp8(args, scales, kwargs):
    """The float32 reference over the fp8 pages (it dequantises them) and, for :func:`fp8_bound`, the same
    attention of ``|v|``."""
    q, k8, v8, table, ctx = args
    ref = paged_attention_reference(checked_call((q.astype(jnp.float32), k8, v8, table, ctx), kwargs, scales))
    k = k8.astype(jnp.float32) * scales["k_scale"][:, None, None]
    v = v8.astype(jnp.float32) * scales["v_scale"][:, None, None]
    abs_v = paged_attention_reference(checked_call((q.astype(jnp.float32), k, jnp.abs(v), table, ctx), kwargs))
    return np.asarray(ref), np.asarray(abs_v), float(np.nanmax(np.abs(np.asarray(v))))


def fp8_bound(ref, abs_v, v_max, dtype, p_round=None, n_keys=0):
    """Per-element bound on ``|kernel - reference|`` over the same fp8 pages.

    Both read identical values: an e4m3 value is exact in bf16 / f16 / f32, the scales are powers of two (the key
    scale times the softmax scale and the value scale times a probability are exact), and bf16 x bf16 products are
    exact in the f32 accumulator. What a bf16 kernel rounds is each probability (``p * s_v`` to bf16, relative
    ``u = 2**-8``: an output error of at most ``u sum p |v| / sum p``, ``abs_v``) and the output itself (``u |o|``).
    ``2**-12 max|v|`` covers f32 summation order and exp2 against exp. An f32 kernel rounds nothing of the kind:
    only that last term.

    ``p_round = (rel, sub)`` (the Mosaic GPU prefill kernel's fp8 path, :data:`P_ROUND_F16`): each probability is
    rounded to relative ``rel``, and by at most ``sub max|v|`` absolute per key where it falls below its type's
    normal range (``n_keys`` keys at most; ``sum p >= 1``); the output is still rounded to q's dtype."""
    u = 2.0 ** -8 if dtype == jnp.bfloat16 else 0.0
    rel, sub = (u, 0.0) if p_round is None else p_round
    return rel * abs_v + u * np.abs(ref) + (2.0 ** -12 + n_keys * sub) * v_max


# (relative rounding of a probability, absolute rounding per key in units of max|v|) of the Mosaic GPU prefill
# kernel's fp8 path: it casts ``p * s_v / s_ref`` (``s_ref``: the largest value scale so far, a power of two with
# ``448 s_ref < 2 max|v|``) to f16 (half an ulp 2**-11; below 2**-14 spacing 2**-24: 2**-25 * 448 s_ref < 2**-24
# max|v|).
P_ROUND_F16 = (2.0 ** -11, 2.0 ** -24)


def check_fp8(out, ref, abs_v, v_max, dtype, **bound):
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    err = np.abs(out - ref)
    bound = fp8_bound(ref, abs_v, v_max, dtype, **bound)
    assert (err <= bound).all(), (float(err.max()), float((err - bound).max()))


def rel_err(out, ref):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
