"""How requests' tokens reach their consumers: :class:`StepOutput`, :class:`TokenEvent` and the router
:class:`Outputs`.

Each request is tracked from the moment it is queued until its last token has been delivered. An engine step
delivers one :class:`StepOutput` per request that got tokens (a decode burst gives a request up to ``K`` tokens in
one), so the host work of a step grows with its rows, not its tokens; an ``Engine.stream`` consumer gets one
:class:`TokenEvent` per token. Tokens are routed to the stream that owns the request, whichever consumer ran the
step (two streams consumed alternately, ``generate`` inside a ``stream`` loop); the outputs of
``Engine.add_request`` requests that a stream's steps produced are held for the next ``Engine.step()``. The
engine owns one :class:`Outputs`; it reads the scheduler only through public calls (``Scheduler.new_tokens`` and
the requests it tracks).
"""

from __future__ import annotations

import collections
import dataclasses
from itertools import repeat
from typing import NamedTuple, Sequence

import numpy as np

from kvjax.engine.sampling import SamplingParams
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


class Chunks(collections.deque):
    """A stream's queue of whole :class:`StepOutput` s (``Outputs.open_stream(chunks=True)``)."""


@dataclasses.dataclass
class Tracked:
    """A request the engine tracks from queueing until its last token is delivered."""

    index: int  # prompt index in its call (events, sampling stream)
    params: SamplingParams  # how it samples (temperature, top-k / top-p, seed) and its limits
    request: Request  # the scheduler's request: its token buffer is the record of what was generated
    sent: int = 0  # generated tokens already delivered


