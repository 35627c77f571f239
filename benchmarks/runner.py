"""Run the benchmark cases of one or more subjects: check each implementation, time it, compare, write JSON.

Usage (repo root; a GPU machine runs ``bash benchmarks/run_gpu.sh``, which does both halves):

    python benchmarks/runner.py --anchors-only [SUBJECT ...] --out OUT/anchors.json   # torch process
    python benchmarks/runner.py [SUBJECT ...] [--anchors-json OUT/anchors.json] --out OUT/bench.json
    python benchmarks/runner.py --table OUT/bench.json                                 # print a saved run
    python benchmarks/runner.py gdn --small --impls reference,interpret                # CPU smoke run

Subjects: ``gdn conv attention mla mlp`` (the default) and ``engine prefix sched_overhead``. Each subject module
declares its cases (``cases(small) -> list[Case | RunCase]``, see ``case.py``) and, where it has torch-side anchors
(fla), ``torch_anchors(small)``. The torch half runs in its own process (fla autotunes; its Triton and JAX's
must not share a process) and measures the torch copy of every case's byte count.

Per case the runner builds the inputs, runs the op's float32 reference, runs each implementation through the
public op (``impl=NAME``) and compares every output with the reference (a failed check is reported, not
timed), times the checked ones and the JAX-side anchors in interleaved rounds (wall clock, and device time from
the profiler's kernel records where there are any), then prints per implementation the median ms, the ratio
to the anchor and to a copy of the same bytes timed the same way in the same run. ``median_ms`` is the device
time where the profiler has device records (GPU), else the wall clock (``timer`` says which).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import timing  # noqa: E402
from case import Case, RunCase  # noqa: E402

OP_SUBJECTS = ("gdn", "conv", "attention", "mla", "mlp")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "bench.json")  # git-ignored
ERROR_CHARS = 2000  # an error message kept in the JSON (cut at a word boundary beyond this)
SUBJECTS = OP_SUBJECTS + ("engine", "prefix", "sched_overhead")
COLUMNS = ("case", "subject", "op", "shapes", "impl", "kind", "ok", "err", "error", "median_ms", "timer",
           "wall_ms", "device_ms", "anchor", "anchor_ms", "vs_anchor", "bytes", "gbps", "copy_gbps", "vs_copy",
           "flops", "tflops", "rounds")


def subject_cases(subject: str, small: bool, only: tuple[str, ...] | None = None) -> list:
    """The cases the subject module ``benchmarks/<subject>.py`` declares (those whose name contains one of
    ``only``, if given)."""
    if subject not in SUBJECTS:
        raise SystemExit(f"unknown subject {subject!r}; subjects: {', '.join(SUBJECTS)}")
    found = importlib.import_module(subject).cases(small)
    return [c for c in found if only is None or any(s in c.name for s in only)]


class Run:
    """One benchmark process: its options, the torch half's figures and the copies timed so far (per bytes)."""

    def __init__(self, *, small: bool, impls: tuple[str, ...] | None, rounds: int, calls: int,
                 anchors: dict | None):
        self.small, self.impls, self.rounds, self.calls = small, impls, rounds, calls
        self.torch = anchors or {"copies": {}, "anchors": {}}
        self.copies: dict[int, dict] = {}

    def copy_gbps(self, nbytes: int, timer: str) -> float | None:
        """The best copy rate (GB/s) of ``nbytes`` in this run, XLA or torch, timed with ``timer``."""
        if nbytes <= 0:
            return None
        if nbytes not in self.copies:
            self.copies[nbytes] = timing.xla_copy(nbytes, n=self.calls)
        rates = []
        for c in (self.copies[nbytes], self.torch["copies"].get(str(nbytes))):
            if c and c.get(f"{timer}_ms"):
                rates.append(c["bytes"] / c[f"{timer}_ms"] / 1e6)
        return max(rates, default=None)


