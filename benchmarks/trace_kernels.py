"""Device time of a ``jax.profiler`` trace by kernel class, per GPU: collectives vs GEMMs vs the rest.

Usage: ``python benchmarks/trace_kernels.py DIR [--steps N]`` (``DIR``: what ``jax.profiler.start_trace(DIR)``
wrote; ``--steps``: how many engine steps the trace holds, to report per step), or
``from trace_kernels import kernel_time_by_class`` (``benchmarks/`` on ``sys.path``, as ``timing.py``).

A kernel's class comes from its name (:func:`classify`): ``collective`` (NCCL kernels, XLA's all-reduce /
all-gather / reduce-scatter / all-to-all / collective-permute), ``gemm`` (cuBLAS / cuBLASLt ``nvjet`` / CUTLASS /
``xmma`` / ``wgmma`` kernels and XLA's GEMM fusions), ``copy`` (memcpy / memset) and ``other`` (elementwise
fusions, the Pallas and Triton kernels). The records are those of ``timing.kernel_records``: every event on a
``Stream`` line of a ``/device:GPU:k`` plane (the ``XLA Ops`` / ``XLA Modules`` lines restate them). Per GPU:
the summed duration of each class, the busy span (first start to last end) and the collectives' share of the
summed kernel time; collectives on their own stream may overlap compute, so shares of the summed time are not
shares of the span.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import re
import sys

CLASSES = ("collective", "gemm", "copy", "other")
_PATTERNS = (
    ("collective", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
                              r"collective[-_]?permute|cross[-_]?device|^psum_", re.I)),  # psum_*: XLA's own
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
    summed over the GPUs / number of GPUs)}``; ``{"gpus": {}}`` where the trace has no device records (a CPU run).
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
                names[ev.name] = names.get(ev.name, 0.0) + ev.duration_ns / 1e6 / steps
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
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    return {"gpus": gpus, "mean": mean,
            "top": [{"name": k[:120], "class": classify(k), "ms": v / n} for k, v in top]}


def module_times(trace_dir: str) -> dict:
    """Per jitted program, from the ``XLA Modules`` line of the latest trace under ``trace_dir`` (each event one
    execution of a program on a GPU): ``{name: {"runs", "span_ms", "kernel_ms", "kernels"}}`` summed over the
    executions and averaged over the GPUs (``span``: the execution's first kernel start to last end as the
    profiler records it; ``kernel_ms`` / ``kernels``: the ``Stream`` records that start inside it), the name without
    its trailing ``(id)``; ``{}`` without device records. What lies between the spans is time the GPU ran nothing
    of these programs: host work, transfers, launches."""
    import jax

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir!r}")
    data = jax.profiler.ProfileData.from_file(max(paths))
    out, planes = {}, 0
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        planes += 1
        modules, kernels = [], []
        for line in plane.lines:
            if line.name == "XLA Modules":
                modules += [(ev.start_ns, ev.start_ns + ev.duration_ns, re.sub(r"\(\d+\)$", "", ev.name))
                            for ev in line.events]
            elif line.name.startswith("Stream"):
                kernels += [(ev.start_ns, ev.duration_ns) for ev in line.events]
        kernels.sort()
        starts = [k[0] for k in kernels]
        for lo, hi, name in modules:
            a, b = bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)
            m = out.setdefault(name, {"runs": 0, "span_ms": 0.0, "kernel_ms": 0.0, "kernels": 0})
            m["runs"] += 1
            m["span_ms"] += (hi - lo) / 1e6
            m["kernel_ms"] += sum(d for _, d in kernels[a:b]) / 1e6
            m["kernels"] += b - a
    for m in out.values():
        for key in m:
            m[key] /= max(planes, 1)
    if planes and not out:  # no program line in this trace: say which lines there are
        lines = sorted({f"{line.name} ({len(list(line.events))})" for plane in data.planes
                        if plane.name.startswith("/device:GPU") for line in plane.lines})
        raise ValueError(f"no 'XLA Modules' line on the GPU planes of {trace_dir!r}; lines: {', '.join(lines)}")
    return out


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
    args = ap.parse_args(argv)
    result = kernel_time_by_class(args.trace_dir, args.steps)
    print(json.dumps(result, indent=1) if args.json else format_classes(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
