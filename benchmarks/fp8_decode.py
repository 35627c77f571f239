"""Split-KV paged decode over fp8 (e4m3) pages, every kernel variant side by side in one process (issue #35, goal 1).

Usage (GPU): ``python benchmarks/fp8_decode.py [--pages 16,64] [--only NAME,...] [--interpret]`` (``benchmarks/``
finds its own imports; ``kvjax`` on ``PYTHONPATH``). B=64, L=4096, Hq=32, Hkv=8, D=128 (the batches of
``benchmarks/attention.py``), per page size one markdown table: device time (profiler; wall clock beside it), the
speed-up over the bf16 kernel, the kernel's bytes (pages read: 1 byte a value plus one f32 scale per page for K and
V over fp8 pages) over its time against an XLA copy of the same bytes (read + written) timed in the same run, and
the max error against the float32 reference over the same pages.

Rows: ``bf16 mma`` (today's tensor-core kernel over bf16 pages, the anchor), ``fp8 mma`` (today's kernel over fp8
pages, its default 2 stages), then the CUDA-core kernel (:mod:`kvjax.pallas.paged.decode_fma`) over fp8 pages
at its knobs (``block_k`` keys a step, ``prefetch`` of the next block, ``num_warps``), and over bf16 pages.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DECODE = (64, 4096, 32, 8, 128)  # B, L, Hq, Hkv, D

# name -> (pages: "bf16" | "fp8", kernel: "mma" | "fma", knobs)
VARIANTS = {
    "bf16 mma": ("bf16", "mma", {}),
    "fp8 mma": ("fp8", "mma", {}),
    "fp8 fma": ("fp8", "fma", {}),
    "fp8 fma prefetch": ("fp8", "fma", {"prefetch": True}),
    "fp8 fma bk32": ("fp8", "fma", {"block_k": 32}),  # page 64: the same as "fp8 fma" (a block is >= a page)
    "fp8 fma bk32 prefetch": ("fp8", "fma", {"block_k": 32, "prefetch": True}),
    "fp8 fma slots=8": ("fp8", "fma", {"slots": 8}),
    "fp8 fma slots=8 prefetch": ("fp8", "fma", {"slots": 8, "prefetch": True}),
    "fp8 fma 8 warps": ("fp8", "fma", {"num_warps": 8}),
    "fp8 fma 8 warps prefetch": ("fp8", "fma", {"num_warps": 8, "prefetch": True}),
    "bf16 fma": ("bf16", "fma", {}),
}


def _err(out, ref) -> str:
    import numpy as np

    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return "NON-FINITE"
    return f"{float(np.abs(out - ref).max()):.2e} (max |ref| {float(np.abs(ref).max()):.2f})"


def _rate(nbytes: int, ms: float | None) -> float | None:
    return None if not ms else nbytes / ms / 1e6  # GB/s


def _page(ps: int, names: list[str], shape: tuple[int, ...], interpret: bool) -> None:
    import jax

    import timing
    from attention import _decode_batch, _quantise, kv_bytes

    from kvjax.ops.attention import PagedAttentionCall, check_call, paged_attention_reference
    from kvjax.pallas.paged import decode, decode_fma

    b, l, hq, hkv, d = shape
    q, kp, vp, bt, _, sl, cu = _decode_batch(b, l, hq, hkv, d, ps, seed=1)
    (kp8, ks), (vp8, vs) = _quantise(kp), _quantise(vp)
    calls = {"bf16": check_call(PagedAttentionCall(q, kp, vp, bt, sl, cu)),
             "fp8": check_call(PagedAttentionCall(q, kp8, vp8, bt, sl, cu, k_scale=ks, v_scale=vs))}
    ref = jax.jit(paged_attention_reference)
    q32 = q.astype(jax.numpy.float32)
    refs = {pages: ref(check_call(dataclasses.replace(c, q=q32))) for pages, c in calls.items()}  # f32, same pages
    nbytes = {"bf16": b * hkv * kv_bytes(l, d, ps, fp8=False), "fp8": b * hkv * kv_bytes(l, d, ps, fp8=True)}
    kernels = {"mma": decode.paged_decode, "fma": decode_fma.paged_decode_fma}
    runners, errs, pages_of = {}, {}, {}
    for name in names:
        pages, kern, knobs = VARIANTS[name]
        fn = jax.jit(functools.partial(kernels[kern], interpret=interpret, **knobs))
        runner = functools.partial(fn, calls[pages])
        try:
            errs[name] = _err(runner(), refs[pages])
        except Exception as e:  # a variant the compiler rejects is reported, the others still run
            errs[name] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            continue
        runners[name], pages_of[name] = runner, pages
    times = timing.interleaved(runners, rounds=5, n=20, device_rounds=2)
    copy = {pages: timing.xla_copy(nb) for pages, nb in nbytes.items()}
    base = times.get("bf16 mma")

    def ms(t):
        return t["device_ms"] if t["device_ms"] is not None else t["wall_ms"]

    clock = "device" if base and base["device_ms"] else "wall"
    print(f"\n## decode B={b} L={l} Hq={hq} Hkv={hkv} D={d} page={ps} ({clock} ms; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind})")
    print("| kernel | device ms | wall ms | vs bf16 mma | GB/s | vs copy of its bytes | max err |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in names:
        if name not in runners:
            print(f"| {name} | - | - | - | - | - | {errs[name]} |")
            continue
        t, pages = times[name], pages_of[name]
        dev = f"{t['device_ms']:.4f}" if t["device_ms"] is not None else "-"
        speed = f"{ms(base) / ms(t):.2f}x" if base else "-"
        gbs = _rate(nbytes[pages], ms(t))
        cgbs = _rate(copy[pages]["bytes"], ms(copy[pages]))
        print(f"| {name} | {dev} | {t['wall_ms']:.4f} | {speed} | {gbs:.0f} | {gbs / cgbs:.1%} | {errs[name]} |")
    for pages, c in copy.items():
        print(f"copy of {c['bytes'] / 1e6:.1f} MB ({pages} pages: {nbytes[pages] / 1e6:.1f} MB) read + written: "
              f"{ms(c):.4f} ms ({_rate(c['bytes'], ms(c)):.0f} GB/s)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", default="16,64", help="page sizes, comma-separated")
    p.add_argument("--only", default="", help="variant names (comma-separated) besides 'bf16 mma'; default all: "
                   + ", ".join(VARIANTS))
    p.add_argument("--interpret", action="store_true", help="a CPU smoke run: B=2, L=256, Hq=8, Hkv=2, D=128 in "
                   "interpret mode (checks the script and the errors; its times mean nothing)")
    args = p.parse_args(argv)
    names = list(VARIANTS)
    if args.only:
        wanted = {x.strip() for x in args.only.split(",") if x.strip()}
        unknown = wanted - set(VARIANTS)
        if unknown:
            p.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
        names = [n for n in VARIANTS if n == "bf16 mma" or n in wanted]
    for ps in (int(x) for x in args.pages.split(",") if x.strip()):
        _page(ps, names, (2, 256, 8, 2, 128) if args.interpret else DECODE, args.interpret)


if __name__ == "__main__":
    main()
