"""A request as the scheduler sees it: its tokens, how many are computed, its GDN slot, and its status; and the
per-slot table that holds the hot state of the running requests.

A step that samples a token for a request first *reserves* its place (``reserve``: the request has one more
token whose value is not known yet, so the next step can already be planned with it as input) and later
*resolves* it with the sampled value (``resolve``). ``append`` does both at once (the synchronous case).

Where the state lives. A request that is not running keeps its tokens, counters and reserved tokens in the
:class:`Request` object. While it runs (from the scheduler's ``start`` to its ``release``) it is *bound* to a
row of the scheduler's :class:`RowTable` (row = its GDN slot): the table's arrays hold its tokens, counters and
reserved tokens, so that a step reads and updates every running request with a few numpy operations, and the
object's attributes (``num_tokens``, ``num_computed``, ``token_ids``, ``pending`` …) read and write that row.
``bind`` copies the object's state into the row, ``unbind`` copies it back. What never changes (prompt length,
``max_new_tokens``, stop ids, request id) stays in the object too.

Stop ids. A request ends at the first sampled token among its ``eos_token_ids`` (up to :data:`MAX_STOP_IDS`
distinct ids: a checkpoint's eos ids and a request's own stop ids); the row table holds them as ``i64[S+1, E]``,
``-1`` padding, ``E`` grown to the widest bound request, so one eos id costs a step what it always did.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import numpy as np

from kvjax.config import INT32_MAX, is_int


MAX_STOP_IDS = 8  # stop token ids of one request at most (the width bound of RowTable.eos)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


def check_stop_ids(eos_token_id: Any, name: str = "eos_token_id", single: bool = True) -> tuple[int, ...]:
    """``eos_token_id`` (``None``, one token id if ``single``, or a sequence of them) as a tuple of distinct ids in
    ``[0, 2**31)``, in order (duplicates dropped); ``ValueError`` naming ``name`` for anything else or for more than
    :data:`MAX_STOP_IDS` distinct ids."""
    what = f"None, {'an int or ' if single else ''}a sequence of ints in [0, {INT32_MAX}]"
    if eos_token_id is None:
        return ()
    if single and is_int(eos_token_id):
        items = [eos_token_id]
    elif isinstance(eos_token_id, (list, tuple, np.ndarray)) and np.ndim(eos_token_id) == 1:
        items = list(eos_token_id)
    else:
        raise ValueError(f"{name} must be {what}, got {eos_token_id!r}")
    bad = [i for i in items if not is_int(i) or not 0 <= i <= INT32_MAX]
    if bad:
        raise ValueError(f"{name} must be {what}, got {eos_token_id!r} ({bad[0]!r})")
    ids = tuple(dict.fromkeys(int(i) for i in items))
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"{name} has {len(ids)} distinct ids, at most {MAX_STOP_IDS} are supported: {ids}")
    return ids


def check_request(prompt: np.ndarray, max_new_tokens: int, eos_token_id: Any) -> np.ndarray:
    """``prompt`` as an array after checking it is a non-empty 1-d array of token ids in ``[0, 2**31)``,
    ``max_new_tokens`` an int >= 1 and ``eos_token_id`` None, a token id or a sequence of them
    (:func:`check_stop_ids`); raises ``ValueError`` naming the bad value. Allocates nothing the size of
    ``max_new_tokens``."""
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt must be a non-empty 1-d integer array, got shape {prompt.shape} {prompt.dtype}")
    if prompt.min() < 0 or prompt.max() > INT32_MAX:
        raise ValueError(f"prompt token ids must lie in [0, {INT32_MAX}], got min {prompt.min()}, max {prompt.max()}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    check_stop_ids(eos_token_id)
    return prompt


class Request:
    """Prompt + generated tokens in one buffer (``token_ids: i32[prompt_len + max_new_tokens]``).

    ``num_tokens`` tokens exist (prompt + outputs so far, the last ``len(pending)`` of them reserved by steps
    in flight: their values are not known yet); ``num_computed`` of them have K/V in the cache. ``slot`` is the
    GDN slot (and block-table row) while running, 0 otherwise. While running, these attributes read and write
    the request's row of the scheduler's :class:`RowTable` (see the module docstring); ``pending`` is then a
    copy.
    """

    def __init__(self, request_id: int, prompt: np.ndarray, max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None = None) -> None:
        prompt = check_request(prompt, max_new_tokens, eos_token_id)
        self.request_id = request_id
        self.prompt_len = int(prompt.size)
        self.max_new_tokens = int(max_new_tokens)
        self.eos_token_ids = check_stop_ids(eos_token_id)  # tuple[int, ...]: the request ends at any of these
        self._token_ids = np.zeros(self.prompt_len + self.max_new_tokens, np.int32)  # i32[prompt + max_new]
        self._token_ids[: self.prompt_len] = prompt
        # i32[prompt_len + max_new_tokens]: prompt, then outputs (0 where reserved); while running, a view of the
        # table row (read it, do not keep it)
        self.token_ids = self._token_ids
        self._num_tokens = self.prompt_len
        self._num_computed = 0
        self._pending: list[tuple[int, int]] = []  # (plan step, plan row) sampling each reserved token, in order
        self._rows: RowTable | None = None  # the table this request is bound to while it runs
        self.slot = 0
        self.status = Status.WAITING
        self.num_preemptions = 0

    @property
    def eos_token_id(self) -> int | None:
        """The first of :attr:`eos_token_ids` (``None``: the request runs to ``max_new_tokens``)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # ---- state (the object's own, or its table row while bound) --------------------------------------------
    @property
    def num_tokens(self) -> int:
        rows = self._rows
        return self._num_tokens if rows is None else rows.num_tokens.item(self.slot)

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        if self._rows is None:
            self._num_tokens = int(value)
        else:
            self._rows.num_tokens[self.slot] = value

    @property
    def num_computed(self) -> int:
        rows = self._rows
        return self._num_computed if rows is None else rows.num_computed.item(self.slot)

    @num_computed.setter
    def num_computed(self, value: int) -> None:
        if self._rows is None:
            self._num_computed = int(value)
        else:
            self._rows.num_computed[self.slot] = value

    @property
    def pending(self) -> list[tuple[int, int]]:
        """[(plan step, plan row)] sampling each reserved token, oldest first (a copy while running)."""
        rows = self._rows
        return self._pending if rows is None else rows.pending(self.slot)

    @property
    def num_output(self) -> int:
        """Generated tokens, reserved ones included (what ``max_new_tokens`` and sampling counters count)."""
        return self.num_tokens - self.prompt_len

    @property
    def num_resolved(self) -> int:
        """Tokens whose values are known (prompt + resolved outputs)."""
        rows = self._rows
        if rows is None:
            return self._num_tokens - len(self._pending)
        return rows.num_tokens.item(self.slot) - rows.num_pending.item(self.slot)

    @classmethod
    def resumed(cls, req: "Request") -> "Request":
        """A new, detached request with ``req``'s id, prompt, limits and resolved outputs (its reserved tokens and
        cached progress dropped): how a request moves into a rebuilt scheduler (``Scheduler.rebuilt``)."""
        p = req.prompt_len
        n = min(max(req.num_resolved, p), req.num_tokens)  # a reservation cut short may count one token too few
        tokens = np.asarray(req.token_ids)
        new = cls(req.request_id, tokens[:p].copy(), req.max_new_tokens, req.eos_token_ids)
        new._token_ids[p:n] = tokens[p:n]
        new._num_tokens = n
        new.num_preemptions = req.num_preemptions
        return new

    @property
    def complete(self) -> bool:
        """The request took its last token (``max_new_tokens`` reached or one of its stop ids sampled), all of them
        resolved."""
        if self.pending:
            return False
        return self.num_output >= self.max_new_tokens or (
            self.num_output > 0 and int(self.token_ids[self.num_tokens - 1]) in self.eos_token_ids)

    @property
    def output_ids(self) -> np.ndarray:
        """i32[num_resolved - prompt_len]: generated tokens whose values are known (a copy while running)."""
        out = self.token_ids[self.prompt_len: self.num_resolved]
        return out if self._rows is None else out.copy()

    # ---- one token at a time (the table does the running requests all at once) -----------------------------
    def reserve(self, step: int = -1, row: int = -1) -> bool:
        """Add a token whose value plan ``step`` samples at ``row`` (placeholder id 0 until resolved); returns
        True when this reaches ``max_new_tokens``."""
        if self._rows is not None:
            return bool(self._rows.reserve(np.array([self.slot]), np.array([row]), step).size)
        n = self._num_tokens
        self._token_ids[n] = 0
        self._pending.append((step, row))  # first: tokens[:num_tokens - len(pending)] stay resolved values
        self._num_tokens = n + 1
        return n + 1 - self.prompt_len >= self.max_new_tokens

    def resolve(self, token: int) -> bool:
        """Give the oldest reserved token its sampled value; returns True if it is one of the request's stop ids
        (eos), in which case the reserved tokens after it are dropped (the request ends there)."""
        if self._rows is not None:
            return bool(self._rows.resolve(np.array([self.slot]), np.array([token]))[0])
        pending = self._pending
        pos = self._num_tokens - len(pending)
        self._token_ids[pos] = token
        del pending[0]
        if int(token) in self.eos_token_ids:
            self._num_tokens = pos + 1
            pending.clear()
            return True
        return False

    def unreserve(self) -> None:
        """Drop every reserved token (their steps' results are lost)."""
        if self._rows is not None:
            self._rows.unreserve(self.slot)
            return
        self._num_tokens -= len(self._pending)
        self._pending.clear()

    def append(self, token: int) -> bool:
        """Append a sampled token (no token reserved before it); returns True when the request is done
        (max_new_tokens or eos)."""
        last = self.reserve()
        return self.resolve(token) or last

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id}, {self.status.value}, slot={self.slot}, "
                f"computed={self.num_computed}/{self.num_tokens}, out={self.num_output}/{self.max_new_tokens})")


