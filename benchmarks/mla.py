"""MLA decode and DSA benchmark cases: ``kvjax.ops.mla_decode`` (Pallas Triton lowering, Mosaic GPU, the Triton
kernel), ``kvjax.ops.sparse_mla_decode`` against dense decode, and the DSA indexer (``kvjax.ops.indexer_scores``).

Usage: ``python benchmarks/runner.py mla`` (GPU; the Triton MLA kernel needs jax-triton installed).

bf16 latent cache ``[P, 64, 576]`` (R = 512, r = 64), pages randomly permuted, random inputs. MLA decode at
B=128, L=4096, H = 16 and 128, anchor: the Triton kernel (``impl="triton"``). Bytes: the latent rows attended,
``B L 576 2`` (queries, outputs and split buffers not counted); FLOPs ``B L H 2 (576 + 512)``.
DSA decode at top-k 2048, B=32, L = 8192 and 32768: sparse decode (bytes: the selected rows) against dense
decode over all L rows (``mla_decode(impl="auto")``, a different computation: timed, not compared); the
indexer (64 heads x 128, fp8 e4m3 keys with one f32 scale per token) against its jnp reference (bytes: the
keys and scales read; scores compared where finite, the ``-inf`` mask exactly); sparse decode over the DSA fp8
key roles against its jnp path (bytes: ``B K (512 + 16 + 128)``).
"""

from __future__ import annotations

import functools

from case import Case, Setup

R, RP, PAGE = 512, 64, 64
SCALE = 192 ** -0.5
MLA = [(128, 4096, 16), (128, 4096, 128)]  # (B, L, H)
DSA = [(32, 8192, 16), (32, 8192, 128), (32, 32768, 16), (32, 32768, 128)]  # (B, L, H)
TOPK = 2048
INDEXER = (64, 128)  # (heads, head dim)


