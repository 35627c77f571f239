"""MLA decode (Pallas: Triton lowering and Mosaic GPU, vs Triton, vs copy bandwidth) and DSA sparse-vs-dense
decode benchmark. ``bash benchmarks/mla_run.sh`` runs the gpu tests, the torch copy and this script in one go.

Run on a GPU (jit-compiled; prints a table last, writes JSON):

    python benchmarks/mla.py --torch-copy OUT/torch_copy.json      # separate process: torch D2D copy
    python benchmarks/mla.py --out OUT/mla.json [--torch-copy-json OUT/torch_copy.json] [--quick]

Bytes counted for MLA decode: the latent rows attended, ``sum(seq_lens) * (R + r) * itemsize`` (queries,
outputs and the f32 split buffers are listed separately, not counted). Copy bandwidth counts bytes read plus
bytes written; "% of copy BW" compares the kernel's latent-bytes rate against the best copy measured here.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

from bench_util import device_ms, torch_device_ms  # noqa: E402  (benchmarks/ on sys.path)


def torch_copy(path: str) -> None:
    import torch

    n = 1 << 30  # 1 GiB
    x = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(5):
        y.copy_(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    t = statistics.median(times)
    res = {"torch_copy_GBps": 2 * n / t / 1e9, "bytes": n, "median_s": t, "device": torch.cuda.get_device_name()}
    # the same copy timed from the profiler's records, as benchmarks/bench_util.device_ms times the kernels
    res["device_s"] = torch_device_ms(lambda: y.copy_(x), n=20)["kernel_ms"] / 1e3
    res["torch_copy_device_GBps"] = 2 * n / res["device_s"] / 1e9
    print(res)
    with open(path, "w") as f:
        json.dump(res, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-copy", default=None)
    ap.add_argument("--torch-copy-json", default=None)
    ap.add_argument("--out", default="mla_bench.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-triton", action="store_true")
    ap.add_argument("--skip-dsa", action="store_true")
    ap.add_argument("--dsa-only", action="store_true", help="copy ceilings, then only the DSA part")
    ap.add_argument("--sweep", action="store_true", help="sweep kernel configs (block_h, warps, stages, splits)")
    ap.add_argument("--heads", type=lambda v: [int(x) for x in v.split(",")], default=[16, 128],
                    help="head counts timed, comma-separated (default 16,128)")
    args = ap.parse_args()
    if args.torch_copy:
        torch_copy(args.torch_copy)
        return

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.ops import mla
    from kvjax.pallas import hopper_gpu
    from kvjax.pallas import mla_decode as pk

    dev = jax.devices()[0]
    results = {"date": time.strftime("%Y-%m-%d"), "device": dev.device_kind, "jax": jax.__version__,
               "num_sms": pk._num_sms(), "mla": [], "dsa": [], "checks": []}
    if args.torch_copy_json:
        with open(args.torch_copy_json) as f:
            results["torch_copy"] = json.load(f)

    def bench(fn, *a, reps=30, inner=5):
        out = fn(*a)
        jax.block_until_ready(out)
        out = fn(*a)
        jax.block_until_ready(out)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                out = fn(*a)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / inner)
        return statistics.median(times)

    # ---- copy ceilings (same run) ----
    n = 1 << 29  # elements of bf16: 1 GiB
    x = jax.random.normal(jax.random.key(0), (n // 1024, 1024), jnp.bfloat16)
    jcopy = jax.jit(lambda a: a * 1.5)
    t = bench(jcopy, x)
    results["jnp_elementwise_GBps"] = 2 * x.nbytes / t / 1e9

    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def copy_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    rows = 32

    @jax.jit
    def pcopy(a):
        return pl.pallas_call(
            copy_kernel, grid=(a.shape[0] // rows,),
            in_specs=[pl.BlockSpec((rows, 1024), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((rows, 1024), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
            compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        )(a)

    t = bench(pcopy, x)
    results["pallas_copy_GBps"] = 2 * x.nbytes / t / 1e9
    del x
    copy_bw = max(results["jnp_elementwise_GBps"], results["pallas_copy_GBps"],
                  results.get("torch_copy", {}).get("torch_copy_GBps", 0.0))
    results["copy_ceiling_GBps"] = copy_bw
    print(f"copy: jnp {results['jnp_elementwise_GBps']:.0f} GB/s, pallas {results['pallas_copy_GBps']:.0f} GB/s, "
          f"torch {results.get('torch_copy', {}).get('torch_copy_GBps', float('nan')):.0f} GB/s", flush=True)

    rng = np.random.default_rng(0)
    if args.dsa_only:
        _bench_dsa(results, bench, rng, quick=args.quick)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        for row in results["dsa"] + results.get("dsa_indexer", []):
            print("dsa", row)
        bad = [c for c in results["checks"] if not c["ok"]]
        print("checks:", len(results["checks"]) - len(bad), "ok,", len(bad), "failed", bad if bad else "")
        return

    def make(b, h, length, page_size=64, lens=None, extra=0):
        lens = np.full(b, length, np.int32) if lens is None else np.asarray(lens, np.int32)
        max_blocks = -(-int(lens.max()) // page_size)
        num_pages = b * max_blocks + extra
        perm = rng.permutation(num_pages).astype(np.int32)
        tables = perm[: b * max_blocks].reshape(b, 1, max_blocks)
        k = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
        pages = jax.random.normal(k[0], (num_pages, page_size, 576), jnp.bfloat16)
        q = jax.random.normal(k[1], (b, h, 512), jnp.bfloat16)
        qr = jax.random.normal(k[2], (b, h, 64), jnp.bfloat16)
        return q, qr, pages, jnp.asarray(tables), jnp.asarray(lens)

    def rel(got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    impls = {"pallas": functools.partial(pk.mla_decode_pallas, kernel="triton")}  # the Triton-lowered kernel
    if hopper_gpu():
        from kvjax.pallas.mla_decode_mgpu import mla_decode_mgpu

        impls["mosaic"] = mla_decode_mgpu
    if not args.skip_triton:
        try:
            from kvjax.triton.mla_decode import mla_decode_triton

            impls["triton"] = mla_decode_triton
        except Exception as e:  # noqa: BLE001 - report and continue with Pallas only
            print("triton unavailable:", repr(e), flush=True)
            results["triton_error"] = repr(e)

    # ---- correctness on the GPU: mixed lengths up to 8k, both head counts, several split factors ----
    scale = 192 ** -0.5
    for h in (16, 128):
        a = make(8, h, 0, lens=[1, 8192, 64, 4097, 777, 8000, 65, 3], extra=7)
        f32 = lambda v: v.astype(jnp.float32)
        want = mla.mla_decode_reference(f32(a[0]), f32(a[1]), f32(a[2]), a[3], a[4], scale=scale)
        variants = [(name, fn, splits) for name, fn in impls.items() for splits in (None, 1, 5)]
        for name, fn, splits in variants:
            try:
                got = fn(*a, scale=scale, num_kv_splits=splits)
                e = rel(got, want)
                ok = e <= 2e-2 and bool(np.isfinite(np.asarray(got, np.float32)).all())
            except Exception as ex:  # noqa: BLE001
                e, ok = repr(ex)[:300], False
            results["checks"].append({"op": "mla_decode", "impl": name, "H": h, "splits": splits,
                                      "rel_err": e, "ok": ok})
            print("check", name, h, splits, e, ok, flush=True)

    # ---- timing: B=128, L=4096, page 64; identical configs for both kernels, interleaved over rounds ----
    b, length = (32, 4096) if args.quick else (128, 4096)
    rounds = 3
    for h in args.heads:
        a = make(b, h, length)
        latent_bytes = b * length * 576 * 2
        configs = [dict()]  # the defaults (kvjax.pallas.mla_decode.default_tiles, automatic splits)
        if args.sweep:
            if h == 16:
                configs += [dict(block_h=16, num_warps=4, num_stages=3, num_kv_splits=sp, block_n=bn)
                            for bn in (32, 64) for sp in (2, 3, 4)]
                configs += [dict(block_h=16, num_warps=4, num_stages=2, num_kv_splits=2, block_n=32)]
            else:
                configs += [dict(block_h=64, num_warps=8, num_stages=2, num_kv_splits=sp, block_n=64)
                            for sp in (2, 3)]
                configs += [dict(block_h=32, num_warps=4, num_stages=2, num_kv_splits=None, block_n=64),
                            dict(block_h=64, num_warps=8, num_stages=3, num_kv_splits=None, block_n=32)]
        entries = []  # (impl, config, jitted call)
        for cfg in configs:
            for name, fn in impls.items():
                if name == "mosaic":
                    continue
                kw = {k: v for k, v in cfg.items() if k != "num_kv_splits"}
                entries.append((name, cfg, jax.jit(lambda *x, _fn=fn, _kw=kw, _sp=cfg.get("num_kv_splits"): _fn(
                    *x, scale=scale, num_kv_splits=_sp, **_kw))))
        if "mosaic" in impls:  # one tile shape, the split factor its knob; probes: copies or products alone
            mcfgs = [dict(), dict(num_kv_splits=2), dict(_probe="copy"), dict(_probe="compute")]
            if args.sweep:
                mcfgs += [dict(num_kv_splits=1), dict(num_kv_splits=3)]
            for cfg in mcfgs:
                entries.append(("mosaic", cfg, jax.jit(lambda *x, _kw=cfg: impls["mosaic"](*x, scale=scale, **_kw))))
        times: dict = {}
        for _ in range(rounds):
            for i, (name, cfg, f) in enumerate(entries):
                if i in times and times[i] is None:
                    continue
                try:
                    times.setdefault(i, []).append(bench(f, *a))
                except Exception as ex:  # noqa: BLE001
                    print("fail", name, cfg, repr(ex)[:200], flush=True)
                    times[i] = None
        dtimes: dict = {}  # profiler device time (kernels only, no launch gaps), interleaved the same way
        for _ in range(rounds):
            for i, (name, cfg, f) in enumerate(entries):
                if times.get(i) is not None:
                    dtimes.setdefault(i, []).append(device_ms(lambda f=f: f(*a), n=10)["kernel_ms"] / 1e3)
        dev_copy = results.get("torch_copy", {}).get("torch_copy_device_GBps")
        for i, ts in times.items():
            name, cfg, _ = entries[i]
            if ts is None:
                results["mla"].append({"impl": name, "H": h, **cfg, "error": True})
                continue
            t = statistics.median(ts)
            gbps = latent_bytes / t / 1e9
            row = {"impl": name, "B": b, "L": length, "H": h, "page": 64, "cfg": cfg or "default",
                   "median_ms": t * 1e3, "rounds_ms": [x * 1e3 for x in ts], "latent_GBps": gbps,
                   "pct_copy": 100 * gbps / copy_bw, "TFLOPs": b * length * h * 2 * (576 + 512) / t / 1e12}
            td = statistics.median(dtimes[i])
            row.update(device_ms=td * 1e3, device_rounds_ms=[x * 1e3 for x in dtimes[i]])
            if dev_copy:
                row["pct_copy_device"] = 100 * latent_bytes / td / 1e9 / dev_copy
            results["mla"].append(row)
            print(f"{name:7s} H={h:3d} {cfg or 'default'} {t*1e3:.3f} ms (rounds {[round(x*1e3, 3) for x in ts]}) "
                  f"{gbps:.0f} GB/s {100*gbps/copy_bw:.1f}% {row['TFLOPs']:.0f} TFLOP/s; device {td*1e3:.3f} ms "
                  f"{row.get('pct_copy_device', float('nan')):.1f}% of the device-timed copy", flush=True)
            best = results.setdefault("best", {}).get(f"{name}_H{h}")
            if "_probe" not in cfg and (best is None or td * 1e3 < best["device_ms"]):  # probes are not kernels
                results["best"][f"{name}_H{h}"] = {"median_ms": t * 1e3, "device_ms": td * 1e3,
                                                   "cfg": cfg or "default"}
            if not cfg:
                results.setdefault("default", {})[f"{name}_H{h}"] = {"median_ms": t * 1e3, "device_ms": td * 1e3}
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)

    if not args.skip_dsa:
        try:
            _bench_dsa(results, bench, rng, quick=args.quick)
        except Exception as ex:  # noqa: BLE001
            results["dsa_error"] = repr(ex)[:500]
            print("dsa failed:", repr(ex)[:500], flush=True)

    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)

    dev_copy = results.get("torch_copy", {}).get("torch_copy_device_GBps", float("nan"))
    print("\n=== MLA decode, B=%d L=%d page 64 bf16, %s; copy ceiling %.0f GB/s (wall), %.0f GB/s (device) ===" % (
        b, length, results["device"], copy_bw, dev_copy))
    print("wall = 5 back-to-back calls / 5 (includes host dispatch); device = profiler kernel time (no gaps)")
    for label in ("default", "best"):
        for key, v in results.get(label, {}).items():
            gbps = b * length * 576 * 2 / (v["median_ms"] / 1e3) / 1e9
            dgbps = b * length * 576 * 2 / (v["device_ms"] / 1e3) / 1e9
            print(f"{label:7s} {key:12s} wall {v['median_ms']:.3f} ms {100*gbps/copy_bw:5.1f}% of copy | device "
                  f"{v['device_ms']:.3f} ms {100*dgbps/dev_copy:5.1f}% of the device-timed copy  {v.get('cfg', '')}")
    for row in results["dsa"] + results.get("dsa_indexer", []):
        print("dsa", row)
    bad = [c for c in results["checks"] if not c["ok"]]
    print("checks:", len(results["checks"]) - len(bad), "ok,", len(bad), "failed", bad if bad else "")


def _bench_dsa(results, bench, rng, quick=False):
    """Decode at top-k 2048 (sparse kernel over the selected rows) vs dense decode over all L rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.ops import dsa
    from kvjax.pallas import mla_decode as pk

    b, topk = (8, 2048) if quick else (32, 2048)
    scale = 192 ** -0.5
    for length in (8192, 32768):
        page = 64
        max_blocks = length // page
        num_pages = b * max_blocks
        perm = rng.permutation(num_pages).astype(np.int32)
        tables = jnp.asarray(perm.reshape(b, 1, max_blocks))
        lens = jnp.full((b,), length, jnp.int32)
        k = jax.random.split(jax.random.key(length), 8)
        pages = jax.random.normal(k[0], (num_pages, page, 576), jnp.bfloat16)
        idx = jax.vmap(lambda kk: jax.random.permutation(kk, length)[:topk])(jax.random.split(k[3], b))
        idx = idx.astype(jnp.int32)
        # indexer over the fp8 indexer cache (jnp reference) for the same step
        ik = jax.random.normal(k[4], (num_pages, page, 128), jnp.float32)
        amax = jnp.max(jnp.abs(ik), axis=-1, keepdims=True) / 448.0
        ikq = (ik / amax).astype(jnp.float8_e4m3fn)
        iq = jax.random.normal(k[5], (b, 64, 128), jnp.bfloat16)
        iw = jax.random.normal(k[6], (b, 64), jnp.float32) * 64 ** -0.5
        cu = jnp.arange(b + 1, dtype=jnp.int32)
        indexer = jax.jit(lambda q_, w_, kq_, ks_, t_, l_: dsa.index_topk(
            dsa.indexer_scores(q_, w_, kq_, ks_, t_, l_, cu_seqlens=cu, scale=128 ** -0.5, impl="reference"),
            topk))
        t_index = bench(indexer, iq, iw, ikq, amax, tables, lens, reps=10, inner=2)
        irow = _bench_indexer_kernel(results, bench, (iq, iw, ikq, amax, tables, lens), cu, topk, length)
        irow["indexer_topk_jnp_ms"] = t_index * 1e3
        results.setdefault("dsa_indexer", []).append(irow)
        print("dsa indexer", irow, flush=True)
        fp8_roles = _fp8_key_roles(pages)  # DSA key cache roles holding the same latent
        for h in (16, 128):
            q = jax.random.normal(k[1], (b, h, 512), jnp.bfloat16)
            qr = jax.random.normal(k[2], (b, h, 64), jnp.bfloat16)
            dense = jax.jit(lambda *x: pk.mla_decode_pallas(*x, scale=scale))
            row = {"B": b, "H": h, "L": length, "topk": topk, "page": 64,
                   "dense_pallas_ms": bench(dense, q, qr, pages, tables, lens) * 1e3,
                   "indexer_topk_jnp_ms": t_index * 1e3}
            want = dsa.sparse_mla_decode(q.astype(jnp.float32), qr.astype(jnp.float32), pages.astype(jnp.float32),
                                         tables, lens, idx, scale=scale, impl="reference")
            for name, fn in (
                ("pallas", lambda *x: pk.sparse_mla_decode_pallas(*x, scale=scale)),
                ("xla_reference", lambda *x: dsa.sparse_mla_decode(*x, scale=scale, impl="reference")),
            ):
                f = jax.jit(fn)
                try:
                    got = f(q, qr, pages, tables, lens, idx)
                    e = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
                    results["checks"].append({"op": "sparse_mla_decode", "impl": name, "H": h, "L": length,
                                              "rel_err": e, "ok": e <= 2e-2})
                    row[f"sparse_{name}_ms"] = bench(f, q, qr, pages, tables, lens, idx) * 1e3
                except Exception as ex:  # noqa: BLE001
                    row[f"sparse_{name}_error"] = repr(ex)[:300]
            _bench_sparse_fp8(results, bench, row, (q, qr) + fp8_roles + (tables, lens, idx), scale)
            results["dsa"].append(row)
            print("dsa", row, flush=True)