class RowTable:
    """The hot state of the running requests, one row per GDN slot (``S = max_seqs``; row 0 is PAD, never
    bound). A scheduler step gathers and updates it by slot with numpy, never looping over requests.

    Reserved tokens of row ``s``: ``num_pending[s]`` of them, at positions ``[num_tokens - num_pending,
    num_tokens)``, sampled by plan ``pend_step[s, k]`` at its row ``pend_row[s, k]`` (oldest first). The token
    width ``W`` grows to the longest bound request (``prompt_len + max_new_tokens``), the reserved-token width
    ``P`` to the most reserved tokens of one request; both start small.
    """

    def __init__(self, max_seqs: int, width: int = 64, max_pending: int = 4) -> None:
        rows = max_seqs + 1
        self.tokens = np.zeros((rows, width), np.int32)  # i32[S+1, W]: prompt + outputs (0 where reserved)
        self.num_tokens = np.zeros(rows, np.int64)  # i64[S+1]
        self.num_computed = np.zeros(rows, np.int64)  # i64[S+1]
        self.prompt_len = np.zeros(rows, np.int64)  # i64[S+1]
        self.max_tokens = np.zeros(rows, np.int64)  # i64[S+1]: prompt_len + max_new_tokens
        self.eos = np.full((rows, 1), -1, np.int64)  # i64[S+1, E]: stop token ids of each row, -1 padding
        self.request_id = np.full(rows, -1, np.int64)  # i64[S+1]: id of the bound request, -1 free row
        self.num_pending = np.zeros(rows, np.int64)  # i64[S+1]: reserved tokens
        self.pend_step = np.zeros((rows, max_pending), np.int64)  # i64[S+1, P]: plan step of each, oldest first
        self.pend_row = np.zeros((rows, max_pending), np.int64)  # i64[S+1, P]: plan row of each
        self.requests: list[Request | None] = [None] * rows  # the request bound to each row

    # ---- binding -------------------------------------------------------------------------------------------
    def bind(self, req: Request, slot: int) -> None:
        """Move ``req``'s state into row ``slot`` (free) and make the row its source of truth."""
        if self.requests[slot] is not None or req._rows is not None:
            raise ValueError(f"bind: row {slot} is taken or {req!r} is bound already")
        size = req._token_ids.size
        if size > self.tokens.shape[1]:
            self._grow(width=max(size, 2 * self.tokens.shape[1]))
        if len(req._pending) > self.pend_step.shape[1]:
            self._grow(max_pending=len(req._pending))
        stops = req.eos_token_ids
        if len(stops) > self.eos.shape[1]:
            self._grow(stops=len(stops))
        self.tokens[slot, :size] = req._token_ids
        self.num_tokens[slot], self.num_computed[slot] = req._num_tokens, req._num_computed
        self.prompt_len[slot], self.max_tokens[slot] = req.prompt_len, size
        self.eos[slot] = -1
        self.eos[slot, : len(stops)] = stops
        self.request_id[slot] = req.request_id
        k = self.num_pending[slot] = len(req._pending)
        if k:
            self.pend_step[slot, :k], self.pend_row[slot, :k] = zip(*req._pending)
        self.requests[slot] = req
        req.slot, req._rows, req.token_ids = slot, self, self.tokens[slot, :size]

    def unbind(self, req: Request) -> None:
        """Copy row ``req.slot`` back into ``req`` and free the row."""
        slot = req.slot
        if req._rows is not self or self.requests[slot] is not req:
            raise ValueError(f"unbind: {req!r} is not bound to this table")
        req._token_ids[:] = self.tokens[slot, : req._token_ids.size]
        req._num_tokens, req._num_computed = int(self.num_tokens[slot]), int(self.num_computed[slot])
        req._pending = self.pending(slot)
        req._rows, req.token_ids = None, req._token_ids  # detached with its full copy before the row is freed
        self.requests[slot], self.request_id[slot], self.num_pending[slot] = None, -1, 0

    def pending(self, slot: int) -> list[tuple[int, int]]:
        """Row ``slot``'s reserved tokens as ``[(plan step, plan row)]``, oldest first."""
        k = self.num_pending.item(slot)
        if k <= 1:  # the usual cases, read per request per step by the engine: no array slices
            return [(self.pend_step.item(slot, 0), self.pend_row.item(slot, 0))] if k else []
        return list(zip(self.pend_step[slot, :k].tolist(), self.pend_row[slot, :k].tolist()))

    def _grow(self, width: int = 0, max_pending: int = 0, stops: int = 0) -> None:
        if width > self.tokens.shape[1]:
            tokens = np.zeros((self.tokens.shape[0], width), np.int32)
            tokens[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = tokens
            for slot, req in enumerate(self.requests):  # their token_ids view the old array
                if req is not None:
                    req.token_ids = tokens[slot, : req._token_ids.size]
        if max_pending > self.pend_step.shape[1]:
            P = max(max_pending, 2 * self.pend_step.shape[1])
            for name in ("pend_step", "pend_row"):
                old = getattr(self, name)
                new = np.zeros((old.shape[0], P), np.int64)
                new[:, : old.shape[1]] = old
                setattr(self, name, new)
        if stops > self.eos.shape[1]:
            eos = np.full((self.eos.shape[0], min(max(stops, 2 * self.eos.shape[1]), MAX_STOP_IDS)), -1, np.int64)
            eos[:, : self.eos.shape[1]] = self.eos
            self.eos = eos

    # ---- many rows at once ---------------------------------------------------------------------------------
    def stop_hit(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """bool, ``tokens``' shape: ``tokens[k, ...]`` (``int[K]`` or ``int[K, J]``, ids >= 0) is one of row
        ``slots[k]``'s stop ids. One compare per column of the table (``E``: the widest bound request's ids)."""
        table = self.eos
        if table.shape[1] == 1:  # every bound request has at most one stop id (the usual case): one gather
            col = table.ravel()[slots]  # i64[K]; -1 (none) matches no token
            return tokens == (col if tokens.ndim == 1 else col[:, None])
        shape = (-1,) + (1,) * (tokens.ndim - 1)
        eos = table[slots]  # i64[K, E]
        hit = tokens == eos[:, 0].reshape(shape)
        for e in range(1, eos.shape[1]):
            hit |= tokens == eos[:, e].reshape(shape)
        return hit

    def reserve(self, slots: np.ndarray, plan_rows: np.ndarray, step: int) -> np.ndarray:
        """Each of ``slots`` (``i64[K]``, distinct, bound) reserves a token that plan ``step`` samples at
        ``plan_rows[k]``. Returns ``i64[J]``: the slots that reached ``max_new_tokens`` (in ``slots``' order)."""
        nt, k = self.num_tokens[slots], self.num_pending[slots]
        if k.size and int(k.max()) >= self.pend_step.shape[1]:
            self._grow(max_pending=int(k.max()) + 1)
        self.tokens[slots, nt] = 0
        self.pend_step[slots, k] = step
        self.pend_row[slots, k] = plan_rows
        self.num_pending[slots] = k + 1
        self.num_tokens[slots] = nt + 1
        return slots[nt + 1 >= self.max_tokens[slots]]

    def reserve_burst(self, slots: np.ndarray, plan_rows: np.ndarray, counts: np.ndarray, stride: int,
                      step: int) -> np.ndarray:
        """Each of ``slots`` (``i64[K]``, distinct, bound) reserves ``counts[k] >= 1`` tokens, sampled by plan
        ``step`` at ``plan_rows[k] + j * stride`` for ``j < counts[k]`` (a decode burst's sub-steps): what
        ``reserve`` once per sub-step does. Returns ``i64[J]``: the slots that reached ``max_new_tokens``, in the
        order those calls would (by sub-step, then as in ``slots``)."""
        nt, k = self.num_tokens[slots], self.num_pending[slots]
        if k.size and int((k + counts).max()) > self.pend_step.shape[1]:
            self._grow(max_pending=int((k + counts).max()))
        j = np.arange(int(counts.max()) if counts.size else 0)
        valid = j[None, :] < counts[:, None]  # bool[K, J]
        np.put(self.tokens, (slots[:, None] * self.tokens.shape[1] + nt[:, None] + j)[valid], 0)
        q = (slots[:, None] * self.pend_step.shape[1] + k[:, None] + j)[valid]  # flat queue entries
        np.put(self.pend_step, q, step)
        np.put(self.pend_row, q, (plan_rows[:, None] + j * stride)[valid])
        self.num_pending[slots] = k + counts
        self.num_tokens[slots] = nt + counts
        last = np.maximum(self.max_tokens[slots] - nt - 1, 0)  # i64[K]: the sub-step reserving the last token
        done = np.flatnonzero(last < counts)
        return slots[done[np.argsort(last[done], kind="stable")]]

    def resolve_burst(self, slots: np.ndarray, step: int, plan_rows: np.ndarray, stride: int,
                      tokens: np.ndarray) -> np.ndarray | None:
        """Give each of ``slots`` (``i64[K]``, distinct, bound) the values ``tokens[k, :counts]`` (``i64[K, J]``,
        ``counts[k]`` = ``tokens``' valid columns, marked by ``>= 0``) of its oldest ``counts[k]`` reserved tokens,
        which must be the ones plan ``step`` samples at ``plan_rows[k] + j * stride``: what ``resolve`` once per
        sub-step does. Returns ``i64[K]``: the sub-step of each row's eos token (``J`` for none; the tokens
        reserved after it are dropped), or ``None``, changing nothing, unless every row's oldest reserved tokens
        are those."""
        J = tokens.shape[1]
        j = np.arange(J)
        valid = tokens >= 0  # bool[K, J]
        counts = valid.sum(1)
        k = self.num_pending[slots]
        P = self.pend_step.shape[1]
        jj = np.minimum(j, P - 1)
        ours = (self.pend_step[slots[:, None], jj] == step) & (self.pend_row[slots[:, None], jj]
                                                               == plan_rows[:, None] + j * stride)
        if (k < counts).any() or not (ours | ~valid).all():
            return None
        pos = self.num_tokens[slots] - k  # i64[K]: position of the oldest reserved token
        first = self._write_runs(slots, pos, tokens, valid)
        left = k - counts  # i64[K]: reserved tokens of later plans, moved to the front of the queues
        m = int(left.max()) if left.size else 0
        if m:
            src = np.minimum(counts[:, None] + np.arange(m), P - 1)  # i64[K, m]
            for queue in (self.pend_step, self.pend_row):
                queue[slots[:, None], np.arange(m)] = queue[slots[:, None], src]
        eos = first < J
        if eos.any():  # the counts shrink first: tokens[:num_tokens - num_pending] stay resolved values throughout
            self.num_tokens[slots[eos]] = pos[eos] + first[eos] + 1
        self.num_pending[slots] = np.where(eos, 0, left)
        return first

    def append(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Give each of ``slots`` (``i64[K]``, distinct, bound, nothing reserved) the tokens ``tokens[k, :counts]``
        (``i64[K, J]``, the valid columns a prefix, marked by ``>= 0``), known now (a verification's accepted run):
        what ``reserve_burst`` then ``resolve_burst`` of them does, without the reservation queue. Returns
        ``i64[K]``: the index of each row's first stop id (``J`` for none; the tokens after it are dropped).
        ``ValueError``, changing nothing, where a row has tokens reserved."""
        if self.num_pending[slots].any():
            raise ValueError(f"append: rows {slots[self.num_pending[slots] > 0].tolist()} have reserved tokens")
        valid = tokens >= 0  # bool[K, J]
        pos = self.num_tokens[slots]  # i64[K]
        first = self._write_runs(slots, pos, tokens, valid)
        self.num_tokens[slots] = pos + np.minimum(valid.sum(1), first + 1)
        return first

    def _write_runs(self, slots: np.ndarray, pos: np.ndarray, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Write each row's run ``tokens[k]`` (``i64[K, J]``, ``valid``: bool[K, J] its columns) at positions
        ``pos[k] + j`` of row ``slots[k]``, 0 after its first stop id; returns that stop id's index (``J``: none)."""
        J = tokens.shape[1]
        j = np.arange(J)
        hit = valid & self.stop_hit(slots, tokens)  # bool[K, J]
        first = np.where(hit.any(1), hit.argmax(1), J)  # i64[K]
        np.put(self.tokens, (slots[:, None] * self.tokens.shape[1] + pos[:, None] + j)[valid],  # flat entries
               np.where(j > first[:, None], 0, tokens)[valid])
        return first

    def oldest_is(self, slots: np.ndarray, step: int, plan_rows: np.ndarray) -> np.ndarray:
        """bool[K]: row ``slots[k]``'s oldest reserved token is the one plan ``step`` samples at ``plan_rows[k]``."""
        return (self.num_pending[slots] > 0) & (self.pend_step[slots, 0] == step) & (self.pend_row[slots, 0]
                                                                                      == plan_rows)

    def resolve(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Give the oldest reserved token of each of ``slots`` (``i64[K]``, distinct, each with one) its value
        ``tokens[k]``. Returns ``bool[K]``: the token is one of the row's stop ids (eos; the reserved tokens after it
        are dropped)."""
        pos = self.num_tokens[slots] - self.num_pending[slots]
        self.tokens[slots, pos] = tokens
        for queue in (self.pend_step, self.pend_row):
            queue[slots, :-1] = queue[slots, 1:]
        self.num_pending[slots] -= 1
        hit = self.stop_hit(slots, tokens)  # bool[K]
        if hit.any():
            self.num_tokens[slots[hit]] = pos[hit] + 1
            self.num_pending[slots[hit]] = 0
        return hit

    def unreserve(self, slot: int) -> None:
        """Drop every reserved token of row ``slot``."""
        self.num_tokens[slot] -= self.num_pending[slot]
        self.num_pending[slot] = 0

    def check_integrity(self, running: list[Request]) -> None:
        """Raise ``AssertionError`` unless exactly the ``running`` requests are bound, each to its slot's row."""
        slots = [r.slot for r in running]
        if any(r._rows is not self or self.requests[r.slot] is not r or self.request_id[r.slot] != r.request_id
               or r.token_ids.base is not self.tokens for r in running):
            raise AssertionError(f"a running request is not bound to its slot's row: {running}")
        free = np.setdiff1d(np.arange(len(self.requests)), slots)
        if (self.request_id[free] != -1).any() or any(self.requests[s] is not None for s in free.tolist()):
            raise AssertionError(f"rows {free[self.request_id[free] != -1].tolist()} are bound but not running")
        bad = (self.num_pending[slots] > self.num_tokens[slots] - self.prompt_len[slots]) | \
            (self.num_tokens[slots] > self.max_tokens[slots])
        if bad.any():
            raise AssertionError(f"rows {np.asarray(slots)[bad].tolist()} hold more reserved tokens than outputs or "
                                 "more tokens than prompt + max_new_tokens")


class RunningList(list):
    """``Scheduler.running``: a plain list of the running requests (in admission order) that counts its changes
    in ``version``, so that the scheduler can keep their slots as an array between changes."""

    version = 0


def _counting(name: str):
    method = getattr(list, name)

    def changed(self, *args, **kwargs):
        self.version += 1
        return method(self, *args, **kwargs)

    changed.__name__ = name
    return changed


for _name in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__",
              "__delitem__", "__iadd__", "__imul__"):
    setattr(RunningList, _name, _counting(_name))
