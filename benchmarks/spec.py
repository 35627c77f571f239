"""Speculative decoding's speed on a model that accepts drafts (issue #36), in one process, side by side.

Usage (GPU): ``python benchmarks/spec.py [--rows 1,16,64] [--json out.json] [--toy-cache DIR]`` (``kvjax`` on
``PYTHONPATH``; ``--toy-cache``: the trained toy kept between runs, no training when it is there);
``--cpu``: the recipe at a reduced size (minutes on 2 CPU cores); ``--smoke``: a CPU run of seconds (tiny task, the
toy untrained; ``tests/test_spec_bench.py``).

Model: the copy toy of :mod:`kvjax.experiments.spec_runs` (float32): two attention layers trained once at the start
with optax on the copy task at the length it serves (prompt + answer; periods 4..8: the toy learns them to near
perfect copying in a minute of a GPU, where periods to 16 left it at 0.83 teacher-forced and its free-running greedy
continuation left the pattern after its first error), so its answers copy its prompt and prompt-lookup drafts are
what it says. Printed: its teacher-forced copy accuracy and its free-running greedy agreement with the prompts'
period (:func:`~kvjax.experiments.spec_runs.free_running`: the share of generated tokens that continue the period,
of sequences without an error), the acceptance to expect. Then an MTP layer trained ``mtp["steps"]`` optax steps
with the toy frozen on its own greedy tokens (self-distillation) with the second draft step chained on the layer's
own hidden state (``speculative="mtp"``; its teacher-forced agreement per chained draft step printed), then a GDN
layer appended that changes no logit but runs in every step (its state recorded per draft and rolled back: the
hybrid's verification cost).

Runs: for each row count (``--rows``), ``waves`` times as many copy prompts (at least ``min_requests``) of
``prompt_len`` tokens, ``max_new`` generated tokens each, pages for every row, each mode of :data:`MODES` (one line
of data each): plain decoding (the engine's defaults: overlap, decode bursts), ``speculative=ngram`` with K = 2 and 4
in single verification steps (host prompt lookup) under the engine's default rule
(:func:`kvjax.sched.spec.draft_length`: drafts shortened or turned off where the
step-cost model says they do not pay), K = 4 with the rule off (``flat_tokens=None``: K drafts whenever possible), and
``speculative=mtp`` with K = 2 and 4 under the rule (the MTP layer drafts inside every step), in single verification
steps and in verification bursts (one dispatch runs the engine's ``decode_burst`` verify-then-draft sub-steps; also
16 and 32 sub-steps), with the rule off, and with the rule's flat region measured in the run (plain decoding runs
first at every row count; its time per sub-step against the rows gives the region,
:func:`~kvjax.experiments.spec_runs.flat_tokens_from`), and ``speculative=ngram`` K = 4 in verification bursts of 32
with the measured rule (sub-step 0's drafts the host's lookup, the later ones the same lookup on the device:
:mod:`kvjax.engine.ngram`); ``--modes`` picks lines (the burst comparison: ``--modes "plain,plain burst 32,mtp K={k}
burst 32 measured rule,ngram K={k} burst 32 measured rule"``). At each row count every line's engine serves the
prompts once to compile, then ``repeats`` rounds (5 on the GPU recipe; ``--repeats``) time one pass of every line in turn (plain
decoding's engines also timed first, alone, for the flat region), each line's figures from its median pass by wall
(single passes of ~0.1 s moved by 15-25% between runs, and the same line by 17-33% between processes: interleaved,
the drift falls on every line alike). ``--profile DIR``: each line's median pass's steps with their host phases,
and one traced pass's kernels and GPU busy time. Columns: generated tokens/s (wall clock of the timed pass) and against
plain decoding at the same rows, steps, tokens per step, acceptance rate (overall and per draft position),
tokens per verification row and step, verification steps, and whether the tokens equal plain decoding's (greedy:
they must); ``model`` is the step-cost model's prediction from the run's own steps (tokens per
``max(T, FLAT_TOKENS)`` against plain decoding's): where it and the measured ratio part, ``FLAT_TOKENS`` is off for
this device and model. The rule's part: the paced K = 4 against the unpaced one at the larger row counts.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# GPU: the --cpu recipe (periods 4..8, lr 1e-2) at the served length with 2x the steps and batch (~14x the copied
# tokens seen): expected near-perfect copying, free-running agreement and n-gram / MTP acceptance near 1
FULL = dict(task=dict(vocab=128, length=224, min_period=4, max_period=8),
            model=dict(hidden=64, layer_types=("full_attention", "full_attention")),
            train=dict(steps=3000, lr=1e-2, batch=64), mtp=dict(steps=400, lr=1e-2, targets="greedy", depth=2),
            idle=("linear_attention",), prompt_len=64, max_new=128, free_prompts=64, waves=2, min_requests=8,
            rows=(1, 16, 64), ks=(2, 4), one_shape=False, repeats=5)
# the recipe at a reduced size, found on 2 CPU cores (``--cpu``: minutes there)
CPU = dict(task=dict(vocab=64, length=64, min_period=4, max_period=8),
           model=dict(hidden=64, layer_types=("full_attention", "full_attention")),
           train=dict(steps=1500, lr=1e-2, batch=32), mtp=dict(steps=300, lr=1e-2, targets="greedy", depth=2),
           idle=("linear_attention",), prompt_len=32, max_new=32, free_prompts=64, waves=2, min_requests=4,
           rows=(1, 4), ks=(2, 4), one_shape=True)
# CPU smoke: one attention layer and an idle GDN one, untrained (steps=0), one step shape per engine (compiles
# dominate on a CPU)
SMOKE = dict(task=dict(vocab=32, length=24, min_period=3, max_period=6), model=dict(hidden=32,
             layer_types=("full_attention",)), train=dict(steps=0), mtp=dict(steps=0), idle=("linear_attention",),
             prompt_len=13, max_new=6, free_prompts=4, waves=1, min_requests=1, rows=(1, 3), ks=(2,), one_shape=True,
             repeats=2)


# The modes run at each row count, one line each: (name, ``SpeculativeConfig`` fields or None for plain decoding,
# further Engine settings, K: "each" of cfg["ks"] (``{k}`` in the name) or their "max"[, the largest row count it runs
# at]). "ngram K={k}" and "mtp K={k}" verify in single steps (decode_burst=1); "burst" lines (either drafter: n-gram
# bursts draft their later sub-steps by prompt lookup on the device, kvjax.engine.ngram) verify in bursts of the
# engine's default length (an MTP engine's default), "burst 16" / "burst 32" in bursts of that many sub-steps.
# ``flat_tokens=MEASURED``: the rule's flat region measured in this run from plain decoding's sub-step times at every
# row count (:func:`kvjax.experiments.spec_runs.flat_tokens_from`; the default where they do not grow). "plain burst
# 32": plain decoding in bursts as long as the longest verification bursts. "rule off" and "measured rule" lines draft
# at any row count (``disable_by_batch_size=None``); the others keep its default (no drafts above 16 rows); "off above
# 16 rows" names it (16).
MEASURED = "measured"
MODES = (
    ("plain", None, {}, None),
    ("plain burst 32", None, dict(decode_burst=32), None, 64),
    ("ngram K={k}", dict(method="ngram"), dict(decode_burst=1), "each"),
    ("ngram K={k} rule off", dict(method="ngram", flat_tokens=None, disable_by_batch_size=None), dict(decode_burst=1),
     "max"),
    ("ngram K={k} burst 32 measured rule", dict(method="ngram", flat_tokens=MEASURED, disable_by_batch_size=None),
     dict(decode_burst=32), "max"),
    ("ngram K={k} burst 32 measured rule off above 16 rows", dict(method="ngram", flat_tokens=MEASURED,
     disable_by_batch_size=16), dict(decode_burst=32), "max"),
    ("mtp K={k}", dict(method="mtp"), dict(decode_burst=1), "each"),
    ("mtp K={k} burst", dict(method="mtp"), dict(decode_burst="auto"), "each"),
    ("mtp K={k} burst rule off", dict(method="mtp", flat_tokens=None, disable_by_batch_size=None),
     dict(decode_burst="auto"), "max"),
    ("mtp K={k} burst 16 rule off", dict(method="mtp", flat_tokens=None, disable_by_batch_size=None),
     dict(decode_burst=16), "max"),
    ("mtp K={k} burst 32 measured rule", dict(method="mtp", flat_tokens=MEASURED, disable_by_batch_size=None),
     dict(decode_burst=32), "max"),
    ("mtp K={k} burst 32 measured rule off above 16 rows", dict(method="mtp", flat_tokens=MEASURED,
     disable_by_batch_size=16), dict(decode_burst=32), "max"),
)


def modes(ks, table=MODES, rows: int | None = None, flat_tokens: int | None = None) -> list[tuple[str, object, dict]]:
    """(name, ``speculative=``, Engine settings) of each run at a row count, from ``table`` (:data:`MODES`) and the
    draft lengths ``ks``; with ``rows``, only the modes that run at that many rows; ``flat_tokens``: what
    :data:`MEASURED` stands for (the default flat region where ``None``)."""
    from kvjax.sched.drafter import FLAT_TOKENS, SpeculativeConfig

    out = []
    for name, fields, settings, which, *cap in table:
        if rows is not None and cap and rows > cap[0]:
            continue
        if fields is None:
            out.append((name, None, dict(settings)))
            continue
        if fields.get("flat_tokens") == MEASURED:
            fields = dict(fields, flat_tokens=flat_tokens or FLAT_TOKENS)
        for k in ks if which == "each" else (max(ks),):
            out.append((name.format(k=k), SpeculativeConfig(num_draft_tokens=k, **fields), dict(settings)))
    return out


@contextlib.contextmanager
def compile_cache():
    """Engines of the same step shapes compile once: a persistent compilation cache in a temporary directory for
    this run (none kept), unless one is configured already; the settings are restored afterwards."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        yield
        return
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    old = {k: getattr(jax.config, k) for k in keys}
    with tempfile.TemporaryDirectory() as cache_dir:
        jax.config.update(keys[0], cache_dir)
        jax.config.update(keys[1], 0.0)
        try:
            yield
        finally:
            for k, v in old.items():
                jax.config.update(k, v)