def _check(runner, compare, ref: tuple, tol) -> tuple[list[float], bool]:
    out = tuple(compare(runner()))
    if len(out) != len(ref):
        raise ValueError(f"{len(out)} outputs, the reference has {len(ref)}")
    errs = [timing.rel_err(o, r) for o, r in zip(out, ref)]
    tols = tol if isinstance(tol, tuple) else (tol,) * len(errs)
    return errs, all(e <= t for e, t in zip(errs, tols))  # nan fails


def _prepare(case: Case, run: Run, setup) -> tuple[dict, list[dict]]:
    """Check every implementation and JAX anchor against the reference: (runners to time, rows)."""
    import jax

    with jax.default_matmul_precision("highest"):  # the float32 oracle in float32, not TF32
        ref = tuple(setup.compare(setup.reference()))
    runners, rows = {}, []
    entries = [(impl, "impl", lambda impl=impl: setup.run(impl)) for impl in (run.impls or case.impls)]
    entries += [(name, "anchor", make) for name, make in setup.anchors.items()]
    for name, kind, make in entries:
        row = {"impl": name, "kind": kind, "ok": False, "err": None, "error": None}
        try:
            runner = make()
            if name in setup.unchecked:
                timing.block(runner())
                row["ok"] = None
            else:
                row["err"], row["ok"] = _check(runner, setup.compare, ref, case.tol)
            if row["ok"] or kind == "anchor":  # an anchor is timed even off the reference (flagged)
                runners[name] = runner
        except Exception as e:  # noqa: BLE001 - an implementation that cannot run here is a row, not a crash
            row["error"] = clip(f"{type(e).__name__}: {e}", ERROR_CHARS)
            if type(e).__name__ == "UnknownImplError":  # not offered here (device, shapes): no verdict
                row["ok"] = None
        if row["ok"] is False and row["error"] is None:
            row["error"] = f"check failed: rel err {row['err']} > tol {case.tol}"
        verdict = {True: "ok", False: "FAILED", None: "n/a"}[row["ok"]]
        print(f"  check {name:24s} {verdict} err={row['err']} {row['error'] or ''}",
              flush=True)
        rows.append(row)
    return runners, rows


