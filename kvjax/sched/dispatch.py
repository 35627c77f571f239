"""One workload over several engines (data parallelism, one engine per process): which engine serves which request,
and a host-only simulation of it (behind ``kvjax simulate --processes N``; :mod:`kvjax.cli.processes` runs the
same splits on real engines).

The unit of work is a *chain*: a request and every request whose ``after`` leads back to it (a conversation's
turns), which stay in one engine and its prefix cache. Two splits:

- ``static``: :func:`shares` deals the chains, largest first (prompt + output tokens), each to the engine with
  the fewest tokens so far, before the run;
- ``dynamic``: the chains, largest first, go one at a time to whichever engine has no request waiting (in
  ``kvjax run`` a counter on ``jax.distributed``'s coordinator hands them out).

:func:`simulate_dispatch` runs ``E`` real schedulers (:class:`~kvjax.sched.scheduler.Scheduler`, no model) in
lockstep, one step each per round, as if every engine's step took the same time; a run's length is its slowest
engine's steps. Against one engine serving the whole workload (:func:`kvjax.sched.simulate.simulate`) that gives
the most a split can gain from the scheduler's side: an engine whose steps run slower (a busier host, another GPU)
is outside it, which is what the dynamic split adapts to and the simulation cannot show.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.sched.scheduler import Scheduler
from kvjax.sched.workload import RequestSpec

SHARES = ("dynamic", "static")


def chains(workload: Sequence) -> list[list[int]]:
    """The requests of ``workload`` grouped into chains (a request with ``after`` joins its predecessor's chain, so a
    conversation's turns stay in one engine and its prefix cache), largest first by tokens (prompt + output; ties
    by first index), each chain's indices in workload order."""
    root = []
    for i, w in enumerate(workload):
        after = getattr(w, "after", -1)
        root.append(root[after] if 0 <= after < i else i)
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(root):
        groups.setdefault(r, []).append(i)
    cost = {r: sum(workload[i].total_len for i in idx) for r, idx in groups.items()}
    return [groups[r] for r in sorted(groups, key=lambda r: (-cost[r], r))]


def shares(workload: Sequence, engines: int) -> list[list[int]]:
    """The static split: which requests of ``workload`` each of ``engines`` serves, its indices in workload order.
    The :func:`chains` go, largest first, to the engine with the fewest tokens (prompt + output) so far (a
    round-robin split leaves the slowest engine's wall, which the run's rate is over, longer). Deterministic."""
    load, out = [0] * engines, [[] for _ in range(engines)]
    for chain in chains(workload):
        e = min(range(engines), key=lambda e: (load[e], e))
        load[e] += sum(workload[i].total_len for i in chain)
        out[e].extend(chain)
    return [sorted(o) for o in out]


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    """One simulated split of a workload over engines (plain Python values)."""

    share: str  # "dynamic" | "static"
    swa_fraction: float  # SWA KV heads / all KV heads
    pool: str  # "shared" | "partitioned"
    recycle: str  # the engines' recycle policy
    steps: tuple[int, ...]  # per engine: scheduler steps until its last request finished
    requests: tuple[int, ...]  # per engine: requests it served
    generated: tuple[int, ...]  # per engine: tokens it sampled
    preemptions: tuple[int, ...]  # per engine

    @property
    def run_steps(self) -> int:
        """The run's length in lockstep rounds: its slowest engine's steps."""
        return max(self.steps)


def simulate_dispatch(workload: list[RequestSpec], cache: CacheConfig, attention: AttentionConfig, *, engines: int,
                      share: str, max_num_batched_tokens: int, pool: str, recycle: str, seed: int = 0,
                      progress: Callable[[int], object] | None = None) -> DispatchResult:
    """Serve ``workload`` on ``engines`` schedulers of ``cache`` pages each (every one the pages of one engine, as
    ``kvjax run`` gives each process), stepped in lockstep: each round every engine with work runs one step (each
    sampling row gets a random token). ``share="static"``: each engine's :func:`shares` part is queued at the start;
    ``"dynamic"``: before its step an engine with no request waiting (nor preempted) takes the next chain, largest
    first. ``progress`` is called after each engine step with the tokens it generated (e.g. a tqdm bar's
    ``update``). ``ValueError`` naming the value for ``engines < 1`` or an unknown ``share``; ``RuntimeError`` if a
    round schedules nothing anywhere while work is left."""
    if not isinstance(engines, int) or isinstance(engines, bool) or engines < 1:
        raise ValueError(f"engines must be an int >= 1, got {engines!r}")
    if share not in SHARES:
        raise ValueError(f"share must be one of {SHARES}, got {share!r}")
    rng = np.random.default_rng(seed)
    scheds = [Scheduler(cache, attention, max_num_batched_tokens=max_num_batched_tokens, pool=pool, recycle=recycle)
              for _ in range(engines)]
    order = chains(workload) if share == "dynamic" else []
    served = [0] * engines
    if share == "static":
        for e, part in enumerate(shares(workload, engines)):
            for i in part:
                scheds[e].add_request(workload[i].prompt, workload[i].max_new_tokens)
            served[e] = len(part)
    steps, generated = [0] * engines, [0] * engines
    nxt = 0
    while nxt < len(order) or any(s.has_unfinished() for s in scheds):
        ran = False
        for e, sched in enumerate(scheds):
            if nxt < len(order) and not sched.waiting and not sched.preempted:
                for i in order[nxt]:
                    sched.add_request(workload[i].prompt, workload[i].max_new_tokens)
                served[e] += len(order[nxt])
                nxt += 1
            if not sched.has_unfinished():
                continue
            plan = sched.schedule()
            if plan.num_seqs == 0:
                continue
            sched.update(plan, rng.integers(1, 32_000, plan.num_seqs))
            steps[e] += 1
            generated[e] += int(plan.sample_mask.sum())
            ran = True
            if progress is not None:
                progress(int(plan.sample_mask.sum()))
        if not ran and any(s.has_unfinished() for s in scheds):
            raise RuntimeError(f"dispatch simulation stalled after {max(steps)} rounds: nothing schedulable")
    return DispatchResult(share, len(attention.swa_heads) / attention.num_kv_heads, pool, recycle, tuple(steps),
                          tuple(served), tuple(generated), tuple(s.num_preemptions for s in scheds))


def format_dispatch_table(results: list[DispatchResult], one_engine_steps: dict[tuple[float, str, str], int]) -> str:
    """Fixed-width table of :func:`simulate_dispatch` runs: per engine its steps, requests and preemptions; the run's
    rounds (its slowest engine's steps) and ``vs one``: ``one_engine_steps[(swa_fraction, pool, recycle)]`` (one
    engine serving the whole workload) over them, the most the split can gain at equal step times."""
    head = (f"{'swa':>5} {'pool':11} {'recycle':7} {'share':7} {'steps per engine':>22} {'requests':>14} "
            f"{'preempt':>14} {'rounds':>7} {'vs one':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        one = one_engine_steps.get((r.swa_fraction, r.pool, r.recycle))
        ratio = f"{one / r.run_steps:6.3f}x" if one else "      -"
        lines.append(f"{r.swa_fraction:5.2f} {r.pool:11} {r.recycle:7} {r.share:7} "
                     f"{' / '.join(map(str, r.steps)):>22} {' / '.join(map(str, r.requests)):>14} "
                     f"{' / '.join(map(str, r.preemptions)):>14} {r.run_steps:7d} {ratio}")
    return "\n".join(lines)
