"""The host tier of the prefix cache: a byte budget, ids, LRU order and the copy log of spilled blocks.

With a host tier the prefix cache (:mod:`kvjax.sched.prefix_cache`; its host side :mod:`kvjax.sched.prefix_host`)
does not drop what it evicts from the device: an idle cached page (one head's block, every layer and role) or a
GDN checkpoint is *spilled* to host memory and gets a host id; a later match may use it, and attaching it *loads*
it back into a fresh device page (checkpoint slot). A block's head is on the device (``entry.pages[h] >= 0``), on
the host (``entry.host[h] >= 0``) or in flight (a copy of this log not yet executed), never two of these at once:
the cache moves its record when it logs the copy.

This module holds what the cache needs on the host side, in numpy and Python only (no data moves here): the
budget (``capacity_bytes``; a page costs ``page_bytes``, a checkpoint ``ckpt_bytes``), fresh host ids (never
reused, so an id names one spilled copy), the LRU order of the entries holding host data (the cache evicts the
least recently used one when a spill needs room), and the **copy log**: the copies logged since the last
:meth:`HostTier.take`, in order. The engine executes a step's log in order before it dispatches the step
(:mod:`kvjax.engine.host_tier`), so every copy lands before the step reads it, spills read a device page before
any later load or step overwrites it, and a load may read a copy spilled earlier in the same log.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from kvjax.config import is_int

KINDS = ("out", "in", "drop")  # device -> host, host -> device, forget host copies


@dataclasses.dataclass(frozen=True)
class CopyOp:
    """One group of copies of the log (all of one kind).

    ``out``: device page ``pages_dev[k]`` -> host id ``pages_host[k]``, checkpoint slot ``ckpts_dev[j]`` -> host
    id ``ckpts_host[j]``; ``in``: the reverse (the host copies are consumed); ``drop``: the host copies
    ``pages_host`` / ``ckpts_host`` are forgotten (``*_dev`` empty)."""

    kind: str
    pages_dev: np.ndarray  # i64[k]
    pages_host: np.ndarray  # i64[k]
    ckpts_dev: np.ndarray  # i64[c]
    ckpts_host: np.ndarray  # i64[c]

    @property
    def num_pages(self) -> int:
        return int(self.pages_host.size)

    @property
    def num_ckpts(self) -> int:
        return int(self.ckpts_host.size)


def _empty() -> np.ndarray:
    return np.zeros(0, np.int64)


class HostTier:
    """Budget, ids, LRU and copy log of the prefix cache's host tier (see the module docstring).

    ``capacity_bytes``: host bytes the tier may hold; ``page_bytes``: one page of one KV head over every layer and
    role; ``ckpt_bytes``: one GDN checkpoint slot over every GDN layer (0 without GDN layers). Counters:
    ``bytes_out`` / ``bytes_in`` (bytes logged each way), ``pages_out`` / ``pages_in``, ``ckpts_out`` /
    ``ckpts_in``, ``evictions`` (entries whose host data was dropped for room)."""

    def __init__(self, capacity_bytes: int, page_bytes: int, ckpt_bytes: int) -> None:
        for name, value, low in (("capacity_bytes", capacity_bytes, 1), ("page_bytes", page_bytes, 1),
                                 ("ckpt_bytes", ckpt_bytes, 0)):
            if not is_int(value) or value < low:
                raise ValueError(f"HostTier.{name} must be an int >= {low}, got {value!r}")
        self.capacity_bytes, self.page_bytes, self.ckpt_bytes = int(capacity_bytes), int(page_bytes), int(ckpt_bytes)
        self.used_bytes = 0
        self._next_id = 0
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # entry keys holding host data
        self.log: list[tuple] = []  # (kind, then the parts of pages_dev, pages_host, ckpts_dev, ckpts_host: i64 arrays
        # or lists of ints) of each group of the log
        self.bytes_out = self.bytes_in = self.pages_out = self.pages_in = self.ckpts_out = self.ckpts_in = 0
        self.evictions = 0

    # ---- budget and ids ------------------------------------------------------------------------------------
    def cost(self, pages: int, ckpts: int) -> int:
        return pages * self.page_bytes + ckpts * self.ckpt_bytes

    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def new_ids(self, n: int) -> np.ndarray:
        """``i64[n]`` fresh host ids."""
        ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
        self._next_id += n
        return ids

    def touch(self, key: int) -> None:
        """Entry ``key`` holds host data and was just used: most recent in the LRU order."""
        self.lru[key] = None
        self.lru.move_to_end(key)

    def forget(self, key: int) -> None:
        self.lru.pop(key, None)

    # ---- the log -------------------------------------------------------------------------------------------
    def spill(self, pages_dev: np.ndarray, ckpts_dev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Log device pages ``pages_dev`` (i64[k]) and checkpoint slots ``ckpts_dev`` (i64[c]) copied to the
        host (the caller checked the budget); returns their host ids ``(i64[k], i64[c])``."""
        pages_dev, ckpts_dev = np.asarray(pages_dev, np.int64), np.asarray(ckpts_dev, np.int64)
        self._charge(pages_dev.size, ckpts_dev.size)
        hp, hc = self.new_ids(pages_dev.size), self.new_ids(ckpts_dev.size)
        self._append("out", pages_dev, hp, ckpts_dev, hc)
        return hp, hc

    def spill_pages(self, pages_dev: list[int]) -> range:
        """:meth:`spill` of device pages only (``pages_dev``: a list of page ids; no numpy on the way, for the
        reclaim loop's many small spills); returns their host ids."""
        n = len(pages_dev)
        self._charge(n, 0)
        ids = range(self._next_id, self._next_id + n)
        self._next_id += n
        if n:  # extends the last group's list parts (joined by _ops)
            if not self.log or self.log[-1][0] != "out":
                self.log.append(("out", [], [], [], []))
            _, pd, ph, _, _ = self.log[-1]
            if not pd or not isinstance(pd[-1], list):
                pd.append([])
                ph.append([])
            pd[-1].extend(pages_dev)
            ph[-1].extend(ids)
        return ids

    def _charge(self, pages: int, ckpts: int) -> None:
        """Count a spill of ``pages`` pages and ``ckpts`` checkpoints (the caller checked the budget:
        ``AssertionError`` if it does not fit)."""
        nbytes = self.cost(pages, ckpts)
        if nbytes > self.free_bytes():
            raise AssertionError(f"host tier: spilling {nbytes} bytes with {self.free_bytes()} free")
        self.used_bytes += nbytes
        self.bytes_out += nbytes
        self.pages_out += pages
        self.ckpts_out += ckpts

    def load(self, pages_host: np.ndarray, pages_dev: np.ndarray, ckpts_host: np.ndarray,
             ckpts_dev: np.ndarray) -> None:
        """Log host copies loaded into device pages / checkpoint slots (``i64`` arrays, pairwise); their host
        bytes are free from now on."""
        pages_host, ckpts_host = np.asarray(pages_host, np.int64), np.asarray(ckpts_host, np.int64)
        nbytes = self.cost(pages_host.size, ckpts_host.size)
        self.used_bytes -= nbytes
        self.bytes_in += nbytes
        self.pages_in += pages_host.size
        self.ckpts_in += ckpts_host.size
        self._append("in", np.asarray(pages_dev, np.int64), pages_host, np.asarray(ckpts_dev, np.int64), ckpts_host)

    def drop(self, pages_host: np.ndarray, ckpts_host: np.ndarray) -> None:
        """Log host copies forgotten (evicted or cleared); their bytes are free."""
        pages_host, ckpts_host = np.asarray(pages_host, np.int64), np.asarray(ckpts_host, np.int64)
        self.used_bytes -= self.cost(pages_host.size, ckpts_host.size)
        self._append("drop", _empty(), pages_host, _empty(), ckpts_host)

    def _append(self, kind: str, pd: np.ndarray, ph: np.ndarray, cd: np.ndarray, ch: np.ndarray) -> None:
        if ph.size == 0 and ch.size == 0:
            return
        if not self.log or self.log[-1][0] != kind:  # consecutive copies of one kind form one group
            self.log.append((kind, [], [], [], []))
        for parts, a in zip(self.log[-1][1:], (pd, ph, cd, ch)):
            if a.size:
                parts.append(a)

    def _ops(self) -> tuple[CopyOp, ...]:
        """The log as :class:`CopyOp` groups (each group's parts joined)."""
        def join(parts: list) -> np.ndarray:
            parts = [np.asarray(x, np.int64) for x in parts]
            return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _empty()

        return tuple(CopyOp(kind, *map(join, parts)) for kind, *parts in self.log)

    def take(self) -> tuple[CopyOp, ...]:
        """The copies logged since the last call, in order (the engine executes them before the step)."""
        ops, self.log = self._ops(), []
        return ops

    def pending(self) -> tuple[set[int], set[int]]:
        """``(device pages, checkpoint slots)`` that a logged, not yet taken load writes (in flight)."""
        ops = self._ops()
        pages = {p for op in ops if op.kind == "in" for p in op.pages_dev.tolist()}
        ckpts = {c for op in ops if op.kind == "in" for c in op.ckpts_dev.tolist()}
        return pages, ckpts