def _fp8_key_roles(pages):
    """bf16 latent pages [P, ps, 576] -> DSA roles (key f8e4m3[P, ps, 512], key_scale f32[P, ps, 4], key_rope)."""
    from kvjax.base.fp8 import quantize_fp8_blockwise

    key, key_scale = quantize_fp8_blockwise(pages[..., :512], 128)
    return key, key_scale, pages[..., 512:]


def _bench_sparse_fp8(results, bench, row, args, scale):
    """Sparse decode over the fp8 key roles: Pallas kernel and the jnp reference path,
    each checked against the f32 reference first. Bytes read per call: ``B·K·(512 + 16 + 128)``."""
    import jax

    from kvjax.ops import dsa
    from kvjax.pallas.dsa_sparse import sparse_mla_decode_fp8_pallas

    q = args[0]
    with jax.default_matmul_precision("highest"):
        want = dsa.sparse_mla_decode_fp8(*args, scale=scale, impl="reference").astype("float32")
    for name, fn in (
        ("pallas_bits", lambda *x: sparse_mla_decode_fp8_pallas(*x, scale=scale)),
        ("xla_reference", lambda *x: dsa.sparse_mla_decode_fp8(*x, scale=scale, impl="reference")),
    ):
        f = jax.jit(fn)
        try:
            got = f(*args).astype("float32")
            e = float(jax.numpy.linalg.norm(got - want) / jax.numpy.linalg.norm(want))
            results["checks"].append({"op": "sparse_mla_decode_fp8", "impl": name, "H": q.shape[1],
                                      "L": row["L"], "rel_err": e, "ok": e <= 2e-2})
            row[f"sparse_fp8_{name}_ms"] = bench(f, *args) * 1e3
        except Exception as ex:  # noqa: BLE001
            row[f"sparse_fp8_{name}_error"] = repr(ex)[:300]


