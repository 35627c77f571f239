"""``python -m kvjax <command>`` (or ``kvjax <command>``): the project's command-line entry point.

Commands:
  info      JAX version, devices, each op's backend table: what impl="auto" takes and why the others decline.
  simulate  Host-only capacity simulation of the scheduler (recycle, pool and prefix-caching policies).
  run       The main job: a toy Qwen3.5 with SWA heads served with recycle none vs timely (+ prefix caching).

A bad command or argument prints one line on stderr and exits with status 2, before any work.
"""

from __future__ import annotations

import importlib
import sys

from kvjax.cli.args import ArgumentParser, fail

# command -> (module with a ``main(argv) -> int``, one-line help)
COMMANDS = {
    "info": ("kvjax.cli.info", "JAX version, devices, each op's kernel choice and why"),
    "simulate": ("kvjax.cli.simulate", "host-only capacity simulation of recycle, pool and prefix-caching policies"),
    "run": ("kvjax.cli.run", "main job: toy Qwen3.5 with SWA heads served with recycle none vs timely"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a command's ``main``; returns the exit status (2: no or
    unknown command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog="python -m kvjax", description="kvjax command line: python -m kvjax <command> "
                            "[options]; python -m kvjax <command> --help lists its options.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    try:
        args = parser.parse_args(argv[:1])
    except ValueError as e:
        return fail("python -m kvjax", e)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.main(argv[1:]) or 0)

