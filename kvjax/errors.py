"""Named kvjax errors. All derive from :class:`KvjaxError`, itself a :class:`ValueError`."""

from __future__ import annotations


class KvjaxError(ValueError):
    """Base class of every error kvjax raises on bad input or exhausted resources."""


class SlotExhaustedError(KvjaxError):
    """No free GDN state slot is left."""


class DoubleFreeError(KvjaxError):
    """A slot or page was freed that is not currently allocated (or is the PAD slot)."""


class OutOfPagesError(KvjaxError):
    """The page pool cannot satisfy an allocation."""


class RequestTooLongError(KvjaxError):
    """A request can never fit in the cache (longer than a block-table row or the whole pool)."""


class UnknownImplError(KvjaxError):
    """An op was asked for an implementation that does not exist (on this backend)."""


class CheckpointError(KvjaxError):
    """A checkpoint or model config cannot be loaded (unknown architecture, missing or mis-shaped tensor)."""


class InvalidPlanError(KvjaxError):
    """A step plan (block tables, slot ids, slot mapping) fails validation before a step."""


class UsageError(KvjaxError):
    """A command-line argument is malformed, out of range, or asks for more than this machine holds."""
