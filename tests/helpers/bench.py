"""The benchmark scripts as modules for tests: ``benchmarks/`` on ``sys.path`` while a test module uses them."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@contextlib.contextmanager
def bench_module(name: str):
    """Import ``benchmarks/<name>.py`` as the scripts import each other (``benchmarks/`` first on ``sys.path``);
    on exit the path entry is removed and the module dropped from ``sys.modules`` (a later import is a fresh one)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop(name, None)


def import_bench(name: str):
    """``benchmarks/<name>.py`` imported and :func:`bench_module`'s exit done at once: for a script whose functions
    import no sibling script when called (those need ``benchmarks/`` on the path: use :func:`bench_module`)."""
    with bench_module(name) as module:
        return module
