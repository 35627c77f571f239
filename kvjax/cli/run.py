"""``python -m kvjax run``: the main job. Same model, same page memory, recycle ``none`` vs ``timely``.

Builds a toy Qwen3.5 (Gated DeltaNet layers + gated full-attention layers) whose full-attention layers have
sliding-window KV heads (random weights), and serves one synthetic long-prompt workload (shaped like the
seed's benchmark: long prompts, long outputs, scaled down) through :class:`kvjax.engine.engine.Engine` twice —
with ``recycle="none"`` and ``recycle="timely"`` — over the same number of pages. Prints one table (generated
tokens/s, tokens/step, mean and peak running requests, preemptions, page utilisation, exposed host share of
step time — the host time the device waited for, see :mod:`kvjax.engine.metrics`) and checks that both runs
generated identical tokens (greedy). The engine overlaps planning step N+1 with step N on the device
(``--no-overlap``: the synchronous engine); ``--decode-burst K`` lets it run up to ``K`` decode steps per dispatch
(:mod:`kvjax.engine.burst`). ``--prefix-caching`` adds both policies with prefix caching
(``keep_tail``, ``max_seqs`` GDN checkpoints beside the same pages); all runs must give identical tokens;
``--host-cache-gb G`` one more, ``timely+prefix+host``, whose prefix cache spills to a host tier of ``G`` GB.

``--mesh DATAxMODEL`` (or ``--devices N`` = ``--mesh Nx1``) runs the engine on a ``("data", "model")`` mesh
(``Engine(mesh=...)``; on CPU, JAX is asked for that many host devices, at most 64): each data shard has the preset's
``max_seqs`` rows and its own pages, and each device holds ``num_pages / MODEL`` pages (the same pages per KV head
as one device). On a mesh the table adds tokens/s per device and each device's page use (``--json`` keeps them:
``devices``, ``generated_tokens_per_s_per_device``, ``pages_per_device``, ``pages_used_device_mean`` / ``_peak``).

One process per GPU (or per host): ``--coordinator HOST:PORT --num-processes N --process-id I`` joins a
``jax.distributed`` run (JAX's multi-controller runtime: NCCL between GPUs, gloo between CPU processes), the same
command started once per process (:mod:`kvjax.cli.processes`). Without ``--mesh`` / ``--devices`` each process
runs its own engine on its own device and serves its share of the requests (data parallel, the host work split
over the processes); the table sums their figures (``wall_tokens_per_s``: every process's tokens over the slowest
process's wall). With ``--mesh`` / ``--devices`` every process builds the same mesh over all processes' devices and
serves the same steps. Only process 0 prints the table and writes ``--json`` / ``--plot``. ``--local-devices``
picks the GPUs of this process (``jax.distributed``'s ``local_device_ids``; one per process for one engine each).

Generated tokens/s is the steady-state rate: steps that compiled a new bucket shape are left out of both the
tokens and the time (compilation is reported apart). Both runs share one compiled step.

Each policy's engine serves the workload ``--repeats`` times (it compiles during the first): the table shows the
median tokens/s and its range over the repeats, so the noise of a figure is visible.

``--compile-cache DIR`` (default ``$KVJAX_COMPILE_CACHE``, else ``~/.cache/kvjax/jax``; ``--no-compile-cache``:
none) turns on JAX's persistent compilation cache, so a second run loads the compiled steps instead of compiling
them again (:mod:`kvjax.cli.compile_cache`).

Presets (``--preset``: ``cpu``, ``gpu``, ``tp``; the toy model each builds and the checks before any work) are
:mod:`kvjax.cli.presets`; the table, device lines, token digest and plot are :mod:`kvjax.cli.report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import KV_CACHE_DTYPES, CacheConfig
from kvjax.engine.engine import Engine
from kvjax.errors import UsageError
from kvjax.cli import compile_cache
from kvjax.cli.args import (ArgumentParser, comma_list, fail, int_at_least, json_destination, number_in,
                            writable_file)
from kvjax.cli.output import provenance, write_json
from kvjax.cli.presets import (ATTENTION, PRESETS, Preset, attention_layout, build_model, check_device,
                               check_sizes, model_config, param_bytes)
from kvjax.cli.report import check_plot_path, device_lines, format_table, save_plot, tokens_digest
from kvjax.cli.processes import (MAX_HOST_DEVICES, Claims, StaticClaims, barrier, combine, gather_served,
                                  parse_mesh, share_claims, start_processes, wall_rate)
from kvjax.models.qwen3_5 import mtp as mtp_lib
from kvjax.sched.drafter import DISABLE_BY_BATCH_SIZE, FLAT_TOKENS, MAX_DRAFT_TOKENS, METHODS, SpeculativeConfig
from kvjax.sched.workload import cache_for, check_servable, kv_page_bytes, same_memory, seed_workload


# presets and report names stay importable from here (tests, benchmarks)
__all__ = ["PRESETS", "Preset", "build_model", "build_parser", "check_device", "device_lines", "format_table",
           "main", "model_config", "param_bytes", "run_policy", "tokens_digest"]


RECYCLES = ("none", "timely")


def make_mesh(spec: str | None, processes: int = 1) -> jax.sharding.Mesh | None:
    """``"DxM"`` -> a ``("data", "model")`` mesh of the first ``D * M`` devices (of every process: the same mesh
    in each); ``UsageError`` for a bad spec or more devices than JAX sees, before anything is placed on them. On
    CPU JAX is first asked for ``D * M / processes`` host devices, at most :data:`MAX_HOST_DEVICES`."""
    if spec is None:
        return None
    d, m = parse_mesh(spec)
    try:
        jax.config.update("jax_num_cpu_devices", min(max(d * m // processes, 1), MAX_HOST_DEVICES))
    except RuntimeError:  # backends already started: keep what there is
        pass
    devices = jax.devices()
    if len(devices) < d * m:
        cap = (f" (on CPU kvjax asks JAX for at most {MAX_HOST_DEVICES} host devices)"
               if devices[0].platform == "cpu" and d * m > MAX_HOST_DEVICES else "")
        raise UsageError(f"--mesh {d}x{m} needs {d * m} devices, {len(devices)} available{cap}")
    return jax.sharding.Mesh(np.array(devices[: d * m]).reshape(d, m), ("data", "model"))


def mesh_spec(args: argparse.Namespace) -> str | None:
    """The ``DxM`` mesh that ``--mesh`` / ``--devices`` ask for (None: one device)."""
    if args.mesh is not None and args.devices is not None:
        raise UsageError("give --mesh or --devices, not both")
    return args.mesh if args.devices is None else f"{args.devices}x1"


def _token_bar(workload, desc: str, progress: bool | None, *, known_total: bool):
    """A tqdm bar over generated tokens named ``desc`` on stderr, or None (``progress`` False, or None and the
    workload generates < 4096 tokens, or no tqdm); its total is the workload's tokens where ``known_total`` (a
    process that claims its requests does not know its share's)."""
    total = sum(w.max_new_tokens for w in workload)
    if not progress and (progress is not None or total < 4096):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total if known_total else None, unit="tok", desc=desc, file=sys.stderr, leave=False)


