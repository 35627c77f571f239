"""Per-step engine metrics: what each step computed, how full the caches were, and where the time went.

``EngineMetrics`` is a plain list of :class:`StepRecord` with a summary; ``to_dict()`` gives columns
(``{field: list}``) ready for ``pandas.DataFrame`` or JSON, ``to_json(path)`` writes them.

One record per device step, appended when its tokens have been read. A decode burst is one record of ``burst``
sub-steps; :meth:`EngineMetrics.summary` counts per sub-step (tokens per step, running requests, page use), so
its figures mean the same with and without bursts, and what ``kvjax simulate`` (one sub-step per step) predicts (a step whose tokens a fault lost is
recorded with ``generated`` 0). A verification burst's ``computed`` (every row's verified positions in every sub-step
it ran), ``row_steps`` and ``sub_steps`` (the burst ends when no row is live) come from its tokens when they are read
(:func:`verify_burst_counts`; a fault that lost
them leaves sub-step 0's plan's counts). Times are wall-clock seconds on the host, split into phases: ``t_schedule``
(scheduler plan incl. recycling and page allocation), ``t_inputs`` (numpy plan -> device inputs, sampling rows),
``t_dispatch`` (the jitted call returning; includes tracing and compiling on a new shape), ``t_wait`` (blocked
reading the step's sampled tokens), ``t_update`` (scheduler resolve, events). ``t_step`` is the step's share of
the ``Engine.step`` calls: the part of the call that dispatched it (schedule .. dispatch) plus the part of the
call that read its tokens (from after that call's own dispatch, or from its start if it dispatched nothing, to
its end); summed over steps it is the time spent inside ``Engine.step``.

Host time. ``t_host = t_step - t_wait``: everything the host does for the step (its total host time).
``t_exposed``: the part of it the device waits for, i.e. time inside ``Engine.step`` during which the host has
observed the device idle (everything dispatched finished) and has not dispatched yet. The host observes
idleness exactly when it blocked on a step's tokens and nothing else is in flight (the synchronous engine: all
of its host time is exposed), and otherwise through non-blocking ``is_ready()`` probes of the latest dispatched
step at the start of a call, after scheduling, after each group of host-tier copies issued and before the
dispatch; the idle interval counts from the first probe that saw it, so ``t_exposed`` is a lower bound, exact to
within one phase (one group of copies). With ``overlap=True`` the
host's work for step N+1 runs while step N computes: ``t_exposed`` stays near 0 while the device step takes
longer than the host's part. Time outside ``Engine.step`` (the caller's own work between calls) is not counted.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import numpy as np

from kvjax.sched import spec
from kvjax.sched.plan import StepPlan


@dataclasses.dataclass(frozen=True)
class StepRecord:
    step: int  # scheduler step
    num_tokens: int  # real tokens computed this step (prefill chunks + decodes)
    num_seqs: int  # rows scheduled this step
    bucket_tokens: int  # T (padded)
    bucket_rows: int  # B (padded)
    bucket_blocks: int  # block-table width (padded)
    decode_only: bool  # the step ran the models' decode path (every row one token)
    generated: int  # tokens appended to requests this step
    running: int  # running requests after scheduling
    waiting: int  # waiting + preempted requests after scheduling
    preemptions: int  # preemptions that happened while planning this step
    pages_used: int  # pages in use after allocation (all pools)
    pages_free: int  # pages free after allocation (all pools)
    compiled: bool  # the device step (or a host-tier copy) was traced and compiled during this step (a new shape)
    t_schedule: float  # seconds (host wall clock; see the module docstring for each phase)
    t_inputs: float  # seconds
    t_dispatch: float  # seconds
    t_wait: float  # seconds
    t_update: float  # seconds
    t_step: float  # seconds, the step's share of Engine.step calls
    t_exposed: float  # seconds of host time the device waited for (lower bound; see the module docstring)
    prefix_hit_tokens: int = 0  # prompt tokens this step's admissions took from the prefix cache
    prefill_tokens: int = 0  # tokens at prompt positions computed this step
    cached_pages: int = 0  # pages the prefix cache holds after scheduling (included in pages_used)
    burst: int = 1  # model sub-steps the step's plan allows (a decode burst: up to Engine(decode_burst=K))
    # model sub-steps that ran, where fewer can (a verification burst's loop ends when no row is live); -1: burst
    sub_steps: int = -1
    # real tokens computed over all sub-steps (a decode burst's rows times their sub-steps; a verification burst's
    # verified positions, 1 + drafts, of every row in every sub-step it ran); -1: num_tokens
    computed: int = -1
    # rows run summed over the sub-steps (each row for the sub-steps it ran); -1: not recorded (the summary takes
    # ``running``, a burst's ``computed``)
    row_steps: int = -1
    # pages in use after allocation on each device's pool, data shard-major (:func:`device_pages_used`); () = one
    # pool, not recorded
    pages_used_devices: tuple[int, ...] = ()
    prefix_hit_tokens_host: int = 0  # of prefix_hit_tokens, those of blocks loaded from the host tier
    host_bytes_out: int = 0  # bytes the step's host-tier copies moved device -> host (spills)
    host_bytes_in: int = 0  # bytes they moved host -> device (loads)
    t_copy: float = 0.0  # seconds issuing the step's host-tier copies (before its dispatch; in t_dispatch's call)
    # speculative decoding (kvjax.engine.verify), a verification step's: rows with drafts, drafts verified, drafts
    # accepted, and per draft position j (0-based): rows verifying a draft there, rows accepting it; 0 / () otherwise
    verify_rows: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    drafts_proposed_at: tuple[int, ...] = ()
    drafts_accepted_at: tuple[int, ...] = ()

    @property
    def ran(self) -> int:
        """Model sub-steps the step ran: ``sub_steps`` where recorded, else ``burst``."""
        return self.sub_steps if self.sub_steps >= 0 else self.burst

    @property
    def t_host(self) -> float:
        """Total host time of the step: all but the wait for its tokens."""
        return self.t_step - self.t_wait


FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))
TUPLES = ("pages_used_devices", "drafts_proposed_at", "drafts_accepted_at")
NUMERIC = tuple(f for f in FIELDS if f not in TUPLES)  # one number per record


def device_pages_used(schedulers: Sequence[Any]) -> tuple[int, ...]:
    """Pages in use on each device's pool: one entry per (data shard, page shard), data shard-major, from the
    data shards' schedulers (``scheduler.blocks``: :class:`kvjax.sched.blocks.BlockAllocator`, whose pools are
    ``shards`` equal runs of page ids, one per model shard holding pages)."""
    out: list[int] = []
    for sched in schedulers:
        b = sched.blocks
        size = np.asarray(b.pool_pages, np.int64).reshape(b.shards, -1).sum(1)
        free = np.asarray(b.free_pages(), np.int64).reshape(b.shards, -1).sum(1)
        out.extend(int(x) for x in size - free)
    return tuple(out)


class EngineMetrics:
    """Step records of one or more runs (append-only)."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def append(self, record: StepRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    def __len__(self) -> int:
        return len(self.records)

    def column(self, name: str) -> np.ndarray:
        if name == "t_host":
            return np.array([r.t_host for r in self.records], np.float64)
        if name not in FIELDS:
            raise ValueError(f"unknown metric {name!r}; known: {FIELDS + ('t_host',)}")
        return np.array([getattr(r, name) for r in self.records])  # pages_used_devices: i64[steps, pools]

    def to_dict(self) -> dict[str, list]:
        """Columns ``{field: [value per step]}`` (plus ``t_host``)."""
        out = {name: [getattr(r, name) for r in self.records] for name in FIELDS}
        out["t_host"] = [r.t_host for r in self.records]
        return out

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump({"steps": self.to_dict(), "summary": self.summary()}, f, indent=1)

    def summary(self, *, skip: int = 0, num_pages: int | None = None) -> dict[str, Any]:
        """Aggregates over the records after the first ``skip`` (e.g. warm-up steps).

        Counts (tokens, steps, running, preemptions, pages) cover every step; per-step figures are per sub-step
        (``generated_tokens_per_step``, ``running_mean``, ``page_util_mean``, ``cached_pages_mean``: a burst weighs
        the sub-steps it ran (``StepRecord.ran``); ``tokens_per_dispatch`` is per record). Times cover only
        the steps that did not compile (``compiled`` False): compilation is a one-off cost per bucket shape, reported apart as
        ``compile_steps`` / ``compile_time_s``. ``generated_tokens_per_s`` = tokens generated in those steps /
        their summed ``t_step`` (the steady-state rate). Host time over them: ``host_share`` = exposed host time
        (``t_exposed``, what the device waits for) / step time, ``host_total_share`` = total host time
        (``t_host``) / step time, with per-step medians ``exposed_host_time_median_s`` / ``host_time_median_s``.
        ``page_util_*`` need ``num_pages`` (else taken as used + free of the first record). Prefix caching:
        ``prefix_hit_tokens`` (prompt tokens served from the cache), ``prefill_tokens`` (prompt positions computed,
        recomputation included), ``prefix_hit_rate`` = hits / (hits + prefill), ``cached_pages_mean``. On a mesh
        whose records carry ``pages_used_devices``: per-device lists ``pages_used_device_mean`` / ``_peak`` and
        ``page_util_device_mean`` / ``_peak`` (:func:`_per_device`). Host tier (``Engine(host_cache_bytes=)``):
        ``prefix_hit_tokens_host`` (of the hits, tokens loaded from host memory), ``prefix_hit_tokens_device``,
        ``host_bytes_out`` / ``host_bytes_in`` (bytes moved each way) and ``copy_share`` = host time issuing the
        copies / step time (the copies' exposed host part; their device part runs in order with the steps).
        """
        recs = self.records[skip:]
        if not recs:
            return {"steps": 0}
        col = {name: np.array([getattr(r, name) for r in recs], np.float64) for name in NUMERIC}
        sub = np.array([r.ran for r in recs], np.float64)  # sub-steps that ran: the weights
        computed = np.where(col["computed"] >= 0, col["computed"], col["num_tokens"])
        # a burst runs every running request (its plan's rows), each for its own sub-steps: the requests running
        # at each sub-step add up to its row_steps (``running`` is counted after the burst reserved them all)
        running = np.where(col["burst"] > 1, np.where(col["row_steps"] >= 0, col["row_steps"], computed),
                           col["running"])
        warm = col["compiled"] == 0
        host = (col["t_step"] - col["t_wait"])[warm]
        exposed = col["t_exposed"][warm]
        step_t = col["t_step"][warm]
        total = float(step_t.sum())
        gen_warm = float(col["generated"][warm].sum())
        pages = num_pages or int(recs[0].pages_used + recs[0].pages_free)
        util = col["pages_used"] / pages
        nan = float("nan")
        n_sub = float(sub.sum())
        return {
            "steps": len(recs),
            "sub_steps": int(n_sub),
            "generated_tokens": int(col["generated"].sum()),
            "computed_tokens": int(computed.sum()),
            "compile_steps": int((~warm).sum()),
            "compile_time_s": float(col["t_step"][~warm].sum()),
            "time_s": total,
            "generated_tokens_per_s": gen_warm / total if total > 0 else nan,
            "generated_tokens_per_step": float(col["generated"].sum() / n_sub),
            "tokens_per_dispatch": float(col["generated"].mean()),
            "step_time_median_s": float(np.median(step_t)) if warm.any() else nan,
            "host_time_median_s": float(np.median(host)) if warm.any() else nan,
            "exposed_host_time_median_s": float(np.median(exposed)) if warm.any() else nan,
            "wait_time_median_s": float(np.median(col["t_wait"][warm])) if warm.any() else nan,
            "host_share": float(exposed.sum() / total) if total > 0 else nan,
            "host_total_share": float(host.sum() / total) if total > 0 else nan,
            "schedule_share": float(col["t_schedule"][warm].sum() / total) if total > 0 else nan,
            "inputs_share": float(col["t_inputs"][warm].sum() / total) if total > 0 else nan,
            "running_mean": float(running.sum() / n_sub),
            "running_peak": int(col["running"].max()),
            "preemptions": int(col["preemptions"].sum()),
            "page_util_mean": float((util * sub).sum() / n_sub),
            "page_util_peak": float(util.max()),
            "prefix_hit_tokens": int(col["prefix_hit_tokens"].sum()),
            "prefill_tokens": int(col["prefill_tokens"].sum()),
            "prefix_hit_rate": _ratio(col["prefix_hit_tokens"].sum(),
                                      col["prefix_hit_tokens"].sum() + col["prefill_tokens"].sum()),
            "cached_pages_mean": float((col["cached_pages"] * sub).sum() / n_sub),
            "prefix_hit_tokens_host": int(col["prefix_hit_tokens_host"].sum()),
            "prefix_hit_tokens_device": int((col["prefix_hit_tokens"] - col["prefix_hit_tokens_host"]).sum()),
            "host_bytes_out": int(col["host_bytes_out"].sum()),
            "host_bytes_in": int(col["host_bytes_in"].sum()),
            "copy_share": float(col["t_copy"][warm].sum() / total) if total > 0 else nan,
            "shapes": len({(r.bucket_tokens, r.bucket_rows, r.bucket_blocks, r.decode_only, r.burst > 1)
                           for r in recs}),
            **_per_device(recs, sub, pages),
            **_speculative(recs, col),
        }


