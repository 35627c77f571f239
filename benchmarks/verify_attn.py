"""Paged attention of a speculative verification step (issue #36): the split-KV decode kernel's row mode against
its one-token programs and the Triton prefill kernel, in one process on the same inputs.

Usage (GPU): ``python benchmarks/verify_attn.py [--rows 1,16,64] [--tokens 2,3,5] [--pages 16,64]
[--row-warps 4] [--device-rounds 2]`` (``kvjax`` on ``PYTHONPATH``); ``--small``: a CPU run of seconds (interpret
mode, tiny shapes, wall clock). Prints a markdown table and the total run time (under 3 minutes on an H100 with the
defaults).

Batch: B rows of J new tokens each (``max_query_len = J``, a verification step's K + 1), every row's context
L = 4096 positions including its new ones, Hq = 32, Hkv = 8, D = 128, bf16 pages of 16 or 64 tokens from a random
permutation of a pool of B x Hkv x L / page pages (one pool per page size, sized for the largest B). Columns, device
time (us) per call from the profiler's kernel records (every kernel of the call: the metadata, the kernel, the
split merge; :func:`timing.interleaved`, the runners round-robin; wall clock where the profiler has no device
records):

- ``rows``: :func:`kvjax.pallas.paged.decode.paged_decode` in its row mode (one program per row, KV head and split
  holds the row's J tokens x the GQA group; each page read once per row), its default splits;
- ``per token``: the same kernel with ``tokens_per_program=1`` (one program per token: a row's pages read J times);
- ``prefill``: :func:`kvjax.pallas.paged.prefill.paged_prefill` with its defaults (query tiles of 128 rows);
- ``auto``: what the backend table picks for the call on this device;
- ``err``: each kernel's largest ``|out - ref|`` against the float32 reference (q in f32 over the same bf16 pages).

Thresholds: ``kvjax.pallas.paged.prefill.FEW_TOKENS`` / ``FEW_TOTAL`` send a verification call to the decode
kernel; the last lines say, per page size, the largest J at which ``rows`` beat ``prefill`` at every B.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FULL = dict(context=4096, hq=32, hkv=8, d=128, rows=(1, 16, 64), tokens=(2, 3, 5), pages=(16, 64))
SMALL = dict(context=96, hq=8, hkv=2, d=32, rows=(1, 3), tokens=(2, 5), pages=(16,))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _pool(page_size: int, cfg: dict, max_rows: int, seed: int):
    """bf16 K and V pages ``[P, page, D]`` for ``max_rows`` rows x Hkv heads x L positions, and the block tables
    ``i32[max_rows, Hkv, L / page]`` of a random permutation of them."""
    import jax
    import jax.numpy as jnp

    blocks = cfg["context"] // page_size
    n_pages = max_rows * cfg["hkv"] * blocks
    keys = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(keys[0], (n_pages, page_size, cfg["d"]), jnp.bfloat16)  # bf16[P, page, D]
    v = jax.random.normal(keys[1], (n_pages, page_size, cfg["d"]), jnp.bfloat16)  # bf16[P, page, D]
    tables = jax.random.permutation(keys[2], n_pages).astype(jnp.int32).reshape(max_rows, cfg["hkv"], blocks)
    return k, v, tables


def _call(k, v, tables, rows: int, tokens: int, cfg: dict, seed: int):
    """The checked call of ``rows`` rows of ``tokens`` new tokens over the pool's first ``rows`` tables."""
    import jax
    import jax.numpy as jnp

    from kvjax.ops.attention import PagedAttentionCall, check_call

    q = jax.random.normal(jax.random.key(seed), (rows * tokens, cfg["hq"], cfg["d"]), jnp.bfloat16)  # bf16[T, Hq, D]
    return check_call(PagedAttentionCall(
        q, k, v, tables[:rows], jnp.full((rows,), cfg["context"], jnp.int32),
        jnp.arange(rows + 1, dtype=jnp.int32) * tokens, max_query_len=tokens))


def _kernels(interpret: bool, row_warps: tuple[int, ...]) -> dict:
    """name -> (jitted kernel entry, its static keyword arguments): the runners of every batch."""
    from kvjax.pallas.paged import decode, prefill

    out = {f"rows w{w}" if len(row_warps) > 1 else "rows": (decode.paged_decode, dict(num_warps=w))
           for w in row_warps}
    out["per token"] = (decode.paged_decode, dict(tokens_per_program=1))
    out["prefill"] = (prefill.paged_prefill, {})
    return {name: (fn, dict(kw, interpret=interpret)) for name, (fn, kw) in out.items()}


def _compile(fn, call, kwargs):
    """``fn`` (a jitted entry) compiled for ``call``, or the exception compiling it raised."""
    try:
        return fn.lower(call, **kwargs).compile()
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build is reported, the rest timed
        return e