def toy_file(cache_dir: str, cfg: dict) -> str:
    """Where ``--toy-cache`` keeps the trained toy and MTP layer of ``cfg`` (named by a digest of its recipe)."""
    recipe = json.dumps({k: cfg[k] for k in ("task", "model", "train", "mtp")}, sort_keys=True, default=str)
    return os.path.join(cache_dir, f"spec_toy_{hashlib.sha256(recipe.encode()).hexdigest()[:16]}.npz")


def _param_key(name: str, path: tuple) -> str:
    """The ``.npz`` key of parameter ``path`` (as ``nnx.to_flat_state`` names it) of module ``name``."""
    return "/".join([name, *map(str, path)])


def save_params(path: str, **modules) -> None:
    """Every parameter of each nnx module in ``modules`` into one ``.npz``."""
    import numpy as np
    from flax import nnx

    np.savez(path, **{_param_key(name, p): np.asarray(var.get_value()) for name, module in modules.items()
                      for p, var in nnx.to_flat_state(nnx.state(module))})


def load_params(path: str, **modules) -> None:
    """The parameters :func:`save_params` wrote, into each module of ``modules`` in place
    (:func:`kvjax.models.common.checkpoint.assign_params`: every parameter, shapes checked)."""
    import numpy as np
    from flax import nnx

    from kvjax.models.common.checkpoint import assign_params

    with np.load(path) as data:
        for name, module in modules.items():
            assign_params(module, {p: data[_param_key(name, p)] for p, _ in nnx.to_flat_state(nnx.state(module))})