def verify_burst_counts(plan: StepPlan, result: np.ndarray) -> tuple[int, int, int]:
    """``(computed, row_steps, sub_steps)`` of a resolved verification burst (``result``: its ``i32[S * B * (K +
    2)]``, read by :func:`kvjax.sched.spec.verified`): the positions its real rows verified (``1 + k`` per row and
    sub-step it ran), the (row, sub-step) pairs that ran, and the sub-steps in which some row ran (the burst's loop
    ends when no row is live, :func:`kvjax.engine.verify.verify_burst`: the sub-steps that ran)."""
    _, k, _, ran = spec.verified(plan, result)
    return int(((k + 1) * ran).sum()), int(ran.sum()), int(ran.any(axis=1).sum())


def _speculative(recs: list[StepRecord], col: dict[str, np.ndarray]) -> dict[str, Any]:
    """Speculative decoding's figures where some record verified drafts (else nothing): ``verify_steps``,
    ``drafts_proposed``, ``drafts_accepted``, ``acceptance_rate`` (accepted / proposed),
    ``acceptance_rate_per_position`` (position ``j``: rows accepting a draft there / rows verifying one there),
    ``tokens_per_verify_row`` (tokens a verification row gains: 1 + its accepted drafts, averaged) and
    ``tokens_per_verify_step`` (tokens generated per verification step)."""
    verify = col["verify_rows"] > 0
    if not verify.any():
        return {}
    width = max(len(r.drafts_proposed_at) for r in recs)
    at = np.zeros((2, width), np.int64)
    for r in recs:
        at[0, : len(r.drafts_proposed_at)] += np.asarray(r.drafts_proposed_at, np.int64)
        at[1, : len(r.drafts_accepted_at)] += np.asarray(r.drafts_accepted_at, np.int64)
    proposed, accepted, rows = (float(col[c].sum()) for c in ("drafts_proposed", "drafts_accepted", "verify_rows"))
    return {"verify_steps": int(verify.sum()), "drafts_proposed": int(proposed), "drafts_accepted": int(accepted),
            "acceptance_rate": _ratio(accepted, proposed),
            "acceptance_rate_per_position": [_ratio(a, p) for p, a in zip(*at.tolist())],
            "tokens_per_verify_row": _ratio(rows + accepted, rows),
            "tokens_per_verify_step": float(col["generated"][verify].mean())}


def _per_device(recs: list[StepRecord], sub: np.ndarray, pages: int) -> dict[str, Any]:
    """Per-device page use where every record has ``pages_used_devices`` (else nothing): lists with one entry
    per device pool, ``pages_used_device_mean`` (per sub-step), ``pages_used_device_peak``, and the pools'
    ``page_util_device_mean`` / ``page_util_device_peak`` (``pages`` spread evenly over the pools)."""
    widths = {len(r.pages_used_devices) for r in recs}
    if len(widths) != 1 or 0 in widths:
        return {}
    used = np.array([r.pages_used_devices for r in recs], np.float64)  # f64[steps, pools]
    mean = (used * sub[:, None]).sum(0) / sub.sum()
    per_pool = pages / used.shape[1]
    peak = used.max(0)
    return {"pages_used_device_mean": mean.tolist(), "pages_used_device_peak": peak.astype(int).tolist(),
            "page_util_device_mean": (mean / per_pool).tolist(), "page_util_device_peak": (peak / per_pool).tolist()}


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b > 0 else float("nan")