def _bench_indexer_kernel(results, bench, args, cu, topk, length):
    """Pallas indexer scores alone and + ``index_topk``, checked against the f32 reference.

    Counted per call: key bytes ``B·L·(128 + 4)`` (fp8 keys + f32 scale) and ``2·B·L·Hi·Di`` FLOPs.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.ops import dsa
    from kvjax.pallas.dsa_indexer import indexer_scores_pallas

    b, hi, di = args[0].shape  # iq bf16[B, Hi, Di]
    scale = di ** -0.5
    row = {"B": b, "Hi": hi, "Di": di, "L": length, "topk": topk, "page": 64,
           "key_MB": b * length * (di + 4) / 1e6, "GFLOP": 2 * b * length * hi * di / 1e9}
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: dsa.indexer_scores(*a, cu_seqlens=cu, scale=scale, impl="reference"))(*args)
    want_idx = np.asarray(dsa.index_topk(want, topk))
    want = np.asarray(want)
    fin = np.isfinite(want)
    for mode in ("bits",):  # fp8 decoded from its bit pattern (native fp8 loads fail to lower, jax 0.11.2)
        scores = jax.jit(lambda *a: indexer_scores_pallas(*a, cu_seqlens=cu, scale=scale))
        both = jax.jit(lambda *a: dsa.index_topk(indexer_scores_pallas(*a, cu_seqlens=cu, scale=scale), topk))
        try:
            got = np.asarray(scores(*args))
            mask_ok = bool((np.isneginf(got) == np.isneginf(want)).all())
            e = float(np.linalg.norm(got[fin] - want[fin]) / np.linalg.norm(want[fin]))
            idx = np.asarray(both(*args))
            overlap = float(np.mean([len(set(idx[t]) & set(want_idx[t])) / topk for t in range(b)]))
            ok = mask_ok and e <= 1e-2 and overlap >= 0.99
            results["checks"].append({"op": "indexer_scores", "impl": f"pallas_{mode}", "L": length, "rel_err": e,
                                      "mask_ok": mask_ok, "topk_overlap": overlap, "ok": ok})
            t = bench(scores, *args)
            row[f"pallas_{mode}_ms"] = t * 1e3
            row[f"pallas_{mode}_GBps"] = row["key_MB"] / 1e3 / t
            row[f"pallas_{mode}_TFLOPs"] = row["GFLOP"] / 1e3 / t
            row[f"pallas_{mode}_topk_ms"] = bench(both, *args) * 1e3
        except Exception as ex:  # noqa: BLE001
            row[f"pallas_{mode}_error"] = repr(ex)[:300]
    row["topk_only_ms"] = bench(jax.jit(lambda s_: dsa.index_topk(s_, topk)), jnp.asarray(want)) * 1e3
    return row


if __name__ == "__main__":
    sys.exit(main())
