"""``python -m kvjax simulate``: the capacity simulator's command line (:mod:`kvjax.sched.simulate` runs it).

Drives the real host scheduler with a synthetic workload and no model, and prints one table: per (SWA fraction,
model shards and head placement, pool, recycle) run (``--model-shards M``: the same page memory in per-device
pools, as the engine on a ``--mesh DxM``), or with ``--prefix-caching`` per prefix-cache mode (off / eager /
keep_tail, timely recycling, shared pool). ``--processes N`` adds a second table: the workload split over N
engines as ``kvjax run``'s processes split it (:mod:`kvjax.sched.dispatch`). Every argument is checked, and the
memory the run needs estimated,
before the first simulation; a flag the chosen mode would ignore is refused. Numpy only, like :mod:`kvjax.sched`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import numpy as np

from kvjax.cli.args import (ArgumentParser, check_memory, comma_list, fail, int_at_least, json_destination,
                            number_in)
from kvjax.cli.output import provenance, write_json
from kvjax.config import KV_CACHE_DTYPES, CacheConfig
from kvjax.errors import UsageError
from kvjax.sched.blocks import POOLS
from kvjax.sched.dispatch import SHARES, format_dispatch_table, simulate_dispatch
from kvjax.sched.prefix_cache import PrefixCacheConfig
from kvjax.sched.recycle import RECYCLE_POLICIES
from kvjax.sched.simulate import (PLACEMENTS, check_servable_sharded, format_prefix_table, format_table, simulate,
                                  simulate_prefix)
from kvjax.sched.workload import (SEED_OUTPUT_MEAN, SEED_PROMPT_MEAN, cache_for, check_servable, few_shot_workload,
                                  kv_page_bytes, multi_turn_workload, same_memory, seed_footprint, seed_workload,
                                  swa_layout, system_prompt_workload)


PREFIX_WORKLOADS = {  # name -> (requests, scale, seed, spread) -> workload; lengths scale with --scale (1: seed-sized)
    "seed": lambda n, k, s, spread: seed_workload(n, scale=k, spread=spread, seed=s),
    "system-prompt": lambda n, k, s, _: system_prompt_workload(n, system_len=max(1, round(8192 * k)),
                                                            user_len=max(1, round(1024 * k)),
                                                            output_len=max(1, round(1024 * k)), seed=s),
    "multi-turn": lambda n, k, s, _: multi_turn_workload(max(1, n // 4), turns=4, first_len=max(1, round(4096 * k)),
                                                      message_len=max(1, round(512 * k)),
                                                      output_len=max(1, round(512 * k)), seed=s),
    "few-shot": lambda n, k, s, _: few_shot_workload(n, tasks=3, shots=8, shot_len=max(1, round(512 * k)),
                                                  question_len=max(1, round(256 * k)),
                                                  output_len=max(1, round(256 * k)), seed=s),
}

PREFIX_MODES = ("off", "eager", "keep_tail")  # the prefix cache off, then its recycle options


def prefix_lengths(workload: str, requests: int, scale: float, spread: float) -> tuple[int, float, int, int]:
    """Without drawing it, what :data:`PREFIX_WORKLOADS` ``[workload]`` would hold: ``(requests, mean tokens per
    request, longest request, output tokens in all)`` (prompt + output; an upper estimate where lengths vary)."""
    def r(x: float) -> int:
        return max(1, round(x * scale))

    if workload == "seed":
        mean = scale * (SEED_PROMPT_MEAN + SEED_OUTPUT_MEAN) + 2
        longest = math.ceil(scale * (SEED_PROMPT_MEAN + SEED_OUTPUT_MEAN) * (1 + spread)) + 2
        return requests, mean, longest, requests * math.ceil(scale * SEED_OUTPUT_MEAN * (1 + spread) + 1)
    if workload == "system-prompt":
        out = r(1024)
        longest = r(8192) + math.ceil(1.5 * r(1024)) + out
        return requests, float(longest), longest, requests * out
    if workload == "multi-turn":
        convs, turns, first, step, out = max(1, requests // 4), 4, r(4096), r(512) + r(512), r(512)
        longest = first + (turns - 1) * step + out
        return convs * turns, first + (turns - 1) * step / 2 + out, longest, convs * turns * out
    if workload == "few-shot":
        out = r(256)
        longest = 8 * r(512) + r(512) // 2 + r(256) + out
        return requests, float(longest), longest, requests * out
    raise ValueError(f"unknown workload {workload!r}; known: {sorted(PREFIX_WORKLOADS)}")


def _page_ratio(args: argparse.Namespace) -> float:
    """Pages of ``--kv-cache-dtype`` per page of the default (bf16) pages in the same page memory."""
    return (kv_page_bytes(args.page_size, args.head_dim) /
            kv_page_bytes(args.page_size, args.head_dim, args.kv_cache_dtype))


def page_memory(args: argparse.Namespace, cache: CacheConfig) -> CacheConfig:
    """``cache`` (``--memory-requests`` in bf16 pages) with the pages of ``--kv-cache-dtype`` the same bytes hold,
    rounded down to a multiple of ``--kv-heads`` (the partitioned pool gives each head an equal share; every pool
    policy of a comparison gets the same pages)."""
    fit = same_memory(cache, kv_page_bytes(args.page_size, args.head_dim),
                      kv_page_bytes(args.page_size, args.head_dim, args.kv_cache_dtype))
    return dataclasses.replace(fit, num_pages=fit.num_pages - fit.num_pages % args.kv_heads)


def prefix_footprint(args: argparse.Namespace) -> int:
    """Host bytes that ``simulate --prefix-caching`` needs, estimated from the arguments alone: the workload's
    token arrays (prompt and output, and the loop's copy), the prefix cache's per-block entries, the block tables,
    page lists and slots (the terms that grow with the arguments)."""
    n, mean, longest, _ = prefix_lengths(args.workload, args.requests, args.scale, args.spread)
    blocks = -(-longest // args.page_size)
    pages = math.ceil(args.memory_requests * _page_ratio(args) * -(-mean // args.page_size)) * args.kv_heads
    return int(n * (20 * mean + 1024)  # int32 prompt + int64 tokens per request, Python objects
               + n * -(-mean // args.page_size) * 256  # hash-chained cache entries per prompt block
               + pages * 64  # owners, free lists, reference counts
               + (args.max_seqs + 1) * args.kv_heads * (4 * blocks + 8) + 256 * args.max_seqs  # tables, slots
               + 64 * args.kv_heads * longest)


def build_parser() -> ArgumentParser:
    """The ``simulate`` command's arguments (``--help`` shows each default)."""
    p = ArgumentParser(prog="python -m kvjax simulate",
                       description="Host-only capacity simulation: the real scheduler, a synthetic seed-shaped "
                                   "workload, no model. Compares recycle and pool policies (or, with "
                                   "--prefix-caching, the prefix cache's modes) at the same page memory.")
    p.add_argument("--requests", type=int_at_least(1), default=64, help="requests, all arriving at step 0")
    p.add_argument("--scale", type=number_in(0, low_open=True, noun="scale"), default=1.0,
                   help="multiplies the seed-shaped lengths (10,599 prompt / 4,054 output tokens on average)")
    p.add_argument("--spread", type=number_in(0, 1, high_open=True), default=0.25,
                   help="lengths uniform in mean*[1-spread, 1+spread] (seed workload)")
    p.add_argument("--kv-heads", type=int_at_least(1), default=4, help="KV heads of the attention layer")
    p.add_argument("--swa-fraction", type=comma_list(number_in(0, 1)), default=[1.0],
                   help="fraction of the KV heads that are sliding-window; a comma list compares several "
                        "(e.g. 0.25,0.5,1.0); --prefix-caching takes one")
    p.add_argument("--window", type=int_at_least(0), default=1024, help="sliding window of the SWA heads (tokens)")
    p.add_argument("--sinks", type=int_at_least(0), default=4, help="attention-sink tokens the SWA heads keep")
    p.add_argument("--page-size", type=int_at_least(1), default=64, help="tokens per page")
    p.add_argument("--memory-requests", type=number_in(0, low_open=True), default=8.0,
                   help="page memory = this many mean-length requests on every head without recycling")
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto",
                   help="K/V page format at the same page memory: auto (bf16 pages) or fp8 / fp8_e4m3 (fp8 pages with "
                        "one f32 scale each: about twice the pages)")
    p.add_argument("--head-dim", type=int_at_least(1), default=256,
                   help="head dimension of the K/V pages (sizes fp8 pages against bf16 ones, and --page-bytes' "
                        "default)")
    p.add_argument("--max-seqs", type=int_at_least(1), default=64, help="most requests running at once (rows)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=2048, help="token budget per step")
    p.add_argument("--recycle", type=comma_list(sorted(RECYCLE_POLICIES)), default=["none", "timely"],
                   help="comma list of recycle policies to compare (not with --prefix-caching: timely)")
    p.add_argument("--pool", type=comma_list(POOLS), default=list(POOLS),
                   help="comma list of page-pool policies to compare (not with --prefix-caching: shared)")
    p.add_argument("--model-shards", type=comma_list(int_at_least(1)), default=[1],
                   help="per-device page pools: the same page memory split over M devices of a mesh's 'model' axis, "
                        "each holding its KV heads' pages (the engine on --mesh DxM); a comma list compares several "
                        "(e.g. 1,2)")
    p.add_argument("--placement", type=comma_list(PLACEMENTS), default=["balanced"],
                   help="how KV heads are split over --model-shards: balanced (the engine's head placement: the "
                        "same mix of SWA and full heads per device where the counts allow) or contiguous (in "
                        "head order); a comma list compares both")
    p.add_argument("--processes", type=int_at_least(1), default=1,
                   help="also split the workload over N engines, one per process as kvjax run --coordinator runs "
                        "them, each with the page memory above, stepped in lockstep: a second table gives each "
                        "engine's steps and the most the split gains over one engine at equal step times")
    p.add_argument("--share", type=comma_list(SHARES), default=list(SHARES),
                   help="with --processes: the splits to compare, dynamic (the next request, largest first, to an "
                        "engine with none waiting) and / or static (split by tokens before the run)")
    p.add_argument("--seed", type=int_at_least(0, 2**32 - 1), default=0, help="seed of the workload and tokens")
    p.add_argument("--check-every", type=int_at_least(0), default=0,
                   help="run the integrity checks every N steps (slow; 0: never)")
    p.add_argument("--json", metavar="FILE", type=json_destination,
                   help="also write the configuration, the results and the run's provenance (versions, commit, "
                        "date) as JSON to FILE; '-' writes it to standard output instead of the table")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on standard error (tqdm); default: on for runs of 100,000 tokens or more")
    p.add_argument("--prefix-caching", action="store_true",
                   help="compare the prefix cache off / eager / keep_tail (timely recycling, shared pool) on "
                        "--workload")
    p.add_argument("--workload", choices=sorted(PREFIX_WORKLOADS), default="seed",
                   help="workload of --prefix-caching")
    p.add_argument("--host-cache-gb", type=number_in(0, low_open=True), default=None,
                   help="with --prefix-caching: also run keep_tail with a host tier of this many GB (evicted blocks "
                        "and checkpoints spill to host memory and come back on a hit)")
    p.add_argument("--page-bytes", type=int_at_least(1), default=None,
                   help="bytes of one KV head's page over every layer, for --host-cache-gb (default: a Qwen3.5-like "
                        "8 attention layers, K and V of --head-dim dims in bf16 (8192 x --page-size at 256) or fp8 "
                        "with their scales)")
    p.add_argument("--ckpt-bytes", type=int_at_least(1), default=24 * 16 * 128 * 128 * 4,
                   help="bytes of one GDN checkpoint over every GDN layer, for --host-cache-gb (default: 24 layers "
                        "of 16 f32 128x128 states)")
    return p


# flags a mode would ignore -> why (refused when given)
_IGNORED_WITH_PREFIX = {"processes": "--prefix-caching simulates one engine",
                        "share": "--prefix-caching simulates one engine",
                        "recycle": "--prefix-caching always recycles timely",
                        "pool": "--prefix-caching always uses the shared pool",
                        "model_shards": "--prefix-caching simulates one page pool",
                        "placement": "--prefix-caching simulates one page pool"}


def _check_mode(p: ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Refuse a flag the chosen mode would silently ignore."""
    given = p.given(argv)
    if "head_dim" in given and args.kv_cache_dtype == "auto" and args.host_cache_gb is None:
        raise UsageError("--head-dim sizes fp8 pages and the host tier's pages: it needs --kv-cache-dtype fp8 or "
                         "--host-cache-gb")
    if not args.prefix_caching:
        if given & {"host_cache_gb", "page_bytes", "ckpt_bytes"}:
            raise UsageError("--host-cache-gb / --page-bytes / --ckpt-bytes need --prefix-caching (the host tier "
                             "holds what the prefix cache evicts)")
        if "workload" in given:
            raise UsageError("--workload needs --prefix-caching (without it the workload is the seed-shaped one)")
        if "placement" in given and max(args.model_shards) == 1:
            raise UsageError("--placement needs --model-shards above 1 (one pool has nothing to place)")
        if "share" in given and args.processes == 1:
            raise UsageError("--share needs --processes above 1 (one engine has nothing to split)")
        if args.processes > 1 and max(args.model_shards) > 1:
            raise UsageError("--processes simulates engines of one page pool each: drop --model-shards")
        return
    for dest, why in _IGNORED_WITH_PREFIX.items():
        if dest in given:
            raise UsageError(f"--{dest} is not used with --prefix-caching ({why}); drop it")
    if len(args.swa_fraction) > 1:
        raise UsageError(f"--prefix-caching takes one --swa-fraction, got {','.join(map(str, args.swa_fraction))}")
    if "spread" in given and args.workload != "seed":
        raise UsageError(f"--spread applies to the seed workload only, not --workload {args.workload}")
    if args.host_cache_gb is None and given & {"page_bytes", "ckpt_bytes"}:
        raise UsageError("--page-bytes / --ckpt-bytes size the host tier: they need --host-cache-gb")


def _kind(args: argparse.Namespace) -> str:
    return "fp8 " if args.kv_cache_dtype != "auto" else ""


def _bar(total: int, enabled: bool | None, desc: str):
    """A tqdm bar over ``total`` tokens on stderr, or None (off, short, or tqdm missing)."""
    if enabled is False or (enabled is None and total < 100_000):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if enabled:
            print("simulate: --progress needs tqdm (pip install tqdm)", file=sys.stderr)
        return None
    return tqdm(total=total, unit="tok", desc=desc, file=sys.stderr, leave=False)


def _run_all(jobs: list, total: int, enabled: bool | None) -> list:
    """Run ``jobs`` = ``[(label, fn(progress) -> result)]`` one after another under one progress bar."""
    bar = _bar(total, enabled, jobs[0][0] if jobs else "")
    results = []
    try:
        for i, (label, fn) in enumerate(jobs):
            if bar is not None:
                bar.set_description(f"{label} ({i + 1}/{len(jobs)})")
            results.append(fn(bar.update if bar is not None else None))
    finally:
        if bar is not None:
            bar.close()
    return results


def _prefix_main(args: argparse.Namespace, argv: list[str]) -> int:
    """``simulate --prefix-caching``: the cache off / eager / keep_tail (timely recycling, ``max_seqs``
    checkpoints) on one workload and one ``--swa-fraction``; prints :func:`format_prefix_table`."""
    check_memory(prefix_footprint(args), f"--prefix-caching --workload {args.workload} --requests {args.requests} "
                                         f"--scale {args.scale:g} --max-seqs {args.max_seqs}")
    workload = PREFIX_WORKLOADS[args.workload](args.requests, args.scale, args.seed, args.spread)
    cache = page_memory(args, cache_for(workload, num_kv_heads=args.kv_heads, page_size=args.page_size,
                                        full_requests=args.memory_requests, max_seqs=args.max_seqs))
    attention = swa_layout(args.kv_heads, args.swa_fraction[0], args.window, args.sinks)
    check_servable(workload, cache, attention, max_num_batched_tokens=args.max_tokens, pool="shared",
                   recycle="timely")
    total = sum(w.max_new_tokens for w in workload)
    jobs = [(f"prefix cache {mode}", lambda progress, mode=mode: simulate_prefix(
                workload, cache, attention, max_num_batched_tokens=args.max_tokens, seed=args.seed,
                check_every=args.check_every, progress=progress,
                prefix=None if mode == "off" else PrefixCacheConfig(args.max_seqs, True, mode)))
            for mode in PREFIX_MODES]
    if args.host_cache_gb is not None:
        tier = PrefixCacheConfig(args.max_seqs, True, "keep_tail", host_bytes=int(args.host_cache_gb * 1e9),
                                 page_bytes=args.page_bytes or 8 * kv_page_bytes(args.page_size, args.head_dim,
                                                                                 args.kv_cache_dtype), ckpt_bytes=args.ckpt_bytes)
        jobs.append(("prefix cache keep_tail + host tier", lambda progress: simulate_prefix(
            workload, cache, attention, max_num_batched_tokens=args.max_tokens, seed=args.seed,
            check_every=args.check_every, progress=progress, prefix=tier)))
    results = _run_all(jobs, total * len(jobs), args.progress)
    if args.json:
        write_json(args.json, dict(meta=provenance("simulate", argv, device="host only (no model)", seed=args.seed),
                                   workload=args.workload, num_pages=cache.num_pages,
                                   config={k: v for k, v in vars(args).items() if k not in ("json", "progress")},
                                   results=[dataclasses.asdict(r) for r in results]))
    if args.json != "-":
        print(f"# prefix caching, workload {args.workload}: {len(workload)} requests, mean prompt "
              f"{np.mean([w.prompt.size for w in workload]):.0f} tokens; {cache.num_pages} {_kind(args)}pages of "
              f"{args.page_size}; swa fraction {args.swa_fraction[0]:g}; timely recycling")
        print(format_prefix_table(results))
    return 0


def main(argv: list[str]) -> int:
    """CLI entry of ``python -m kvjax simulate``; returns the exit status (2, with one line on stderr, for a bad
    argument, a flag the mode would ignore, a size this machine cannot hold, or a request some configuration can
    never serve; all checked before the first simulation)."""
    p = build_parser()
    try:
        args = p.parse_args(argv)
        _check_mode(p, args, argv)
        if args.prefix_caching:
            return _prefix_main(args, argv)
        host, _ = seed_footprint(args.requests, scale=args.scale, spread=args.spread, num_kv_heads=args.kv_heads,
                                 page_size=args.page_size, full_requests=args.memory_requests * _page_ratio(args),
                                 max_seqs=args.max_seqs)
        check_memory(host * args.processes, f"--requests {args.requests} --scale {args.scale:g} --max-seqs "
                                             f"{args.max_seqs} --memory-requests {args.memory_requests:g}"
                                             + (f" --processes {args.processes}" if args.processes > 1 else ""))
        workload = seed_workload(args.requests, scale=args.scale, spread=args.spread, seed=args.seed)
        cache = page_memory(args, cache_for(workload, num_kv_heads=args.kv_heads, page_size=args.page_size,
                                            full_requests=args.memory_requests, max_seqs=args.max_seqs))
        shardings = [(m, place) for m in dict.fromkeys(args.model_shards)
                     for place in (args.placement if m > 1 else args.placement[:1])]
        runs = [(swa_layout(args.kv_heads, frac, args.window, args.sinks), m, place, pool, recycle)
                for frac in args.swa_fraction for m, place in shardings for pool in args.pool
                for recycle in args.recycle]
        for attention, m, place, pool, recycle in runs:  # every run can serve every request, before the first
            if m == 1:
                check_servable(workload, cache, attention, max_num_batched_tokens=args.max_tokens, pool=pool,
                               recycle=recycle)
            else:
                check_servable_sharded(workload, cache, attention, max_num_batched_tokens=args.max_tokens, pool=pool,
                                       recycle=recycle, model_shards=m, placement=place)
        total = sum(w.max_new_tokens for w in workload)
        jobs = [(f"swa {len(att.swa_heads) / att.num_kv_heads:g}{f' M={m} {place}' if m > 1 else ''} {pool} {recycle}",
                 lambda progress, att=att, m=m, place=place, pool=pool, recycle=recycle: simulate(
                     workload, cache, att, max_num_batched_tokens=args.max_tokens, pool=pool, recycle=recycle,
                     seed=args.seed, check_every=args.check_every, progress=progress, model_shards=m,
                     placement=place))
                for att, m, place, pool, recycle in runs]
        if args.processes > 1:
            jobs += [(f"swa {len(att.swa_heads) / att.num_kv_heads:g} {pool} {recycle} x{args.processes} {share}",
                      lambda progress, att=att, pool=pool, recycle=recycle, share=share: simulate_dispatch(
                          workload, cache, att, engines=args.processes, share=share,
                          max_num_batched_tokens=args.max_tokens, pool=pool, recycle=recycle, seed=args.seed,
                          progress=progress))
                     for att, _, _, pool, recycle in runs for share in args.share]
        done = _run_all(jobs, total * len(jobs), args.progress)
        results, dispatched = done[: len(runs)], done[len(runs):]
    except ValueError as e:
        return fail("simulate", e)
    one_steps = {(r.swa_fraction, r.pool, r.recycle): r.steps for r in results if r.model_shards == 1}
    config = dict(vars(args), num_pages=cache.num_pages, max_blocks_per_seq=cache.max_blocks_per_seq,
                  mean_prompt=float(np.mean([w.prompt.size for w in workload])),
                  mean_output=float(np.mean([w.max_new_tokens for w in workload])))
    for key in ("json", "progress", "workload"):
        config.pop(key)
    if args.json:
        write_json(args.json, dict(meta=provenance("simulate", argv, device="host only (no model)", seed=args.seed),
                                   config=config, results=[dataclasses.asdict(r) for r in results],
                                   dispatch=[dict(dataclasses.asdict(d), rounds=d.run_steps,
                                                  vs_one=one_steps[(d.swa_fraction, d.pool, d.recycle)] / d.run_steps)
                                             for d in dispatched]))
    if args.json != "-":
        print(f"# {args.requests} requests, mean prompt {config['mean_prompt']:.0f} / output "
              f"{config['mean_output']:.0f} tokens; {args.kv_heads} KV heads, window {args.window}, sinks "
              f"{args.sinks}; {cache.num_pages} {_kind(args)}pages of {args.page_size} ({args.memory_requests:g} full "
              f"requests in bf16 pages); "
              f"max_seqs {args.max_seqs}, {args.max_tokens} tokens/step")
        print(format_table(results))
        if dispatched:
            print(f"# {args.processes} engines, one per process, {cache.num_pages} pages each, in lockstep (every "
                  f"engine's step the same time); vs one = one engine's steps over the slowest engine's")
            print(format_dispatch_table(dispatched, one_steps))
    return 0
