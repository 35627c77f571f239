"""Verification bursts (issue #36) against plain decoding and single MTP verification steps, side by side.

Usage (GPU): ``python benchmarks/spec_burst.py [--rows 1,16,64] [--json out.json]`` (``kvjax`` on ``PYTHONPATH``);
``--cpu`` / ``--smoke`` as :mod:`spec` (``benchmarks/spec.py``), whose model, runs and columns this is: the same
copy toy, MTP layer and idle GDN layer, with its modes replaced by :data:`MODES` (plain decoding with the engine's
defaults; the MTP drafter in single verification steps, ``decode_burst=1``; the MTP drafter in verification bursts
of the engine's default ``decode_burst``, under the rule and with it off).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import spec  # noqa: E402  (benchmarks/spec.py)

MODES = (
    ("plain", None, {}, None),
    ("mtp K={k}", dict(method="mtp"), dict(decode_burst=1), "each"),
    ("mtp K={k} burst", dict(method="mtp"), dict(decode_burst="auto"), "each"),
    ("mtp K={k} burst rule off", dict(method="mtp", flat_tokens=None), dict(decode_burst="auto"), "max"),
)


def main(argv=None) -> dict:
    base = spec.modes
    spec.modes = lambda ks, table=MODES: base(ks, table)
    try:
        return spec.main(argv)
    finally:
        spec.modes = base


if __name__ == "__main__":
    main()
