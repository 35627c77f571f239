"""Head-wise paged attention benchmark cases (``kvjax.ops.paged_attention``): decode, head-wise SWA decode and
prefill, each beside its anchor.

Usage: ``python benchmarks/runner.py attention`` (GPU; bf16, jit-compiled, K/V pages a random permutation).

- decode, B=64, L=4096, Hq=32, Hkv=8, D=128, pages of 16 and 64 (1 GiB of bf16 K/V pages, far over L2);
  anchor: JAX's own ``jax.experimental.pallas.ops.gpu.paged_attention`` on the same K/V in its layout
  (``[Hkv, P, page, D]`` plus one table per sequence). Bytes: K + V read.
- the same decode over fp8 pages (``... fp8``: the bf16 pages quantised page by page with power-of-two scales, as
  the cache write does); anchor: the bf16-pages batch through ``impl="auto"`` (``bf16 pages``, timed, not
  compared: ``vs anchor`` is the speed-up over bf16 pages in the same run). Bytes: the fp8 pages (1 byte a value)
  plus their f32 scales (one per page for K and one for V).
- head-wise SWA decode, B=32, L=8192, KV heads 0-3 full, 4-7 window 512 + 4 sinks, their pages below the window
  recycled (-1); anchor: the same batch with every head full (``whole row``: the bytes of a kernel that masks the
  window without skipping pages). Bytes: the pages visited only (and their scales, for the fp8 case, whose whole
  row is over the same fp8 pages). Also timed: the same kernel in its grid order (``grid order``: programs launched
  by (token, head, split), not longest walk first; checked against the reference).
- ragged decode, B=32 rows alternating 8192 and 512 tokens, Hq=32, Hkv=8, D=128, page 16, every head full, bf16 and
  fp8 pages; anchor: the kernel in its grid order (``grid order``), so ``vs anchor`` is what launching the longest
  walks first gains (``kvjax.pallas.paged.decode.longest_walks_first``). Bytes: the K + V of both row lengths.
- prefill, one causal sequence T=4096, H=32, D=128, pages of 64, 128 and 16, bf16 and fp8 pages; anchors: ``jax.nn.
  dot_product_attention(implementation="cudnn")`` and JAX's Pallas Triton ``mha`` on the contiguous bf16 problem
  (not compared for fp8 pages: the reference reads the quantised values).
"""

from __future__ import annotations

import functools

from case import Case, Setup

DECODE = (64, 4096, 32, 8, 128, 16)  # B, L, Hq, Hkv, D, page
DECODE_PAGES = (16, 64)
SWA = (32, 8192, 32, 8, 128, 16)
WINDOW, SINKS = 512, 4
RAGGED = (32, 8192, 512, 32, 8, 128, 16)  # B, L of the even rows, L of the odd rows, Hq, Hkv, D, page
PREFILL = (4096, 32, 128)  # T, H, D
PREFILL_PAGES = (64, 128, 16)
SMALL = dict(decode=(4, 64, 4, 2, 32, 16), swa=(2, 128, 4, 2, 32, 16), window=32, prefill=(128, 2, 32), pages=(16,),
             decode_pages=(16,), ragged=(2, 128, 32, 4, 2, 32, 16))
