"""fp8 (e4m3) pages in the split-KV decode kernel, its ``fp8_convert`` variants beside bf16 pages, in one process
(issue #35).

Usage (GPU): ``python benchmarks/fp8_decode_variants.py`` (``benchmarks/`` finds its own imports; ``kvjax`` on
``PYTHONPATH``). B=64, L=4096, Hq=32, Hkv=8, D=128, pages of 16 and 64 (the batches of ``fp8_variants.py``): bf16
pages through ``auto``, the fp8 kernel today (``fp8_convert="cast"``) and ``fp8_convert="bits"`` (bit placement,
V converted in its load layout), each at the default 2 stages and at 3. Prints wall and device ms (medians of
interleaved rounds, :func:`timing.interleaved`), the speed-up over bf16, the kernel's bytes over its wall time
against an XLA copy of the same bytes timed in the same run, and the max error against the float32 reference over
the same pages.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp8_variants import DECODE, DECODE_PAGES, _checked_call, _err, _report  # noqa: E402

VARIANTS = (("cast", None), ("bits", None), ("cast", 3), ("bits", 3))  # (fp8_convert, num_stages)


def _page(ps: int) -> None:
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
    for conv, st in VARIANTS:
        f = functools.partial(decode.paged_decode, fp8_convert=conv, num_stages=st)
        runners[f"fp8 {conv}" + ("" if st is None else f" stages={st}")] = lambda _f=f: _f(call8)
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
