"""Causal conv1d on the GDN conv pool: fused XLA path vs the Pallas kernels, against the copy ceiling.

    PYTHONPATH=$PWD python3 benchmarks/conv.py --out OUT/conv.json [--quick]

Every variant is first checked against the reference path (``impl="reference"``: gather, ``kvjax.ops.conv``
reference, scatter) on the same inputs: output relative L2 error and exact equality of the written states.
Timing: jit-compiled public op (``kvjax.state.gdn_ops.conv_decode`` / ``conv_prefill``) with the pool donated
and chained call to call; median over rounds of the mean of back-to-back calls. Decode rotates over 8 layers
of the pool and 8 input buffers so the working set (about 200 MB) exceeds L2. Bytes: state read + write, x
read, y written (weights ignored: < 0.2 MB). The copy ceiling is measured in the same run (Pallas copy
kernel, XLA elementwise, and a torch device-to-device copy in a subprocess where torch has CUDA).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.state import gdn_ops as gdn_state
from kvjax.state.gdn_pool import GDNStatePool

from bench_util import jax_copy_ceiling, rel_err as _rel, time_ms as _time  # noqa: E402  (benchmarks/ on sys.path)

W = 4
ROTATE = 8
STEPS = 16
PREFILL_STEPS = 4


TORCH_COPY = """
import json, torch
x = torch.randn(256 * 1024 * 1024, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ts = []
for _ in range(7):
    s.record()
    for _ in range(20): y.copy_(x)
    e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 20)