def build(cfg: dict, toy_cache: str | None = None) -> tuple[object, dict]:
    """The served model of ``cfg``: the copy toy trained (``train``; none: untrained), its free-running greedy
    agreement with the prompts' period, its MTP layer trained (``mtp``) and the idle layers appended. Prints each
    figure; returns ``(model, figures)``. ``toy_cache``: a folder where the trained toy and MTP layer of this recipe
    are loaded from when there (no training), saved to otherwise."""
    import numpy as np

    from kvjax.experiments import spec_runs

    task = spec_runs.CopyTask(**cfg["task"])
    t0 = time.perf_counter()
    cached = toy_cache is not None and os.path.exists(toy_file(toy_cache, cfg))
    if cached:  # the recipe's architecture, untrained, then the saved parameters
        model, _ = spec_runs.train_copy(task, cfg["model"], dict(cfg["train"], steps=0))
        head, _ = spec_runs.copy_mtp(model, task, **dict(cfg["mtp"], steps=0))
        load_params(toy_file(toy_cache, cfg), toy=model, mtp=head)
        hist = mtp_hist = "loaded"
    else:
        model, hist = spec_runs.train_copy(task, cfg["model"], cfg["train"])
    figures = dict(copy_accuracy=spec_runs.copy_accuracy(model, task, np.random.default_rng(1)))
    state = ("loaded from " + toy_file(toy_cache, cfg) if cached else
             f"trained {cfg['train']['steps']} steps" if hist else "untrained")
    prompts = task.prompts(np.random.default_rng(3), cfg["free_prompts"], cfg["prompt_len"] - 1)
    figures["free_running"] = spec_runs.free_running(model, prompts, cfg["max_new"])
    fr = figures["free_running"]
    print(f"copy toy {state} in {time.perf_counter() - t0:.1f} s: teacher-forced copy accuracy "
          f"{figures['copy_accuracy']:.3f}; free-running greedy over {cfg['max_new']} tokens of {len(prompts)} "
          f"prompts: {fr['agreement']:.3f} of the tokens continue the prompt's period, {fr['perfect']:.3f} of the "
          f"sequences without an error, first error after {fr['first_error']:.3f} of the tokens on average")
    t0 = time.perf_counter()
    m = cfg["mtp"]
    if not cached:
        head, mtp_hist = spec_runs.copy_mtp(model, task, **m)
        if toy_cache is not None:
            os.makedirs(toy_cache, exist_ok=True)
            save_params(toy_file(toy_cache, cfg), toy=model, mtp=head)
    depth = max(cfg["ks"])
    accs = spec_runs.mtp_copy_accuracy(model, head, task, np.random.default_rng(2), depth=depth, against="greedy")
    figures["mtp_accuracy_per_step"] = accs
    print(f"MTP layer {'loaded' if cached else 'trained ' + str(m['steps']) + ' steps' if mtp_hist else 'random'} in "
          f"{time.perf_counter() - t0:.1f} s (toy frozen; {m.get('targets', 'greedy')} targets, {m.get('depth', 2)} "
          f"chained steps in the loss): teacher-forced agreement with the toy's greedy token two ahead, per chained "
          f"draft step: {', '.join(f'{a:.3f}' for a in accs)}")
    return spec_runs.attach_mtp(spec_runs.with_idle_layers(model, cfg["idle"]), head), figures


