"""How requests' tokens reach their consumers: :class:`StepOutput` and :class:`TokenEvent`, ``stream`` /
``generate``.

Each request is tracked from the moment it is queued until its last token has been delivered. An engine step
delivers one :class:`StepOutput` per request that got tokens (a decode burst gives a request up to ``K`` tokens in
one), so the host work of a step grows with its rows, not its tokens; a :meth:`Consumers.stream` consumer gets one
:class:`TokenEvent` per token. Tokens are routed to the stream that owns the request, whichever consumer ran the
step (two streams consumed alternately, ``generate`` inside a ``stream`` loop); the outputs of
:meth:`~kvjax.engine.engine.Engine.add_request` requests that a stream's steps produced are held for the next
``Engine.step()``. :class:`Consumers` is the part of :class:`~kvjax.engine.engine.Engine` that does this, ``abort``
included; it relies on the engine's ``schedulers``, ``_tracked``, ``_inbox``, ``_held``, ``_queue``, ``_step``
and ``vocab_size``.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from itertools import repeat
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from kvjax.engine.args import check_call, check_seed, check_temperature
from kvjax.config import is_int
from kvjax.errors import RequestTooLongError
from kvjax.sched.request import Request, Status


class TokenEvent(NamedTuple):
    """One generated token, as :meth:`Engine.stream` yields it (immutable; a named tuple)."""

    index: int  # position of the request's prompt in the ``prompts`` list of the call
    request_id: int  # scheduler request id (for :meth:`Engine.abort`)
    token: int  # the sampled token id
    position: int  # 0-based index of this token among the request's generated tokens
    finished: bool  # the request is done (max_new_tokens or eos)


class StepOutput(NamedTuple):
    """The tokens one engine step gave one request, in order (:meth:`Engine.step` returns one per request that got
    any, after those held from steps a stream consumer ran)."""

    index: int  # the ``index`` the request was added with (its prompt's position in a stream's ``prompts``)
    request_id: int  # scheduler request id (for :meth:`Engine.abort`)
    tokens: list  # list[int]: the new token ids (at least one)
    position: int  # 0-based index of ``tokens[0]`` among the request's generated tokens
    finished: bool  # the request is done (max_new_tokens or eos): ``tokens[-1]`` is its last token

    def events(self) -> list[TokenEvent]:
        """The same tokens as :class:`TokenEvent` s (the last one ``finished`` if the request is done)."""
        n = len(self.tokens)
        return [TokenEvent(self.index, self.request_id, t, self.position + i, self.finished and i == n - 1)
                for i, t in enumerate(self.tokens)]


@dataclasses.dataclass
class Tracked:
    index: int  # prompt index in its call (events, sampling stream)
    temperature: float  # 0 = greedy
    seed: int  # sampling seed
    request: Request  # the scheduler's request: its token buffer is the record of what was generated
    sent: int = 0  # generated tokens already delivered



class Consumers:
    """Event collection and the ``stream`` / ``generate`` consumers of an :class:`~kvjax.engine.engine.Engine`."""

    def abort(self, request_id: int) -> list[int]:
        """Abort a queued or running request (its slot and pages go back at once); returns the tokens that were
        delivered (by :meth:`step`, or yielded by its stream). Its tokens not yet delivered (a stream's queue,
        outputs held for the next ``step()``, a burst's later tokens) are dropped, and so is any token a step in
        flight samples for it (a request that finished in the scheduler with tokens still undelivered is aborted
        too). ``ValueError`` for a request id that is not an int, unknown, or whose tokens were all delivered."""
        if not is_int(request_id):
            raise ValueError(f"request_id must be an int, got {request_id!r}")
        owner = [s for s in self.schedulers if request_id in s.requests]
        if owner:
            owner[0].abort(request_id)
        elif request_id not in self._tracked and request_id not in self._queued:
            raise ValueError(f"unknown request id {request_id} (never added, aborted, or all its tokens delivered)")
        # finished in the scheduler with tokens not yet delivered, or still queued for its stream: drop them
        tr = self._tracked.pop(request_id, None) or self._queued.pop(request_id)
        box = self._inbox.pop(request_id, None)
        dropped = 0
        if box:
            kept = [ev for ev in box if ev.request_id != request_id]
            dropped = len(box) - len(kept)
            box.clear()
            box.extend(kept)
        dropped += sum(len(out.tokens) for out in self._held if out.request_id == request_id)
        self._held = [out for out in self._held if out.request_id != request_id]
        out = tr.request.output_ids.tolist()
        return out[: len(out) - dropped]

    def _collect(self, request_ids: Sequence[int]) -> list[StepOutput]:
        """Outputs of the tokens these requests took since their last delivery (read from the scheduler's
        requests, so a step cut short still delivers what it recorded); queued for their stream consumer too."""
        outs, tracked = [], self._tracked
        for rid in request_ids:
            tr = tracked.get(rid)
            if tr is None:
                continue
            req = tr.request
            new = req.token_ids[req.prompt_len + tr.sent: req.num_resolved].tolist()  # resolved, not sent
            done = (req.status is Status.FINISHED and not req.pending) or req.complete
            self._deliver(tr, rid, new, done, outs)
            if done:
                del tracked[rid]
                if rid in self._inbox:  # its last events wait in its stream's queue: abort may still drop them
                    self._queued[rid] = tr
        return outs

    def _deliver(self, tr: Tracked, rid: int, new: list[int], done: bool, outs: list[StepOutput]) -> None:
        """Append the :class:`StepOutput` of request ``rid``'s ``new`` tokens to ``outs`` (``finished`` if
        ``done``), their :class:`TokenEvent` s to its stream's queue if it has one, and record them as sent."""
        if not new:
            return
        out = StepOutput(tr.index, rid, new, tr.sent, done)
        outs.append(out)
        box = self._inbox.get(rid)
        if box is not None:
            have, n = tr.sent, len(new)
            new_tuple = tuple.__new__  # a TokenEvent from its fields' tuple, without the generated __new__'s call
            evs = [new_tuple(TokenEvent, f) for f in zip(repeat(tr.index, n), repeat(rid, n), new,
                                                         range(have, have + n), repeat(False, n))]
            if done:
                evs[-1] = evs[-1]._replace(finished=True)
            box.extend(evs)
        tr.sent += len(new)

    def _collect_plan(self, sched, plan) -> list[StepOutput]:
        """:meth:`_collect` for one resolved plan's rows, reading the running requests' counters and new tokens
        from the scheduler's row table in one gather (a row whose request left the table, or finished, takes the
        per-request path)."""
        rids, n, rt = plan.request_ids, plan.num_seqs, sched.rows
        if not n:
            return []
        slots = np.asarray(plan.gdn_slots[:n], np.int64)  # i64[n]
        tracked = self._tracked
        trs = [tracked.get(rid) for rid in rids]
        sent = np.fromiter([-1 if tr is None else tr.sent for tr in trs], np.int64, n)  # i64[n]; -1: not tracked
        bound = rt.request_id[slots] == np.asarray(rids, np.int64)  # bool[n]: the request still runs there
        first = rt.prompt_len[slots] + np.maximum(sent, 0)  # i64[n]: position of the first token not delivered
        count = np.where(bound, rt.num_tokens[slots] - rt.num_pending[slots] - first, 0)  # i64[n]: resolved since
        m = int(count.max())
        new = rt.tokens[slots[:, None], np.minimum(first[:, None] + np.arange(m), rt.tokens.shape[1] - 1)].tolist() \
            if m > 0 else None  # [n][m]: each row's next m tokens (the first count[b] are new)
        new_tuple = tuple.__new__  # a StepOutput from its fields' tuple (no generated __new__)
        ks = count.tolist()
        if not self._inbox and m > 0 and min(ks) == m and bound.all() and (sent >= 0).all():
            # the usual decode step: every row running, tracked and given m new tokens; no stream to feed
            outs = list(map(new_tuple, repeat(StepOutput), zip([tr.index for tr in trs], rids, new, sent.tolist(),
                                                                  repeat(False))))
            for tr, k in zip(trs, ks):
                tr.sent += k
            return outs
        outs: list[StepOutput] = []
        inbox = self._inbox
        for rid, tr, k, left, row in zip(rids, trs, ks, (~bound).tolist(), new or repeat(None)):
            if left:  # finished or left the table: its request object holds its state
                outs += self._collect([rid])
            elif tr is not None and k > 0:  # a running request is not done: finishing unbinds it first
                if inbox:
                    self._deliver(tr, rid, row[:k], False, outs)
                else:
                    outs.append(new_tuple(StepOutput, (tr.index, rid, row[:k], tr.sent, False)))
                    tr.sent += k
        return outs

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
               temperature: float = 0.0, seed: int = 0, progress: bool | None = None) -> Iterator[TokenEvent]:
        """Generate for every prompt, yielding each token as it is sampled (:class:`TokenEvent`).

        Arguments are checked when ``stream`` is called (``ValueError`` naming the value, as
        :meth:`add_request`); the requests are queued at the first ``next()``. A prompt that can never fit raises
        :class:`RequestTooLongError` naming its index before any step runs, and none of this call's requests
        stays queued. The caller may :meth:`abort` any request (by ``event.request_id``) between events;
        closing the generator early (or an error inside it) aborts what is left.

        Several consumers may run at once (two streams consumed alternately, ``generate`` inside a ``stream``
        loop): whichever consumer runs a step, every event goes to the stream whose request produced it, so
        each consumer gets all of its tokens, in order. ``progress``: tqdm bar over generated tokens (``None``:
        on when the run generates >= 4096 tokens).
        """
        calls = check_call(prompts, max_new_tokens, self.vocab_size)
        temperature, seed = check_temperature(temperature), check_seed(seed)
        return self._stream(calls, temperature, seed, progress)

    def _stream(self, calls: list, temperature: float, seed: int, progress: bool | None) -> Iterator[TokenEvent]:
        ids = []
        try:
            for i, (p, m) in enumerate(calls):
                try:
                    ids.append(self._queue(p, m, temperature, seed, i))
                except RequestTooLongError as err:
                    raise RequestTooLongError(f"prompt {i} (length {len(p)}) rejected: {err}") from None
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        box: collections.deque[TokenEvent] = collections.deque()
        for rid in ids:
            self._inbox[rid] = box
        bar = self._progress_bar(int(sum(m for _, m in calls)), progress)
        try:
            while box or any(rid in self._tracked for rid in ids):
                if not box:
                    self._held += [out for out in self._step() if out.request_id not in self._inbox]
                    continue
                ev = box.popleft()
                if ev.finished:
                    self._queued.pop(ev.request_id, None)
                if bar is not None:
                    bar.update(1)
                yield ev
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:  # generator closed early: abort what is left
                self._inbox.pop(rid, None)
                self._queued.pop(rid, None)
                if rid in self._tracked:
                    self.abort(rid)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
                 temperature: float = 0.0, seed: int = 0, progress: bool | None = None) -> list[list[int]]:
        """Generate for every prompt; returns the generated token ids per prompt (prompt order).

        ``temperature == 0`` is greedy. Sampling keys derive from ``(seed, prompt index, tokens so far)``, so the
        result does not depend on batching, preemption or the recycle policy. Raises ``ValueError`` (nothing
        queued) for a bad argument (see :meth:`add_request`) and :class:`RequestTooLongError` (nothing queued)
        if a prompt can never fit in the cache. May run inside another consumer's :meth:`stream` loop.
        """
        events = self.stream(prompts, max_new_tokens, temperature=temperature, seed=seed, progress=progress)
        out: list[list[int]] = [[] for _ in range(len(prompts))]
        for ev in events:
            out[ev.index].append(ev.token)
        return out

    @staticmethod
    def _progress_bar(total: int, progress: bool | None):
        if progress is False or (progress is None and total < 4096):
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            warnings.warn("progress bar requested but tqdm is not installed", stacklevel=3)
            return None
        return tqdm(total=total, unit="tok", desc="generate")

