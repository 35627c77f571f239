"""Checked command-line arguments of ``python -m kvjax``: every bad value fails before any work, in one line.

:class:`ArgumentParser` is ``argparse``'s, except that a bad argument raises :class:`~kvjax.errors.UsageError`
(a ``ValueError``) instead of printing the usage and exiting, so a command's ``main`` prints one line and returns
exit status 2 (:func:`fail`). The ``type=`` factories below reject a bad value naming it (``--page-size 0``,
``--scale nan``, ``--recycle ,``), :func:`writable_file` refuses an output path that cannot be written before the
run it would record, and :func:`check_memory` refuses a size that this machine cannot hold.

Stdlib only (never imports jax), so that ``simulate``, ``run``, ``info`` and the dispatcher share it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Sequence

from kvjax.errors import UsageError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default after its text (``(default: none,timely)``); flags off by default and
    defaults of ``None`` (the text says what happens) show none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or default is False or default is argparse.SUPPRESS
                or not action.option_strings):
            return text
        shown = ",".join(str(x) for x in default) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise :class:`UsageError` (one line, no usage dump, no exit), and
    whose ``--help`` shows every flag's default (:class:`HelpFormatter`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)

    def given(self, argv: Sequence[str]) -> set[str]:
        """The destinations of the options ``argv`` sets explicitly (abbreviations included), to refuse a flag
        that a mode would ignore. ``argv`` must already parse."""
        saved = [(a, a.default) for a in self._actions]
        try:
            for a, _ in saved:
                a.default = argparse.SUPPRESS
            return set(vars(self.parse_args(argv)))
        finally:
            for a, default in saved:
                a.default = default


def fail(command: str, err: Exception) -> int:
    """Print ``command: err`` as one line on stderr; returns the exit status 2."""
    print(f"{command}: {' '.join(str(err).split())}", file=sys.stderr)
    return 2


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """``type=`` for an int in ``[minimum, maximum]``."""
    what = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


def number_in(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False,
              noun: str = "number") -> Callable[[str], float]:
    """``type=`` for a finite float in the interval from ``low`` to ``high`` (ends open as asked); ``noun``
    names the value in the message (``must be a finite scale > 0``)."""
    what = f"a finite {noun} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if high == math.inf:
        what = f"a finite {noun} {'>' if low_open else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


def comma_list(item: Callable[[str], object] | Sequence[str]) -> Callable[[str], list]:
    """``type=`` for a non-empty comma list without repeats; ``item`` is a ``type=`` function or the choices."""
    choices = None if callable(item) else tuple(item)

    def parse(text: str) -> list:
        parts = [x.strip() for x in text.split(",")]
        if not text.strip() or any(not x for x in parts):
            raise argparse.ArgumentTypeError(f"must be a comma list without empty entries, got {text!r}")
        if choices is not None:
            bad = [x for x in parts if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(choices)} (got {text!r})")
            values = parts
        else:
            values = [item(x) for x in parts]
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"has a repeated entry: {text!r}")
        return values

    return parse


def writable_file(text: str) -> str:
    """``type=`` for an output file that can be created or overwritten (checked now, written after the run)."""
    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: directory {parent!r} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    if not os.path.exists(path) and not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: directory {parent!r} is not writable")
    existed = os.path.exists(path)
    try:  # what access() cannot tell (root in /proc, a read-only mount): open it, leave it as it was
        with open(path, "a" if existed else "x"):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {err.strerror or err}") from None
    if not existed:
        os.remove(path)
    return text


def json_destination(text: str) -> str:
    """``type=`` for ``--json FILE``: ``-`` is standard output, anything else a :func:`writable_file`."""
    return text if text == "-" else writable_file(text)


def physical_memory() -> int | None:
    """Bytes of RAM of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_memory(needed: float, what: str, available: int | None = None, where: str = "host memory") -> None:
    """Raise :class:`UsageError` if about ``needed`` bytes for ``what`` exceed ``available`` bytes of ``where``
    (default: this machine's RAM; no check if unknown)."""
    available = physical_memory() if available is None else available
    if available is not None and needed > available:
        raise UsageError(f"{what} needs about {_gib(needed)} of {where}, this machine has {_gib(available)}: "
                         "use a smaller size")


def _gib(n: float) -> str:
    return f"{n / 2**40:.1f} TiB" if n >= 2**40 else f"{n / 2**30:.1f} GiB"
