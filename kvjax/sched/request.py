"""A request as the scheduler sees it: its tokens, how many are computed, its GDN slot, and its status.

A step that samples a token for a request first *reserves* its place (``reserve``: the request has one more
token whose value is not known yet, so the next step can already be planned with it as input) and later
*resolves* it with the sampled value (``resolve``). ``append`` does both at once (the synchronous case).
"""

from __future__ import annotations

import enum

import numpy as np

from kvjax.config import INT32_MAX, is_int


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


def check_request(prompt: np.ndarray, max_new_tokens: int, eos_token_id: int | None) -> np.ndarray:
    """``prompt`` as an array after checking it is a non-empty 1-d array of token ids in ``[0, 2**31)``,
    ``max_new_tokens`` an int >= 1 and ``eos_token_id`` None or a token id; raises ``ValueError`` naming the bad
    value. Allocates nothing the size of ``max_new_tokens``."""
    prompt = np.asarray(prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt must be a non-empty 1-d integer array, got shape {prompt.shape} {prompt.dtype}")
    if prompt.min() < 0 or prompt.max() > INT32_MAX:
        raise ValueError(f"prompt token ids must lie in [0, {INT32_MAX}], got min {prompt.min()}, max {prompt.max()}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if eos_token_id is not None and (not is_int(eos_token_id) or not 0 <= eos_token_id <= INT32_MAX):
        raise ValueError(f"eos_token_id must be None or an int in [0, {INT32_MAX}], got {eos_token_id!r}")
    return prompt


class Request:
    """Prompt + generated tokens in one buffer (``token_ids: i32[prompt_len + max_new_tokens]``).

    ``num_tokens`` tokens exist (prompt + outputs so far, the last ``len(pending)`` of them reserved by steps
    in flight: their values are not known yet); ``num_computed`` of them have K/V in the cache. ``slot`` is the
    GDN slot (and block-table row) while running, 0 otherwise.
    """

    def __init__(self, request_id: int, prompt: np.ndarray, max_new_tokens: int,
                 eos_token_id: int | None = None) -> None:
        prompt = check_request(prompt, max_new_tokens, eos_token_id)
        self.request_id = request_id
        self.prompt_len = int(prompt.size)
        self.max_new_tokens = int(max_new_tokens)
        self.eos_token_id = None if eos_token_id is None else int(eos_token_id)
        self.token_ids = np.zeros(self.prompt_len + self.max_new_tokens, np.int32)  # i32[prompt + max_new]
        self.token_ids[: self.prompt_len] = prompt
        self.num_tokens = self.prompt_len
        self.num_computed = 0
        self.slot = 0
        self.status = Status.WAITING
        self.num_preemptions = 0
        self.pending: list[tuple[int, int]] = []  # (plan step, plan row) sampling each reserved token, in order

    @property
    def num_output(self) -> int:
        """Generated tokens, reserved ones included (what ``max_new_tokens`` and sampling counters count)."""
        return self.num_tokens - self.prompt_len

    @property
    def num_resolved(self) -> int:
        """Tokens whose values are known (prompt + resolved outputs)."""
        return self.num_tokens - len(self.pending)

    @property
    def output_ids(self) -> np.ndarray:
        """i32[num_resolved - prompt_len]: generated tokens whose values are known."""
        return self.token_ids[self.prompt_len: self.num_resolved]

    def reserve(self, step: int = -1, row: int = -1) -> bool:
        """Add a token whose value plan ``step`` samples at ``row`` (placeholder id 0 until resolved); returns
        True when this reaches ``max_new_tokens``."""
        n = self.num_tokens
        self.token_ids[n] = 0
        self.num_tokens = n + 1
        self.pending.append((step, row))
        return n + 1 - self.prompt_len >= self.max_new_tokens

    def resolve(self, token: int) -> bool:
        """Give the oldest reserved token its sampled value; returns True if it is eos, in which case the
        reserved tokens after it are dropped (the request ends there)."""
        pending = self.pending
        pos = self.num_tokens - len(pending)
        self.token_ids[pos] = token
        del pending[0]
        if self.eos_token_id is not None and int(token) == self.eos_token_id:
            self.num_tokens = pos + 1
            self.pending.clear()
            return True
        return False

    def unreserve(self) -> None:
        """Drop every reserved token (their steps' results are lost)."""
        self.num_tokens -= len(self.pending)
        self.pending.clear()

    def append(self, token: int) -> bool:
        """Append a sampled token (no token reserved before it); returns True when the request is done
        (max_new_tokens or eos)."""
        last = self.reserve()
        return self.resolve(token) or last

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id}, {self.status.value}, slot={self.slot}, "
                f"computed={self.num_computed}/{self.num_tokens}, out={self.num_output}/{self.max_new_tokens})")
