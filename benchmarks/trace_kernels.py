"""Device time of a ``jax.profiler`` trace by kernel class, per GPU: collectives vs GEMMs vs the rest.

Usage: ``python benchmarks/trace_kernels.py DIR [--steps N]`` (``DIR``: what ``jax.profiler.start_trace(DIR)``
wrote; ``--steps``: how many engine steps the trace holds, to report per step), or
``from trace_kernels import kernel_time_by_class`` (``benchmarks/`` on ``sys.path``, as ``timing.py``).

A kernel's class comes from its name (:func:`classify`): ``collective`` (NCCL kernels, XLA's all-reduce /
all-gather / reduce-scatter / all-to-all / collective-permute, kvjax's one-shot all-reduce kernel and the
multi-GPU barrier XLA launches before it), ``gemm`` (cuBLAS / cuBLASLt ``nvjet`` / CUTLASS /
``xmma`` / ``wgmma`` kernels and XLA's GEMM fusions), ``copy`` (memcpy / memset) and ``other`` (elementwise
fusions, the Pallas and Triton kernels). The records are those of ``timing.kernel_records``: every event on a
``Stream`` line of a ``/device:GPU:k`` plane (the ``XLA Ops`` / ``XLA Modules`` lines restate them). Per GPU:
the summed duration of each class, the busy span (first start to last end) and the collectives' share of the
summed kernel time; collectives on their own stream may overlap compute, so shares of the summed time are not
shares of the span.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys

CLASSES = ("collective", "gemm", "copy", "other")
_PATTERNS = (
    ("collective", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
                              r"collective[-_]?permute|cross[-_]?device|^psum_|"  # psum_*: XLA's own
                              r"multi[-_]?gpu[-_]?barrier", re.I)),  # before a Mosaic GPU kernel that communicates
    ("gemm", re.compile(r"gemm|cublas|cutlass|nvjet|xmma|wgmma|matmul|\bdot\b|dot[-_]fusion|_dot_|^dot", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy[-_]?engine", re.I)),
)


def classify(name: str) -> str:
    """The class of a kernel record's name: one of :data:`CLASSES` (first matching pattern wins)."""
    for cls, pattern in _PATTERNS:
        if pattern.search(name):
            return cls
    return "other"


def kernel_time_by_class(trace_dir: str, steps: int = 1) -> dict:
    """Per GPU plane of the trace under ``trace_dir``: ``{"gpus": {plane: {"ms": {class: ms per step},
    "kernels": {class: records per step}, "span_ms": busy span per step, "collective_share": collective / all}},
    "mean": the same figures averaged over the GPUs, "top": the 12 longest kernels (name, class, ms per step,
    summed over the GPUs / number of GPUs), "names": {name: {"count", "ms"} per step and GPU}}``; ``{"gpus": {}}`` where the trace has no device records (a CPU run).
    ``steps``: what the trace holds, so every time is per step."""
    import jax

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir!r}")
    data = jax.profiler.ProfileData.from_file(max(paths))  # the latest trace
    gpus, names = {}, {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        ms = dict.fromkeys(CLASSES, 0.0)
        count = dict.fromkeys(CLASSES, 0)
        starts, ends = [], []
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                cls = classify(ev.name)
                ms[cls] += ev.duration_ns / 1e6 / steps
                count[cls] += 1
                starts.append(ev.start_ns)
                ends.append(ev.start_ns + ev.duration_ns)
                c, t = names.get(ev.name, (0, 0.0))
                names[ev.name] = (c + 1, t + ev.duration_ns / 1e6 / steps)
        total = sum(ms.values())
        gpus[plane.name] = {"ms": ms, "kernels": {c: n / steps for c, n in count.items()},
                            "span_ms": (max(ends) - min(starts)) / 1e6 / steps if ends else 0.0,
                            "total_ms": total, "collective_share": ms["collective"] / total if total else None}
    if not gpus:
        return {"gpus": {}}
    n = len(gpus)
    mean = {"ms": {c: sum(g["ms"][c] for g in gpus.values()) / n for c in CLASSES},
            "span_ms": sum(g["span_ms"] for g in gpus.values()) / n,
            "total_ms": sum(g["total_ms"] for g in gpus.values()) / n}
    mean["collective_share"] = mean["ms"]["collective"] / mean["total_ms"] if mean["total_ms"] else None
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:12]
    return {"gpus": gpus, "mean": mean,
            "top": [{"name": k[:120], "class": classify(k), "ms": v / n} for k, (_, v) in top],
            "names": {k: {"count": c / steps / n, "ms": v / n} for k, (c, v) in names.items()}}


def busy_time(trace_dir: str) -> dict:
    """How busy the GPUs were over the latest trace under ``trace_dir``, averaged over the GPU planes: ``kernels``
    (records on the ``Stream`` lines: kernels and device copies), ``kernel_ms`` (their summed durations),
    ``busy_ms`` (the union of their intervals: time some record ran) and ``span_ms`` (first start to last end);
    ``{}`` without device records. The wall of the traced work minus ``busy_ms`` is time the GPU ran nothing: host
    work, launches, waits. (jax 0.11's GPU traces have no per-program line, so per-program spans are not read.)"""
    import jax

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir!r}")
    data = jax.profiler.ProfileData.from_file(max(paths))
    rows = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        ivs = sorted((ev.start_ns, ev.start_ns + ev.duration_ns) for line in plane.lines
                     if line.name.startswith("Stream") for ev in line.events)
        if not ivs:
            continue
        busy, (lo, hi) = 0, ivs[0]
        for a, b in ivs[1:]:
            if a > hi:
                busy, lo, hi = busy + hi - lo, a, b
            else:
                hi = max(hi, b)
        busy += hi - lo
        rows.append(dict(kernels=len(ivs), kernel_ms=sum(b - a for a, b in ivs) / 1e6, busy_ms=busy / 1e6,
                         span_ms=(max(b for _, b in ivs) - ivs[0][0]) / 1e6))
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def format_classes(result: dict) -> str:
    """One line per GPU (and the mean): ms per step of each class, the span and the collectives' share."""
    if not result["gpus"]:
        return "no device records in the trace (a CPU run)"
    rows = list(result["gpus"].items()) + [("mean", result["mean"])]
    lines = [f"{'gpu':16} " + " ".join(f"{c:>10}" for c in CLASSES) + f" {'total':>8} {'span':>8} {'coll %':>7}"]
    for name, g in rows:
        share = g["collective_share"]
        lines.append(f"{name[-16:]:16} " + " ".join(f"{g['ms'][c]:10.3f}" for c in CLASSES)
                     + f" {g['total_ms']:8.3f} {g['span_ms']:8.3f} {'-' if share is None else f'{100 * share:6.1f}':>7}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="device time of a jax.profiler trace by kernel class, per GPU")
    ap.add_argument("trace_dir")
    ap.add_argument("--steps", type=int, default=1, help="engine steps the trace holds (times are per step)")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    ap.add_argument("--names", type=int, default=0, help="also the N kernel names run most often (per step: count "
                    "and ms)")
    args = ap.parse_args(argv)
    result = kernel_time_by_class(args.trace_dir, args.steps)
    print(json.dumps(result, indent=1) if args.json else format_classes(result))
    if args.names and result["gpus"]:
        for name, r in sorted(result["names"].items(), key=lambda kv: -kv[1]["count"])[: args.names]:
            print(f"{r['count']:8.2f} {r['ms'] * 1e3:9.1f} us  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