SCALE_BYTES = 4  # one f32 scale per fp8 page (K and V each)


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def kv_bytes(tokens: int, d: int, page: int, fp8: bool) -> int:
    """Bytes of K + V for ``tokens`` positions of one KV head in pages of ``page``: 2 bytes a value for bf16
    pages; 1 byte a value plus one f32 scale per page (K and V each) for fp8 pages."""
    if not fp8:
        return tokens * d * 2 * 2
    return 2 * (tokens * d + -(-tokens // page) * SCALE_BYTES)


def _quantise(pages):
    """bf16[P, page, D] pages as fp8 pages with one power-of-two scale per page, as the cache write stores them:
    (f8e4m3[P, page, D], f32[P])."""
    import jax
    import jax.numpy as jnp

    from kvjax.base.fp8 import FP8_DTYPE, pow2_scale

    @jax.jit
    def quantise(x):
        s = pow2_scale(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(1, 2)))  # f32[P]
        return (x.astype(jnp.float32) / jnp.where(s > 0, s, 1.0)[:, None, None]).astype(FP8_DTYPE), s

    return quantise(pages)


def _pages(kp, vp, fp8: bool):
    """``(kp, vp, scales)``: the pages as they are (``scales`` None), or as fp8 pages (:func:`_quantise`) with
    ``scales = (k_scale, v_scale)``."""
    if not fp8:
        return kp, vp, None
    (kp, ks), (vp, vs) = _quantise(kp), _quantise(vp)
    return kp, vp, (ks, vs)


def _paged(q, kp, vp, bt, sl, cu, window, sinks, scales=None):
    """Setup over one paged batch: the public op per impl and its float32 reference. ``scales``: ``(k_scale,
    v_scale)`` f32[P] each, for fp8 pages."""
    import jax

    from kvjax.ops import paged_attention

    extra = {} if scales is None else dict(zip(("k_scale", "v_scale"), scales))

    def op(impl):
        return jax.jit(lambda *a: paged_attention(*a, cu_seqlens=cu, window=window, sinks=sinks, impl=impl,
                                                  **extra))

    def run(impl: str):
        f = op(impl)
        return lambda: f(q, kp, vp, bt, sl)

    return Setup(run=run, reference=lambda: (op("reference")(q, kp, vp, bt, sl),))


def _grid_order(setup: Setup, q, kp, vp, bt, sl, cu, window=0, sinks=0, scales=None) -> None:
    """Add the anchor ``grid order``: the split-KV decode kernel on the same batch with ``longest_first=False``
    (interpret mode off the GPU), checked against the reference like the op."""
    import jax

    from kvjax.ops.attention import PagedAttentionCall, check_call
    from kvjax.pallas.paged import decode

    k_scale, v_scale = scales or (None, None)
    call = check_call(PagedAttentionCall(q, kp, vp, bt, sl, cu, window, sinks, k_scale, v_scale))
    grid = jax.jit(functools.partial(decode.paged_decode, longest_first=False, interpret=not _on_gpu()))
    setup.anchors["grid order"] = lambda: lambda: grid(call)


def _decode_batch(b, l, hq, hkv, d, ps, seed):
    import jax
    import jax.numpy as jnp

    per_head = b * l // ps
    keys = jax.random.split(jax.random.key(seed), 4)
    kp = jax.random.normal(keys[0], (hkv * per_head, ps, d), jnp.bfloat16)  # bf16[P, page, D]
    vp = jax.random.normal(keys[1], (hkv * per_head, ps, d), jnp.bfloat16)  # bf16[P, page, D]
    anchor_bt = jax.random.permutation(keys[2], per_head).astype(jnp.int32).reshape(b, l // ps)  # i32[B, blocks]
    bt = jnp.arange(hkv, dtype=jnp.int32)[None, :, None] * per_head + anchor_bt[:, None, :]  # i32[B, Hkv, blocks]
    q = jax.random.normal(keys[3], (b, hq, d), jnp.bfloat16)  # bf16[B, Hq, D]
    return q, kp, vp, bt, anchor_bt, jnp.full((b,), l, jnp.int32), jnp.arange(b + 1, dtype=jnp.int32)


def _decode_setup(shape, fp8: bool = False) -> Setup:
    import jax

    b, l, hq, hkv, d, ps = shape
    q, kp, vp, bt, anchor_bt, sl, cu = _decode_batch(*shape, seed=1)
    if fp8:  # the same batch over fp8 pages; anchor: the bf16 pages through auto (the kernel fp8 replaces)
        (kp8, ks), (vp8, vs) = _quantise(kp), _quantise(vp)
        setup = _paged(q, kp8, vp8, bt, sl, cu, 0, 0, scales=(ks, vs))
        bf16 = jax.jit(lambda *a: _paged_auto(*a, cu=cu))
        setup.anchors["bf16 pages"] = lambda: lambda: bf16(q, kp, vp, bt, sl)
        setup.unchecked = ("bf16 pages",)  # other values (unquantised pages): timed, not compared
        return setup
    setup = _paged(q, kp, vp, bt, sl, cu, 0, 0)
    if _on_gpu():
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

        per_head = b * l // ps
        anchor = jax.jit(lambda q_, k_, v_, bt_, sl_: jax_pa.paged_attention(
            q_ * d ** -0.5, k_.reshape(hkv, per_head, ps, d), v_.reshape(hkv, per_head, ps, d), bt_, sl_,
            k_splits=min(16, l // ps)))
        setup.anchors["jax paged_attention"] = lambda: lambda: anchor(q, kp, vp, anchor_bt, sl)
    return setup


def swa_pages(l: int, ps: int, window: int, sinks: int) -> int:
    """Pages a head with ``window`` / ``sinks`` visits for the token at position ``l - 1`` (all if window 0)."""
    if window == 0:
        return -(-l // ps)
    lo = (l - window) // ps
    sink_pages = {p for p in range(-(-sinks // ps)) if p < lo}
    return (l - 1) // ps - lo + 1 + len(sink_pages)


def _swa_setup(shape, window: int, fp8: bool = False) -> Setup:
    import jax
    import jax.numpy as jnp

    b, l, hq, hkv, d, ps = shape
    q, kp, vp, bt, _, sl, cu = _decode_batch(*shape, seed=2)
    half = hkv // 2
    win = jnp.array([0] * half + [window] * (hkv - half), jnp.int32)  # i32[Hkv]
    snk = jnp.array([0] * half + [SINKS] * (hkv - half), jnp.int32)  # i32[Hkv]
    col = jnp.arange(l // ps)[None, None, :]
    dead = (win[None, :, None] > 0) & ((col + 1) * ps <= l - win[None, :, None]) & (col * ps >= snk[None, :, None])
    kp, vp, scales = _pages(kp, vp, fp8)  # fp8 pages for both: the bytes-prediction ratio over fp8 pages
    swa_bt = jnp.where(dead, -1, bt)  # pages below the window recycled
    setup = _paged(q, kp, vp, swa_bt, sl, cu, win, snk, scales)
    _grid_order(setup, q, kp, vp, swa_bt, sl, cu, win, snk, scales)
    whole = jax.jit(lambda *a: _paged_auto(*a, cu=cu, scales=scales))
    setup.anchors["whole row"] = lambda: lambda: whole(q, kp, vp, bt, sl)
    setup.unchecked = ("whole row",)  # a different computation (no window): timed, not compared
    return setup


def _ragged_setup(shape, fp8: bool = False) -> Setup:
    import jax.numpy as jnp

    b, long, short, hq, hkv, d, ps = shape
    q, kp, vp, bt, _, _, cu = _decode_batch(b, long, hq, hkv, d, ps, seed=4)
    sl = jnp.where(jnp.arange(b) % 2 == 0, long, short).astype(jnp.int32)  # i32[B]: long and short rows alternate
    kp, vp, scales = _pages(kp, vp, fp8)
    setup = _paged(q, kp, vp, bt, sl, cu, 0, 0, scales)
    _grid_order(setup, q, kp, vp, bt, sl, cu, scales=scales)
    return setup


def _paged_auto(q, kp, vp, bt, sl, *, cu, scales=None):
    from kvjax.ops import paged_attention

    k_scale, v_scale = scales or (None, None)
    return paged_attention(q, kp, vp, bt, sl, cu_seqlens=cu, impl="auto", k_scale=k_scale, v_scale=v_scale)


def _prefill_setup(t: int, h: int, d: int, ps: int, fp8: bool = False) -> Setup:
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v = (jax.random.normal(kk, (t, h, d), jnp.bfloat16) for kk in keys[:3])  # bf16[T, H, D]
    blocks = t // ps
    perm = jax.random.permutation(jax.random.fold_in(keys[3], ps), h * blocks).astype(jnp.int32)
    pages = lambda x: jnp.zeros((h * blocks, ps, d), x.dtype).at[perm].set(  # noqa: E731
        jnp.swapaxes(x, 0, 1).reshape(h * blocks, ps, d))  # page bt[0, hh, j] holds x[j*ps:(j+1)*ps, hh]
    kp, vp, scales = _pages(pages(k), pages(v), fp8)
    setup = _paged(q, kp, vp, perm.reshape(1, h, blocks), jnp.array([t], jnp.int32), jnp.array([0, t], jnp.int32),
                   0, 0, scales)
    if fp8:  # the anchors read the unquantised bf16 values: timed, not compared
        setup.unchecked = ("cudnn", "jax mha")
    if _on_gpu():
        from jax.experimental.pallas.ops.gpu import attention as jattn

        cudnn = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(
            a[None], b[None], c[None], scale=d ** -0.5, is_causal=True, implementation="cudnn")[0])
        mha = jax.jit(lambda a, b, c: jattn.mha(
            a[None], b[None], c[None], None, sm_scale=d ** -0.5, causal=True, num_warps=8, num_stages=3,
            block_sizes=jattn.BlockSizes(block_q=128, block_k=128))[0])
        setup.anchors["cudnn"] = lambda: lambda: cudnn(q, k, v)
        setup.anchors["jax mha"] = lambda: lambda: mha(q, k, v)
    return setup


def cases(small: bool = False) -> list[Case]:
    """Decode (bf16 and fp8 pages, per page size), SWA decode and ragged decode (bf16 and fp8) and prefill (bf16
    and fp8, per page size); ``small``: tiny shapes (CPU smoke run). A case over fp8 pages is named ``... fp8``
    (the bf16 one keeps its name)."""
    dec, swa = (SMALL["decode"], SMALL["swa"]) if small else (DECODE, SWA)
    window = SMALL["window"] if small else WINDOW
    (t, h, d), pages = (SMALL["prefill"], SMALL["pages"]) if small else (PREFILL, PREFILL_PAGES)
    decode_pages = SMALL["decode_pages"] if small else DECODE_PAGES
    out = []
    for ps in decode_pages:
        b, l, hq, hkv, dd, _ = dec
        shape = (b, l, hq, hkv, dd, ps)
        name = f"paged decode B={b} L={l} Hq={hq} Hkv={hkv} page={ps}"
        shapes = dict(B=b, L=l, Hq=hq, Hkv=hkv, D=dd, page=ps)
        out.append(Case(name, "kvjax.ops.paged_attention", shapes, ("pallas", "auto"),
                        functools.partial(_decode_setup, shape), anchor="jax paged_attention",
                        bytes=b * hkv * kv_bytes(l, dd, ps, fp8=False)))
        out.append(Case(f"{name} fp8", "kvjax.ops.paged_attention", dict(shapes, pages="fp8"), ("pallas", "auto"),
                        functools.partial(_decode_setup, shape, fp8=True), anchor="bf16 pages",
                        bytes=b * hkv * kv_bytes(l, dd, ps, fp8=True)))
    b, l, hq, hkv, dd, ps = swa
    shapes = dict(B=b, L=l, Hq=hq, Hkv=hkv, D=dd, page=ps, window=window, sinks=SINKS, swa_heads=hkv // 2)
    visited = (hkv // 2) * swa_pages(l, ps, 0, 0) + (hkv - hkv // 2) * swa_pages(l, ps, window, SINKS)
    for fp8 in (False, True):
        out.append(Case(f"paged SWA decode B={b} L={l} window={window}" + (" fp8" if fp8 else ""),
                        "kvjax.ops.paged_attention", dict(shapes, pages="fp8") if fp8 else shapes, ("pallas", "auto"),
                        functools.partial(_swa_setup, swa, window, fp8=fp8), anchor="whole row",
                        bytes=b * kv_bytes(visited * ps, dd, ps, fp8=fp8)))
    ragged = SMALL["ragged"] if small else RAGGED
    b, long, short, hq, hkv, dd, ps = ragged
    shapes = dict(B=b, L=f"{long}/{short}", Hq=hq, Hkv=hkv, D=dd, page=ps)
    for fp8 in (False, True):
        out.append(Case(f"paged ragged decode B={b} L={long}/{short}" + (" fp8" if fp8 else ""),
                        "kvjax.ops.paged_attention", dict(shapes, pages="fp8") if fp8 else shapes, ("pallas", "auto"),
                        functools.partial(_ragged_setup, ragged, fp8=fp8), anchor="grid order",
                        bytes=b // 2 * hkv * (kv_bytes(long, dd, ps, fp8) + kv_bytes(short, dd, ps, fp8))))
    for ps in pages:
        for fp8 in (False, True):
            out.append(Case(f"paged prefill T={t} H={h} page={ps}" + (" fp8" if fp8 else ""),
                            "kvjax.ops.paged_attention",
                            dict(T=t, H=h, D=d, page=ps, causal=True, **({"pages": "fp8"} if fp8 else {})),
                            ("pallas", "prefill", "mosaic", "auto"),
                            functools.partial(_prefill_setup, t, h, d, ps, fp8),
                            anchor="cudnn", flops=4 * (t * (t + 1) // 2) * d * h))
    return out


if __name__ == "__main__":  # python benchmarks/attention.py [runner options]: these cases through the runner
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import runner

    sys.exit(runner.subject_main("attention", sys.argv[1:]))