def run(cfg: dict, *, interpret: bool, row_warps: tuple[int, ...], rounds: int, n: int, device_rounds: int,
        workers: int) -> list:
    """Every batch of ``cfg``: all kernels and references compiled first (``workers`` threads: XLA and Triton
    compile outside the GIL), then each batch checked and timed in turn."""
    import concurrent.futures
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.ops import attention
    from timing import interleaved

    kernels = _kernels(interpret, row_warps)
    batches = []
    for page_size in cfg["pages"]:
        k, v, tables = _pool(page_size, cfg, max(cfg["rows"]), seed=page_size)
        for rows in cfg["rows"]:
            for tokens in cfg["tokens"]:
                call = _call(k, v, tables, rows, tokens, cfg, seed=rows * 100 + tokens)
                batches.append((page_size, rows, tokens, call, dataclasses.replace(call, q=call.q.astype(jnp.float32))))
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        jobs = [{name: pool.submit(_compile, fn, call, kw) for name, (fn, kw) in kernels.items()}
                | {"reference": pool.submit(_compile, attention.paged_attention_reference, call32, {})}
                for _, _, _, call, call32 in batches]
        built = [{name: job.result() for name, job in batch.items()} for batch in jobs]
    print(f"  compiled {sum(len(b) for b in built)} executables in {time.perf_counter() - t0:.0f} s", flush=True)

    results = []
    for (page_size, rows, tokens, call, call32), exe in zip(batches, built):
        where = f"page {page_size} B={rows} J={tokens}"
        if isinstance(exe["reference"], Exception):
            print(f"  {where}: reference FAILED: {exe['reference']!r}"[:400], flush=True)
            continue
        ref = np.asarray(exe["reference"](call32))
        runners, errs = {}, {}
        for name in kernels:
            try:
                if isinstance(exe[name], Exception):
                    raise exe[name]
                out = np.asarray(jax.device_get(exe[name](call)), np.float32)
            except Exception as e:  # noqa: BLE001 - a kernel that fails here is reported, the rest timed
                print(f"  {where}: {name} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            runners[name] = functools.partial(exe[name], call)
            errs[name] = float(np.abs(out - ref).max()) if np.isfinite(out).all() else float("nan")
        if not runners:
            continue
        times = interleaved(runners, rounds=rounds, n=n, device_rounds=device_rounds)
        auto = attention.TABLE.choose("auto", (call,), {})[0]
        results.append(dict(page=page_size, rows=rows, tokens=tokens, auto=auto, errs=errs, times={
            name: t["device_ms"] if t["device_ms"] is not None else t["wall_ms"] for name, t in times.items()},
            timer="device" if next(iter(times.values()))["device_ms"] is not None else "wall"))
        print(f"  {where}: " + ", ".join(f"{name} {t * 1e3:.1f} us" for name, t in results[-1]["times"].items()),
              flush=True)
    return results


def _us(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def table(results: list) -> str:
    names = list(dict.fromkeys(n for r in results for n in r["times"]))
    head = ("| page | B x J | " + " | ".join(f"{name} (us)" for name in names) + " | rows / per token | rows / prefill"
            " | auto | " + " | ".join(f"err {name}" for name in names) + " |")
    lines = [head, "|" + "---:|" * (len(names) * 2 + 5)]
    row_name = names[0]
    for r in results:
        t, e = r["times"], r["errs"]
        lines.append(f"| {r['page']} | {r['rows']} x {r['tokens']} | " + " | ".join(_us(t.get(n)) for n in names)
                     + f" | {_ratio(t.get(row_name), t.get('per token'))} | {_ratio(t.get(row_name), t.get('prefill'))}"
                     + f" | {r['auto']} | " + " | ".join("-" if n not in e else f"{e[n]:.1e}" for n in names) + " |")
    return "\n".join(lines)


def thresholds(results: list) -> list[str]:
    """Per page size, the largest J at which the row mode beat the prefill kernel at every B measured."""
    out = []
    for page in sorted({r["page"] for r in results}):
        wins = {}
        for r in results:
            if r["page"] != page:
                continue
            row_t = min((t for n, t in r["times"].items() if n.startswith("rows")), default=float("inf"))
            wins.setdefault(r["tokens"], []).append(row_t < r["times"].get("prefill", float("inf")))
        best = None
        for j, w in sorted(wins.items()):  # the J measured, up to the first where prefill was faster at some B
            if not all(w):
                break
            best = j
        out.append(f"page {page}: row mode faster than prefill at every B for J <= {best} "
                   f"(measured J: {sorted(wins)})")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="CPU: interpret mode, tiny shapes")
    p.add_argument("--rows", type=_ints, default=None)
    p.add_argument("--tokens", type=_ints, default=None)
    p.add_argument("--pages", type=_ints, default=None)
    p.add_argument("--row-warps", type=_ints, default=(4,), help="num_warps of the row mode (several: a sweep)")
    p.add_argument("--rounds", type=int, default=3, help="wall-clock rounds per runner")
    p.add_argument("--calls", type=int, default=20, help="calls per timed round")
    p.add_argument("--device-rounds", type=int, default=2, help="profiler rounds per runner (median)")
    p.add_argument("--workers", type=int, default=8, help="threads compiling the kernels and references")
    args = p.parse_args(argv)
    cfg = dict(SMALL if args.small else FULL)
    for key in ("rows", "tokens", "pages"):
        if getattr(args, key):
            cfg[key] = getattr(args, key)
    import jax

    from kvjax.pallas.paged import decode, prefill

    t0 = time.perf_counter()
    print(f"# verification paged attention: {jax.devices()[0].device_kind}, jax {jax.__version__}, L={cfg['context']} "
          f"Hq={cfg['hq']} Hkv={cfg['hkv']} D={cfg['d']} bf16; FEW_TOKENS={prefill.FEW_TOKENS} "
          f"FEW_TOTAL={prefill.FEW_TOTAL} MAX_TOKENS_PER_PROGRAM={decode.MAX_TOKENS_PER_PROGRAM}", flush=True)
    results = run(cfg, interpret=args.small, row_warps=args.row_warps, rounds=args.rounds, n=args.calls,
                  device_rounds=args.device_rounds, workers=args.workers)
    print(f"\ntimer: {results[0]['timer']} time per call\n")
    print(table(results))
    print()
    for line in thresholds(results):
        print(line)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
