"""Where a kernel's time goes, from the GPU's hardware counters: Nsight Compute (``ncu``) on one call of a case.

Usage (a GPU machine with ``ncu``, ``kvjax`` on ``PYTHONPATH``): ``python benchmarks/ncu_probe.py CASE [CASE ...]
[--out DIR]``. Each case runs in a child process under ``ncu --profile-from-start off``: the child builds the
inputs, calls the case twice (compile, warm-up) and profiles only the third call, between ``cuProfilerStart`` and
``cuProfilerStop`` (so neither the input generation nor the compiler's autotuning is profiled). ``ncu`` keeps the
GPU's clocks as they are (``--clock-control none``, as the device notes ask). Per case it writes under ``--out``
(default ``benchmarks/out/ncu``) the report ``CASE.ncu-rep``, the details page ``CASE.txt`` and the per-instruction
source page ``CASE.sass.csv``, and prints a markdown summary (:func:`report`):

- per kernel of the call (those over 2% of the call's kernel time): duration, grid, registers a thread, shared
  memory a block, theoretical / achieved occupancy, issued IPC, instructions issued, DRAM and SM throughput, local
  memory spilling requests, and the warp-state breakdown (cycles a warp waits per issued instruction, by reason);
- per kernel with a source page: the SASS opcodes by share of stall samples and of executed instructions, and the
  lines with the most stall samples.

Cases (:data:`CASES`; shapes as the other benchmarks of the same op):

- ``decode:PAGE[:fp8]``: paged decode B=64, L=4096, Hq=32, Hkv=8, D=128 (``attention.py``'s batch) through the
  split-KV kernel, bf16 pages or fp8 pages with per-page scales;
- ``prefill:PAGE[:PRODUCTS]``: paged prefill T=4096, H=32, D=128, causal (``fp8_prefill.py``'s batch) through the
  Mosaic GPU kernel, bf16 pages, or fp8 pages with ``fp8_products`` PRODUCTS (``e4m3x2_qk`` / ``e4m3_qk``);
- ``gdn:I``: the chunked gated delta rule, ``chunk_gated_delta_rule(impl="auto")`` jitted, at FlashQLA's shape
  ``gdn.FLASHQLA_SHAPES[I]`` (``gdn.py``'s recipe).

Without ``ncu`` on the PATH it says so and exits 2. The parsers (:func:`parse_details`, :func:`parse_source`) read
ncu's text details page and source CSV and are tested on CPU with excerpts of real reports.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = {"decode": "PAGE[:fp8]", "prefill": "PAGE[:PRODUCTS]", "gdn": "I"}
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats",
            "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "InstructionStats", "SourceCounters")
SUMMARY_METRICS = (  # (label, ncu metric name) of the per-kernel table
    ("regs", "Registers Per Thread"), ("smem KB", "Dynamic Shared Memory Per Block"),
    ("occ theor %", "Theoretical Occupancy"), ("occ achieved %", "Achieved Occupancy"),
    ("IPC", "Issued Ipc Active"), ("instructions", "Issued Instructions"), ("DRAM %", "DRAM Throughput"),
    ("SM %", "Compute (SM) Throughput"), ("spill requests", "Local Memory Spilling Requests"),
    ("cycles / instr", "Warp Cycles Per Issued Instruction"))
_UNITS = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6,  # durations in us, shared memory in KB (ncu scales units)
          "byte/block": 1 / 1024, "Kbyte/block": 1.0, "Mbyte/block": 1024.0}
_KERNEL_LINE = re.compile(r"^  (\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context")
_NUMBER = re.compile(r"^-?[\d,]*\.?\d+$")


def parse_case(text: str) -> tuple[str, tuple[str, ...]]:
    """``"decode:16:fp8"`` -> ``("decode", ("16", "fp8"))``; ``ValueError`` naming the case for an unknown kind or
    a malformed argument."""
    kind, *args = text.split(":")
    if kind not in CASES:
        raise ValueError(f"unknown case {text!r}: kinds are " + ", ".join(f"{k}:{a}" for k, a in CASES.items()))
    if not args or not args[0].isdigit():
        raise ValueError(f"case {text!r} needs {kind}:{CASES[kind]} (a number first)")
    if kind == "decode" and args[1:] not in ([], ["fp8"]):
        raise ValueError(f"case {text!r}: decode takes decode:PAGE or decode:PAGE:fp8")
    if kind == "prefill" and len(args) > 2:
        raise ValueError(f"case {text!r}: prefill takes prefill:PAGE[:PRODUCTS]")
    if kind == "gdn" and len(args) != 1:
        raise ValueError(f"case {text!r}: gdn takes gdn:I")
    return kind, tuple(args)


def build(text: str):
    """The case's call: a function of no arguments (inputs built and closed over; GPU only)."""
    import jax

    kind, args = parse_case(text)
    if kind == "decode":
        from attention import _decode_batch, _paged_auto, _quantise
        from fp8_variants import _checked_call

        from kvjax.pallas.paged import decode

        q, kp, vp, bt, _, sl, cu = _decode_batch(64, 4096, 32, 8, 128, int(args[0]), seed=1)
        if args[1:] != ("fp8",):
            f = jax.jit(lambda *a: _paged_auto(*a, cu=cu))
            return lambda: f(q, kp, vp, bt, sl)
        (kp8, ks), (vp8, vs) = _quantise(kp), _quantise(vp)
        call8 = _checked_call(q, kp8, vp8, bt, sl, cu, scales=(ks, vs))
        return lambda: decode.paged_decode(call8)
    if kind == "prefill":
        from fp8_prefill import _batch

        from kvjax.ops.attention import PagedAttentionCall, check_call
        from kvjax.pallas.paged import prefill_mgpu

        q, (kp, vp), ((kp8, ks), (vp8, vs)), bt, sl, cu = _batch(4096, int(args[0]))
        if len(args) == 1:
            c16 = check_call(PagedAttentionCall(q, kp, vp, bt, sl, cu))
            return lambda: prefill_mgpu.paged_prefill_mgpu(c16)
        c8 = check_call(PagedAttentionCall(q, kp8, vp8, bt, sl, cu, k_scale=ks, v_scale=vs))
        return lambda: prefill_mgpu.paged_prefill_mgpu(c8, fp8_products=args[1])
    from gdn import FLASHQLA_SHAPES, flashqla_case

    from kvjax.ops import gdn

    seqlens, hk, hv = FLASHQLA_SHAPES[int(args[0])]
    q, k, v, g, beta, h0, cu, scale, _ = flashqla_case(seqlens, hk, hv, reference=False)
    f = jax.jit(lambda q, k, v, g, b, h: gdn.chunk_gated_delta_rule(
        q, k, v, g, b, cu_seqlens=cu, initial_state=h, scale=scale, impl="auto"))
    return lambda: f(q, k, v, g, beta, h0)


