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
(``keep_tail``, ``max_seqs`` GDN checkpoints beside the same pages); all runs must give identical tokens.

``--mesh DATAxMODEL`` (or ``--devices N`` = ``--mesh Nx1``) runs the engine on a ``("data", "model")`` mesh
(:mod:`kvjax.engine.mesh`; on CPU, JAX is asked for that many host devices): each data shard has the preset's
``max_seqs`` rows and its own pages, and each device holds ``num_pages / MODEL`` pages (the same pages per KV head
as one device).

Generated tokens/s is the steady-state rate: steps that compiled a new bucket shape are left out of both the
tokens and the time (compilation is reported apart). Both runs share one compiled step.

Presets: ``cpu`` (default; f32, about a minute on a 2-core laptop CPU including compilation) and ``gpu`` (bf16,
a larger model and workload for one accelerator). Both use few bucket shapes (one block-table width, one row
count, two token counts) so that each run compiles about three times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import AttentionConfig, CacheConfig, GDNConfig
from kvjax.engine.engine import Engine
from kvjax.errors import UsageError
from kvjax.cli.args import ArgumentParser, check_memory, fail, int_at_least, number_in, writable_file
from kvjax.sched.workload import cache_for, check_servable, seed_footprint, seed_workload


@dataclasses.dataclass(frozen=True)
class Preset:
    # model
    vocab: int
    hidden: int
    intermediate: int
    layer_types: tuple[str, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    gdn: tuple[int, int, int, int]  # Hk, Hv, K, V
    dtype: str
    # workload and memory
    requests: int
    scale: float  # of the seed's mean lengths (10,599 prompt / 4,054 output tokens)
    swa_fraction: float
    window: int
    sinks: int
    page_size: int
    memory_requests: float  # page memory = this many mean-length requests on every head without recycling
    max_seqs: int
    max_tokens: int  # token budget per step
    token_buckets: tuple[int, ...] | None  # None: the scheduler's powers of two
    row_buckets: tuple[int, ...] | None


_G, _A = "linear_attention", "full_attention"
PRESETS = {
    "cpu": Preset(vocab=512, hidden=64, intermediate=128, layer_types=(_G, _G, _G, _A), q_heads=8, kv_heads=4,
                  head_dim=32, gdn=(2, 4, 16, 16), dtype="float32", requests=16, scale=0.02, swa_fraction=0.75,
                  window=32, sinks=4, page_size=16, memory_requests=3.0, max_seqs=8, max_tokens=128,
                  token_buckets=(16, 128), row_buckets=(8,)),
    "gpu": Preset(vocab=32768, hidden=1024, intermediate=3072, layer_types=(_G, _G, _G, _A) * 2, q_heads=16,
                  kv_heads=4, head_dim=128, gdn=(4, 8, 128, 128), dtype="bfloat16", requests=32, scale=0.1,
                  swa_fraction=0.75, window=128, sinks=4, page_size=64, memory_requests=4.0, max_seqs=16,
                  max_tokens=1024, token_buckets=(16, 1024), row_buckets=(16,)),
}


RECYCLES = ("none", "timely")


def attention_layout(p: Preset) -> AttentionConfig:
    """The attention layers' KV heads: the first ``round(swa_fraction * kv_heads)`` SWA, the rest full."""
    return AttentionConfig.with_swa_fraction(p.q_heads, p.kv_heads, p.head_dim, swa_fraction=p.swa_fraction,
                                             window=p.window, sinks=p.sinks)


def check_sizes(p: Preset) -> None:
    """Raise :class:`UsageError` before any work if the workload, the scheduler and the K/V pages of preset ``p``
    would not fit this machine (host memory, and device memory where JAX reports a limit)."""
    host, pages = seed_footprint(p.requests, scale=p.scale, num_kv_heads=p.kv_heads, page_size=p.page_size,
                                 full_requests=p.memory_requests, max_seqs=p.max_seqs)
    kv = p.layer_types.count(_A) * 2 * pages * p.page_size * p.head_dim * jnp.dtype(p.dtype).itemsize
    what = f"--requests {p.requests} --scale {p.scale:g} --memory-requests {p.memory_requests:g}"
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    limit = (stats or {}).get("bytes_limit")
    if limit is None:  # device memory is host memory
        check_memory(host + kv, what)
    else:
        check_memory(host, what)
        check_memory(kv, f"{what} ({pages} K/V pages per layer)", limit, "device memory")


def check_plot_path(path: str) -> None:
    """Raise :class:`UsageError` if matplotlib is missing or cannot write ``path``'s format (by its suffix)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    suffix = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise UsageError(f"--plot {path!r}: matplotlib cannot write .{suffix} files (use one of "
                         f"{', '.join(sorted(formats))})")


def build_model(p: Preset, *, seed: int = 0):
    """Random-weight toy Qwen3.5 with ``swa_fraction`` of the KV heads sliding-window (window, sinks)."""
    from kvjax.models.qwen3_5 import Qwen3_5Config, init_random

    attention = attention_layout(p)
    config = Qwen3_5Config(vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate,
                           layer_types=p.layer_types, attention=attention, gdn=GDNConfig(*p.gdn, 4),
                           rope_theta=10000.0)
    return init_random(config, seed=seed, dtype=jnp.dtype(p.dtype))


def make_mesh(spec: str | None) -> jax.sharding.Mesh | None:
    """``"DxM"`` -> a ``("data", "model")`` mesh of the first ``D * M`` devices (on CPU JAX is asked for that
    many host devices first); ``UsageError`` for a bad spec or too few devices."""
    if spec is None:
        return None
    try:
        d, m = (int(x) for x in spec.lower().split("x"))
        assert d >= 1 and m >= 1
    except (ValueError, AssertionError):
        raise UsageError(f"--mesh must be DATAxMODEL with ints >= 1 (e.g. 2x2), got {spec!r}") from None
    try:
        jax.config.update("jax_num_cpu_devices", max(d * m, 1))
    except RuntimeError:  # backends already started: keep what there is
        pass
    devices = jax.devices()
    if len(devices) < d * m:
        raise UsageError(f"--mesh {d}x{m} needs {d * m} devices, {len(devices)} available")
    return jax.sharding.Mesh(np.array(devices[: d * m]).reshape(d, m), ("data", "model"))


def run_policy(model, workload, cache: CacheConfig, p: Preset, recycle: str, *, progress: bool | None,
               overlap: bool = True, prefix_caching: bool = False, mesh: jax.sharding.Mesh | None = None,
               decode_burst: int = 1):
    """Serve ``workload`` with one recycle policy; returns (outputs, summary dict, per-step columns, wall s)."""
    if mesh is not None:  # the same pages per KV head as one device
        cache = dataclasses.replace(cache, num_pages=max(cache.num_pages // mesh.shape["model"], 1))
    engine = Engine(model, cache, overlap=overlap, recycle=recycle, max_num_batched_tokens=p.max_tokens,
                    token_buckets=p.token_buckets, row_buckets=p.row_buckets,
                    block_buckets=(cache.max_blocks_per_seq,), prefix_caching=prefix_caching, mesh=mesh,
                    decode_burst=1 if prefix_caching or mesh is not None else decode_burst)
    t0 = time.perf_counter()
    outs = engine.generate([w.prompt for w in workload], [w.max_new_tokens for w in workload], progress=progress)
    wall = time.perf_counter() - t0
    engine.check_integrity()
    engine.clear_prefix_cache()
    if not engine.is_idle():
        raise AssertionError(f"{recycle}: slots or pages left allocated after the run")
    summary = engine.metrics.summary(num_pages=engine.total_pages)
    summary["wall_s"] = wall
    cols = engine.metrics.to_dict()
    return outs, summary, {k: cols[k] for k in ("pages_used", "running", "generated", "t_step", "t_exposed",
                                                "compiled")}


def format_table(results: dict[str, dict]) -> str:
    """Fixed-width table, one line per policy, of ``{policy: EngineMetrics.summary() + wall_s}``."""
    head = (f"{'recycle':15} {'tok/s':>9} {'tok/step':>8} {'steps':>6} {'run mean':>8} {'run peak':>8} "
            f"{'preempt':>7} {'util mean':>9} {'util peak':>9} {'host %':>6} {'compile s':>9}")
    lines = [head, "-" * len(head)]
    for name, s in results.items():
        lines.append(f"{name:15} {s['generated_tokens_per_s']:9.1f} {s['generated_tokens_per_step']:8.2f} "
                     f"{s['steps']:6d} {s['running_mean']:8.2f} {s['running_peak']:8d} {s['preemptions']:7d} "
                     f"{s['page_util_mean']:9.3f} {s['page_util_peak']:9.3f} {100 * s['host_share']:6.1f} "
                     f"{s['compile_time_s']:9.1f}")
    return "\n".join(lines)


def save_plot(path: str, columns: dict[str, dict], num_pages: int) -> None:
    """Write a PNG of pages in use and running requests per step, one line per policy (``columns`` as
    returned by :func:`run_policy`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, col in columns.items():
        ax1.plot(col["pages_used"], label=f"recycle={name}")
        ax2.plot(col["running"], label=f"recycle={name}")
    ax1.axhline(num_pages, color="k", lw=0.8, ls="--", label="pages")
    ax1.set_ylabel("pages in use")
    ax2.set_ylabel("running requests")
    ax2.set_xlabel("engine step")
    ax1.legend()
    ax1.set_title("kvjax run: page memory in use, recycle none vs timely")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """CLI entry of ``python -m kvjax run``; returns the exit status (1 if the two runs' tokens differ)."""
    ap = ArgumentParser(prog="python -m kvjax run", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--requests", type=int_at_least(1), help="override the preset's number of requests")
    ap.add_argument("--scale", type=number_in(0, low_open=True, noun="scale"),
                    help="override the preset's length scale (x seed mean lengths)")
    ap.add_argument("--swa-fraction", type=number_in(0, 1), help="override the fraction of SWA KV heads")
    ap.add_argument("--memory-requests", type=number_in(0, low_open=True),
                    help="override the page memory (in full-length requests)")
    ap.add_argument("--seed", type=int_at_least(0, 2**31 - 1), default=0)
    ap.add_argument("--json", metavar="FILE", type=writable_file,
                    help="write config, summaries and per-step columns as JSON")
    ap.add_argument("--plot", metavar="FILE", type=writable_file,
                    help="save pages in use over time for both runs (PNG)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="tqdm progress bar (default: on for long runs)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="also run both policies with prefix caching (keep_tail)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="plan step N+1 while step N runs on the device (default); --no-overlap: synchronous")
    ap.add_argument("--decode-burst", metavar="K", type=int_at_least(1, 64), default=1,
                    help="up to K decode steps per dispatch (Engine(decode_burst=K); default 1; runs with prefix "
                         "caching or on a mesh take 1)")
    ap.add_argument("--mesh", metavar="DATAxMODEL", help="run on a (data, model) device mesh, e.g. 2x2")
    ap.add_argument("--devices", type=int_at_least(1), help="run on N devices, data parallel (= --mesh Nx1)")
    try:  # every check before any work: a bad value exits 2 with one line
        args = ap.parse_args(argv)
        if args.mesh is not None and args.devices is not None:
            raise UsageError("give --mesh or --devices, not both")
        mesh = make_mesh(args.mesh if args.devices is None else f"{args.devices}x1")
        if mesh is not None and args.prefix_caching:
            raise UsageError("--prefix-caching is not supported with --mesh / --devices")
        if args.plot:
            check_plot_path(args.plot)
        overrides = {k: v for k, v in (("requests", args.requests), ("scale", args.scale),
                                       ("swa_fraction", args.swa_fraction),
                                       ("memory_requests", args.memory_requests)) if v is not None}
        p = dataclasses.replace(PRESETS[args.preset], **overrides)
        check_sizes(p)
        workload = seed_workload(p.requests, scale=p.scale, vocab=p.vocab, seed=args.seed)
        cache = cache_for(workload, num_kv_heads=p.kv_heads, page_size=p.page_size,
                          full_requests=p.memory_requests, max_seqs=p.max_seqs)
        for recycle in RECYCLES:  # the engine's scheduler: shared pool, the preset's token budget
            check_servable(workload, cache, attention_layout(p), max_num_batched_tokens=p.max_tokens,
                           pool="shared", recycle=recycle)
        model = build_model(p, seed=args.seed)
    except ValueError as e:
        return fail("run", e)
    prompt_lens = [int(w.prompt.size) for w in workload]
    out_lens = [w.max_new_tokens for w in workload]
    print(f"# kvjax run --preset {args.preset} on {jax.devices()[0].device_kind} ({jax.default_backend()}): "
          f"toy Qwen3.5 {len(p.layer_types)} layers ({p.layer_types.count(_A)} attention), hidden {p.hidden}, "
          f"{p.kv_heads} KV heads of which {round(p.swa_fraction * p.kv_heads)} SWA (window {p.window}, sinks "
          f"{p.sinks}), {p.dtype}")
    print(f"# {p.requests} requests, prompt {np.mean(prompt_lens):.0f} / output {np.mean(out_lens):.0f} tokens "
          f"on average; {cache.num_pages} pages of {p.page_size} tokens per layer ({p.memory_requests:g} full "
          f"requests without recycling); max_seqs {p.max_seqs}, {p.max_tokens} tokens/step; overlap "
          f"{'on' if args.overlap else 'off'}; decode burst {args.decode_burst if mesh is None else 1}"
          + ("" if mesh is None else f"; mesh {mesh.shape['data']}x{mesh.shape['model']} (data x model)"))
    outputs, results, columns = {}, {}, {}
    runs = [(r, False) for r in RECYCLES] + ([(r, True) for r in RECYCLES] if args.prefix_caching else [])
    for recycle, cached in runs:
        name = recycle + ("+prefix" if cached else "")
        outputs[name], results[name], columns[name] = run_policy(model, workload, cache, p, recycle,
                                                                 progress=args.progress, overlap=args.overlap,
                                                                 prefix_caching=cached, mesh=mesh,
                                                                 decode_burst=args.decode_burst)
    same = all(o == outputs["none"] for o in outputs.values())
    gain = results["timely"]["generated_tokens_per_s"] / results["none"]["generated_tokens_per_s"]
    print(format_table(results))
    print(f"timely / none: {gain:.2f}x generated tokens/s, "
          f"{results['timely']['generated_tokens_per_step'] / results['none']['generated_tokens_per_step']:.2f}x "
          f"tokens/step; identical tokens in {'all' if args.prefix_caching else 'both'} runs: {'yes' if same else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "config": dataclasses.asdict(p), "overlap": args.overlap,
                       "decode_burst": args.decode_burst,
                       "device": jax.devices()[0].device_kind,
                       "num_pages": cache.num_pages, "max_blocks_per_seq": cache.max_blocks_per_seq,
                       "identical_tokens": same, "gain_tokens_per_s": gain, "results": results,
                       "steps": columns}, f, indent=1)
    if args.plot:
        save_plot(args.plot, columns, cache.num_pages)
    return 0 if same else 1
