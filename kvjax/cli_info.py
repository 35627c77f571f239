"""``python -m kvjax info``: what this machine offers kvjax."""

from __future__ import annotations

import argparse
import json

import jax

import kvjax
from kvjax import ops
from kvjax.state import gdn_ops as gdn_state  # noqa: F401  (registers the pool-integrated GDN ops)


def collect() -> dict:
    """JAX version, backend, devices and the implementations of every op usable here."""
    backend = jax.default_backend()
    return {
        "kvjax": kvjax.__version__,
        "jax": jax.__version__,
        "backend": backend,
        "devices": [str(d) for d in jax.devices()],
        "ops": {op: ops.available(op, backend) for op in ops.dispatch.ops()},
    }


def main(argv: list[str]) -> int:
    """CLI entry of ``python -m kvjax info``: prints :func:`collect` as a table (or JSON); returns 0."""
    parser = argparse.ArgumentParser(prog="python -m kvjax info")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"kvjax {info['kvjax']}  jax {info['jax']}  backend {info['backend']}")
    for d in info["devices"]:
        print(f"  device: {d}")
    width = max((len(op) for op in info["ops"]), default=10)
    print(f"{'op':<{width}}  implementations")
    for op, impls in info["ops"].items():
        print(f"{op:<{width}}  {', '.join(impls)}")
    return 0
