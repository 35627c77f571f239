"""What a benchmark case is: the declarations the subject modules (``gdn.py``, ``conv.py``, ``attention.py``,
``mla.py``, ``engine.py``, ``sched_overhead.py``) give to ``benchmarks/runner.py``.

Usage: ``from case import Case, Setup, RunCase`` (``benchmarks/`` on ``sys.path``; a module, not a script).
Imports no jax: the torch anchor process builds the case list too (names and bytes), and a case's arrays are
built only when the runner runs it (:attr:`Case.setup`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

Runner = Callable[[], Any]  # one call of the timed work; returns the arrays compared with the reference


@dataclasses.dataclass
class Setup:
    """A case's inputs, built on the device.

    ``run(impl)`` returns a :data:`Runner` calling the PUBLIC op with ``impl=`` (jitted; state such as a
    donated pool chained from call to call) and doing nothing else on the device (the device timer counts every
    kernel of the call). Its first call starts from the case's fresh state; ``reference()`` returns the same
    outputs from the op's ``impl="reference"`` (its float32 oracle). ``compare`` maps such outputs to the tuple
    of arrays compared (a layer of a pool, finite scores and their mask), only when checking.
    ``anchors`` maps a JAX-side anchor's name (JAX's own Pallas paged attention, cuDNN attention, ...) to a
    factory of its runner, compared with the reference the same way, except those named in ``unchecked``
    (a different computation, e.g. the whole-row walk a SWA batch is compared with: timed, not compared).
    """

    run: Callable[[str], Runner]
    reference: Callable[[], tuple]
    anchors: dict[str, Callable[[], Runner]] = dataclasses.field(default_factory=dict)
    unchecked: tuple[str, ...] = ()
    compare: Callable[[Any], tuple] = lambda out: out if isinstance(out, tuple) else (out,)


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at one shape, timed with each of ``impls`` (backend-table names: ``"pallas"``, ``"mosaic"``,
    ``"triton"``, ``"reference"``, ``"auto"``, ``"interpret"``...).

    ``anchor`` names what the ratio is taken against: an impl of this case, a JAX-side anchor of its
    :class:`Setup`, or a torch-side anchor (``torch:NAME``: measured by the subject's ``torch_anchors`` in the
    ``--anchors-only`` process). ``bytes``: compulsory bytes read + written (compared with a copy of the same
    bytes in the same run); ``flops``: arithmetic of one call; ``tol``: bound on the relative L2 error of each
    output against the reference (one float, or one per output)."""

    name: str
    op: str
    shapes: dict
    impls: tuple[str, ...]
    setup: Callable[[], Setup]
    anchor: str | None = None
    bytes: int = 0
    flops: int = 0
    tol: float | tuple[float, ...] = 2e-2

    def __post_init__(self):
        if not self.impls:
            raise ValueError(f"case {self.name!r}: no implementation to time")
        if self.bytes < 0 or self.flops < 0:
            raise ValueError(f"case {self.name!r}: bytes and flops must be >= 0")


@dataclasses.dataclass(frozen=True)
class RunCase:
    """A measurement that is not one op's call (the engine serving a workload, the scheduler's host time).

    ``measure()`` returns rows with at least ``impl`` (the variant, e.g. ``recycle="timely"``), ``median_ms``
    (the headline time: a step, a ``schedule()`` call), ``ok`` and any other figures; ``anchor`` names the row
    (``impl``) the others are compared with."""

    name: str
    op: str
    shapes: dict
    measure: Callable[[], list[dict]]
    anchor: str | None = None