def run_case(case: Case, subject: str, run: Run) -> list[dict]:
    """Rows (every column of :data:`COLUMNS`) for one op case: its implementations, anchors, torch anchors."""
    print(f"[{subject}] {case.name}", flush=True)
    runners, rows = _prepare(case, run, case.setup())
    times = timing.interleaved(runners, rounds=run.rounds, n=run.calls,
                               device_rounds=max(1, run.rounds // 2)) if runners else {}
    for name, figures in run.torch["anchors"].get(case.name, {}).items():
        rows.append({"impl": f"torch:{name}", "kind": "anchor", "ok": None, "err": None, "error": None})
        times[f"torch:{name}"] = {**figures, "wall_rounds": [], "device_rounds": []}
    timer = "device" if any(t.get("device_ms") for t in times.values()) else "wall"
    anchor = times.get(case.anchor, {}).get(f"{timer}_ms") if case.anchor else None
    copy = run.copy_gbps(case.bytes, timer) if times else None
    out = []
    for row in rows:
        t = times.get(row["impl"], {})
        ms = t.get(f"{timer}_ms")
        gbps = case.bytes / ms / 1e6 if ms and case.bytes else None
        row.update(case=case.name, subject=subject, op=case.op, shapes=case.shapes, median_ms=ms, timer=timer,
                   wall_ms=t.get("wall_ms"), device_ms=t.get("device_ms"), anchor=case.anchor, anchor_ms=anchor,
                   vs_anchor=anchor / ms if anchor and ms else None, bytes=case.bytes, gbps=gbps,
                   copy_gbps=copy, vs_copy=gbps / copy if gbps and copy else None, flops=case.flops,
                   tflops=case.flops / ms / 1e9 if ms and case.flops else None,
                   rounds=t.get(f"{timer}_rounds", []))
        out.append({k: row[k] for k in COLUMNS})
    return out


def run_measure(case: RunCase, subject: str) -> list[dict]:
    """Rows for a :class:`RunCase` (engine, scheduler): its own figures, plus every column."""
    print(f"[{subject}] {case.name}", flush=True)
    rows = case.measure()
    anchor = next((r["median_ms"] for r in rows if r["impl"] == case.anchor), None)
    out = []
    for r in rows:
        base = dict.fromkeys(COLUMNS)
        base.update(case=case.name, subject=subject, op=case.op, shapes=case.shapes, kind="run", timer="wall",
                    wall_ms=r["median_ms"], anchor=case.anchor, anchor_ms=anchor, bytes=0, flops=0, rounds=[],
                    vs_anchor=anchor / r["median_ms"] if anchor and r.get("median_ms") else None)
        base.update(r)
        out.append(base)
    return out


def run_subjects(subjects: list[str], *, small: bool = False, impls: tuple[str, ...] | None = None,
                 rounds: int = 7, calls: int = 20, anchors: dict | None = None, out: str | None = None,
                 only: tuple[str, ...] | None = None) -> dict:
    """Run every case of ``subjects``; returns (and writes to ``out`` after every case) the JSON report."""
    import jax

    run = Run(small=small, impls=impls, rounds=rounds, calls=calls, anchors=anchors)
    dev = jax.devices()[0]
    report = {"date": time.strftime("%Y-%m-%d"), "device": dev.device_kind, "backend": jax.default_backend(),
              "jax": jax.__version__, "torch_device": run.torch.get("device"), "small": small, "rows": []}
    if not small:
        report["copy_1GiB"] = {"xla": timing.xla_copy(timing.COPY_BYTES, n=calls),
                               "torch": run.torch["copies"].get(str(timing.COPY_BYTES))}
    for subject in subjects:
        for case in subject_cases(subject, small, only):
            try:
                rows = run_measure(case, subject) if isinstance(case, RunCase) else run_case(case, subject, run)
            except Exception as e:  # noqa: BLE001 - keep the other cases' figures
                traceback.print_exc()
                rows = [dict(dict.fromkeys(COLUMNS), case=case.name, subject=subject, op=case.op, ok=False,
                             shapes=case.shapes, error=clip(f"{type(e).__name__}: {e}", ERROR_CHARS),
                             rounds=[])]
            report["rows"] += rows
            if out:
                with open(out, "w") as f:
                    json.dump(report, f, indent=1, default=str)
    return report


def torch_half(subjects: list[str], small: bool, out: str) -> dict:
    """The torch process: torch copies of every case's bytes (and 1 GiB), and the subjects' torch anchors."""
    import torch

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copies": {}, "anchors": {}}
    sizes = {timing.COPY_BYTES}
    for subject in subjects:
        sizes |= {c.bytes for c in subject_cases(subject, small) if isinstance(c, Case) and c.bytes}
        module = importlib.import_module(subject)
        if hasattr(module, "torch_anchors"):
            try:
                res["anchors"].update(module.torch_anchors(small))
            except Exception as e:  # noqa: BLE001 - keep the copies and the other anchors
                traceback.print_exc()
                res[f"{subject}_error"] = clip(repr(e), ERROR_CHARS)
    for nbytes in sorted(sizes):
        res["copies"][str(nbytes)] = timing.torch_copy(nbytes)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return res


def clip(text: str, limit: int) -> str:
    """``text`` on one line, cut at a word boundary to at most ``limit`` characters with `` …`` where it was cut
    (never mid-word, so a reader sees where the message continues)."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    head = text[: limit - 2]
    cut = head.rfind(" ")
    return (head[:cut] if cut > limit // 2 else head).rstrip() + " …"


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(report: dict) -> None:
    """One line per implementation: median ms, ratio to the anchor and to the copy of the same bytes."""
    print(f"\n{report['date']}  {report['device']}  jax {report['jax']}  (median_ms: device time where the "
          f"profiler has device records, else wall clock)")
    case = None
    for r in report["rows"]:
        if r["case"] != case:
            case = r["case"]
            print(f"\n{case}  [{r['op']}]  anchor: {r['anchor'] or '-'}  bytes {r['bytes'] or '-'}  "
                  f"copy {_fmt(r['copy_gbps'], '.0f')} GB/s")
            print(f"  {'impl':26s} {'ok':>5s} {'err':>9s} {'ms':>9s} {'timer':>6s} {'vs anchor':>9s} "
                  f"{'GB/s':>7s} {'vs copy':>7s} {'TFLOP/s':>8s}")
        err = r["err"][0] if isinstance(r["err"], list) and r["err"] else r["err"]
        print(f"  {r['impl'] or '-':26s} {str(r['ok']):>5s} {_fmt(err, '9.1e')} {_fmt(r['median_ms'], '9.4f')} "
              f"{r['timer'] or '-':>6s} {_fmt(r['vs_anchor'], '9.2f')} {_fmt(r['gbps'], '7.0f')} "
              f"{_fmt(r['vs_copy'], '7.1%')} {_fmt(r['tflops'], '8.1f')}  {clip(r['error'] or '', 100)}")


def subject_main(subject: str, argv: list[str]) -> int:
    """``python benchmarks/<subject>.py [runner options]``: that subject's cases through :func:`main`. Where JAX
    sees no GPU and no ``--small`` / ``--impls`` is given, it runs the CPU smoke run (``--small --impls
    reference,interpret``: tiny shapes, kernels in interpret mode) and says so, instead of GPU-sized cases
    whose kernels would all decline."""
    import jax

    print(f"benchmarks/{subject}.py: the {subject} cases through benchmarks/runner.py "
          "(python benchmarks/runner.py --help lists the options)", file=sys.stderr)
    if jax.default_backend() != "gpu" and not any(a.split("=")[0] in ("--small", "--impls") for a in argv):
        print(f"no GPU here ({jax.default_backend()}): running the CPU smoke run --small --impls reference,interpret "
              "(tiny shapes; the timings say nothing about a GPU)", file=sys.stderr)
        argv = ["--small", "--impls", "reference,interpret", *argv]
    return main([subject, *argv])


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns 1 when a checked implementation failed its check, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("subjects", nargs="*", help=f"of {', '.join(SUBJECTS)} (default: {' '.join(OP_SUBJECTS)})")
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="JSON report, rewritten after every case (default: benchmarks/out/bench.json, git-ignored)")
    ap.add_argument("--anchors-only", action="store_true", help="the torch half: anchors and torch copies")
    ap.add_argument("--anchors-json", default=None, help="the torch half's JSON, merged into this run")
    ap.add_argument("--table", default=None, help="print the table of a saved run and exit")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--impls", default=None, help="comma-separated impl names replacing every case's own")
    ap.add_argument("--cases", default=None, help="comma-separated parts of case names: run only those cases")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per round")
    a = ap.parse_args(argv)
    subjects = a.subjects or list(OP_SUBJECTS)
    if not a.table and os.path.dirname(os.path.abspath(a.out)):
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    if a.table:
        with open(a.table) as f:
            print_table(json.load(f))
        return 0
    if a.anchors_only:
        torch_half(subjects, a.small, a.out)
        return 0
    anchors = None
    if a.anchors_json and os.path.exists(a.anchors_json):
        with open(a.anchors_json) as f:
            anchors = json.load(f)
    report = run_subjects(subjects, small=a.small, impls=tuple(a.impls.split(",")) if a.impls else None,
                          rounds=a.rounds, calls=a.calls, anchors=anchors, out=a.out,
                          only=tuple(a.cases.split(",")) if a.cases else None)
    print_table(report)
    print(f"report: {a.out}")
    return int(any(r["ok"] is False and r["kind"] in ("impl", "run") for r in report["rows"]))


if __name__ == "__main__":
    sys.exit(main())
