"""``python -m kvjax simulate``: the capacity simulator's command line (:mod:`kvjax.sched.simulate` runs it).

Drives the real host scheduler with a synthetic workload and no model, and prints one table: per (SWA fraction,
pool, recycle) run, or with ``--prefix-caching`` per prefix-cache mode. Numpy only, like :mod:`kvjax.sched`.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from kvjax.cli.args import ArgumentParser, check_memory, comma_list, fail, int_at_least, number_in
from kvjax.sched.blocks import POOLS
from kvjax.sched.prefix_cache import PrefixCacheConfig
from kvjax.sched.recycle import RECYCLE_POLICIES
from kvjax.sched.simulate import format_prefix_table, format_table, simulate, simulate_prefix
from kvjax.sched.workload import (cache_for, check_servable, few_shot_workload, multi_turn_workload, seed_footprint,
                                  seed_workload, swa_layout, system_prompt_workload)


PREFIX_WORKLOADS = {  # name -> (requests, scale, seed) -> workload; lengths scale with --scale (1: seed-sized)
    "seed": lambda n, k, s: seed_workload(n, scale=k, seed=s),
    "system-prompt": lambda n, k, s: system_prompt_workload(n, system_len=max(1, round(8192 * k)),
                                                            user_len=max(1, round(1024 * k)),
                                                            output_len=max(1, round(1024 * k)), seed=s),
    "multi-turn": lambda n, k, s: multi_turn_workload(max(1, n // 4), turns=4, first_len=max(1, round(4096 * k)),
                                                      message_len=max(1, round(512 * k)),
                                                      output_len=max(1, round(512 * k)), seed=s),
    "few-shot": lambda n, k, s: few_shot_workload(n, tasks=3, shots=8, shot_len=max(1, round(512 * k)),
                                                  question_len=max(1, round(256 * k)),
                                                  output_len=max(1, round(256 * k)), seed=s),
}


def _prefix_main(args) -> int:
    """``simulate --prefix-caching``: the cache off / eager / keep_tail (timely recycling, ``max_seqs``
    checkpoints) on one workload and the first ``--swa-fraction``; prints :func:`format_prefix_table`."""
    workload = PREFIX_WORKLOADS[args.workload](args.requests, args.scale, args.seed)
    cache = cache_for(workload, num_kv_heads=args.kv_heads, page_size=args.page_size,
                      full_requests=args.memory_requests, max_seqs=args.max_seqs)
    attention = swa_layout(args.kv_heads, args.swa_fraction[0], args.window, args.sinks)
    results = [simulate_prefix(workload, cache, attention, max_num_batched_tokens=args.max_tokens, seed=args.seed,
                               check_every=args.check_every,
                               prefix=None if mode == "off" else PrefixCacheConfig(args.max_seqs, True, mode))
               for mode in ("off", "eager", "keep_tail")]
    if args.json:
        print(json.dumps(dict(workload=args.workload, num_pages=cache.num_pages,
                              results=[dataclasses.asdict(r) for r in results]), indent=2))
    else:
        print(f"# prefix caching, workload {args.workload}: {len(workload)} requests, mean prompt "
              f"{np.mean([w.prompt.size for w in workload]):.0f} tokens; {cache.num_pages} pages of "
              f"{args.page_size}; swa fraction {args.swa_fraction[0]:g}; timely recycling")
        print(format_prefix_table(results))
    return 0


def main(argv: list[str]) -> int:
    """CLI entry of ``python -m kvjax simulate``; returns the exit status (2, with one line on stderr, for a bad
    argument, a size this machine cannot hold, or a request some configuration can never serve; all checked
    before the first simulation)."""
    p = ArgumentParser(prog="python -m kvjax simulate", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int_at_least(1), default=64, help="requests, all arriving at step 0 (default 64)")
    p.add_argument("--scale", type=number_in(0, low_open=True, noun="scale"), default=1.0,
                   help="multiplies the seed-shaped lengths (10,599 prompt / 4,054 output tokens on average)")
    p.add_argument("--spread", type=number_in(0, 1, high_open=True), default=0.25,
                   help="lengths uniform in mean*[1-spread, 1+spread]")
    p.add_argument("--kv-heads", type=int_at_least(1), default=4)
    p.add_argument("--swa-fraction", type=comma_list(number_in(0, 1)), default=[1.0],
                   help="comma list, e.g. 0.25,0.5,1.0")
    p.add_argument("--window", type=int_at_least(0), default=1024)
    p.add_argument("--sinks", type=int_at_least(0), default=4)
    p.add_argument("--page-size", type=int_at_least(1), default=64)
    p.add_argument("--memory-requests", type=number_in(0, low_open=True), default=8.0,
                   help="page memory = this many mean-length requests on every head without recycling")
    p.add_argument("--max-seqs", type=int_at_least(1), default=64)
    p.add_argument("--max-tokens", type=int_at_least(1), default=2048, help="token budget per step")
    p.add_argument("--recycle", type=comma_list(sorted(RECYCLE_POLICIES)), default=["none", "timely"],
                   help="comma list of none,timely")
    p.add_argument("--pool", type=comma_list(POOLS), default=list(POOLS), help="comma list of shared,partitioned")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--check-every", type=int_at_least(0), default=0,
                   help="run integrity checks every N steps (slow; 0: never)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--prefix-caching", action="store_true",
                   help="compare the prefix cache off / eager / keep_tail (timely recycling) on --workload")
    p.add_argument("--workload", choices=sorted(PREFIX_WORKLOADS), default="seed",
                   help="with --prefix-caching: seed | system-prompt | multi-turn | few-shot")
    try:
        args = p.parse_args(argv)
        if args.prefix_caching:
            return _prefix_main(args)
        host, _ = seed_footprint(args.requests, scale=args.scale, spread=args.spread, num_kv_heads=args.kv_heads,
                                 page_size=args.page_size, full_requests=args.memory_requests,
                                 max_seqs=args.max_seqs)
        check_memory(host, f"--requests {args.requests} --scale {args.scale:g} --max-seqs {args.max_seqs} "
                           f"--memory-requests {args.memory_requests:g}")
        workload = seed_workload(args.requests, scale=args.scale, spread=args.spread, seed=args.seed)
        cache = cache_for(workload, num_kv_heads=args.kv_heads, page_size=args.page_size,
                          full_requests=args.memory_requests, max_seqs=args.max_seqs)
        runs = [(swa_layout(args.kv_heads, frac, args.window, args.sinks), pool, recycle)
                for frac in args.swa_fraction for pool in args.pool for recycle in args.recycle]
        for attention, pool, recycle in runs:  # every run can serve every request, before the first one starts
            check_servable(workload, cache, attention, max_num_batched_tokens=args.max_tokens, pool=pool,
                           recycle=recycle)
        results = [simulate(workload, cache, attention, max_num_batched_tokens=args.max_tokens, pool=pool,
                            recycle=recycle, seed=args.seed, check_every=args.check_every)
                   for attention, pool, recycle in runs]
    except ValueError as e:
        return fail("simulate", e)
    config = dict(vars(args), num_pages=cache.num_pages, max_blocks_per_seq=cache.max_blocks_per_seq,
                  mean_prompt=float(np.mean([w.prompt.size for w in workload])),
                  mean_output=float(np.mean([w.max_new_tokens for w in workload])))
    config.pop("json")
    if args.json:
        print(json.dumps(dict(config=config, results=[dataclasses.asdict(r) for r in results]), indent=2))
    else:
        print(f"# {args.requests} requests, mean prompt {config['mean_prompt']:.0f} / output "
              f"{config['mean_output']:.0f} tokens; {args.kv_heads} KV heads, window {args.window}, sinks "
              f"{args.sinks}; {cache.num_pages} pages of {args.page_size} ({args.memory_requests:g} full requests); "
              f"max_seqs {args.max_seqs}, {args.max_tokens} tokens/step")
        print(format_table(results))
    return 0