def print_profile(rows: int, name: str, r: dict) -> None:
    """Where a line's time goes: the median timed pass's steps with their host phases, and the traced pass's wall
    against the GPU's kernels and busy time (:func:`trace_kernels.busy_time`)."""
    print(f"\n{rows} rows, {name}: the median timed pass's steps (ms; wall {r['wall_s'] * 1e3:.2f}, passes "
          + ", ".join(f"{w * 1e3:.1f}" for w in r["walls"]) + ")")
    print("| step | tokens | rows | burst | ran | generated | verify rows | schedule | inputs | dispatch | wait "
          "| update | step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in r["records"]:
        print(f"| {s['step']} | {s['num_tokens']} | {s['num_seqs']} | {s['burst']} | {s['sub_steps']} | "
              f"{s['generated']} | {s['verify_rows']} | " + " | ".join(
                  f"{s[k] * 1e3:.3f}" for k in ("t_schedule", "t_inputs", "t_dispatch", "t_wait", "t_update",
                                                 "t_step")) + " |")
    t, g = r["traced"], r.get("gpu") or {}
    if g:
        wall = t["wall_s"] * 1e3
        print(f"traced pass: {wall:.2f} ms wall, {t['engine_steps']} engine steps, {t['steps']} sub-steps; "
              f"{g['kernels']:.0f} kernels ({g['kernels'] / t['steps']:.1f} a sub-step), {g['kernel_ms']:.2f} ms of "
              f"kernels ({g['kernel_ms'] / t['steps'] * 1e3:.1f} us a sub-step), GPU busy {g['busy_ms']:.2f} ms "
              f"({g['busy_ms'] / wall:.0%} of the wall)")


def main(argv=None) -> dict:
    """Run the benchmark (``argv``: the command line's arguments)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a CPU run of seconds")
    ap.add_argument("--cpu", action="store_true", help="the recipe at a reduced size (minutes on a CPU)")
    ap.add_argument("--rows", default=None, help="row counts, comma-separated (default 1,16,64)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--modes", default=None, help="the lines of MODES to run, by name as written there ('{k}' "
                    "unexpanded), comma-separated (default: every line)")
    ap.add_argument("--profile", default=None, help="a folder: one more pass of each line under jax.profiler "
                    "(traces kept there); prints each line's steps with their host phases, and the traced pass's "
                    "kernels, kernel time and GPU busy time")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (one pass of every line each; default: "
                    "the recipe's, 5 on the GPU)")
    ap.add_argument("--toy-cache", default=None, help="a folder: load the trained toy and MTP layer of the recipe "
                    "from it when there (no training), else train and save them there")
    args = ap.parse_args(argv)
    table = MODES
    if args.modes:
        names = args.modes.split(",")
        unknown = sorted(set(names) - {m[0] for m in MODES})
        if unknown:
            ap.error(f"--modes: no line {unknown[0]!r} in MODES (names: {', '.join(m[0] for m in MODES)})")
        table = tuple(m for m in MODES if m[0] in names)
    cfg = dict(SMOKE if args.smoke else CPU if args.cpu else FULL)
    if args.rows:
        cfg["rows"] = tuple(int(r) for r in args.rows.split(","))
    if args.repeats is not None:
        if args.repeats < 1:
            ap.error(f"--repeats must be >= 1, got {args.repeats}")
        cfg["repeats"] = args.repeats

    import jax
    import numpy as np

    from kvjax.experiments import spec_runs
    from kvjax.sched.drafter import FLAT_TOKENS

    with compile_cache():
        model, figures = build(cfg, args.toy_cache)
        print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; layers {model.config.layer_types}", flush=True)
        task = spec_runs.CopyTask(**cfg["task"])
        rows_out, profiles = [], []

        def prompts_at(rows):
            n = max(cfg["min_requests"], rows * cfg["waves"])  # a few at 1 row, so the timed pass is not a blink
            return task.prompts(np.random.default_rng(rows), n, cfg["prompt_len"] - 1)

        # plain decoding first at every row count: the measured flat region (and the baseline engines)
        repeats = cfg.get("repeats", 1)  # timed passes of each line; the median's figures

        def trace_dir(rows, name):
            return None if args.profile is None else os.path.join(args.profile, f"{rows}-{name.replace(' ', '_')}")

        def new_engine(rows, speculative=None, **settings):
            return spec_runs.spec_engine(model, prompts_at(rows), cfg["max_new"], rows=rows, speculative=speculative,
                                         one_shape=cfg["one_shape"], **settings)

        plain_engines = {rows: new_engine(rows) for rows in cfg["rows"]}
        plain = {rows: spec_runs.pass_figures([spec_runs.timed_pass(eng, prompts_at(rows), cfg["max_new"])
                                               for _ in range(repeats)], rows)
                 for rows, eng in plain_engines.items()}
        flat = None
        if len(set(cfg["rows"])) > 1:
            flat = spec_runs.flat_tokens_from(list(plain), [r["wall_s"] / r["steps"] for r in plain.values()])
        figures["flat_tokens_measured"] = flat
        print("plain decoding, ms per sub-step: " + ", ".join(f"{r['wall_s'] / r['steps'] * 1e3:.3f} at {n} rows"
                                                              for n, r in plain.items())
              + f"; measured flat region {flat} tokens (the rule's default {FLAT_TOKENS})", flush=True)
        print("\n| rows | mode | tok/s | vs plain | model | steps | tok/step | acceptance | per position | "
              "tok/verify row | tok/verify step | verify steps | identical |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
        for rows in cfg["rows"]:
            prompts = prompts_at(rows)
            # every line's engine compiled first, then rounds of one timed pass of each line in turn: the host's
            # drift over a run (tens of percent on a GPU host between lines minutes apart) falls on every line alike
            engines = {name: plain_engines[rows] if speculative is None and not settings else
                       new_engine(rows, speculative, **settings)
                       for name, speculative, settings in modes(cfg["ks"], table, rows, flat)}
            passes = {name: [] for name in engines}
            for _ in range(repeats):
                for name, eng in engines.items():
                    passes[name].append(spec_runs.timed_pass(eng, prompts, cfg["max_new"]))
            results = {}
            for name, eng in engines.items():
                d = trace_dir(rows, name)
                traced = None if d is None else spec_runs.traced_pass(eng, prompts, cfg["max_new"], d)
                results[name] = spec_runs.pass_figures(passes[name], rows, traced=traced)
                if d is not None:
                    from trace_kernels import busy_time

                    results[name]["gpu"] = busy_time(d)
            base = results.get("plain") or spec_runs.pass_figures(
                [spec_runs.timed_pass(plain_engines[rows], prompts, cfg["max_new"]) for _ in range(repeats)], rows)
            expect = base["outputs"]
            for name, r in results.items():
                outputs = r.pop("outputs")
                r.update(mode=name, vs_plain=r["tok_s"] / base["tok_s"], identical=outputs == expect,
                         model_vs_plain=r["tok_per_cost"] / base["tok_per_cost"])
                rows_out.append(r)
                per = ", ".join(f"{x:.2f}" for x in r.get("acceptance_rate_per_position", []))
                spec = (f"{r['acceptance_rate']:.3f} | {per} | {r['tokens_per_verify_row']:.2f} | "
                        f"{r['tokens_per_verify_step']:.1f}" if r["verify_steps"] else "- | - | - | -")
                print(f"| {rows} | {name} | {r['tok_s']:.0f} | {r['vs_plain']:.2f}x | {r['model_vs_plain']:.2f}x | "
                      f"{r['steps']} | {r['tokens_per_step']:.1f} | {spec} | {r['verify_steps']} | {r['identical']} |",
                      flush=True)
                if args.profile is not None:
                    profiles.append((rows, name, r))
        for rows, name, r in profiles:
            print_profile(rows, name, r)
    report = dict(config={k: v for k, v in cfg.items()}, **figures, rows=rows_out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=float)
    return report


if __name__ == "__main__":
    main()
