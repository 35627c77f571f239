"""The scheduler's ledger: what happens to requests between a step's plan and its sampled tokens.

``advance(plan)`` applies what the host knows at dispatch (requests move on and reserve the tokens the step
samples), ``resolve(plan, sampled)`` gives those tokens their values (oldest plan first), ``update`` does both at
once and ``rollback()`` forgets what a fault lost. The two-halves protocol is in the scheduler's module docstring.
The ledger owns the plans in flight; the running requests' rows (:class:`~kvjax.sched.request.RowTable`) and the
request table are the scheduler's, shared with it; a request that finishes or must be recomputed goes through the
scheduler's transitions (:class:`Transitions`), which free its slot and pages.
"""

from __future__ import annotations

import collections
from typing import Protocol

import numpy as np

from kvjax.sched.integrity import check_sampled
from kvjax.sched.plan import StepPlan
from kvjax.sched.request import Request, RowTable, Status


class Transitions(Protocol):
    """What the ledger asks of its scheduler (:class:`~kvjax.sched.scheduler.Scheduler`)."""

    def finish(self, req: Request) -> None: ...

    def preempt(self, req: Request) -> None: ...

    def requeue(self, req: Request) -> None: ...

    def clear_prefix_cache(self) -> int: ...


class Ledger:
    """Plans between ``schedule`` and their tokens: ``advance`` / ``resolve`` / ``update`` / ``rollback``.

    ``rows``: the running requests' row table; ``requests``: request id -> request (both the scheduler's);
    ``transitions``: the scheduler. ``planned``: the latest plan, scheduled and not advanced; ``unresolved``:
    ``(plan, i64[nseq] its rows' slots, i64[nseq] its rows' request ids)`` of each advanced plan, oldest first.
    """

    def __init__(self, rows: RowTable, requests: dict[int, Request], transitions: Transitions) -> None:
        self.rows, self.requests, self.transitions = rows, requests, transitions
        self.planned: StepPlan | None = None
        self.unresolved: collections.deque[tuple[StepPlan, np.ndarray, np.ndarray]] = collections.deque()

    def update(self, plan: StepPlan, sampled: np.ndarray) -> list[Request]:
        """Apply a step's result at once: ``advance(plan)`` then ``resolve(plan, sampled)`` (``sampled: int[B]``,
        the token sampled for each plan row, read only where ``plan.sample_mask``). Returns the requests that
        finished. Raises ``ValueError`` before changing anything for a stale plan, an earlier plan still
        unresolved, or a bad ``sampled`` (see :meth:`resolve`); the plan can then still be applied."""
        if plan is not self.planned:
            raise ValueError(f"update() needs the plan of the latest schedule(), got the plan of step "
                             f"{getattr(plan, 'step', plan)!r}")
        if self.unresolved:
            raise ValueError(f"update() with step {self.unresolved[0][0].step} advanced and not resolved")
        tokens = check_sampled(plan, sampled)
        return self.advance(plan) + self._resolve(plan, tokens)

    def advance(self, plan: StepPlan) -> list[Request]:
        """Apply the host-known half of the latest plan: requests advance by their tokens and reserve the token
        the plan samples for them; those that reach ``max_new_tokens`` finish (slot and pages freed). Returns
        them. ``ValueError`` (nothing changed) unless ``plan`` is the latest schedule()'s, not yet advanced."""
        t, nseq = self.rows, plan.num_seqs
        slots, live = self.take(plan)
        sample = plan.sample_mask[:nseq]  # bool[nseq]
        steps = plan.query_lens[:nseq] if plan.burst_len is None else plan.burst_len[:nseq]  # i32[nseq]
        if live.all():  # the usual case: no masking
            t.num_computed[slots] += steps
        else:
            t.num_computed[slots[live]] += steps[live]
            sample = live & sample
        rows = np.flatnonzero(sample)  # i64[K]: rows that reserve a token
        if plan.burst == 1:
            done = t.reserve(slots[rows], rows, plan.step)
        else:  # a burst: row b reserves the tokens of its steps[b] sub-steps
            done = t.reserve_burst(slots[rows], rows, np.maximum(steps[rows], 1).astype(np.int64),
                                   plan.token_stride, plan.step)
        finished = [t.requests[slot] for slot in done.tolist()]
        for req in finished:
            self.transitions.finish(req)
        return finished

    def take(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """Move the latest plan from scheduled to unresolved (the first part of every ``advance``): returns its
        rows' slots (i64[nseq]) and which rows are still running (bool[nseq]: not aborted between schedule and
        now). ``ValueError`` (nothing changed) unless ``plan`` is the latest schedule()'s, not yet advanced."""
        if plan is not self.planned:
            raise ValueError(f"advance() needs the plan of the latest schedule(), not yet advanced; got the plan of "
                             f"step {getattr(plan, 'step', plan)!r}")
        self.planned = None
        nseq = plan.num_seqs
        slots = plan.gdn_slots[:nseq].astype(np.int64)  # i64[nseq]
        rids = np.fromiter(plan.request_ids, np.int64, nseq)  # i64[nseq]
        self.unresolved.append((plan, slots, rids))
        return slots, self.rows.request_id[slots] == rids

    def resolve(self, plan: StepPlan, sampled: np.ndarray) -> list[Request]:
        """Give the tokens ``plan`` reserved their sampled values (``sampled: int[>= num_seqs]``, row ``b``'s
        token, read where ``plan.sample_mask``; a burst's: ``int[>= (burst - 1) * S + num_seqs]``, sub-step ``j``
        of row ``b`` at ``j * S + b``, ``S = plan.token_stride``); a request that sampled eos finishes (tokens reserved after it are
        dropped). Returns the requests that finished here. Rows of requests aborted since, or whose token was
        dropped, are skipped. Raises ``ValueError`` before changing anything unless ``plan`` is the oldest
        advanced, unresolved plan and ``sampled`` a 1-d integer array of token ids in ``[0, 2**31)`` (checked
        where the plan samples) with an entry per row."""
        if not self.unresolved or plan is not self.unresolved[0][0]:
            oldest = self.unresolved[0][0].step if self.unresolved else None
            raise ValueError(f"resolve() takes the oldest advanced plan (step {oldest}), got the plan of step "
                             f"{getattr(plan, 'step', plan)!r}")
        return self._resolve(plan, check_sampled(plan, sampled))

    def _resolve(self, plan: StepPlan, tokens: np.ndarray) -> list[Request]:
        """``resolve`` after its checks (``tokens: i64[burst, nseq]``, sub-step by sub-step)."""
        if plan.burst > 1:
            finished = self._resolve_burst(plan, tokens)
            if finished is not None:
                self.unresolved.popleft()
                return finished
        _, slots, rids = self.unresolved[0]
        t, step, B = self.rows, plan.step, plan.token_stride
        sample = plan.sample_mask[: plan.num_seqs]
        steps = None if plan.burst_len is None else plan.burst_len[: plan.num_seqs]
        finished: list[Request] = []
        for j in range(plan.burst):
            sub = sample if steps is None else sample & (steps > j)  # bool[nseq]: rows sampling at sub-step j
            bound = sub & (t.request_id[slots] == rids)  # bool[nseq]: the row's request still runs there
            rows = np.flatnonzero(bound)
            ours = t.oldest_is(slots[rows], step, rows + j * B)  # bool[K]: its oldest reserved token is this one
            if not ours.all():
                rows = rows[ours]
            eos = set(rows[t.resolve(slots[rows], tokens[j, rows])].tolist())  # rows whose token was eos
            # One by one, in row order: the eos rows above, and the rows of requests no longer running there.
            for b in sorted(eos.union(np.flatnonzero(sub & ~bound).tolist())):
                self._resolve_row(plan, j, b, b in eos, tokens, finished)
        self.unresolved.popleft()
        return finished

    def _resolve_row(self, plan: StepPlan, j: int, b: int, eos: bool, tokens: np.ndarray,
                     finished: list[Request]) -> None:
        """Sub-step ``j`` of row ``b``, one by one: an eos the row table resolved (``eos``: its request finishes),
        or the token of a request no longer in the table, given to the request if it is still its oldest reserved
        one. Finished requests are appended to ``finished``; a finished one without reserved tokens is let go."""
        _, slots, rids = self.unresolved[0]
        if eos:
            req, hit = self.rows.requests[int(slots[b])], True
        else:
            req = self.requests.get(int(rids[b]))
            if req is None or req.status is Status.ABORTED or not req.pending \
                    or req.pending[0] != (plan.step, b + j * plan.token_stride):
                return
            hit = req.resolve(int(tokens[j, b]))
        if hit and req.status is not Status.FINISHED:
            self.transitions.finish(req)
            finished.append(req)
        if req.status is Status.FINISHED and not req.pending:
            self.requests.pop(req.request_id, None)

    def _resolve_burst(self, plan: StepPlan, tokens: np.ndarray) -> list[Request] | None:
        """``_resolve`` of a burst with every sub-step of the rows still bound in one pass of the row table
        (``RowTable.resolve_burst``); the other rows (requests that finished at ``advance``, aborted, preempted)
        and the eos hits one by one in the order of ``_resolve``'s sub-step loop. ``None``, changing nothing, where
        a bound row's oldest reserved tokens are not this plan's (``_resolve`` then goes sub-step by sub-step)."""
        _, slots, rids = self.unresolved[0]
        t, step, B, n = self.rows, plan.step, plan.token_stride, plan.num_seqs
        counts = np.where(plan.sample_mask[:n], plan.burst_len[:n], 0)  # i32[n]: tokens each row samples
        bound = t.request_id[slots] == rids  # bool[n]
        rows = np.flatnonzero(bound & (counts > 0))
        j = np.arange(plan.burst)
        grid = np.where(j < counts[rows, None], tokens[:, rows].T, -1)  # i64[K, burst]: -1 past a row's count
        first = t.resolve_burst(slots[rows], step, rows, B, grid)
        if first is None:
            return None
        eos = first < plan.burst
        events = [(int(first[k]), int(rows[k])) for k in np.flatnonzero(eos).tolist()]
        eos_rows = {b for _, b in events}
        for b in np.flatnonzero(~bound & (counts > 0)).tolist():
            events += [(jb, b) for jb in range(int(counts[b]))]
        finished: list[Request] = []
        for jb, b in sorted(events):
            self._resolve_row(plan, jb, b, b in eos_rows, tokens, finished)
        return finished

    def new_tokens(self, plan: StepPlan, sent: np.ndarray) -> tuple[np.ndarray, np.ndarray, list | None]:
        """The resolved tokens of a resolved ``plan``'s rows, from their request's output position ``sent[b]``
        (``i64[n]``, ``n = plan.num_seqs``; a negative value counts as 0), in one gather of the row table.
        Returns ``bound`` (bool[n]: the row's request still runs in its slot; other rows read nothing), ``count``
        (i64[n]: resolved output tokens from ``sent[b]`` on) and ``[n][m]`` lists of each row's next ``m =
        max(count)`` tokens (only the first ``count[b]`` are its; ``None`` when ``m`` is 0)."""
        rt, n = self.rows, plan.num_seqs
        slots = np.asarray(plan.gdn_slots[:n], np.int64)  # i64[n]
        bound = rt.request_id[slots] == np.asarray(plan.request_ids, np.int64)  # bool[n]
        first = rt.prompt_len[slots] + np.maximum(sent, 0)  # i64[n]: position of the first token asked for
        count = np.where(bound, rt.num_tokens[slots] - rt.num_pending[slots] - first, 0)  # i64[n]
        m = int(count.max()) if n else 0
        if m <= 0:
            return bound, count, None
        cols = np.minimum(first[:, None] + np.arange(m), rt.tokens.shape[1] - 1)  # i64[n, m]
        return bound, count, rt.tokens[slots[:, None], cols].tolist()

    def rollback(self) -> None:
        """Forget the latest plan if not advanced, and the advanced plans not yet resolved (a fault lost their
        results): their reserved tokens are dropped, every running request they advanced is preempted (its
        cache may lack their writes; recomputed later), a request that had finished on a reserved token is
        requeued as preempted, and one that had resolved its last token is let go."""
        self.planned = None
        self.transitions.clear_prefix_cache()  # a lost step never wrote the pages and checkpoints it published
        seen: set[int] = set()
        for _, _, rids in self.unresolved:
            for rid in rids.tolist():
                req = self.requests.get(rid)
                if req is None or id(req) in seen or req.status is Status.ABORTED:
                    continue
                seen.add(id(req))
                reserved = bool(req.pending)
                req.unreserve()
                if req.status is Status.RUNNING:
                    self.transitions.preempt(req)
                elif req.status is Status.FINISHED and reserved:
                    self.transitions.requeue(req)
                elif req.status is Status.FINISHED:  # took its last token; the resolve cut short kept it
                    del self.requests[rid]
        self.unresolved.clear()
