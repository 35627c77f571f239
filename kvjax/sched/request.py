"""A request as the scheduler sees it: its tokens, how many are computed, its GDN slot, and its status."""

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

    ``num_tokens`` tokens are known (prompt + outputs so far); ``num_computed`` of them have K/V in the cache.
    ``slot`` is the GDN slot (and block-table row) while running, 0 otherwise.
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

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def output_ids(self) -> np.ndarray:
        """i32[num_output]: tokens generated so far."""
        return self.token_ids[self.prompt_len: self.num_tokens]

    def append(self, token: int) -> bool:
        """Append a sampled token; returns True when the request is done (max_new_tokens or eos)."""
        self.token_ids[self.num_tokens] = token
        self.num_tokens += 1
        return self.num_output >= self.max_new_tokens or (
            self.eos_token_id is not None and int(token) == self.eos_token_id)

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id}, {self.status.value}, slot={self.slot}, "
                f"computed={self.num_computed}/{self.num_tokens}, out={self.num_output}/{self.max_new_tokens})")
