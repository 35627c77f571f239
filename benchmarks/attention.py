"""Head-wise paged attention benchmark cases (``kvjax.ops.paged_attention``): decode, head-wise SWA decode and
prefill, each beside its anchor.

Usage: ``python benchmarks/runner.py attention`` (GPU; bf16, jit-compiled, K/V pages a random permutation).

- decode, B=64, L=4096, Hq=32, Hkv=8, D=128, page 16 (1 GiB of K/V pages, far over L2); anchor: JAX's own
  ``jax.experimental.pallas.ops.gpu.paged_attention`` on the same K/V in its layout (``[Hkv, P, page, D]``
  plus one table per sequence). Bytes: K + V read.
- head-wise SWA decode, B=32, L=8192, KV heads 0-3 full, 4-7 window 512 + 4 sinks, their pages below the window
  recycled (-1); anchor: the same batch with every head full (``whole row``: the bytes of a kernel that masks the
  window without skipping pages). Bytes: the pages visited only.
- prefill, one causal sequence T=4096, H=32, D=128, pages of 64, 128 and 16; anchors: ``jax.nn.
  dot_product_attention(implementation="cudnn")`` and JAX's Pallas Triton ``mha`` on the contiguous problem.
"""

from __future__ import annotations

import functools

from case import Case, Setup

DECODE = (64, 4096, 32, 8, 128, 16)  # B, L, Hq, Hkv, D, page
SWA = (32, 8192, 32, 8, 128, 16)
WINDOW, SINKS = 512, 4
PREFILL = (4096, 32, 128)  # T, H, D
PREFILL_PAGES = (64, 128, 16)
SMALL = dict(decode=(4, 64, 4, 2, 32, 16), swa=(2, 128, 4, 2, 32, 16), window=32, prefill=(128, 2, 32), pages=(16,))


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _paged(q, kp, vp, bt, sl, cu, window, sinks):
    """Setup over one paged batch: the public op per impl and its float32 reference."""
    import jax

    from kvjax.ops import paged_attention

    def op(impl):
        return jax.jit(lambda *a: paged_attention(*a, cu_seqlens=cu, window=window, sinks=sinks, impl=impl))

    def run(impl: str):
        f = op(impl)
        return lambda: f(q, kp, vp, bt, sl)

    return Setup(run=run, reference=lambda: (op("reference")(q, kp, vp, bt, sl),))


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


def _decode_setup(shape) -> Setup:
    import jax

    b, l, hq, hkv, d, ps = shape
    q, kp, vp, bt, anchor_bt, sl, cu = _decode_batch(*shape, seed=1)
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


def _swa_setup(shape, window: int) -> Setup:
    import jax
    import jax.numpy as jnp

    b, l, hq, hkv, d, ps = shape
    q, kp, vp, bt, _, sl, cu = _decode_batch(*shape, seed=2)
    half = hkv // 2
    win = jnp.array([0] * half + [window] * (hkv - half), jnp.int32)  # i32[Hkv]
    snk = jnp.array([0] * half + [SINKS] * (hkv - half), jnp.int32)  # i32[Hkv]
    col = jnp.arange(l // ps)[None, None, :]
    dead = (win[None, :, None] > 0) & ((col + 1) * ps <= l - win[None, :, None]) & (col * ps >= snk[None, :, None])
    setup = _paged(q, kp, vp, jnp.where(dead, -1, bt), sl, cu, win, snk)  # pages below the window recycled
    whole = jax.jit(lambda *a: _paged_auto(*a, cu=cu))
    setup.anchors["whole row"] = lambda: lambda: whole(q, kp, vp, bt, sl)
    setup.unchecked = ("whole row",)  # a different computation (no window): timed, not compared
    return setup


def _paged_auto(q, kp, vp, bt, sl, *, cu):
    from kvjax.ops import paged_attention

    return paged_attention(q, kp, vp, bt, sl, cu_seqlens=cu, impl="auto")


def _prefill_setup(t: int, h: int, d: int, ps: int) -> Setup:
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v = (jax.random.normal(kk, (t, h, d), jnp.bfloat16) for kk in keys[:3])  # bf16[T, H, D]
    blocks = t // ps
    perm = jax.random.permutation(jax.random.fold_in(keys[3], ps), h * blocks).astype(jnp.int32)
    pages = lambda x: jnp.zeros((h * blocks, ps, d), x.dtype).at[perm].set(  # noqa: E731
        jnp.swapaxes(x, 0, 1).reshape(h * blocks, ps, d))  # page bt[0, hh, j] holds x[j*ps:(j+1)*ps, hh]
    setup = _paged(q, pages(k), pages(v), perm.reshape(1, h, blocks), jnp.array([t], jnp.int32),
                   jnp.array([0, t], jnp.int32), 0, 0)
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
    """Decode, SWA decode and prefill (one case per page size); ``small``: tiny shapes (CPU smoke run)."""
    dec, swa = (SMALL["decode"], SMALL["swa"]) if small else (DECODE, SWA)
    window = SMALL["window"] if small else WINDOW
    (t, h, d), pages = (SMALL["prefill"], SMALL["pages"]) if small else (PREFILL, PREFILL_PAGES)
    b, l, hq, hkv, dd, ps = dec
    out = [Case(f"paged decode B={b} L={l} Hq={hq} Hkv={hkv} page={ps}", "kvjax.ops.paged_attention",
                dict(B=b, L=l, Hq=hq, Hkv=hkv, D=dd, page=ps), ("pallas", "auto"),
                functools.partial(_decode_setup, dec), anchor="jax paged_attention", bytes=b * hkv * l * dd * 4)]
    b, l, hq, hkv, dd, ps = swa
    visited = (hkv // 2) * swa_pages(l, ps, 0, 0) + (hkv - hkv // 2) * swa_pages(l, ps, window, SINKS)
    out.append(Case(f"paged SWA decode B={b} L={l} window={window}", "kvjax.ops.paged_attention",
                    dict(B=b, L=l, Hq=hq, Hkv=hkv, D=dd, page=ps, window=window, sinks=SINKS, swa_heads=hkv // 2),
                    ("pallas", "auto"), functools.partial(_swa_setup, swa, window), anchor="whole row",
                    bytes=b * visited * ps * dd * 4))
    out += [Case(f"paged prefill T={t} H={h} page={ps}", "kvjax.ops.paged_attention",
                 dict(T=t, H=h, D=d, page=ps, causal=True), ("pallas", "mosaic", "auto"),
                 functools.partial(_prefill_setup, t, h, d, ps), anchor="cudnn",
                 flops=4 * (t * (t + 1) // 2) * d * h) for ps in pages]
    return out


if __name__ == "__main__":  # python benchmarks/attention.py [runner options]: these cases through the runner
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import runner

    sys.exit(runner.subject_main("attention", sys.argv[1:]))
