"""Paged prefill over fp8 pages against bf16 pages through the Mosaic GPU kernel, in one process (issue #35, goal 2:
fp8 no slower than bf16 at T=4096).

Usage (Hopper GPU): ``python benchmarks/fp8_prefill.py [--pages 64,128] [--stages 2,3] [--products
e4m3x2_qk,e4m3_qk] [--rounds 5]``
(``benchmarks/`` finds its own imports; ``kvjax`` on ``PYTHONPATH``). One causal sequence T=4096, H=32 (one KV head
per query head), D=128, bf16 q, pages permuted in the pool. Per page size, timed round-robin
(:func:`timing.interleaved`: profiler device time, and wall clock of back-to-back calls), the medians:

- ``bf16 pages``: the Mosaic GPU kernel (``paged_prefill_mgpu``) over bf16 pages: the baseline;
- ``fp8 e4m3x2_qk`` (the kernel's default over fp8 pages: e4m3 + one power-of-two f32 scale per page): ``q K^T``
  on e4m3 tensor cores with q as the sum of two e4m3 tiles (exact for bf16 q in e4m3's normal range), V converted
  to f16 once per slot by the producer warpgroup;
- ``fp8 e4m3_qk``: the same with q rounded to one e4m3 tile per row (faster, less exact).

The fp8 kernels run at each of ``--stages`` (ring slots, at least 2 over fp8 pages; the bf16 kernel at its default:
3 bf16 slots do not fit in shared memory) for each of ``--products``, all timed in one round-robin with the bf16
baseline (rows ``fp8 <products> stages=<n>``). Every combination is a kernel compiled in the run: the defaults time 4
fp8 kernels per page size (2 products x 2 stages), ``--stages 2`` 2.

Errors: max ``|out - reference|`` against the float32 reference over the same pages (bf16 pages for the bf16 row,
the fp8 pages for the others; the kernel's own rounding, q's included), and against the float32 reference over the
bf16 pages (what fp8 pages cost in all), beside the largest reference value. Prints markdown tables (the defaults,
4 fp8 kernels per page size: under 3 minutes on an H100).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPE = (4096, 32, 128)  # T, H, D (--tokens changes T)


def _err(out, ref) -> str:
    import numpy as np

    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return "NON-FINITE"
    return f"{float(np.abs(out - ref).max()):.2e}"


def _batch(t: int, page_size: int):
    """(q bf16[T, H, D], bf16 pages, fp8 pages + scales, table, seq_lens, cu_seqlens) of one causal row."""
    import jax
    import jax.numpy as jnp
    from attention import _quantise

    _, h, d = SHAPE
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v = (jax.random.normal(kk, (t, h, d), jnp.bfloat16) for kk in keys[:3])  # bf16[T, H, D]
    blocks = t // page_size
    perm = jax.random.permutation(jax.random.fold_in(keys[3], page_size), h * blocks).astype(jnp.int32)

    def pages(x):  # bf16[H * blocks, page_size, D] in permuted order
        return jnp.zeros((h * blocks, page_size, d), x.dtype).at[perm].set(
            jnp.swapaxes(x, 0, 1).reshape(h * blocks, page_size, d))

    kp, vp = pages(k), pages(v)
    bt = perm.reshape(1, h, blocks)  # i32[1, H, blocks]
    return q, (kp, vp), (_quantise(kp), _quantise(vp)), bt, jnp.array([t], jnp.int32), jnp.array([0, t], jnp.int32)


def run_page(t: int, page_size: int, *, stages: tuple[int, ...], products: tuple[str, ...], rounds: int) -> None:
    import jax

    import timing

    from kvjax.ops.attention import PagedAttentionCall, check_call, paged_attention_reference
    from kvjax.pallas.paged import prefill_mgpu

    _, h, d = SHAPE
    flops = 4 * (t * (t + 1) // 2) * d * h
    q, (kp, vp), ((kp8, ks), (vp8, vs)), bt, sl, cu = _batch(t, page_size)
    call16 = check_call(PagedAttentionCall(q, kp, vp, bt, sl, cu))
    call8 = check_call(PagedAttentionCall(q, kp8, vp8, bt, sl, cu, k_scale=ks, v_scale=vs))
    kernel = prefill_mgpu.paged_prefill_mgpu
    runners = {"bf16 pages": lambda: kernel(call16)}
    for mode in products:
        for st in stages:
            runners[f"fp8 {mode} stages={st}"] = lambda m=mode, s=st: kernel(call8, stages=s, fp8_products=m)
    ref = jax.jit(paged_attention_reference)
    ref16, ref8 = ref(call16), ref(call8)
    errs = {}
    for name in list(runners):
        try:
            out = runners[name]()
            errs[name] = f"{_err(out, ref16 if name == 'bf16 pages' else ref8)} | {_err(out, ref16)}"
        except Exception as e:  # a variant the compiler rejects is reported, the others still run
            errs[name] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            del runners[name]
    if "bf16 pages" not in runners:  # no baseline (no Hopper GPU): the failures only
        for name, e in errs.items():
            print(f"{name}: {e}")
        return
    times = timing.interleaved(runners, rounds=rounds, n=10, device_rounds=3)
    base = times["bf16 pages"]
    print(f"\n## prefill T={t} H={h} D={d} page={page_size} (causal, "
          f"{flops / 1e9:.1f} GFLOP; max |ref| bf16 {float(abs(ref16).max()):.2f}, fp8 {float(abs(ref8).max()):.2f})")
    print("| kernel | device ms | vs bf16 (device) | wall ms | vs bf16 (wall) | TFLOP/s (device) | max err vs f32 ref "
          "(same pages) | vs f32 ref (bf16 pages) |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for name in errs:
        if name not in times:
            print(f"| {name} | - | - | - | - | - | {errs[name]} | |")
            continue
        tm = times[name]
        dev, wall = tm["device_ms"], tm["wall_ms"]
        dev_s = f"{dev:.4f}" if dev is not None else "-"
        vs_dev = f"{base['device_ms'] / dev:.2f}x" if dev is not None and base["device_ms"] is not None else "-"
        tf = f"{flops / (dev if dev is not None else wall) / 1e9:.0f}"
        print(f"| {name} | {dev_s} | {vs_dev} | {wall:.4f} | {base['wall_ms'] / wall:.2f}x | {tf} | {errs[name]} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", default="64,128", help="page sizes, comma-separated (64 and / or 128)")
    p.add_argument("--stages", default="2,3", help="ring slots of the fp8 kernels, comma-separated")
    p.add_argument("--products", default="e4m3x2_qk,e4m3_qk", help="fp8_products of the fp8 kernels, comma-separated")
    p.add_argument("--tokens", type=int, default=SHAPE[0], help="T, a multiple of the page sizes")
    p.add_argument("--rounds", type=int, default=5, help="wall-clock rounds of timing.interleaved")
    args = p.parse_args(argv)
    import jax

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    def names(text):
        return tuple(x.strip() for x in text.split(",") if x.strip())

    for ps in (int(x) for x in names(args.pages)):
        run_page(args.tokens, ps, stages=tuple(int(x) for x in names(args.stages)), products=names(args.products),
                 rounds=args.rounds)


if __name__ == "__main__":
    main()