class Outputs:
    """The engine's record of what each request has been given, and its consumers' queues.

    ``tracked``: request id -> :class:`Tracked` from queueing until its last token is delivered; ``inbox``: request
    id -> the event queue of the stream that owns it; ``queued``: finished requests whose last events still wait in
    a stream's queue (an abort may drop them); ``held``: outputs of requests no stream owns, produced by steps a
    stream consumer ran, kept for the next ``Engine.step()``.
    """

    def __init__(self) -> None:
        self.tracked: dict[int, Tracked] = {}
        self.inbox: dict[int, collections.deque] = {}
        self.queued: dict[int, Tracked] = {}
        self.held: list[StepOutput] = []
        self._undo: list[tuple] = []  # what this step changed, logged before each change (see rollback)

    # ---- a step as a transaction ---------------------------------------------------------------------------
    def begin(self) -> None:
        """A step starts: what it delivers from now on can be taken back by :meth:`rollback`."""
        self._undo = []

    def rollback(self) -> None:
        """Take back every delivery since :meth:`begin` (a fault cut the step short): the requests' counts of
        tokens given, the events queued for streams, the held outputs and the tracking of finished requests are
        as they were, so those tokens go out again, once, with a later step."""
        undo, self._undo = self._undo, []
        for entry in reversed(undo):
            kind = entry[0]
            if kind == "sent":
                entry[1].sent = entry[2]
            elif kind == "box":
                box, n = entry[1], entry[2]
                while len(box) > n:
                    box.pop()
            elif kind == "held":
                self.held = entry[1]
            elif kind == "tracked":
                self.tracked[entry[1]] = entry[2]
                self.queued.pop(entry[1], None)

    def rebind(self, requests: dict[int, Request]) -> None:
        """Point the tracked requests at these objects (a rebuilt scheduler's; request id -> request); those not
        among them keep theirs (complete: nothing left to compute)."""
        for table in (self.tracked, self.queued):
            for rid, tr in table.items():
                new = requests.get(rid)
                if new is not None:
                    tr.request = new

    def track(self, rid: int, tracked: Tracked) -> None:
        """Start tracking request ``rid`` (just queued)."""
        self.tracked[rid] = tracked

    def drop(self, rid: int) -> list[int]:
        """Forget request ``rid`` (aborted): its undelivered tokens (a stream's queue, held outputs) are dropped;
        returns the tokens it was given. ``ValueError`` if it is not known here."""
        tr = self.tracked.pop(rid, None) or self.queued.pop(rid, None)
        if tr is None:
            raise ValueError(f"unknown request id {rid} (never added, aborted, or all its tokens delivered)")
        box = self.inbox.pop(rid, None)
        dropped = 0
        if box:
            kept = [ev for ev in box if ev.request_id != rid]
            dropped = sum(len(ev.tokens) if type(ev) is StepOutput else 1 for ev in box if ev.request_id == rid)
            box.clear()
            box.extend(kept)
        dropped += sum(len(out.tokens) for out in self.held if out.request_id == rid)
        self.held = [out for out in self.held if out.request_id != rid]
        out = tr.request.output_ids.tolist()
        return out[: len(out) - dropped]

    def known(self, rid: int) -> bool:
        """``rid`` still has tokens to deliver (tracked, or events queued for its stream)."""
        return rid in self.tracked or rid in self.queued

    def hold(self, outs: list[StepOutput]) -> None:
        """Keep the outputs no stream owns for the next ``Engine.step()``."""
        self._undo.append(("held", self.held))
        self.held = self.held + [out for out in outs if out.request_id not in self.inbox]

    def take_held(self) -> list[StepOutput]:
        """The held outputs, handed out (the list is emptied)."""
        held = self.held
        self._undo.append(("held", held))
        self.held = []
        return held

    def open_stream(self, ids: Sequence[int], chunks: bool = False) -> collections.deque:
        """One queue for a stream's requests: of :class:`TokenEvent` s, or with ``chunks`` of the
        :class:`StepOutput` s themselves (``Engine.generate``: no per-token object)."""
        box: collections.deque = Chunks() if chunks else collections.deque()
        for rid in ids:
            self.inbox[rid] = box
        return box

    def consumed(self, ev: TokenEvent | StepOutput) -> None:
        """A stream yielded ``ev`` (an event, or a chunk of a :meth:`open_stream` ``(chunks=True)`` queue)."""
        if ev.finished:
            self.queued.pop(ev.request_id, None)

    def close_stream(self, ids: Sequence[int]) -> list[int]:
        """A stream ends: its queue goes; returns its requests still tracked (to abort)."""
        for rid in ids:
            self.inbox.pop(rid, None)
            self.queued.pop(rid, None)
        return [rid for rid in ids if rid in self.tracked]

    def collect(self, request_ids: Sequence[int]) -> list[StepOutput]:
        """Outputs of the tokens these requests took since their last delivery (read from the scheduler's
        requests, so a step cut short still delivers what it recorded); queued for their stream consumer too."""
        outs, tracked = [], self.tracked
        for rid in request_ids:
            tr = tracked.get(rid)
            if tr is None:
                continue
            req = tr.request
            new = req.token_ids[req.prompt_len + tr.sent: req.num_resolved].tolist()  # resolved, not sent
            done = (req.status is Status.FINISHED and not req.pending) or req.complete
            self.deliver(tr, rid, new, done, outs)
            if done:
                self._undo.append(("tracked", rid, tr))
                del tracked[rid]
                if rid in self.inbox:  # its last events wait in its stream's queue: abort may still drop them
                    self.queued[rid] = tr
        return outs

    def deliver(self, tr: Tracked, rid: int, new: list[int], done: bool, outs: list[StepOutput]) -> None:
        """Append the :class:`StepOutput` of request ``rid``'s ``new`` tokens to ``outs`` (``finished`` if
        ``done``), their :class:`TokenEvent` s to its stream's queue if it has one, and record them as sent."""
        if not new:
            return
        out = StepOutput(tr.index, rid, new, tr.sent, done)
        outs.append(out)
        box = self.inbox.get(rid)
        self._undo.append(("sent", tr, tr.sent))
        if type(box) is Chunks:
            self._undo.append(("box", box, len(box)))
            box.append(out)
        elif box is not None:
            self._undo.append(("box", box, len(box)))
            have, n = tr.sent, len(new)
            new_tuple = tuple.__new__  # a TokenEvent from its fields' tuple, without the generated __new__'s call
            evs = [new_tuple(TokenEvent, f) for f in zip(repeat(tr.index, n), repeat(rid, n), new,
                                                         range(have, have + n), repeat(False, n))]
            if done:
                evs[-1] = evs[-1]._replace(finished=True)
            box.extend(evs)
        tr.sent += len(new)

    def collect_plan(self, sched, plan) -> list[StepOutput]:
        """:meth:`collect` for one resolved plan's rows of ``sched``, their new tokens read in one gather
        (``Scheduler.new_tokens``; a row whose request left the table, or finished, takes the per-request path)."""
        rids, n = plan.request_ids, plan.num_seqs
        if not n:
            return []
        tracked = self.tracked
        trs = [tracked.get(rid) for rid in rids]
        sent = np.fromiter([-1 if tr is None else tr.sent for tr in trs], np.int64, n)  # i64[n]; -1: not tracked
        bound, count, new = sched.new_tokens(plan, sent)
        m = int(count.max())
        new_tuple = tuple.__new__  # a StepOutput from its fields' tuple (no generated __new__)
        ks = count.tolist()
        if not self.inbox and m > 0 and min(ks) == m and bound.all() and (sent >= 0).all():
            # the usual decode step: every row running, tracked and given m new tokens; no stream to feed
            outs = list(map(new_tuple, repeat(StepOutput), zip([tr.index for tr in trs], rids, new, sent.tolist(),
                                                                  repeat(False))))
            undo = self._undo
            for tr, k in zip(trs, ks):
                undo.append(("sent", tr, tr.sent))
                tr.sent += k
            return outs
        outs: list[StepOutput] = []
        inbox = self.inbox
        for rid, tr, k, left, row in zip(rids, trs, ks, (~bound).tolist(), new or repeat(None)):
            if left:  # finished or left the table: its request object holds its state
                outs += self.collect([rid])
            elif tr is not None and k > 0:  # a running request is not done: finishing unbinds it first
                if inbox:
                    self.deliver(tr, rid, row[:k], False, outs)
                else:
                    outs.append(new_tuple(StepOutput, (tr.index, rid, row[:k], tr.sent, False)))
                    self._undo.append(("sent", tr, tr.sent))
                    tr.sent += k
        return outs

