"""Speculative decoding's speed on a model that accepts drafts (issue #36), in one process, side by side.

Usage (GPU): ``python benchmarks/spec.py [--rows 1,16,64] [--json out.json]`` (``kvjax`` on ``PYTHONPATH``);
``--smoke``: a CPU run of seconds (tiny task, the toy untrained; ``tests/test_spec_bench.py``).

Model: the copy toy of :mod:`kvjax.experiments.spec_runs` (float32): two attention layers trained once at the start
with optax on the copy task at the length it serves (prompt + answer), so its answers copy its prompt and
prompt-lookup drafts are what it says, and an MTP layer trained ``mtp_steps`` optax steps on the same task with the
toy frozen (``speculative="mtp"``; its teacher-forced two-ahead accuracy printed), then a GDN layer appended that
changes no logit but runs in every step (its state recorded per draft and rolled back: the hybrid's verification
cost). Its teacher-forced copy accuracy is
printed: the acceptance to expect.

Runs: for each row count (``--rows``), ``waves`` times as many copy prompts (at least ``min_requests``) of
``prompt_len`` tokens, ``max_new`` generated tokens each, pages for every row: plain decoding (the engine's defaults:
overlap, decode bursts), then ``speculative=ngram`` with K = 2 and 4 under the engine's default rule
(:func:`kvjax.sched.spec.draft_length`: drafts shortened or turned off where the step-cost model says they do not
pay), K = 4 with the rule off (``flat_tokens=None``: K drafts whenever possible), and ``speculative=mtp`` with
K = 2 and 4 under the rule (the MTP layer drafts inside every step). Each
engine serves the prompts once to compile, then once timed. Columns: generated tokens/s (wall clock of the timed
pass) and against plain decoding at the same rows, steps, tokens per step, acceptance rate (overall and per draft
position), tokens per verification row and step, verification steps, and whether the tokens equal plain
decoding's (greedy: they must); ``model`` is the step-cost model's prediction from the run's own steps (tokens per
``max(T, FLAT_TOKENS)`` against plain decoding's): where it and the measured ratio part, ``FLAT_TOKENS`` is off for
this device and model. The rule's part: the paced K = 4 against the unpaced one at the larger row counts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FULL = dict(task=dict(vocab=128, length=224, min_period=4, max_period=16), hidden=64, steps=2000, lr=1e-2,
            mtp_steps=300, layers=("full_attention", "full_attention"), idle=("linear_attention",), prompt_len=64,
            max_new=128, waves=2, min_requests=8, rows=(1, 16, 64), ks=(2, 4), one_shape=False)
# CPU smoke: one attention layer and an idle GDN one, untrained (steps=0), one step shape per engine (compiles
# dominate on a CPU)
SMOKE = dict(task=dict(vocab=32, length=24, min_period=3, max_period=6), hidden=32, steps=0, lr=3e-3, mtp_steps=0,
             layers=("full_attention",), idle=("linear_attention",), prompt_len=13, max_new=6, waves=1, min_requests=1,
             rows=(1, 3), ks=(2,), one_shape=True)


def modes(ks) -> list[tuple[str, object]]:
    """(name, ``speculative=``) of each run at a row count: plain, ngram per K (paced), ngram at the largest K
    unpaced, then the MTP layers' drafts per K (paced)."""
    from kvjax.sched.drafter import SpeculativeConfig

    out = [("plain", None)] + [(f"ngram K={k}", SpeculativeConfig(num_draft_tokens=k)) for k in ks]
    out += [(f"ngram K={max(ks)} rule off", SpeculativeConfig(num_draft_tokens=max(ks), flat_tokens=None))]
    return out + [(f"mtp K={k}", SpeculativeConfig(method="mtp", num_draft_tokens=k)) for k in ks]


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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a CPU run of seconds")
    ap.add_argument("--rows", default=None, help="row counts, comma-separated (default 1,16,64)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    if args.rows:
        cfg["rows"] = tuple(int(r) for r in args.rows.split(","))

    import jax
    import numpy as np

    from kvjax.experiments import spec_runs, tasks

    with compile_cache():
        task = spec_runs.CopyTask(**cfg["task"])
        t0 = time.perf_counter()
        model = spec_runs.copy_model(task, hidden=cfg["hidden"], layer_types=cfg["layers"])
        acc = None  # untrained (the smoke run)
        if cfg["steps"]:
            model, hist = tasks.train(model, task, steps=cfg["steps"], batch=32, lr=cfg["lr"],
                                      warmup=min(30, cfg["steps"] // 2))
            acc = spec_runs.copy_accuracy(model, task, np.random.default_rng(1))
            print(f"copy toy trained {cfg['steps']} steps in {time.perf_counter() - t0:.1f} s: teacher-forced copy "
                  f"accuracy {acc:.3f}, loss {hist['loss'][-20:].mean():.4f}")
        t0 = time.perf_counter()
        head, mtp_hist = spec_runs.copy_mtp(model, task, steps=cfg["mtp_steps"], lr=cfg["lr"])
        mtp_acc = spec_runs.mtp_copy_accuracy(model, head, task, np.random.default_rng(2))
        print(f"MTP layer {'trained ' + str(cfg['mtp_steps']) + ' steps' if mtp_hist else 'random'} in "
              f"{time.perf_counter() - t0:.1f} s (toy frozen): teacher-forced two-ahead copy accuracy {mtp_acc:.3f}")
        model = spec_runs.attach_mtp(spec_runs.with_idle_layers(model, cfg["idle"]), head)
        print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; layers {model.config.layer_types}", flush=True)
        rows_out = []
        print("\n| rows | mode | tok/s | vs plain | model | steps | tok/step | acceptance | per position | "
              "tok/verify row | tok/verify step | verify steps | identical |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
        for rows in cfg["rows"]:
            n = max(cfg["min_requests"], rows * cfg["waves"])  # a few at 1 row, so the timed pass is not a blink
            prompts = task.prompts(np.random.default_rng(rows), n, cfg["prompt_len"] - 1)
            base = None
            for name, speculative in modes(cfg["ks"]):
                r = spec_runs.spec_run(model, prompts, cfg["max_new"], rows=rows, speculative=speculative,
                                       one_shape=cfg["one_shape"])
                outputs = r.pop("outputs")
                if base is None:
                    base = dict(r, outputs=outputs)
                r.update(mode=name, vs_plain=r["tok_s"] / base["tok_s"], identical=outputs == base["outputs"],
                         model_vs_plain=r["tok_per_cost"] / base["tok_per_cost"], copy_accuracy=acc)
                rows_out.append(r)
                per = ", ".join(f"{x:.2f}" for x in r.get("acceptance_rate_per_position", []))
                spec = (f"{r['acceptance_rate']:.3f} | {per} | {r['tokens_per_verify_row']:.2f} | "
                        f"{r['tokens_per_verify_step']:.1f}" if r["verify_steps"] else "- | - | - | -")
                print(f"| {rows} | {name} | {r['tok_s']:.0f} | {r['vs_plain']:.2f}x | {r['model_vs_plain']:.2f}x | "
                      f"{r['steps']} | {r['tokens_per_step']:.1f} | {spec} | {r['verify_steps']} | {r['identical']} |",
                      flush=True)
    report = dict(config={k: v for k, v in cfg.items()}, copy_accuracy=acc, mtp_copy_accuracy=mtp_acc, rows=rows_out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=float)
    return report


if __name__ == "__main__":
    main()
