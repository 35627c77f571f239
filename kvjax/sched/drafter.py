"""Speculative decoding's drafters (host side, numpy): what proposes the tokens a verification step checks.

A :class:`Drafter` looks at a running request's tokens (prompt and resolved outputs) and proposes up to
``max_drafts`` next tokens; the engine runs them with the request's last token through the model in one ragged
step and keeps the longest prefix the target model agrees with (:mod:`kvjax.sched.spec`, :mod:`kvjax.engine.verify`).
A drafter is deterministic: its proposal is a point mass, which is what the rejection sampling of
:mod:`kvjax.engine.sampling` assumes (``q(d) = 1``).

- :class:`NgramDrafter`: prompt lookup (n-gram) drafting, no weights: find the request's last ``n`` tokens
  earlier in its own tokens (the longest ``n`` from ``max_ngram`` down to ``min_ngram`` that occurs; its latest
  occurrence) and propose the tokens that followed it. Its host ``propose`` drafts single verification steps and a
  verification burst's sub-step 0; the burst's later sub-steps draft on the device by the same rule from the rows'
  histories (:func:`kvjax.engine.ngram.lookup`).
- :class:`StepDrafter`: drafts that come from the device step's output (``"mtp"``: the model's MTP layer drafts
  inside the jitted step, :mod:`kvjax.engine.drafting`); the engine records each step's drafts here
  (:meth:`StepDrafter.record`) and the next plan takes them (:meth:`StepDrafter.drafts_rows`) instead of a host
  ``propose`` (on a mesh, one per data shard: :func:`shard_drafters`).
- A drafter with ``bursts = True`` (these two; a subclass of :class:`NgramDrafter` has ``False``) verifies in
  verification bursts (:mod:`kvjax.sched.burst`): its later sub-steps' drafts are made on the device;
  :func:`ngram_sizes` says which rule a burst's device lookup runs.
- :class:`PacedDrafter`: a drafter with the step-cost rule that shortens or turns off the drafts where they do not
  pay (large batches; :func:`kvjax.sched.spec.draft_length`).
- :class:`SpeculativeConfig`: the engine's ``speculative=`` setting (method, ``num_draft_tokens`` = ``K``, n-gram
  sizes, ``flat_tokens`` of the rule), validated when built; :func:`make_drafter` builds its drafter.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvjax.config import is_int

MAX_DRAFT_TOKENS = 16  # K at most (a verification row is K + 1 tokens; the step compiles per K)
METHODS = ("ngram", "mtp")
# The rule's default flat region of the step-cost model (tokens a step computes at about the cost of one): a bf16
# weight read feeds two FLOPs per token, and accelerators of this generation do a few hundred FLOPs per byte read, so
# a decode step stays memory-bound up to a few hundred tokens. A setting to measure (benchmarks/spec.py), not a figure.
FLAT_TOKENS = 256
# The default row limit above which no step drafts. Every GPU run of benchmarks/spec.py (RESULTS.md "Speculative
# decoding") had verification paying at 16 rows (MTP K = 4: 1.05-1.58x) and all but one losing at 64 (MTP 0.66-0.80x,
# once 1.14x; n-gram 0.29-0.30x), where without drafts a step is the plain decode burst; at 32 rows MTP lost too (0.83x
# with every draft accepted, HISTORY run 132), so the crossover lies between 16 and 32. None: no limit.
DISABLE_BY_BATCH_SIZE = 16


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for one request at a time (host side).

    A drafter whose drafts come from the device step instead (``from_step = True``: :class:`StepDrafter`) is not
    asked to ``propose``: :func:`kvjax.sched.spec.propose` reads its ``drafts_rows`` and the engine feeds it each
    step's drafts through ``record``."""

    num_draft_tokens: int  # K: drafts per verification at most

    def propose(self, tokens: np.ndarray, max_drafts: int) -> np.ndarray:
        """``tokens``: i32[n], the request's known tokens (prompt, then its resolved outputs, the last one not yet
        computed); returns i32[<= max_drafts] proposed next tokens (possibly none)."""
        ...


