"""GDN state-slot allocator: hands out slots ``1..max_seqs``; slot 0 is the PAD sentinel and is never handed out.

The same id is the request's row in the head-wise block tables (:mod:`kvjax.sched.blocks`), so one id, with no
``+1`` offset anywhere, addresses a running request's GDN state and its pages.
"""

from __future__ import annotations

from kvjax.config import is_int
from kvjax.errors import DoubleFreeError, SlotExhaustedError

PAD_SLOT = 0


class SlotAllocator:
    """Free list of GDN slots ``1..max_seqs``. ``allocate`` returns the lowest free slot."""

    def __init__(self, max_seqs: int) -> None:
        if not is_int(max_seqs) or max_seqs < 1:
            raise ValueError(f"SlotAllocator: max_seqs must be an int >= 1, got {max_seqs!r}")
        self.max_seqs = max_seqs = int(max_seqs)
        self._free: list[int] = list(range(max_seqs, 0, -1))  # pop() -> lowest slot
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def allocated(self) -> frozenset[int]:
        return frozenset(self._used)

    def allocate(self) -> int:
        """Take a free slot in ``1..max_seqs``; raises :class:`SlotExhaustedError` when none is left."""
        if not self._free:
            raise SlotExhaustedError(f"no free GDN slot: all max_seqs={self.max_seqs} slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot``; raises :class:`DoubleFreeError` for slot 0 (PAD) or a slot that is not allocated, and
        ``ValueError`` for a non-integer (``True`` and ``1.0`` would otherwise pass for slot 1); nothing changes."""
        if not is_int(slot):
            raise ValueError(f"GDN slot must be an int, got {slot!r}")
        slot = int(slot)
        if slot == PAD_SLOT:
            raise DoubleFreeError("cannot free GDN slot 0: it is the PAD sentinel, never allocated")
        if slot not in self._used:
            raise DoubleFreeError(f"GDN slot {slot} is not allocated (double free or outside 1..{self.max_seqs})")
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless free + used == 1..max_seqs, disjoint, and PAD is in neither."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"slot free list holds duplicates: {sorted(self._free)}")
        if free & self._used:
            raise AssertionError(f"slots both free and used: {sorted(free & self._used)}")
        if free | self._used != set(range(1, self.max_seqs + 1)):
            raise AssertionError(f"slots free+used != 1..{self.max_seqs}: free={sorted(free)} used={sorted(self._used)}")
