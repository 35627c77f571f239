"""Capacity-simulator sweeps: how much head-wise SWA recycling buys at fixed page memory, and why.

Wraps :func:`kvjax.sched.simulate.simulate` (the real scheduler, no model: every decoding row "generates" one
token per step) over one varied parameter at a time: the fraction of SWA KV heads, the window, the sink count,
the pool policy. :func:`trace_simulation` reruns one configuration step by step through the public
:class:`~kvjax.sched.scheduler.Scheduler` API and records pages in use, running requests and generated tokens
per step (the simulator itself only reports aggregates).

Rows are plain dicts (``SimResult`` fields plus ``window``, ``sinks``, ``gain``, ``bound_gain``) so a notebook
can tabulate or plot them without pandas.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from kvjax.config import CacheConfig
from kvjax.sched.scheduler import Scheduler
from kvjax.sched.simulate import sim_result, simulate, simulation_steps, throughput_bound
from kvjax.sched.workload import RequestSpec, cache_for, seed_workload, swa_layout

SWEEP_KEYS = ("swa_fraction", "window", "sinks", "pool")


@dataclasses.dataclass(frozen=True)
class SimSetup:
    """A workload and the fixed page memory it runs in."""

    workload: tuple  # tuple[RequestSpec, ...], all arriving at step 0
    cache: CacheConfig
    kv_heads: int
    max_num_batched_tokens: int

    @property
    def mean_prompt(self) -> float:
        return float(np.mean([w.prompt.size for w in self.workload]))

    @property
    def mean_output(self) -> float:
        return float(np.mean([w.max_new_tokens for w in self.workload]))

    def attention(self, swa_fraction: float, window: int, sinks: int):
        """The layer layout: the first ``round(swa_fraction * kv_heads)`` KV heads SWA."""
        return swa_layout(self.kv_heads, swa_fraction, window, sinks if swa_fraction > 0 else 0)


def seed_setup(num_requests: int, *, scale: float, kv_heads: int = 4, page_size: int = 64,
               memory_requests: float = 8.0, max_seqs: int = 64, max_tokens: int = 2048, seed: int = 0) -> SimSetup:
    """The seed-shaped workload (``kvjax.sched.workload.seed_workload``: ~10.6k prompt / ~4.05k output tokens
    times ``scale``) in page memory holding ``memory_requests`` mean-length requests on every head."""
    wl = seed_workload(num_requests, scale=scale, seed=seed)
    cache = cache_for(wl, num_kv_heads=kv_heads, page_size=page_size, full_requests=memory_requests,
                      max_seqs=max_seqs)
    return SimSetup(tuple(wl), cache, kv_heads, max_tokens)


class SimSweep:
    """Runs simulator configurations of one :class:`SimSetup`, memoised.

    ``recycle="none"`` keeps every page of every head, so its schedule does not depend on the SWA layout: it is
    simulated once per pool and reused (its ``bound`` is the no-recycling bound, also layout-independent).
    """

    def __init__(self, setup: SimSetup, *, seed: int = 0) -> None:
        self.setup = setup
        self.seed = seed
        self._memo: dict[tuple, dict] = {}

    def run(self, *, swa_fraction: float, window: int, sinks: int, pool: str, recycle: str) -> dict:
        """One configuration -> a row dict (``SimResult`` fields, ``window``, ``sinks``)."""
        s = self.setup
        key = (pool, recycle) if recycle == "none" else (swa_fraction, window, sinks, pool, recycle)
        if key not in self._memo:
            att = s.attention(swa_fraction if recycle != "none" else 1.0, window, sinks)
            res = simulate(list(s.workload), s.cache, att, max_num_batched_tokens=s.max_num_batched_tokens,
                           pool=pool, recycle=recycle, seed=self.seed)
            self._memo[key] = dataclasses.asdict(res)
        return dict(self._memo[key], swa_fraction=swa_fraction, window=window, sinks=sinks, pool=pool,
                    recycle=recycle)

    def trace(self, *, swa_fraction: float, window: int, sinks: int, pool: str, recycle: str) -> dict:
        """:func:`trace_simulation` of one configuration; its summary row is memoised for :meth:`run`."""
        tr = trace_simulation(self.setup, swa_fraction=swa_fraction, window=window, sinks=sinks, pool=pool,
                              recycle=recycle, seed=self.seed)
        key = (pool, recycle) if recycle == "none" else (swa_fraction, window, sinks, pool, recycle)
        self._memo.setdefault(key, dict(tr["row"]))
        return tr

    def compare(self, **config) -> dict:
        """``none`` and ``timely`` for one configuration: ``{"none": row, "timely": row}``, each with ``gain`` and
        ``bound_gain`` relative to ``none``."""
        out = {r: self.run(**config, recycle=r) for r in ("none", "timely")}
        base = out["none"]
        for row in out.values():
            row["gain"] = row["tokens_per_step"] / base["tokens_per_step"]
            row["bound_gain"] = row["bound_tokens_per_step"] / base["bound_tokens_per_step"]
        return out

    def sweep(self, vary: str, values: Iterable, base: dict) -> list[dict]:
        """Vary one of ``SWEEP_KEYS`` over ``values`` with the rest from ``base``; rows for none and timely,
        each tagged with ``"value"`` (the varied value)."""
        if vary not in SWEEP_KEYS:
            raise ValueError(f"vary must be one of {SWEEP_KEYS}, got {vary!r}")
        missing = set(SWEEP_KEYS) - set(base) - {vary}
        if missing:
            raise ValueError(f"base config lacks {sorted(missing)}")
        rows = []
        for v in values:
            cfg = dict(base, **{vary: v})
            for row in self.compare(**cfg).values():
                rows.append(dict(row, value=v))
        return rows


def select(rows: list[dict], **match) -> list[dict]:
    """Rows whose fields equal every ``match`` item."""
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def column(rows: list[dict], name: str) -> np.ndarray:
    return np.array([r[name] for r in rows])


def format_rows(rows: list[dict], cols: tuple[str, ...] = ("value", "pool", "recycle", "tokens_per_step",
                                                            "bound_tokens_per_step", "gain", "bound_gain",
                                                            "peak_concurrency", "preemptions",
                                                            "page_util_mean")) -> str:
    """A fixed-width text table of ``rows`` (floats to 4 significant digits)."""
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(x) for x in cells])


def trace_simulation(setup: SimSetup, *, swa_fraction: float, window: int, sinks: int, pool: str, recycle: str,
                     seed: int = 0) -> dict:
    """Per-step trace of one simulator run: ``pages_used``, ``running``, ``generated``, ``preemptions``
    (cumulative), each ``int64[steps]``, plus ``num_pages`` and ``row``: the run's summary with the fields of
    :class:`kvjax.sched.simulate.SimResult` (same numbers as :func:`~kvjax.sched.simulate.simulate`).

    Same loop as :func:`kvjax.sched.simulate.simulate` (every sampling row generates one random token)."""
    att = setup.attention(swa_fraction, window, sinks)
    sched = Scheduler(setup.cache, att, max_num_batched_tokens=setup.max_num_batched_tokens, pool=pool,
                      recycle=recycle)
    for w in setup.workload:
        sched.add_request(w.prompt, w.max_new_tokens)
    pages, running, generated, preempt = [], [], [], []
    for plan in simulation_steps(sched, seed=seed):
        pages.append(sched.blocks.used_pages())
        running.append(len(sched.running))
        generated.append(int(plan.sample_mask.sum()))
        preempt.append(sched.num_preemptions)
    gen = np.asarray(generated, np.int64)
    util = np.asarray(pages, np.float64) / setup.cache.num_pages
    row = dataclasses.asdict(sim_result(list(setup.workload), sched, pool=pool, recycle=recycle,
                                        generated=int(gen.sum()), peak=int(max(running)), util=util))
    return {"pages_used": np.asarray(pages, np.int64), "running": np.asarray(running, np.int64), "generated": gen,
            "preemptions": np.asarray(preempt, np.int64), "num_pages": setup.cache.num_pages, "row": row}


def workload_bound(workload: list[RequestSpec], cache: CacheConfig, attention, *, max_num_batched_tokens: int,
                   pool: str, recycle: str) -> float:
    """The simulator's upper bound on generated tokens per step for any workload (see
    :func:`kvjax.sched.simulate.throughput_bound`)."""
    return float(throughput_bound(list(workload), cache, attention, max_num_batched_tokens=max_num_batched_tokens,
                                  pool=pool, recycle=recycle != "none"))
