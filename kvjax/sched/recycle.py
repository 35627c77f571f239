"""SWA block recycling: the rule, the per-step policies, and page footprints derived from the rule.

The rule (DESIGN.md). A query at position ``i`` attends key ``j`` iff ``j <= i`` and (``i - j < window`` or
``j < sinks``). Before a step, a request has ``L`` computed tokens; this step's and all later queries sit at
``i >= L``. So a non-sink key ``j`` is still needed iff ``j >= L - window + 1``, and block ``b`` (positions
``[b*ps, (b+1)*ps)``) of a SWA head is recyclable iff

- its last position is out of every future window: ``(b + 1) * ps <= L - window + 1``, and
- it holds no sink position: ``b * ps >= sinks``, i.e. ``b >= ceil(sinks / ps)``, and
- (block-boundary rule) it is not the block that holds position ``L``, written this step: ``b < L // ps``.
  The first condition already implies this for ``window >= 1``; it is enforced explicitly anyway.

Full-attention heads (``window == 0``) never recycle.

A policy is an object with one method, ``recycle(blocks, rows, num_computed) -> pages freed``, that the scheduler
calls at the start of every step with its running requests. A new policy is a few lines, e.g.::

    class LazyRecycle:
        name, frees_swa_blocks = "lazy", True
        def __init__(self, threshold): self.threshold = threshold
        def recycle(self, blocks, rows, num_computed):
            return recycle_out_of_window(blocks, rows, num_computed) if blocks.available() < self.threshold else 0
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvjax.errors import RequestTooLongError
from kvjax.sched.blocks import BlockAllocator


def first_recyclable_block(sinks: np.ndarray | int, page_size: int) -> np.ndarray:
    """i64[...]: the lowest block index that holds no sink position, ``ceil(sinks / page_size)``."""
    return -(-np.asarray(sinks, np.int64) // page_size)


def recycle_stop(num_computed: np.ndarray | int, window: np.ndarray | int, page_size: int) -> np.ndarray:
    """Blocks ``[0, stop)`` are out of the window of every query at ``>= num_computed`` (0 for full heads).

    Broadcasts ``num_computed`` against ``window``; the block-boundary rule caps ``stop`` at ``L // page_size``.
    """
    L = np.asarray(num_computed, np.int64)
    w = np.asarray(window, np.int64)
    stop = np.minimum(np.maximum((L - w + 1) // page_size, 0), L // page_size)
    return stop if (w > 0).all() else np.where(w > 0, stop, 0)


def recycle_out_of_window(blocks: BlockAllocator, rows: np.ndarray, num_computed: np.ndarray) -> int:
    """Free every recyclable block of the given rows (``rows: i64[R]``, ``num_computed: i64[R]``); returns pages
    freed. Vectorised over rows and heads; a per-(row, head) cursor skips blocks already handled, and
    ``blocks.recycle_due`` the rows with nothing to free yet: after a row is handled, it is the lowest
    ``num_computed`` at which one of its SWA heads' next block leaves the window (``(start + 1) * page_size +
    window - 1``, ``start`` = the head's first block not freed; cursors only grow until ``free_row`` resets it)."""
    swa = blocks.swa_heads
    if len(swa) == 0 or len(rows) == 0:
        return 0
    rows, num_computed = _check_rows(blocks, rows), np.asarray(num_computed, np.int64)
    due = num_computed >= blocks.recycle_due[rows]  # bool[R]
    if not due.any():
        return 0
    rows, num_computed = rows[due], num_computed[due]
    window, sinks = blocks.window[swa], blocks.sinks[swa]
    freed = free_blocks_before(blocks, rows, swa, num_computed, window, sinks)
    start = np.maximum(blocks.recycled_upto[rows[:, None], swa[None, :]],
                       first_recyclable_block(sinks, blocks.page_size)[None, :])  # i64[R', n_swa]
    blocks.recycle_due[rows] = ((start + 1) * blocks.page_size + window[None, :] - 1).min(axis=1)
    return freed


def _check_rows(blocks: BlockAllocator, rows: np.ndarray) -> np.ndarray:
    """``rows`` as ``i64[R]``; ``ValueError`` unless each lies in ``1..max_seqs`` (numpy would wrap a negative one)."""
    rows = np.asarray(rows, np.int64)
    if rows.size and (rows.min() < 1 or rows.max() > blocks.cache.max_seqs):
        raise ValueError(f"rows {rows.tolist()} must lie in 1..{blocks.cache.max_seqs} (GDN slots)")
    return rows