def _latent(b: int, length: int, h: int, seed: int, page: int = PAGE):
    import jax
    import jax.numpy as jnp
    import numpy as np

    blocks = -(-length // page)
    tables = np.random.default_rng(seed).permutation(b * blocks).astype(np.int32).reshape(b, 1, blocks)
    k = jax.random.split(jax.random.key(seed), 3)
    pages = jax.random.normal(k[0], (b * blocks, page, R + RP), jnp.bfloat16)  # bf16[P, page, R + r]
    q = jax.random.normal(k[1], (b, h, R), jnp.bfloat16)  # bf16[B, H, R]
    qr = jax.random.normal(k[2], (b, h, RP), jnp.bfloat16)  # bf16[B, H, r]
    return q, qr, pages, jnp.asarray(tables), jnp.full((b,), length, jnp.int32)


def _op_setup(op, args, **kw) -> Setup:
    """Setup of a read-only op ``op(*args, impl=, **kw)``: jitted per impl."""
    import jax

    def call(impl):
        f = jax.jit(lambda *a: op(*a, impl=impl, **kw))
        return lambda: f(*args)

    return Setup(run=call, reference=lambda: (call("reference")(),))


def _mla_setup(b: int, length: int, h: int) -> Setup:
    from kvjax.ops import mla_decode

    return _op_setup(mla_decode, _latent(b, length, h, seed=h), scale=SCALE)


def _dsa_setup(b: int, length: int, h: int, topk: int) -> Setup:
    import jax
    import jax.numpy as jnp

    from kvjax.ops import mla_decode, sparse_mla_decode

    args = _latent(b, length, h, seed=length + h)
    keys = jax.random.split(jax.random.key(length), b)
    idx = jax.vmap(lambda kk: jax.random.permutation(kk, length)[:topk])(keys).astype(jnp.int32)  # i32[B, K]
    setup = _op_setup(sparse_mla_decode, args + (idx,), scale=SCALE)
    dense = jax.jit(lambda *a: mla_decode(*a, scale=SCALE, impl="auto"))
    setup.anchors["dense mla_decode auto"] = lambda: lambda: dense(*args)
    setup.unchecked = ("dense mla_decode auto",)
    return setup


def _fp8_setup(b: int, length: int, h: int, topk: int) -> Setup:
    """Sparse decode over the DSA key roles holding the same latent: fp8 ``key`` + f32 ``key_scale`` (one per
    128 values) + bf16 ``key_rope``."""
    import jax
    import jax.numpy as jnp

    from kvjax.base.fp8 import quantize_fp8_blockwise
    from kvjax.ops import sparse_mla_decode_fp8

    q, qr, pages, tables, lens = _latent(b, length, h, seed=length + h)
    key, key_scale = quantize_fp8_blockwise(pages[..., :R], 128)  # f8e4m3[P, page, R], f32[P, page, R // 128]
    keys = jax.random.split(jax.random.key(length), b)
    idx = jax.vmap(lambda kk: jax.random.permutation(kk, length)[:topk])(keys).astype(jnp.int32)  # i32[B, K]
    return _op_setup(sparse_mla_decode_fp8, (q, qr, key, key_scale, pages[..., R:], tables, lens, idx),
                     scale=SCALE)


def _indexer_setup(b: int, length: int, heads: int, dim: int) -> Setup:
    import jax
    import jax.numpy as jnp

    from kvjax.ops import indexer_scores

    blocks = length // PAGE
    k = jax.random.split(jax.random.key(length), 4)
    tables = jax.random.permutation(k[0], b * blocks).astype(jnp.int32).reshape(b, 1, blocks)  # i32[B, 1, blocks]
    ik = jax.random.normal(k[1], (b * blocks, PAGE, dim), jnp.float32)
    amax = jnp.max(jnp.abs(ik), axis=-1, keepdims=True) / 448.0  # f32[P, page, 1]: one scale per token
    ikq = (ik / amax).astype(jnp.float8_e4m3fn)  # f8e4m3[P, page, Di]
    q = jax.random.normal(k[2], (b, heads, dim), jnp.bfloat16)  # bf16[B, Hi, Di]
    w = jax.random.normal(k[3], (b, heads), jnp.float32) * heads ** -0.5  # f32[B, Hi]
    cu = jnp.arange(b + 1, dtype=jnp.int32)
    lens = jnp.full((b,), length, jnp.int32)

    def run(impl: str):
        f = jax.jit(lambda *a: indexer_scores(*a, cu_seqlens=cu, scale=dim ** -0.5, impl=impl))
        return lambda: f(q, w, ikq, amax, tables, lens)

    return Setup(run=run, reference=lambda: run("reference")(), compare=_finite_and_mask)


def _finite_and_mask(scores) -> tuple:
    """f32[T, L] scores -> (the scores with -inf as 0, the mask of finite ones as 0 / 1)."""
    import numpy as np

    scores = np.asarray(scores, np.float64)
    finite = np.isfinite(scores)
    return np.where(finite, scores, 0.0), finite.astype(np.float64)


def cases(small: bool = False) -> list[Case]:
    """MLA decode, DSA sparse decode and indexer cases; ``small``: tiny shapes (CPU smoke run)."""
    mla = [(2, 100, 4)] if small else MLA
    dsa = [(2, 256, 4)] if small else DSA
    topk = 64 if small else TOPK
    heads, dim = (4, 32) if small else INDEXER
    out = [Case(f"mla decode B={b} L={n} H={h}", "kvjax.ops.mla_decode", dict(B=b, L=n, H=h, page=PAGE),
                ("pallas", "mosaic", "triton", "auto"), functools.partial(_mla_setup, b, n, h), anchor="triton",
                bytes=b * n * (R + RP) * 2, flops=b * n * h * 2 * (R + RP + R)) for b, n, h in mla]
    out += [Case(f"dsa sparse decode B={b} L={n} H={h} topk={topk}", "kvjax.ops.sparse_mla_decode",
                 dict(B=b, L=n, H=h, topk=topk, page=PAGE), ("pallas", "reference", "auto"),
                 functools.partial(_dsa_setup, b, n, h, topk), anchor="dense mla_decode auto",
                 bytes=b * topk * (R + RP) * 2, flops=b * topk * h * 2 * (R + RP + R)) for b, n, h in dsa]
    out += [Case(f"dsa sparse fp8 decode B={b} L={n} H={h} topk={topk}", "kvjax.ops.sparse_mla_decode_fp8",
                 dict(B=b, L=n, H=h, topk=topk, page=PAGE), ("pallas", "reference", "auto"),
                 functools.partial(_fp8_setup, b, n, h, topk), anchor="reference",
                 bytes=b * topk * (R + R // 128 * 4 + RP * 2)) for b, n, h in dsa]
    for b, n in dict.fromkeys((b, n) for b, n, _ in dsa):
        out.append(Case(f"dsa indexer B={b} L={n}", "kvjax.ops.indexer_scores", dict(B=b, L=n, Hi=heads, Di=dim),
                        ("pallas", "reference", "auto"), functools.partial(_indexer_setup, b, n, heads, dim),
                        anchor="reference", bytes=b * n * (dim + 4), flops=2 * b * n * heads * dim,
                        tol=(1e-2, 0.0)))
    return out
