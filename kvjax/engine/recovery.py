"""Fault recovery of the engine: after a fault in a step, every data shard's scheduler is brought back to a state
the next step can run from (:class:`Recovery`, a part of :class:`~kvjax.engine.engine.Engine`).

The tokens of steps in flight are dropped (each scheduler's ``rollback``), every running request is preempted by
recompute (one that already took its last token is released), and the caches, possibly donated or written by a
lost step, are rebuilt before the next step. Tokens already read are kept, so a run continues to the same outputs
as an uninterrupted one. :class:`Recovery` relies on the engine's ``schedulers``, ``_inflight``, ``caches``,
``_record``, ``_collect``, ``_held``, ``_inbox`` and ``num_recoveries``.
"""

from __future__ import annotations

from kvjax.engine.consumers import is_done
from kvjax.sched.plan import StepPlan
from kvjax.sched.request import Status
from kvjax.sched.scheduler import Scheduler


class Recovery:
    """The engine's ``_recover`` (see the module docstring)."""

    def _recover(self, plans: list[StepPlan] | None, device_called: bool) -> None:
        """Bring the engine back to a state the next step can run from after a fault in a step (``plans``: the
        step's plans, one per data shard, if it got that far): the tokens of steps in flight are dropped (the
        schedulers' rollback), every running request is preempted by recompute (a request that already took
        its last token is released), and the caches, possibly donated or written by a lost step, are rebuilt at
        the next step. Tokens already read are delivered (by the next ``step()``, or to their stream)."""
        self.num_recoveries += 1
        lost = [f.plans for f in self._inflight] + ([plans] if plans is not None else [])
        if device_called or self._inflight:
            self.caches = None
        for f in self._inflight:  # their device work counts; their tokens are lost
            self._record(f, generated=0, t_wait=0.0, t_update=0.0, t_part=0.0, t_exposed=0.0)
        self._inflight.clear()
        touched: dict[int, None] = {}
        for d, sched in enumerate(self.schedulers):
            touched.update(dict.fromkeys(recover_shard(sched, [ps[d] for ps in lost])))
        self._held += [out for out in self._collect(list(touched)) if out.request_id not in self._inbox]


def recover_shard(sched: Scheduler, plans: list[StepPlan]) -> list[int]:
    """One data shard's part of :meth:`Recovery._recover` (``plans``: its lost plans); returns the ids of the
    requests it touched."""
    for p in plans:  # cut short between "took its last token" and "released"
        for rid in p.request_ids:
            req = sched.requests.get(rid)
            if req is not None and req.status is Status.RUNNING and req not in sched.running:
                sched.running.append(req)
    touched = [*(rid for p in plans for rid in p.request_ids), *(r.request_id for r in sched.running)]
    for req in list(sched.running):
        if is_done(req):
            sched.abort(req.request_id)  # releases slot and pages; its tokens are complete
    sched.rollback()  # drops reserved tokens; preempts the running requests the lost steps advanced
    for req in reversed(list(sched.running)):
        sched._preempt(req)  # the scheduler's own preemption path (progress dropped, requeued first)
    return touched