def free_blocks_before(
    blocks: BlockAllocator,
    rows: np.ndarray,  # i64[R]
    heads: np.ndarray,  # i64[H]
    num_computed: np.ndarray,  # i64[R]
    window: np.ndarray | int,  # i64[H] (or one value): keep the last ``window`` positions of each head
    sinks: np.ndarray | int,  # i64[H] (or one value): never free a block holding a position < sinks
) -> int:
    """Free, for every (row, head), the blocks ``[max(cursor, first sink-free block), recycle_stop)`` and
    advance the per-(row, head) cursor to the stop; returns pages freed. The building block of the policies.
    Raises ``ValueError`` for a head outside ``0..H_kv-1`` or a row outside ``1..max_seqs`` (numpy would wrap a
    negative one); nothing changes then."""
    ranges = recyclable_ranges(blocks, rows, heads, num_computed, window, sinks)
    if len(ranges[0]) == 0:
        return 0
    freed = blocks.free_ranges(*ranges)
    blocks.recycled_upto[ranges[0], ranges[1]] = ranges[3]
    return freed


def recyclable_ranges(blocks: BlockAllocator, rows: np.ndarray, heads: np.ndarray, num_computed: np.ndarray,
                      window: np.ndarray | int, sinks: np.ndarray | int) -> tuple[np.ndarray, ...]:
    """``(rows, heads, starts, stops)``, ``i64[K]`` each: the non-empty block ranges that
    :func:`free_blocks_before` frees (same arguments and errors); changes nothing."""
    heads = np.asarray(heads, np.int64)
    if ((heads < 0) | (heads >= blocks.num_heads)).any():
        raise ValueError(f"heads {heads.tolist()} must lie in 0..{blocks.num_heads - 1} (num_kv_heads)")
    rows = _check_rows(blocks, rows)
    window, sinks = np.asarray(window, np.int64), np.asarray(sinks, np.int64)
    if window.shape != heads.shape or sinks.shape != heads.shape:
        window, sinks = np.broadcast_to(window, heads.shape), np.broadcast_to(sinks, heads.shape)
    stop = recycle_stop(np.asarray(num_computed, np.int64)[:, None], window[None, :], blocks.page_size)
    cursor = blocks.recycled_upto[rows[:, None], heads[None, :]]
    start = np.maximum(cursor, first_recyclable_block(sinks, blocks.page_size)[None, :])
    r, k = np.nonzero(stop > start)
    return rows[r], heads[k], start[r, k], stop[r, k]


class RecyclePolicy(Protocol):
    """What the scheduler calls once per step, before it allocates this step's blocks."""

    name: str
    frees_swa_blocks: bool  # whether out-of-window blocks are (eventually) given back; sizes the too-long check

    def recycle(self, blocks: BlockAllocator, rows: np.ndarray, num_computed: np.ndarray) -> int: ...


class NoRecycle:
    """``none``: blocks stay until the request finishes or is preempted."""

    name = "none"
    frees_swa_blocks = False

    def recycle(self, blocks: BlockAllocator, rows: np.ndarray, num_computed: np.ndarray) -> int:
        return 0


class TimelyRecycle:
    """``timely``: free a SWA head's block as soon as the rule allows, every step."""

    name = "timely"
    frees_swa_blocks = True

    def recycle(self, blocks: BlockAllocator, rows: np.ndarray, num_computed: np.ndarray) -> int:
        return recycle_out_of_window(blocks, rows, num_computed)


RECYCLE_POLICIES = {"none": NoRecycle, "timely": TimelyRecycle}


def make_recycle_policy(policy: "str | RecyclePolicy") -> RecyclePolicy:
    """A policy object from its name (``none`` | ``timely``) or the object itself."""
    if isinstance(policy, str):
        if policy not in RECYCLE_POLICIES:
            raise ValueError(f"recycle policy must be one of {sorted(RECYCLE_POLICIES)}, got {policy!r}")
        return RECYCLE_POLICIES[policy]()
    if not callable(getattr(policy, "recycle", None)) or not hasattr(policy, "frees_swa_blocks"):
        raise ValueError(f"recycle policy {policy!r} needs a recycle(blocks, rows, num_computed) method and a "
                         "frees_swa_blocks attribute")
    return policy