ts.sort(); print(json.dumps({"ms": ts[3], "bytes": 2 * x.numel() * 4}))
"""


def copy_ceiling():
    res = jax_copy_ceiling()
    nbytes = res["bytes"]
    try:
        out = subprocess.run([sys.executable, "-c", TORCH_COPY], capture_output=True, text=True, timeout=120)
        res["torch_copy_ms"] = json.loads(out.stdout.strip().splitlines()[-1])["ms"]
    except Exception as e:  # no torch / no CUDA torch: the JAX copies remain
        res["torch_copy_error"] = repr(e)[:200]
    for key in ("xla_add", "pallas_copy", "torch_copy"):
        if f"{key}_ms" in res:
            res[f"{key}_gbps"] = nbytes / res[f"{key}_ms"] / 1e6
    res["best_gbps"] = max(v for k, v in res.items() if k.endswith("_gbps"))
    return res


def _check(name, y, new_conv, ry, rconv, layer, live_slots):
    new = np.asarray(new_conv[layer, live_slots], np.float32)
    ref = np.asarray(rconv[layer, live_slots], np.float32)
    return {"err_y": _rel(y, ry), "state_exact": bool(np.array_equal(new, ref)),
            "pad_slot_untouched": bool(jnp.all(new_conv[:, 0] == 0))}


def bench_decode(batch, dim, ceiling, quick):
    rng = np.random.default_rng(batch)
    num_slots = batch + 9
    conv0 = jax.random.normal(jax.random.key(1), (ROTATE, num_slots, dim, W - 1), jnp.bfloat16).at[:, 0].set(0)
    ssm0 = jnp.zeros((ROTATE, num_slots, 1, 1, 1), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (dim, W), jnp.float32) * 0.5
    xs = [jax.random.normal(jax.random.key(10 + i), (batch, dim), jnp.bfloat16) for i in range(ROTATE)]
    slots = jnp.asarray(rng.permutation(np.arange(1, num_slots))[:batch].astype(np.int32))
    layers = [jnp.asarray(i, jnp.int32) for i in range(ROTATE)]
    nbytes = 2 * batch * dim * (W - 1) * 2 + 2 * batch * dim * 2
    ry, rpool = gdn_state.conv_decode(xs[0], w, None, GDNStatePool(conv=jnp.array(conv0), ssm=jnp.array(ssm0)),
                                      layer=3, slot_ids=slots, impl="reference")
    rconv = np.asarray(rpool.conv, np.float32)
    live = np.asarray(slots)
    configs = [("reference", {})]
    tunings = [(256, 2), (512, 4)] if quick else [(128, 1), (256, 1), (256, 2), (512, 2), (512, 4), (1024, 4)]
    configs += [("pallas", {"block_d": bd, "num_warps": nw}) for bd, nw in tunings]
    rows = []
    for impl, tuning in configs:
        def step(x, pool, layer, impl=impl, tuning=tuning):
            if not tuning:
                return gdn_state.conv_decode(x, w, None, pool, layer=layer, slot_ids=slots, impl=impl)
            y, c = gdn_state.conv_decode_pool_pallas(x, w, None, pool.conv, layer=layer, slot_ids=slots,
                                                     activation="silu", **tuning)
            return y, GDNStatePool(conv=c, ssm=pool.ssm)

        fn = jax.jit(step, donate_argnums=1)
        y, p = fn(xs[0], GDNStatePool(conv=jnp.array(conv0), ssm=jnp.array(ssm0)), layers[3])
        r = dict(kind="decode", B=batch, D=dim, impl=impl, **tuning,
                 **_check(impl, y, p.conv, ry, rconv, 3, live))
        del p
        state = [GDNStatePool(conv=jnp.array(conv0), ssm=jnp.array(ssm0)), 0]

        def run():
            i = state[1] = (state[1] + 1) % ROTATE
            y, state[0] = fn(xs[i], state[0], layers[i])
            return y

        r["per_call_ms"] = _time(run, n=50)  # includes host dispatch of one jitted call

        def multi(x, pool):  # STEPS unrolled steps, y feeds the next x, layers rotate: device time only
            for i in range(STEPS):
                x, pool = step(x, pool, i % ROTATE)
            return x, pool

        mfn = jax.jit(multi, donate_argnums=1)
        state = [GDNStatePool(conv=jnp.array(conv0), ssm=jnp.array(ssm0))]

        def run_multi():
            y, state[0] = mfn(xs[0], state[0])
            return y

        r["ms"] = _time(run_multi, n=5) / STEPS
        r["gbps"] = nbytes / r["ms"] / 1e6
        r["pct_copy"] = 100 * r["gbps"] / ceiling
        r["bytes"] = nbytes
        print(_row(r), flush=True)
        rows.append(r)
        del state
    return rows


def bench_prefill(lens, dim, ceiling, quick):
    rng = np.random.default_rng(len(lens))
    n = len(lens)
    num_slots = n + 9
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    t = int(sum(lens))
    conv0 = jax.random.normal(jax.random.key(1), (2, num_slots, dim, W - 1), jnp.bfloat16).at[:, 0].set(0)
    ssm0 = jnp.zeros((2, num_slots, 1, 1, 1), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (dim, W), jnp.float32) * 0.5
    x = jax.random.normal(jax.random.key(3), (t, dim), jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(np.arange(1, num_slots))[:n].astype(np.int32))
    has_init = jnp.asarray(np.arange(n) % 2 == 0)
    nbytes = 2 * t * dim * 2 + n * dim * (W - 1) * 2 * 2
    kw = dict(layer=1, slot_ids=slots, has_initial_state=has_init, cu_seqlens=cu)
    ry, rpool = gdn_state.conv_prefill(x, w, None, GDNStatePool(conv=jnp.array(conv0), ssm=jnp.array(ssm0)),
                                       impl="reference", **kw)
    rconv = np.asarray(rpool.conv, np.float32)
    ry = np.asarray(ry, np.float32)
    del rpool
    configs = [("reference", {})]
    tunings = [(32, 128, 4), (16, 256, 4)] if quick else [
        (32, 128, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 4), (64, 128, 4)]
    configs += [("pallas", {"block_t": bt, "block_d": bd, "num_warps": nw}) for bt, bd, nw in tunings]
    rows = []
    for impl, tuning in configs:
        def step(x, pool, impl=impl, tuning=tuning):
            if not tuning:
                return gdn_state.conv_prefill(x, w, None, pool, impl=impl, **kw)
            y, c = gdn_state.conv_prefill_pool_pallas(x, w, None, pool.conv, activation="silu", **kw, **tuning)
            return y, GDNStatePool(conv=c, ssm=pool.ssm)

        fn = jax.jit(step, donate_argnums=1)
        y, p = fn(x, GDNStatePool(conv=jnp.array(conv0), ssm=jnp.array(ssm0)))
        r = dict(kind="prefill", N=n, T=t, D=dim, impl=impl, **tuning,
                 **_check(impl, y, p.conv, ry, rconv, 1, np.asarray(slots)))
        del p, y
        state = [GDNStatePool(conv=jnp.array(conv0), ssm=jnp.array(ssm0))]

        def run():
            y, state[0] = fn(x, state[0])
            return y

        r["per_call_ms"] = _time(run, n=10 if quick else 20)

        def multi(x, pool):  # STEPS unrolled steps, y feeds the next x: device time only
            for _ in range(PREFILL_STEPS):
                x, pool = step(x, pool)
            return x, pool

        mfn = jax.jit(multi, donate_argnums=1)
        state = [GDNStatePool(conv=jnp.array(conv0), ssm=jnp.array(ssm0))]

        def run_multi():
            y, state[0] = mfn(x, state[0])
            return y

        r["ms"] = _time(run_multi, n=3) / PREFILL_STEPS
        r["gbps"] = nbytes / r["ms"] / 1e6
        r["pct_copy"] = 100 * r["gbps"] / ceiling
        r["bytes"] = nbytes
        print(_row(r), flush=True)
        rows.append(r)
        del state
    return rows


HEADER = (f"{'kind':8} {'shape':22} {'impl':9} {'tuning':12} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'call ms':>8} "
          f"{'err_y':>8} state")


def _row(r):
    shape = f"B={r['B']} D={r['D']}" if r["kind"] == "decode" else f"N={r['N']} T={r['T']} D={r['D']}"
    tun = "/".join(str(r[k]) for k in ("block_t", "block_d", "num_warps") if k in r)
    return (f"{r['kind']:8} {shape:22} {r['impl']:9} {tun:12} {r['ms']:8.4f} {r['gbps']:7.0f} {r['pct_copy']:6.1f} "
            f"{r['per_call_ms']:8.4f} {r['err_y']:8.1e} {'exact' if r['state_exact'] else 'DIFF'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="conv.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    res["copy"] = copy_ceiling()
    ceiling = res["copy"]["best_gbps"]
    print("copy", res["copy"], flush=True)
    print(HEADER, flush=True)
    res["decode"], res["prefill"] = [], []
    shapes = (("decode", bench_decode, (128, 12288)), ("decode", bench_decode, (256, 6144)),
              ("prefill", bench_prefill, ([8192], 6144)), ("prefill", bench_prefill, ([4096] * 4, 12288)))
    for kind, fn, shape in shapes:
        res[kind] += fn(*shape, ceiling, args.quick)
        with open(args.out, "w") as f:  # after every shape: a timeout still leaves the finished ones
            json.dump(res, f, indent=1)
    print(f"\n{res['device']}  copy ceiling {ceiling:.0f} GB/s")
    print(HEADER)
    for r in res["decode"] + res["prefill"]:
        print(_row(r))


if __name__ == "__main__":
    main()
