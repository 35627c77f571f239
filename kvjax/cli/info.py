"""``python -m kvjax info``: what this machine offers kvjax, and which kernel each op takes.

For every op's backend table it prints the implementations usable on the device and, for each of the table's
example calls, what ``impl="auto"`` takes and why every higher-priority backend declines. ``--device h100``
(or ``h200``, ``a100``, ``cpu``) asks the tables about a device that is not this one.
"""

from __future__ import annotations

import json

import jax

import kvjax
from kvjax import ops
from kvjax.base.device import NAMED, DeviceKind, current_device
from kvjax.errors import UsageError
from kvjax.cli.args import ArgumentParser, fail


def collect(device: DeviceKind | None = None) -> dict:
    """JAX version, devices and, per op: implementations usable on ``device`` and, per example call, the
    ``auto`` choice with every backend's reason to decline (``None`` = it accepts)."""
    device = device or current_device()
    out_ops = {}
    for table in ops.tables():
        examples = {}
        for name, make in table.examples.items():
            args, kwargs = make()
            reasons = table.explain(args, kwargs, device)
            examples[name] = {"auto": next(n for n, why in reasons if why is None),
                              "reasons": {n: why for n, why in reasons}}
        out_ops[table.op] = {"implementations": table.available(device), "examples": examples,
                             "notes": {b.name: b.note for b in table.backends if b.note}}
    return {
        "kvjax": kvjax.__version__,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "asked_for": str(device),
        "ops": out_ops,
    }


def main(argv: list[str]) -> int:
    """CLI entry of ``python -m kvjax info``: prints :func:`collect` as text (or JSON); returns 0 (2 with one line
    on stderr for a bad argument)."""
    parser = ArgumentParser(prog="python -m kvjax info")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--device", choices=["current", *NAMED], default="current",
                        help="ask the backend tables about this device (default: this machine's)")
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        return fail("info", e)
    info = collect(None if args.device == "current" else NAMED[args.device])
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"kvjax {info['kvjax']}  jax {info['jax']}  backend {info['backend']}")
    for d in info["devices"]:
        print(f"  device: {d}")
    print(f"kernel choice for: {info['asked_for']}")
    for op, entry in info["ops"].items():
        print(f"\n{op}: {', '.join(entry['implementations'])}")
        for impl, note in entry["notes"].items():
            print(f"  [{impl}] {note}")
        for name, ex in entry["examples"].items():
            print(f"  {name}: auto -> {ex['auto']}")
            for impl, why in ex["reasons"].items():
                if impl == ex["auto"]:
                    break
                print(f"      {impl} declines: {why}")
    return 0