def _serve(engine: Engine, workload, desc: str, progress: bool | None) -> list[list[int]]:
    """``engine.generate`` of ``workload`` with a tqdm bar named ``desc`` on stderr (``progress`` None: on for runs
    of 4096 tokens or more)."""
    bar = _token_bar(workload, desc, progress, known_total=True)
    out: list[list[int]] = [[] for _ in workload]
    try:
        for ev in engine.stream([w.prompt for w in workload], [w.max_new_tokens for w in workload], progress=False):
            out[ev.index].append(ev.token)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return out


def _serve_claimed(engine: Engine, workload, claims, desc: str, progress: bool | None) -> dict[int, list[int]]:
    """Serve the requests of ``workload`` that this process claims (a :class:`~kvjax.cli.processes.Claims` or
    :class:`~kvjax.cli.processes.StaticClaims`): a chain is taken whenever the engine has no request waiting, and
    each request is queued under its workload index (its sampling stream). Returns workload index -> tokens of
    every request served here; a tqdm bar over them named ``desc`` (``progress`` None: on when the whole workload
    generates >= 4096 tokens)."""
    bar = _token_bar(workload, desc, progress, known_total=False)
    out: dict[int, list[int]] = {}
    try:
        while True:
            idle = not engine.has_unfinished()
            if not claims.done and engine.num_waiting() == 0:
                for g in claims.claim(wait=idle):  # an idle engine waits for the claim in flight
                    engine.add_request(workload[g].prompt, workload[g].max_new_tokens, index=g)
                    out[g] = []
            if not engine.has_unfinished():
                if claims.done:
                    return out
                continue
            for o in engine.step():
                out[o.index].extend(o.tokens)
                if bar is not None:
                    bar.update(len(o.tokens))
    finally:
        if bar is not None:
            bar.close()