def _profiler(on: bool) -> None:
    """``cuProfilerStart`` / ``cuProfilerStop`` through the driver, on the device's primary context (the one JAX
    uses) made current on this thread."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    cuda.cuInit(0)
    cuda.cuCtxGetCurrent(ctypes.byref(ctx))
    if not ctx.value:
        dev = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), 0)
        cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        cuda.cuCtxSetCurrent(ctx)
    rc = cuda.cuProfilerStart() if on else cuda.cuProfilerStop()
    if rc:
        raise RuntimeError(f"cuProfiler{'Start' if on else 'Stop'} returned CUDA error {rc}")


def child(text: str) -> None:
    """Run the case twice, then once more between profiler start and stop (the call ``ncu`` records)."""
    import jax

    fn = build(text)
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    _profiler(True)
    jax.block_until_ready(fn())
    _profiler(False)


def parse_details(text: str) -> list[dict]:
    """ncu's text details page -> per kernel ``{"name", "grid", "block", "metrics": {name: (value, unit)}}`` (a
    value a float, thousands separators dropped; the last of repeated names wins). Rule lines, tables' headers and
    the advice paragraphs are skipped."""
    kernels: list[dict] = []
    for line in text.splitlines():
        m = _KERNEL_LINE.match(line)
        if m:
            dims = tuple(int(x) for x in m.groups()[1:])
            kernels.append({"name": m.group(1), "grid": dims[:3], "block": dims[3:], "metrics": {}})
            continue
        if not kernels or not line.startswith("    ") or line.startswith("     "):
            continue
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) in (2, 3) and _NUMBER.match(parts[-1]) and parts[0] != "Metric Name":
            kernels[-1]["metrics"][parts[0]] = (float(parts[-1].replace(",", "")),
                                                parts[1] if len(parts) == 3 else "")
    return kernels


def parse_source(text: str) -> list[dict]:
    """ncu's source page as CSV (``--page source --csv --print-source sass``) -> per kernel ``{"name", "lines":
    [(sass, stall samples, executed)]}`` (executed: warp-level instructions)."""
    kernels: list[dict] = []
    header: list[str] | None = None
    for row in csv.reader(io.StringIO(text)):
        if row and row[0] == "Kernel Name":
            kernels.append({"name": row[1] if len(row) > 1 else "?", "lines": []})
            header = None
        elif row and row[0] == "Address":
            header = row
        elif header and kernels and len(row) == len(header):
            rec = dict(zip(header, row))
            kernels[-1]["lines"].append((rec["Source"].strip(), _num(rec.get("Warp Stall Sampling (All Samples)")),
                                         _num(rec.get("Instructions Executed"))))
    return kernels


def _num(x) -> float:
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers: ``"@!P4 NANOSLEEP.SYNCS 0x98"`` ->
    ``"NANOSLEEP"``."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def source_summary(kernel: dict, top: int = 12) -> str:
    """Markdown: the opcodes by share of stall samples (with their share of executed instructions) and the
    ``top`` lines with the most samples."""
    lines = kernel["lines"]
    samples = sum(s for _, s, _ in lines) or 1.0
    executed = sum(e for _, _, e in lines) or 1.0
    by_op, by_op_exec = collections.Counter(), collections.Counter()
    for sass, s, e in lines:
        by_op[opcode(sass)] += s
        by_op_exec[opcode(sass)] += e
    out = [f"\n#### {kernel['name']}: {samples:.0f} stall samples, {executed:.0f} instructions executed",
           "| opcode | stall samples | executed |", "|---|---:|---:|"]
    out += [f"| {op} | {100 * s / samples:.1f}% | {100 * by_op_exec[op] / executed:.1f}% |"
            for op, s in by_op.most_common(15)]
    out += ["", "| samples | executed | SASS |", "|---:|---:|---|"]
    out += [f"| {s:.0f} | {e:.0f} | `{sass[:90]}` |" for sass, s, e in sorted(lines, key=lambda r: -r[1])[:top]]
    return "\n".join(out)


def scaled(metrics: dict, name: str) -> float | None:
    """A metric in the summary's units (durations in us, shared memory in KB, whatever unit ncu printed), None if
    absent."""
    if name not in metrics:
        return None
    value, unit = metrics[name]
    return value * _UNITS.get(unit, 1.0)


def report(case: str, details: list[dict], source: list[dict], min_share: float = 0.02) -> str:
    """Markdown summary of one case (the module doc's list)."""
    durations = [scaled(k["metrics"], "Duration") or 0.0 for k in details]
    total = sum(durations) or 1.0
    out = [f"\n### {case}: {len(details)} kernels, {total:.1f} us of kernel time",
           "| kernel | us | grid | " + " | ".join(label for label, _ in SUMMARY_METRICS) + " |",
           "|---|---:|---|" + "---:|" * len(SUMMARY_METRICS)]
    big = [(k, d) for k, d in zip(details, durations) if d >= min_share * total]
    for k, d in big:
        values = [scaled(k["metrics"], name) for _, name in SUMMARY_METRICS]
        cells = ["-" if v is None else f"{v:g}" for v in values]
        grid = "x".join(str(g) for g in k["grid"])
        out.append(f"| {k['name'][:60]} | {d:.1f} | {grid} | " + " | ".join(cells) + " |")
    for k, _ in big:
        stalls = sorted(((name[6:], v) for name, (v, _) in k["metrics"].items()
                         if name.startswith("Stall ") and v >= 0.05), key=lambda x: -x[1])
        if stalls:
            out.append(f"\n{k['name'][:60]}: a warp waits per issued instruction, by reason (cycles): "
                       + ", ".join(f"{name} {v:.2f}" for name, v in stalls))
    names = {k["name"] for k, _ in big}
    out += [source_summary(s) for s in source if s["name"] in names and s["lines"]]
    return "\n".join(out)


def probe(case: str, out_dir: str) -> str:
    """Profile one case under ``ncu`` and return its :func:`report` (files under ``out_dir``, module doc)."""
    parse_case(case)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, case.replace(":", "_"))
    cmd = ["ncu", "--clock-control", "none", "--target-processes", "all", "--profile-from-start", "off",
           "--import-source", "no", "-f", "-o", stem]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, os.path.abspath(__file__), "--child", case]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode or not os.path.exists(stem + ".ncu-rep"):
        raise RuntimeError(f"ncu on {case} failed (exit {run.returncode}): {(run.stdout + run.stderr)[-2000:]}")
    details = subprocess.run(["ncu", "-i", stem + ".ncu-rep", "--page", "details", "--print-details", "all"],
                             capture_output=True, text=True, check=True).stdout
    source = subprocess.run(["ncu", "-i", stem + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                            capture_output=True, text=True, check=True).stdout
    with open(stem + ".txt", "w") as fh:
        fh.write(details)
    with open(stem + ".sass.csv", "w") as fh:
        fh.write(source)
    return report(case, parse_details(details), parse_source(source))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+", help="; ".join(f"{k}:{a}" for k, a in CASES.items()))
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "ncu"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.cases[0])
        return 0
    for case in args.cases:
        parse_case(case)
    if shutil.which("ncu") is None:
        print("ncu (Nsight Compute) is not on the PATH: this tool needs a GPU machine with it", file=sys.stderr)
        return 2
    for case in args.cases:
        print(probe(case, args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
