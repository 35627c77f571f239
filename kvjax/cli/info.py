"""``python -m kvjax info``: what this machine offers kvjax, and which kernel each op takes.

For every op's backend table it prints the implementations usable on the device and, for each of the table's
example calls, what ``impl="auto"`` takes and why every higher-priority backend declines. ``--device h100``
(or ``h200``, ``a100``, ``cpu``) asks the tables about a device that is not this one.
"""

from __future__ import annotations

import jax

import kvjax
from kvjax import ops
from kvjax.base.device import NAMED, DeviceKind, current_device
from kvjax.errors import UsageError
from kvjax.cli.args import ArgumentParser, fail, json_destination
from kvjax.cli.output import provenance, write_json


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


def _declines(example: dict) -> dict[str, str]:
    """``{impl: reason}`` of the backends tried before ``auto``'s choice on one example call."""
    out = {}
    for impl, why in example["reasons"].items():
        if impl == example["auto"]:
            break
        out[impl] = why
    return out


def common_declines(info: dict) -> dict[str, list[str]]:
    """``{reason: ["impl in op", ...]}`` for every backend that declines *every* example call of its op with the same
    reason (on a CPU: each GPU kernel's "needs a GPU"); :func:`main` prints these once instead of per call."""
    out: dict[str, list[str]] = {}
    for op, entry in info["ops"].items():
        declined = [_declines(ex) for ex in entry["examples"].values()]
        for impl in declined[0] if declined else ():
            whys = {d.get(impl) for d in declined}
            if len(whys) == 1 and None not in whys:
                out.setdefault(whys.pop(), []).append(f"{impl} in {op}")
    return out


def build_parser() -> ArgumentParser:
    """The ``info`` command's arguments (``--help`` shows each default)."""
    parser = ArgumentParser(prog="python -m kvjax info",
                            description="What this machine offers kvjax: JAX version, devices and, for every op's "
                                        "backend table, which implementation impl='auto' takes on each example call "
                                        "and why the others decline.")
    parser.add_argument("--json", metavar="FILE", type=json_destination,
                        help="also write everything as JSON, with the run's provenance (versions, commit, device, "
                             "date), to FILE; '-' writes it to standard output instead of the text")
    parser.add_argument("--device", choices=["current", *NAMED], default="current",
                        help="ask the backend tables about this device instead of this machine's")
    return parser


def main(argv: list[str]) -> int:
    """CLI entry of ``python -m kvjax info``: prints :func:`collect` as text (and/or JSON); returns 0 (2 with one
    line on stderr for a bad argument)."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return fail("info", e)
    info = collect(None if args.device == "current" else NAMED[args.device])
    if args.json:
        device = f"{jax.local_devices()[0].device_kind} ({jax.default_backend()})"
        write_json(args.json, {"meta": provenance("info", argv, device=device, seed=None), **info})
        if args.json == "-":
            return 0
    print(f"kvjax {info['kvjax']}  jax {info['jax']}  backend {info['backend']}")
    for d in info["devices"]:
        print(f"  device: {d}")
    print(f"kernel choice for: {info['asked_for']}")
    common = common_declines(info)
    if common:
        print("\ndeclined on every example call of the op (listed once here, not under each call):")
        for why, where in common.items():
            print(f"  {why}: {', '.join(where)}")
    grouped = {(w.split(" in ", 1)[1], w.split(" in ", 1)[0]) for ws in common.values() for w in ws}
    for op, entry in info["ops"].items():
        print(f"\n{op}: {', '.join(entry['implementations'])}")
        for impl, note in entry["notes"].items():
            print(f"  [{impl}] {note}")
        for name, ex in entry["examples"].items():
            print(f"  {name}: auto -> {ex['auto']}")
            for impl, why in ex["reasons"].items():
                if impl == ex["auto"]:
                    break
                if (op, impl) not in grouped:
                    print(f"      {impl} declines: {why}")
    return 0