def burst_arg(text: str) -> int | str:
    """``--decode-burst``: ``auto`` or an int in [1, 64]."""
    return "auto" if text == "auto" else int_at_least(1, 64)(text)


def int_or_none_arg(text: str) -> int | None:
    """``--flat-tokens`` / ``--disable-by-batch-size``: ``none`` or an int >= 1."""
    return None if text == "none" else int_at_least(1)(text)


def run_policy(model, workload, cache: CacheConfig, p: Preset, recycle: str, *, progress: bool | None,
               overlap: bool = True, prefix_caching: bool = False, mesh: jax.sharding.Mesh | None = None,
               decode_burst: int | str = "auto", repeats: int = 1, name: str | None = None, before_repeat=None,
               host_cache_bytes: int = 0, speculative: SpeculativeConfig | None = None,
               claims: Callable[[str], Claims | StaticClaims] | None = None):
    """Serve ``workload`` with one recycle policy ``repeats`` times on one engine (compiled during the first);
    returns (outputs, summary dict, per-step columns). The summary is the last repeat's
    :meth:`EngineMetrics.summary` with ``generated_tokens_per_s`` the median over the repeats,
    ``generated_tokens_per_s_repeats`` each repeat's, ``compile_time_s`` summed (``compile_s_repeats`` each
    repeat's), ``wall_s`` each repeat's wall time, ``wall_net_s`` the same less the steps that compiled,
    ``wall_tokens_per_s`` the generated tokens over a repeat's ``wall_net_s`` (:func:`~kvjax.cli.processes.wall_rate`)
    and ``identical_repeats`` whether every repeat generated the same tokens; the columns are the last repeat's.
    ``before_repeat(name)``: called before each repeat's clock starts (a barrier of the processes). ``speculative``:
    the engine's speculative decoding (``Engine(speculative=)``; the summary then has its acceptance figures).
    ``claims(name)``: one engine of a multi-process run serves only the requests it claims from that object
    (:class:`~kvjax.cli.processes.Claims`, a new one per repeat, ``name`` the repeat's); the outputs are then every
    process's, gathered after each repeat (:func:`~kvjax.cli.processes.gather_served`), and the summary this
    process's, with ``requests_served`` (in the last repeat)."""
    if mesh is not None:  # the same pages per KV head as one device
        cache = dataclasses.replace(cache, num_pages=max(cache.num_pages // mesh.shape["model"], 1))
    engine = Engine(model, cache, overlap=overlap, recycle=recycle, max_num_batched_tokens=p.max_tokens,
                    kv_cache_dtype=p.kv_cache_dtype,
                    token_buckets=p.token_buckets, row_buckets=p.row_buckets,
                    block_buckets=(cache.max_blocks_per_seq,), prefix_caching=prefix_caching, mesh=mesh,
                    decode_burst=decode_burst, host_cache_bytes=host_cache_bytes, speculative=speculative)
    name = name or recycle
    runs, first = [], None
    for r in range(repeats):
        engine.metrics.clear()
        if before_repeat is not None:
            before_repeat(f"{name} {r}")
        t0 = time.perf_counter()
        desc = f"{name} {r + 1}/{repeats}"
        if claims is None:
            outs = _serve(engine, workload, desc, progress)
            wall = time.perf_counter() - t0
        else:
            served = _serve_claimed(engine, workload, claims(f"{name} {r}"), desc, progress)
            wall = time.perf_counter() - t0
            outs, served_last = gather_served(served, len(workload)), len(served)
        engine.check_integrity()
        engine.clear_prefix_cache()  # every repeat starts from the same (empty) cache
        if not engine.is_idle():
            raise AssertionError(f"{name}: slots or pages left allocated after the run")
        first = outs if first is None else first
        runs.append((outs, engine.metrics.summary(num_pages=engine.total_pages), wall))
    outs, summary, _ = runs[-1]
    if claims is not None:
        summary = dict(summary, requests_served=served_last)
    rates = [s.get("generated_tokens_per_s", 0.0) for _, s, _ in runs]  # a process that claimed nothing: no steps
    compiles = [s.get("compile_time_s", 0.0) for _, s, _ in runs]  # each repeat's steps that compiled
    net = [w - c for (_, _, w), c in zip(runs, compiles)]
    devices = 1 if mesh is None else mesh.size
    summary = dict(summary, generated_tokens_per_s=statistics.median(rates), generated_tokens_per_s_repeats=rates,
                   compile_time_s=sum(compiles), wall_s=[w for _, _, w in runs],
                   identical_repeats=all(o == first for o, _, _ in runs), devices=devices,
                   generated_tokens_per_s_per_device=statistics.median(rates) / devices,
                   pages_per_device=cache.num_pages,
                   compile_s_repeats=compiles, wall_net_s=net,
                   wall_tokens_per_s=wall_rate(summary.get("generated_tokens", 0), net))
    cols = engine.metrics.to_dict()
    return outs, summary, {k: cols[k] for k in ("pages_used", "running", "generated", "t_step", "t_exposed",
                                                "compiled")}


def spec_lines(results: dict[str, dict]) -> str:
    """Per policy, speculative decoding's figures: drafts proposed and accepted, the acceptance rate (overall and per
    draft position), tokens per verification row and per verification step."""
    lines = []
    for name, s in results.items():
        if "drafts_proposed" not in s:
            lines.append(f"# {name}: speculative: no drafts proposed")
            continue
        per = " ".join(f"{r:.2f}" for r in s["acceptance_rate_per_position"])
        lines.append(f"# {name}: speculative: {s['drafts_proposed']} drafts proposed, {s['drafts_accepted']} accepted "
                     f"(rate {s['acceptance_rate']:.3f}; per position {per}); {s['tokens_per_verify_row']:.2f} "
                     f"tokens per verify row, {s['tokens_per_verify_step']:.2f} per verify step "
                     f"({s['verify_steps']} verify steps)")
    return "\n".join(lines)


def _per_preset(field: str) -> str:
    """``"cpu 16, gpu 32"``: a preset field's value in each preset (for ``--help``)."""
    return ", ".join(f"{name} {getattr(p, field):g}" for name, p in sorted(PRESETS.items()))


def build_parser() -> ArgumentParser:
    """The ``run`` command's arguments (``--help`` shows each default)."""
    ap = ArgumentParser(prog="python -m kvjax run",
                        description="The main job: a toy Qwen3.5 (random weights, 3 of 4 KV heads sliding-window) "
                                    "serves a seed-shaped long-prompt workload with recycle none and timely at the "
                                    "same page memory; prints tokens/s (median and range over --repeats), "
                                    "concurrency, preemptions and page use, and checks the tokens are identical.")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                    help="model and workload size: cpu (f32, small), gpu (bf16, for one accelerator) or tp (bf16, "
                         "a dense 3.7B-parameter Qwen3.5 for tensor parallelism, --mesh 1xM)")
    ap.add_argument("--force", action="store_true", help="run --preset gpu or tp even where JAX sees no GPU")
    ap.add_argument("--requests", type=int_at_least(1), help=f"override the preset's number of requests ({_per_preset('requests')})")
    ap.add_argument("--scale", type=number_in(0, low_open=True, noun="scale"),
                    help=f"override the preset's length scale, x the seed's mean lengths ({_per_preset('scale')})")
    ap.add_argument("--swa-fraction", type=number_in(0, 1), help=f"override the preset's fraction of SWA KV heads ({_per_preset('swa_fraction')})")
    ap.add_argument("--memory-requests", type=number_in(0, low_open=True),
                    help="override the preset's page memory, in full-length requests without recycling "
                         f"({_per_preset('memory_requests')})")
    ap.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES),
                    help="K/V pages: auto (the preset's dtype) or fp8 / fp8_e4m3 (fp8 pages with one f32 scale each, "
                         "Engine(kv_cache_dtype=)) in the same page memory, so about twice the pages (default: auto)")
    ap.add_argument("--seed", type=int_at_least(0, 2**31 - 1), default=0, help="seed of the weights and workload")
    ap.add_argument("--repeats", type=int_at_least(1, 100), default=3,
                    help="serve the workload this many times per policy (one compilation) and report the median "
                         "tokens/s and its range")
    ap.add_argument("--json", metavar="FILE", type=json_destination,
                    help="also write the config, the summaries, per-step columns and the run's provenance (versions, "
                         "commit, device, seed, date) as JSON to FILE; '-' writes it to standard output instead of "
                         "the table")
    ap.add_argument("--plot", metavar="FILE", type=writable_file,
                    help="save pages in use and running requests over the run, per policy (PNG)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar per policy and repeat on standard error (tqdm); default: on for runs of "
                         "4096 tokens or more")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="also run both policies with prefix caching (keep_tail)")
    ap.add_argument("--host-cache-gb", type=number_in(0, low_open=True), default=None,
                    help="with --prefix-caching: one more run, timely with prefix caching and a host tier of this "
                         "many GB (evicted blocks and GDN checkpoints spill to host memory; on a mesh, per data shard)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="plan step N+1 while step N runs on the device; --no-overlap: the synchronous engine")
    ap.add_argument("--decode-burst", metavar="K", type=burst_arg, default="auto",
                    help="up to K decode steps per dispatch when every running request decodes and none could be "
                         "admitted (Engine(decode_burst=K)); 'auto' = 8; 1 = single steps")
    ap.add_argument("--speculative", choices=METHODS,
                    help="speculative decoding (Engine(speculative=)): decoding rows verify up to "
                         "--num-draft-tokens drafts per step (ngram: prompt lookup; mtp: the model's MTP layers, "
                         "with --mtp); both verify in bursts of --decode-burst sub-steps (ngram: the first "
                         "sub-step's drafts looked up on the host, later ones on the device); both run on a mesh "
                         "(--mesh / --devices)")
    ap.add_argument("--num-draft-tokens", metavar="K", type=int_at_least(1, MAX_DRAFT_TOKENS), default=None,
                    help=f"with --speculative: drafts per verification row at most (1..{MAX_DRAFT_TOKENS}; default 4)")
    ap.add_argument("--mtp", action="store_true",
                    help="give the toy random MTP layers (kvjax.models.qwen3_5.mtp; untrained: its drafts are "
                         "rarely accepted), which --speculative mtp drafts with inside every step")
    ap.add_argument("--flat-tokens", metavar="N|none", type=int_or_none_arg, default=argparse.SUPPRESS,
                    help="with --speculative: the flat region of the step-cost rule that shortens or turns off drafts "
                         "where they do not pay (tokens a step computes at about the cost of one); 'none': always up "
                         f"to K drafts (default: {FLAT_TOKENS})")
    ap.add_argument("--disable-by-batch-size", metavar="N|none", type=int_or_none_arg, default=argparse.SUPPRESS,
                    help="with --speculative: no drafts in a step while more than N requests run (vLLM's option); "
                         f"'none': no limit (default: {DISABLE_BY_BATCH_SIZE})")
    ap.add_argument("--compile-cache", metavar="DIR",
                    help="JAX's persistent compilation cache: a later run loads the compiled steps from DIR instead "
                         f"of compiling them again (default: ${compile_cache.ENV}, else ~/.cache/kvjax/jax)")
    ap.add_argument("--no-compile-cache", action="store_true", help="compile everything, use no persistent cache")
    ap.add_argument("--mesh", metavar="DATAxMODEL", help="run on a (data, model) device mesh, e.g. 2x2")
    ap.add_argument("--devices", type=int_at_least(1), help="run on N devices, data parallel (= --mesh Nx1)")
    ap.add_argument("--coordinator", metavar="HOST:PORT",
                    help="one process of a multi-process run (jax.distributed; start the same command once per "
                         "process with its --process-id): the address of process 0. Without --mesh / --devices "
                         "each process runs one engine on its share of the requests (data parallel); with them "
                         "the mesh spans every process's devices. Only process 0 prints")
    ap.add_argument("--num-processes", type=int_at_least(1), help="processes of the multi-process run")
    ap.add_argument("--process-id", type=int_at_least(0), help="this process's index in the multi-process run")
    ap.add_argument("--share", choices=("dynamic", "static"),
                    help="one engine per process: how the processes split the requests. dynamic (default): each "
                         "claims the next request, largest first, from the coordinator whenever it has none "
                         "waiting; static: split by tokens before the run")
    ap.add_argument("--local-devices", metavar="IDS", type=comma_list(int_at_least(0)),
                    help="the local GPUs this process drives (e.g. 0 for one process per GPU); default: every GPU "
                         "it sees")
    return ap


def main(argv: list[str]) -> int:
    """CLI entry of ``python -m kvjax run``; returns the exit status (1 if the runs' tokens differ, 2 with one line
    on stderr for a bad argument, checked before any work)."""
    ap = build_parser()
    try:  # every check before any work: a bad value exits 2 with one line
        args = ap.parse_args(argv)
        spec = mesh_spec(args)
        if args.host_cache_gb is not None and not args.prefix_caching:
            raise UsageError("--host-cache-gb needs --prefix-caching")
        if args.num_draft_tokens is not None and args.speculative is None:
            raise UsageError("--num-draft-tokens needs --speculative")
        if args.speculative == "mtp" and spec is not None and PRESETS[args.preset].device_init:
            raise UsageError(f"--speculative mtp on a mesh needs a preset drawn on the host: --preset {args.preset}'s "
                             "weights are drawn sharded on the devices, without MTP layers")
        if args.speculative == "mtp" and not args.mtp:
            raise UsageError("--speculative mtp drafts with the model's MTP layers: add --mtp (the toy has none)")
        if args.mtp and args.speculative != "mtp":
            raise UsageError("--mtp serves --speculative mtp only")
        if hasattr(args, "flat_tokens") and args.speculative is None:  # given at all, even at its default value
            raise UsageError("--flat-tokens needs --speculative")
        if hasattr(args, "disable_by_batch_size") and args.speculative is None:  # given at all
            raise UsageError("--disable-by-batch-size needs --speculative")
        speculative = None if args.speculative is None else SpeculativeConfig(
            args.speculative, num_draft_tokens=args.num_draft_tokens or 4,
            flat_tokens=getattr(args, "flat_tokens", FLAT_TOKENS),
            disable_by_batch_size=getattr(args, "disable_by_batch_size", DISABLE_BY_BATCH_SIZE))
        cache_dir, cache_note = compile_cache.resolve(args.compile_cache, args.no_compile_cache)
        if args.share is not None and (args.coordinator is None or spec is not None):
            raise UsageError("--share needs one engine per process (--coordinator without --mesh / --devices)")
        processes = start_processes(args, spec)  # before any other JAX use
        per_process = processes > 1 and spec is None  # one engine per process (data parallel)
        if cache_dir is not None:  # before any compilation; the command's entry only (library code sets no globals)
            compile_cache.enable(cache_dir)
        mesh = make_mesh(spec, processes)
        check_device(args.preset, args.force)
        if args.plot:
            check_plot_path(args.plot)
        overrides = {k: v for k, v in (("requests", args.requests), ("scale", args.scale),
                                       ("swa_fraction", args.swa_fraction),
                                       ("memory_requests", args.memory_requests),
                                       ("kv_cache_dtype", args.kv_cache_dtype)) if v is not None}
        p = dataclasses.replace(PRESETS[args.preset], **overrides)
        check_sizes(p)
        workload = seed_workload(p.requests, scale=p.scale, vocab=p.vocab, seed=args.seed)
        cache = cache_for(workload, num_kv_heads=p.kv_heads, page_size=p.page_size,
                          full_requests=p.memory_requests, max_seqs=p.max_seqs)
        size = jnp.dtype(p.dtype).itemsize
        cache = same_memory(cache, kv_page_bytes(p.page_size, p.head_dim, dtype_bytes=size),
                            kv_page_bytes(p.page_size, p.head_dim, p.kv_cache_dtype, dtype_bytes=size))
        for recycle in RECYCLES:  # the engine's scheduler: shared pool, the preset's token budget
            check_servable(workload, cache, attention_layout(p), max_num_batched_tokens=p.max_tokens,
                           pool="shared", recycle=recycle)
        model = build_model(p, seed=args.seed, mesh=mesh)
        if args.mtp:
            mtp_lib.attach(model, mtp_lib.init(model.config, seed=args.seed, dtype=jnp.dtype(p.dtype)))
        claims = share_claims(workload, args.share or "dynamic", processes) if per_process else None
    except ValueError as e:
        return fail("run", e)
    leader = jax.process_index() == 0  # every process serves the same steps; process 0 reports them
    if cache_note and leader:
        print(cache_note, file=sys.stderr)
    out = open(os.devnull, "w") if not leader else sys.stderr if args.json == "-" else sys.stdout  # '-': JSON alone
    device = f"{jax.local_devices()[0].device_kind} ({jax.default_backend()})"
    prompt_lens = [int(w.prompt.size) for w in workload]
    out_lens = [w.max_new_tokens for w in workload]
    print(f"# kvjax run --preset {args.preset} on {device}: "
          f"toy Qwen3.5 {len(p.layer_types)} layers ({p.layer_types.count(ATTENTION)} attention), hidden {p.hidden}, "
          f"{p.kv_heads} KV heads of which {round(p.swa_fraction * p.kv_heads)} SWA (window {p.window}, sinks "
          f"{p.sinks}), {p.dtype}", file=out)
    print(f"# {p.requests} requests, prompt {np.mean(prompt_lens):.0f} / output {np.mean(out_lens):.0f} tokens "
          f"on average; {cache.num_pages} {'' if p.kv_cache_dtype == 'auto' else 'fp8 '}pages of {p.page_size} "
          f"tokens per layer ({p.memory_requests:g} full "
          f"requests without recycling); max_seqs {p.max_seqs}, {p.max_tokens} tokens/step; overlap "
          f"{'on' if args.overlap and speculative is None else 'off'}; decode burst "
          f"{1 if speculative is not None and speculative.method != 'mtp' else args.decode_burst}; "
          + ("" if speculative is None else f"speculative {speculative.method} K={speculative.num_draft_tokens}; ")
          + f"{args.repeats} repeat{'s' if args.repeats > 1 else ''} per policy"
          + ("" if mesh is None else f"; mesh {mesh.shape['data']}x{mesh.shape['model']} (data x model)")
          + ("" if processes == 1 else f"; {processes} processes"), file=out)
    outputs, results, columns = {}, {}, {}
    runs = [(r, False) for r in RECYCLES] + ([(r, True) for r in RECYCLES] if args.prefix_caching else [])
    host_bytes = 0 if args.host_cache_gb is None else int(args.host_cache_gb * 1e9)
    runs += [("timely", True)] if host_bytes else []
    for k, (recycle, cached) in enumerate(runs):
        host = host_bytes if k == len(runs) - 1 and host_bytes else 0
        name = recycle + ("+prefix" if cached else "") + ("+host" if host else "")
        outputs[name], results[name], columns[name] = run_policy(model, workload, cache, p, recycle,
                                                                 progress=args.progress if leader else False,
                                                                 overlap=args.overlap,
                                                                 prefix_caching=cached, mesh=mesh,
                                                                 decode_burst=args.decode_burst,
                                                                 before_repeat=barrier if per_process else None,
                                                                 repeats=args.repeats, name=name,
                                                                 host_cache_bytes=host, speculative=speculative,
                                                                 claims=claims)
    if per_process:  # the processes' figures (their tokens were gathered after each repeat), in every process
        results = {k: combine(v, args.repeats) for k, v in results.items()}
    same = all(o == outputs["none"] for o in outputs.values()) and all(r["identical_repeats"] for r in results.values())
    gain = results["timely"]["generated_tokens_per_s"] / results["none"]["generated_tokens_per_s"]
    none_rates, timely_rates = (results[k]["generated_tokens_per_s_repeats"] for k in ("none", "timely"))
    print(format_table(results, per_device=mesh is not None), file=out)
    if mesh is not None:
        print(device_lines(results, mesh), file=out)
    if speculative is not None:
        print(spec_lines(results), file=out)
    if per_process:
        for name, s in results.items():
            each = ", ".join(f"{r:.0f}" for r in s["generated_tokens_per_s_processes"])
            served = " + ".join(str(n) for n in s["requests_served_processes"])
            print(f"# {name}: one engine per process ({served} requests), {s['generated_tokens_per_s']:.1f} tok/s "
                  f"summed ({each}); "
                  f"{s['wall_tokens_per_s']:.1f} tok/s over the slowest process's wall", file=out)
    print(f"timely / none: {gain:.2f}x generated tokens/s (medians of {args.repeats}; "
          f"{min(timely_rates) / max(none_rates):.2f}-{max(timely_rates) / min(none_rates):.2f}x over the repeats' "
          f"extremes), "
          f"{results['timely']['generated_tokens_per_step'] / results['none']['generated_tokens_per_step']:.2f}x "
          f"tokens/step; identical tokens in every run and repeat: {'yes' if same else 'NO'}", file=out)
    if args.json and leader:
        write_json(args.json, {"meta": provenance("run", argv, device=device, seed=args.seed),
                               "preset": args.preset, "config": dataclasses.asdict(p), "overlap": args.overlap,
                               "decode_burst": args.decode_burst, "repeats": args.repeats,
                               "speculative": None if speculative is None else
                               {"method": speculative.method, "num_draft_tokens": speculative.num_draft_tokens},
                               "mesh": None if mesh is None else [mesh.shape["data"], mesh.shape["model"]],
                               "compile_cache": cache_dir, "num_pages": cache.num_pages,
                               "max_blocks_per_seq": cache.max_blocks_per_seq,
                               "processes": processes, "identical_tokens": same, "gain_tokens_per_s": gain,
                               "tokens_digest": {k: tokens_digest(v) for k, v in outputs.items()},
                               "results": results, "steps": columns})
    if args.plot and leader:
        save_plot(args.plot, columns, cache.num_pages)
    if processes > 1:
        jax.distributed.shutdown()
    return 0 if same else 1
