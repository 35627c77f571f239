"""The notebooks' one size parameter: ``KVJAX_NB_SIZE=small`` (default; CI on 2 CPU cores) or ``gpu``."""

from __future__ import annotations

import os

SIZES = ("small", "gpu")


class Size(str):
    """The chosen size (a ``str``): ``small`` or ``gpu``; ``pick(small=..., gpu=...)`` selects a value."""

    def pick(self, *, small, gpu):
        return small if self == "small" else gpu


def notebook_size(value: str | None = None) -> Size:
    """``value`` or the ``KVJAX_NB_SIZE`` environment variable (default ``small``), validated."""
    raw = value if value is not None else os.environ.get("KVJAX_NB_SIZE", "small")
    raw = raw.strip().lower()
    if raw not in SIZES:
        raise ValueError(f"KVJAX_NB_SIZE must be one of {SIZES}, got {raw!r}")
    return Size(raw)