class NgramDrafter:
    """Prompt-lookup drafting: the continuation of the latest earlier occurrence of the request's last n-gram.

    ``num_draft_tokens``: K; ``max_ngram`` / ``min_ngram``: the n-gram sizes tried, longest first."""

    @property
    def bursts(self) -> bool:
        """Verification bursts run this rule on the device (:func:`kvjax.engine.ngram.lookup`): for an
        :class:`NgramDrafter` itself, not a subclass, whose ``propose`` may differ (as :func:`ngram_sizes`)."""
        return type(self) is NgramDrafter

    def __init__(self, num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.num_draft_tokens, self.max_ngram, self.min_ngram = int(num_draft_tokens), int(max_ngram), int(min_ngram)

    def propose(self, tokens: np.ndarray, max_drafts: int) -> np.ndarray:
        tokens = np.asarray(tokens)
        n_tok = tokens.shape[0]
        k = min(int(max_drafts), self.num_draft_tokens)
        if k <= 0:
            return np.zeros(0, np.int32)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            # windows starting at 0 .. n_tok - n - 1: every earlier occurrence (not the suffix itself)
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [n_tok - n, n]
            hits = np.flatnonzero((windows == tokens[n_tok - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start: start + k].astype(np.int32)
        return np.zeros(0, np.int32)


class StepDrafter:
    """Drafts computed on the device by the step itself (``speculative="mtp"``: every jitted step also runs the
    model's MTP layer and returns ``i32[B, K]`` drafts beside its tokens; :mod:`kvjax.engine.drafting`).

    :meth:`record` keeps, per slot, the drafts of the request that ran there and its token count when they were
    made (they continue exactly those tokens); :meth:`drafts_rows` gives them to the next plan only while the
    request and its token count are unchanged (a preempted, aborted or recomputed request gets new ones from the
    step that recomputes it). ``propose`` proposes nothing (no host drafting)."""

    from_step = True
    bursts = True

    def __init__(self, num_draft_tokens: int) -> None:
        self.num_draft_tokens = int(num_draft_tokens)
        K = self.num_draft_tokens
        self._rid = np.full(1, -1, np.int64)  # i64[S]: by slot, the request whose drafts are held (-1: none)
        self._count = np.zeros(1, np.int64)  # i64[S]: its token count when they were made
        self._drafts = np.full((1, K), -1, np.int64)  # i64[S, K]: the drafts (-1 past a row's last)

    def propose(self, tokens: np.ndarray, max_drafts: int) -> np.ndarray:
        return np.zeros(0, np.int32)

    def record(self, rows: Any, slots: np.ndarray, request_ids: np.ndarray, drafts: np.ndarray) -> None:
        """After a step was resolved: ``drafts`` (i32[>= n, J]: the step's width, the first ``K`` kept) of its rows'
        ``slots`` (i64[n]) and ``request_ids`` (i64[n]); ``rows``: the scheduler's row table (a row whose request
        left its slot is skipped)."""
        n = slots.size
        live = rows.request_id[slots] == request_ids  # bool[n]
        if n and int(slots.max()) >= self._rid.size:  # grown to the largest slot seen
            size = int(slots.max()) + 1
            grow = size - self._rid.size
            self._rid = np.concatenate([self._rid, np.full(grow, -1, np.int64)])
            self._count = np.concatenate([self._count, np.zeros(grow, np.int64)])
            self._drafts = np.concatenate([self._drafts, np.full((grow, self.num_draft_tokens), -1, np.int64)])
        s = slots[live]
        self._rid[s] = request_ids[live]
        self._count[s] = rows.num_tokens[s]
        w = min(np.shape(drafts)[1], self.num_draft_tokens)
        self._drafts[s] = -1
        self._drafts[s, :w] = np.asarray(drafts)[:n, :w][live]

    def drafts_rows(self, slots: np.ndarray, request_ids: np.ndarray, num_tokens: np.ndarray,
                    max_drafts: np.ndarray) -> list[np.ndarray]:
        """For each row (``slots``, ``request_ids``, ``num_tokens``, ``max_drafts``: i64[R] each): i32[<= max_drafts]
        the drafts recorded for its request at ``num_tokens`` tokens (none if stale), up to the first ``-1``."""
        known = slots < self._rid.size  # bool[R]
        at = np.where(known, slots, 0)
        fresh = known & (self._rid[at] == request_ids) & (self._count[at] == num_tokens)  # bool[R]
        d = self._drafts[at]  # i64[R, K]
        upto = np.cumprod(d >= 0, axis=1).sum(1)  # i64[R]: drafts before the first -1
        n = np.where(fresh, np.minimum(upto, np.maximum(max_drafts, 0)), 0).tolist()
        d = d.astype(np.int32)
        return [d[i, :k] for i, k in enumerate(n)]


class PacedDrafter:
    """``drafter`` under the rule that picks, every step, the draft length that pays (0: none) from the step-cost
    model with a flat region of ``flat_tokens`` tokens and the acceptance measured so far
    (:func:`kvjax.sched.spec.draft_length`, applied by :func:`kvjax.sched.spec.propose`; ``None``: up to K drafts),
    and no drafts at all while more than ``disable_by_batch_size`` requests run (``None``: no such limit)."""

    def __init__(self, drafter: Drafter, flat_tokens: int | None, disable_by_batch_size: int | None = None) -> None:
        self.drafter = drafter
        self.flat_tokens = None if flat_tokens is None else int(flat_tokens)
        self.disable_by_batch_size = disable_by_batch_size
        self.num_draft_tokens = drafter.num_draft_tokens
        self.from_step = bool(getattr(drafter, "from_step", False))
        self.bursts = bool(getattr(drafter, "bursts", False))

    def propose(self, tokens: np.ndarray, max_drafts: int) -> np.ndarray:
        return self.drafter.propose(tokens, max_drafts)

    def record(self, *args: Any) -> None:
        """A step drafter's :meth:`StepDrafter.record`."""
        self.drafter.record(*args)

    def drafts_rows(self, *args: np.ndarray) -> list[np.ndarray]:
        """A step drafter's :meth:`StepDrafter.drafts_rows`."""
        return self.drafter.drafts_rows(*args)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``Engine(speculative=...)``: how the engine drafts and verifies.

    Fields: ``method`` ["ngram"]: the drafter (:data:`METHODS`: ``"ngram"`` prompt lookup, on the host for single
    verification steps and a burst's first sub-step, on the device for a verification burst's later ones; ``"mtp"``
    the model's MTP layer on the device, :class:`StepDrafter`; the engine checks that the model has one);
    ``num_draft_tokens`` [4]: K, drafts per verification row at most, an int in ``[1, MAX_DRAFT_TOKENS]``; ``max_ngram``
    [3] / ``min_ngram`` [1]: the n-gram sizes of ``"ngram"`` (``1 <= min_ngram <= max_ngram``); ``drafter`` [None]: a
    ready :class:`Drafter` object instead of ``method``'s (its ``num_draft_tokens`` must equal K); ``flat_tokens``
    [:data:`FLAT_TOKENS`]: the flat region of the step-cost model of the rule that shortens or turns off drafts where
    they do not pay (an int >= 1; ``None``: always up to K drafts; :func:`kvjax.sched.spec.draft_length`);
    ``disable_by_batch_size`` [:data:`DISABLE_BY_BATCH_SIZE`]: vLLM's option of that name: no drafts in a step while
    more than this many requests run when its drafts are chosen (before it admits new ones; an int >= 1; ``None``: no
    limit): where the rule's cost model, which prices tokens only, misses what a verification costs against plain
    decode bursts (benchmarks/RESULTS.md "Speculative decoding"). ``ValueError`` names a bad field."""

    method: str = "ngram"
    num_draft_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    drafter: Any = None
    flat_tokens: int | None = FLAT_TOKENS
    disable_by_batch_size: int | None = DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not is_int(self.num_draft_tokens) or not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be an int in [1, {MAX_DRAFT_TOKENS}], got "
                             f"{self.num_draft_tokens!r}")
        if not is_int(self.min_ngram) or not is_int(self.max_ngram) or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need ints 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram!r}, "
                             f"max_ngram={self.max_ngram!r}")
        if self.drafter is not None and (not isinstance(self.drafter, Drafter)
                                         or self.drafter.num_draft_tokens != self.num_draft_tokens):
            raise ValueError(f"drafter must implement kvjax.sched.drafter.Drafter with num_draft_tokens="
                             f"{self.num_draft_tokens}, got {self.drafter!r:.80}")
        if self.flat_tokens is not None and (not is_int(self.flat_tokens) or self.flat_tokens < 1):
            raise ValueError(f"flat_tokens must be None or an int >= 1, got {self.flat_tokens!r}")
        if self.disable_by_batch_size is not None and (not is_int(self.disable_by_batch_size)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"disable_by_batch_size must be None or an int >= 1, got {self.disable_by_batch_size!r}")

    @classmethod
    def of(cls, value: Any) -> "SpeculativeConfig | None":
        """``None``, a method name (``"ngram"`` / ``"mtp"``: its defaults), a :class:`SpeculativeConfig`, or a
        :class:`Drafter` object (K = its ``num_draft_tokens``), as a config (``ValueError`` otherwise)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls(method=value)
        if isinstance(value, Drafter):
            return cls(num_draft_tokens=value.num_draft_tokens, drafter=value)
        raise ValueError(f"speculative must be None, one of {METHODS}, a SpeculativeConfig or a Drafter, "
                         f"got {value!r:.80}")


def shard_drafters(drafter: Drafter | None, n: int) -> list[Drafter | None]:
    """The drafter of each of an engine's ``n`` data shards: ``drafter`` itself for one shard or a host drafter
    (whose ``propose`` reads only the tokens it is given); for a drafter whose drafts come from the device step
    (``from_step``) on several shards, an independent copy per shard (its own held drafts, the same settings), so
    that each shard's scheduler reads the drafts its own step rows made: two shards' equal slot numbers never mix."""
    if n == 1 or drafter is None or not getattr(drafter, "from_step", False):
        return [drafter] * n
    return [copy.deepcopy(drafter) for _ in range(n)]


def ngram_sizes(drafter: Drafter | None) -> tuple[int, int] | None:
    """``(max_ngram, min_ngram)`` of ``drafter`` where it is (or paces) an :class:`NgramDrafter` itself (not a
    subclass, whose ``propose`` may differ from the device's rule): the lookup its verification bursts run on the
    device; else ``None``."""
    inner = drafter.drafter if isinstance(drafter, PacedDrafter) else drafter
    return (inner.max_ngram, inner.min_ngram) if type(inner) is NgramDrafter else None


# from this many rows up the n-gram lookup runs over every row at once in :func:`propose_rows`; below it row by row,
# which is faster there (host time a lookup, periodic histories of 130-200 tokens, K = 4, sizes 3..1, 2026-11-28:
# 1 row 25 us row by row against 133 at once, 4 rows 135 / 169, 16 rows 550 / 129, 64 rows 2094 / 386)
BATCH_ROWS = 8


def propose_rows(drafter: Drafter, tokens: np.ndarray, lengths: np.ndarray, max_drafts: np.ndarray
                 ) -> list[np.ndarray]:
    """Each row's ``drafter.propose(tokens[r, :lengths[r]], max_drafts[r])`` (``tokens``: i64[R, >= max length];
    ``lengths`` / ``max_drafts``: i64[R], ``max_drafts >= 1``): an :class:`NgramDrafter` itself (:func:`ngram_sizes`)
    looks up :data:`BATCH_ROWS` or more rows at once (the same rule, a few elementwise passes over ``[R, L]`` per
    n-gram size, as :func:`kvjax.engine.ngram.lookup` on the device); fewer rows, and any other drafter, row by row.
    Returns one integer array a row, at most ``max_drafts[r]`` drafts each."""
    sizes = ngram_sizes(drafter)
    R = lengths.shape[0]
    if sizes is None or R < BATCH_ROWS:
        return [np.asarray(drafter.propose(tokens[r, : lengths[r]], int(max_drafts[r])), np.int64)[: max_drafts[r]]
                for r in range(R)]
    L = int(lengths.max())
    hist = np.asarray(tokens)[:, :L]  # [R, L]
    at = np.arange(R)
    start = np.full(R, -1, np.int64)  # where each row's drafts begin (-1: no match yet)
    for n in range(sizes[0], sizes[1] - 1, -1):
        W = L - n  # window starts 0 .. L - n - 1 (each row's own bound below)
        if W <= 0:
            continue
        match = np.arange(W)[None, :] <= (lengths - n - 1)[:, None]  # bool[R, W]: windows before the last token
        for i in range(n):
            match &= hist[:, i: i + W] == hist[at, np.maximum(lengths - n + i, 0)][:, None]
        latest = np.where(match.any(axis=1), W - 1 - np.argmax(match[:, ::-1], axis=1), -1)  # the latest window
        start = np.where((start < 0) & (latest >= 0), latest + n, start)
    count = np.where(start >= 0, np.clip(np.minimum(lengths - start, np.minimum(max_drafts, drafter.num_draft_tokens)),
                                         0, None), 0)  # i64[R]
    return [hist[r, start[r]: start[r] + count[r]].astype(np.int32) for r in range(R)]


def make_drafter(config: SpeculativeConfig) -> Drafter:
    """The drafter ``config`` names (its ``drafter`` object where given), paced by the rule unless ``flat_tokens``
    and ``disable_by_batch_size`` are both ``None``."""
    if config.drafter is not None:
        drafter = config.drafter
    elif config.method == "mtp":
        drafter = StepDrafter(config.num_draft_tokens)
    else:
        drafter = NgramDrafter(config.num_draft_tokens, config.max_ngram, config.min_ngram)
    if config.flat_tokens is None and config.disable_by_batch_size is None:
        return drafter
    return PacedDrafter(drafter, config.flat_tokens, config.disable_by_batch_size)
