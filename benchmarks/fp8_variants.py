"""Split-KV paged decode over fp8 (e4m3) pages beside bf16 pages, in one process (issue #35, goal 1): the decode
kernel over fp8 pages at its default and each ``--stages``, with the copy rate of the same bytes measured in the
same run. Prefill over fp8 pages: ``benchmarks/fp8_prefill.py``.

Usage (GPU): ``python benchmarks/fp8_variants.py [--stages 3]`` (``benchmarks/`` finds its own imports; ``kvjax``
on ``PYTHONPATH``). Prints one line per kernel: wall clock of back-to-back calls and device time (profiler), both
medians of interleaved rounds (:func:`timing.interleaved`), the speed-up over bf16 pages, the kernel's bytes over
its time against an XLA copy of the same bytes (read + written) timed in the same run, and the max error against
the float32 reference.

B=64, L=4096, Hq=32, Hkv=8, D=128, pages of 16 and 64 (the bf16 and fp8 batches of ``benchmarks/attention.py``):
bf16 pages through ``auto`` (the split-KV kernel), then the split-KV kernel over the fp8 pages at its default
``num_stages`` and at each of ``--stages``. Bytes: the pages read (fp8: 1 byte a value plus one f32 scale per page
for K and V). Error: max ``|out - reference|`` over the same fp8 pages, beside the largest output.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DECODE = (64, 4096, 32, 8, 128)  # B, L, Hq, Hkv, D
DECODE_PAGES = (16, 64)


def _err(out, ref) -> str:
    import numpy as np

    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return "NON-FINITE"
    return f"{float(np.abs(out - ref).max()):.2e} (max |ref| {float(np.abs(ref).max()):.2f})"


def _report(title: str, times: dict, base: str, *, nbytes: dict, copy: dict, flops: int = 0, errs: dict) -> None:
    print(f"\n## {title}")
    print("| kernel | wall ms | device ms | vs bf16 (wall) | GB/s (wall) | vs copy of its bytes | TFLOP/s | max err |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, t in times.items():
        wall, dev = t["wall_ms"], t["device_ms"]
        nb = nbytes.get(name, 0)
        gbs = f"{nb / wall / 1e6:.0f}" if nb else ""
        vs_copy = f"{(nb / wall) / (copy[nb]['bytes'] / copy[nb]['wall_ms']):.1%}" if nb else ""
        tf = f"{flops / wall / 1e9:.0f}" if flops else ""
        dev_s = f"{dev:.4f}" if dev is not None else "-"
        print(f"| {name} | {wall:.4f} | {dev_s} | {times[base]['wall_ms'] / wall:.2f}x | {gbs} | {vs_copy} | {tf} | "
              f"{errs.get(name, '')} |")
    for nb, c in copy.items():
        dev = f", device {c['device_ms']:.4f} ms" if c["device_ms"] is not None else ""
        print(f"copy of {nb / 1e6:.1f} MB read + written: wall {c['wall_ms']:.4f} ms ({c['bytes'] / c['wall_ms'] / 1e6:.0f} "
              f"GB/s){dev}")


def _checked_call(q, kp, vp, bt, sl, cu, *, scales=None):
    """The call ``paged_attention`` hands its kernels (full heads, softmax scale ``D**-0.5``), checked."""
    from kvjax.ops.attention import PagedAttentionCall, check_call

    k_scale, v_scale = scales or (None, None)
    return check_call(PagedAttentionCall(q, kp, vp, bt, sl, cu, k_scale=k_scale, v_scale=v_scale))


def decode_part(stages: tuple[int, ...]) -> None:
    for ps in DECODE_PAGES:
        _decode_page(ps, stages)


def _decode_page(ps: int, stages: tuple[int, ...]) -> None:
    import jax

    import timing
    from attention import _decode_batch, _paged_auto, _quantise, kv_bytes

    from kvjax.ops import paged_attention
    from kvjax.pallas.paged import decode

    b, l, hq, hkv, d = DECODE
    q, kp, vp, bt, _, sl, cu = _decode_batch(b, l, hq, hkv, d, ps, seed=1)
    (kp8, ks), (vp8, vs) = _quantise(kp), _quantise(vp)
    call8 = _checked_call(q, kp8, vp8, bt, sl, cu, scales=(ks, vs))
    bf16 = jax.jit(lambda *a: _paged_auto(*a, cu=cu))
    runners = {"bf16 pages (auto)": lambda: bf16(q, kp, vp, bt, sl)}
    calls = {}
    for st in (None, *stages):
        calls["fp8 (default)" if st is None else f"fp8 stages={st}"] = functools.partial(decode.paged_decode,
                                                                                         num_stages=st)
    for name, f in calls.items():
        runners[name] = lambda _f=f: _f(call8)
    ref = jax.jit(lambda *a, **kw: paged_attention(*a, cu_seqlens=cu, impl="reference", **kw))
    ref8, ref16 = ref(q, kp8, vp8, bt, sl, k_scale=ks, v_scale=vs), ref(q, kp, vp, bt, sl)
    errs = {"bf16 pages (auto)": _err(runners["bf16 pages (auto)"](), ref16)}
    for name in calls:
        try:
            errs[name] = _err(runners[name](), ref8)
        except Exception as e:  # a setting the compiler rejects is reported, the others still run
            errs[name] = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
            del runners[name]
    nb16, nb8 = b * hkv * kv_bytes(l, d, ps, fp8=False), b * hkv * kv_bytes(l, d, ps, fp8=True)
    nbytes = {name: (nb16 if name.startswith("bf16") else nb8) for name in runners}
    times = timing.interleaved(runners, rounds=5, n=20, device_rounds=2)
    copy = {nb: timing.xla_copy(nb) for nb in (nb16, nb8)}
    _report(f"decode B={b} L={l} Hq={hq} Hkv={hkv} D={d} page={ps}", times, "bf16 pages (auto)",
            nbytes=nbytes, copy=copy, errs=errs)
    for name in errs:
        if name not in runners:
            print(f"{name}: {errs[name]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="3", help="num_stages of the fp8 decode kernel beside its default (2), "
                   "comma-separated; empty: the default only")
    args = p.parse_args(argv)
    import jax

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    decode_part(tuple(int(x) for x in args.stages.split(",") if x.strip()))


if __name__ == "__main__":
    main()
