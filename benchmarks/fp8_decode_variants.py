"""The split-KV decode kernel's ``page_ids`` variants over fp8 (e4m3) pages beside bf16 pages, in one process
(issue #35).

Usage (GPU): ``python benchmarks/fp8_decode_variants.py`` (``benchmarks/`` finds its own imports; ``kvjax`` on
``PYTHONPATH``). B=64, L=4096, Hq=32, Hkv=8, D=128, pages of 16 and 64 (the batches of ``fp8_variants.py``): bf16
pages through ``auto``, the fp8 kernel today (``page_ids="load"``, 2 stages), ``page_ids="prefetch"`` (block c+1's
page ids read during block c, carried in the loop) and ``"join"`` (one page-id read, its layout converted) at 2 and 3
stages, today's kernel and ``"prefetch"`` at 8 warps, and the bf16-page kernel called directly with ``"load"`` and
``"prefetch"``. Prints wall and device ms (medians of interleaved rounds, :func:`timing.interleaved`), the speed-up
over bf16, the kernel's bytes over its wall time against an XLA copy of the same bytes timed in the same run, and the
max error against the float32 reference over the same pages.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp8_variants import DECODE, DECODE_PAGES, _checked_call, _err, _report  # noqa: E402

# name -> paged_decode keywords (fp8 pages)
FP8_VARIANTS = {
    "fp8 today": {},
    "fp8 prefetch": dict(page_ids="prefetch"),
    "fp8 join": dict(page_ids="join"),
    "fp8 prefetch stages=3": dict(page_ids="prefetch", num_stages=3),
    "fp8 join stages=3": dict(page_ids="join", num_stages=3),
    "fp8 today warps=8": dict(num_warps=8),
    "fp8 prefetch warps=8": dict(page_ids="prefetch", num_warps=8),
}
BF16_VARIANTS = {"bf16 pallas load": {}, "bf16 pallas prefetch": dict(page_ids="prefetch")}


def _page(ps: int) -> None:
    import jax

    import timing
    from attention import _decode_batch, _paged_auto, _quantise, kv_bytes

    from kvjax.ops import paged_attention
    from kvjax.pallas.paged import decode

    b, l, hq, hkv, d = DECODE
    q, kp, vp, bt, _, sl, cu = _decode_batch(b, l, hq, hkv, d, ps, seed=1)
    (kp8, ks), (vp8, vs) = _quantise(kp), _quantise(vp)
    call8, call16 = _checked_call(q, kp8, vp8, bt, sl, cu, scales=(ks, vs)), _checked_call(q, kp, vp, bt, sl, cu)
    bf16 = jax.jit(lambda *a: _paged_auto(*a, cu=cu))
    runners = {"bf16 pages (auto)": lambda: bf16(q, kp, vp, bt, sl)}
    for variants, call in ((FP8_VARIANTS, call8), (BF16_VARIANTS, call16)):
        for name, kw in variants.items():
            f = functools.partial(decode.paged_decode, **kw)
            runners[name] = lambda _f=f, _c=call: _f(_c)
    ref = jax.jit(lambda *a, **kw: paged_attention(*a, cu_seqlens=cu, impl="reference", **kw))
    ref8, ref16 = ref(q, kp8, vp8, bt, sl, k_scale=ks, v_scale=vs), ref(q, kp, vp, bt, sl)
    errs = {}
    for name in list(runners):
        try:
            errs[name] = _err(runners[name](), ref16 if name.startswith("bf16") else ref8)
        except Exception as e:  # a variant the compiler rejects is reported, the others still run
            errs[name] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
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


def main() -> None:
    import jax

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for ps in DECODE_PAGES:
        _page(ps)


if __name__ == "__main__":
    main()
