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
    the path entry is removed on exit."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