# ---- footprints (for admission checks and the simulator's bound) --------------------------------------------
def live_blocks(num_computed: np.ndarray, num_new: np.ndarray, window: np.ndarray, sinks: np.ndarray,
                page_size: int, recycle: bool = True) -> np.ndarray:
    """i64[N, H]: blocks a head holds during a step that starts at ``num_computed`` (``i64[N]``) and writes
    ``num_new`` (``i64[N]``) tokens, after timely recycling (``recycle=True``) or with none (``False``).
    ``window``, ``sinks``: ``i64[H]``."""
    L = np.asarray(num_computed, np.int64)[:, None]
    total = -(-(L + np.asarray(num_new, np.int64)[:, None]) // page_size)
    total = np.broadcast_to(total, (total.shape[0], len(window)))
    if not recycle:
        return total.copy()
    stop = recycle_stop(L, np.asarray(window, np.int64)[None, :], page_size)
    first = first_recyclable_block(np.asarray(sinks, np.int64), page_size)[None, :]
    return total - np.maximum(stop - first, 0)


def peak_live_blocks(total_len: int, window: np.ndarray, sinks: np.ndarray, page_size: int, max_chunk: int,
                     recycle: bool = True) -> np.ndarray:
    """i64[H]: each head's blocks in its worst step of a request of ``total_len`` tokens running alone, with
    chunks of up to ``max_chunk`` tokens starting anywhere (a resumed request re-prefills prompt + outputs)."""
    if not recycle:  # nothing freed: the last step holds every block of every head (checked every admission)
        return np.full(len(window), -(-max(total_len - 1, 1) // page_size), np.int64)
    return _per_step_blocks(total_len, window, sinks, page_size, max_chunk, recycle).max(axis=0)


def peak_total_blocks(total_len: int, window: np.ndarray, sinks: np.ndarray, page_size: int, max_chunk: int,
                      recycle: bool = True) -> int:
    """Pages (all heads) of the worst step of a request of ``total_len`` tokens running alone."""
    if not recycle:
        return len(window) * -(-max(total_len - 1, 1) // page_size)
    return int(_per_step_blocks(total_len, window, sinks, page_size, max_chunk, recycle).sum(axis=1).max())


def _per_step_blocks(total_len: int, window, sinks, page_size: int, max_chunk: int, recycle: bool) -> np.ndarray:
    # Fed tokens are positions [0, total_len - 1): the last output token is sampled, never fed.
    fed = max(total_len - 1, 1)
    L = np.arange(fed, dtype=np.int64)
    n = np.minimum(max_chunk, fed - L)
    return live_blocks(L, n, np.asarray(window, np.int64), np.asarray(sinks, np.int64), page_size, recycle)


def check_fits(blocks: BlockAllocator, prompt_len: int, max_new_tokens: int, max_chunk: int,
               frees_swa_blocks: bool) -> None:
    """Raise :class:`RequestTooLongError` unless a request of ``prompt_len + max_new_tokens`` tokens fits a
    block-table row and the pages of its worst step (chunks of up to ``max_chunk`` tokens; SWA blocks recycled
    if ``frees_swa_blocks``) fit ``blocks``' pool even when it runs alone."""
    # The last output token is sampled, never fed: positions [0, total - 1) are cached.
    cache, total = blocks.cache, prompt_len + max_new_tokens
    if total - 1 > cache.max_seq_len:
        raise RequestTooLongError(
            f"request of {prompt_len} prompt + {max_new_tokens} new tokens caches {total - 1} positions > "
            f"max_seq_len={cache.max_seq_len} (page_size * max_blocks_per_seq)")
    args = (blocks.window, blocks.sinks, cache.page_size, max_chunk, frees_swa_blocks)
    if blocks.pool == "partitioned":
        peak, have = int(peak_live_blocks(total, *args).max()), blocks.pool_pages[0]
        where = "pages per head (partitioned pool)"
    else:
        heads = np.array_split(np.arange(blocks.num_heads), blocks.shards)  # each shard's pool
        peak = max(peak_total_blocks(total, args[0][h], args[1][h], *args[2:]) for h in heads)
        have, where = cache.num_pages, "pages (shared pool)" if blocks.shards == 1 else \
            "pages of one model shard's pool (shared)"
    if peak > have:
        raise RequestTooLongError(
            f"request of {total} tokens needs {peak} {where} in its worst step even alone, only {have} exist")
