"""Synthetic workloads and model layouts for the capacity simulator.

The seed-shaped workload copies the seed's benchmark (random fixed-IO dataset): 128 prompts with 1,356,656 input
and 518,946 output tokens in all, i.e. means of 10,599 prompt and 4,054 output tokens per request. Lengths are
drawn uniformly in ``mean * [1 - spread, 1 + spread]`` and multiplied by ``scale`` (to shrink the run); every
output runs to ``max_new_tokens`` (the seed benchmarks with ``--ignore-eos``).

Before drawing a workload, :func:`seed_footprint` estimates the host memory it and a scheduler serving it take
(the command lines refuse sizes this machine cannot hold); after, :func:`check_servable` checks that a scheduler
configuration can serve every request (so a run fails before it starts, not midway).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvjax.config import AttentionConfig, CacheConfig, check_kv_cache_dtype
from kvjax.sched.scheduler import Scheduler

SEED_PROMPT_MEAN = 10_599  # 1,356,656 input tokens / 128 prompts
SEED_OUTPUT_MEAN = 4_054  # 518,946 output tokens / 128 prompts
SEED_SPREAD = 0.25  # lengths uniform in mean * [1 - spread, 1 + spread]


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    prompt: np.ndarray  # i32[prompt_len]
    max_new_tokens: int  # output length (the seed runs with --ignore-eos)
    output: np.ndarray | None = None  # i32[max_new_tokens]: the tokens it generates (None: random)
    after: int = -1  # index of the request that must finish before this one arrives (-1: arrives at step 0)

    @property
    def total_len(self) -> int:
        return int(self.prompt.size) + self.max_new_tokens


def seed_workload(num_requests: int, *, scale: float = 1.0, spread: float = SEED_SPREAD, vocab: int = 32_000,
                  seed: int = 0) -> list[RequestSpec]:
    """``num_requests`` requests shaped like the seed's benchmark, lengths scaled by ``scale`` (>= 1 token)."""
    if num_requests < 1 or not 0 < scale < math.inf or not 0 <= spread < 1 or vocab < 2:
        raise ValueError(f"seed_workload: need num_requests >= 1, scale > 0, 0 <= spread < 1, vocab >= 2; got "
                         f"{num_requests}, {scale}, {spread}, {vocab}")
    rng = np.random.default_rng(seed)

    def lengths(mean: float) -> np.ndarray:
        return np.maximum(1, np.rint(scale * mean * rng.uniform(1 - spread, 1 + spread, num_requests))).astype(int)

    prompts, outputs = lengths(SEED_PROMPT_MEAN), lengths(SEED_OUTPUT_MEAN)
    return [RequestSpec(rng.integers(1, vocab, p, dtype=np.int32), int(o)) for p, o in zip(prompts, outputs)]


def swa_layout(num_kv_heads: int, swa_fraction: float, window: int, sinks: int, *, group_size: int = 2,
               head_dim: int = 128) -> AttentionConfig:
    """A layer whose first ``round(swa_fraction * num_kv_heads)`` KV heads are SWA (``window``, ``sinks``)."""
    return AttentionConfig.with_swa_fraction(num_kv_heads * group_size, num_kv_heads, head_dim,
                                             swa_fraction=swa_fraction, window=window, sinks=sinks)


def cache_for(workload: list[RequestSpec], *, num_kv_heads: int, page_size: int, full_requests: float,
              max_seqs: int) -> CacheConfig:
    """Page memory that holds ``full_requests`` mean-length requests on every head without recycling; block
    tables wide enough for the longest request."""
    mean_len = float(np.mean([w.total_len for w in workload]))
    pages = _pages_for(mean_len, num_kv_heads=num_kv_heads, page_size=page_size, full_requests=full_requests)
    longest = max(w.total_len for w in workload)
    return CacheConfig(page_size=page_size, num_pages=pages, max_seqs=max_seqs,
                       max_blocks_per_seq=-(-longest // page_size))


FP8_SCALE_BYTES = 4  # one f32 scale per fp8 page (kvjax.state.kv_cache)


def kv_page_bytes(page_size: int, head_dim: int, kv_cache_dtype: str = "auto", *, dtype_bytes: int = 2) -> int:
    """Bytes of one KV head's K and V pages in one attention layer: ``2 * page_size * head_dim * dtype_bytes``
    (``"auto"``: pages of a ``dtype_bytes`` float), or ``2 * (page_size * head_dim + 4)`` for ``"fp8"`` /
    ``"fp8_e4m3"`` (one byte a value plus the page's f32 scale)."""
    if check_kv_cache_dtype(kv_cache_dtype) == "fp8":
        return 2 * (page_size * head_dim + FP8_SCALE_BYTES)
    return 2 * page_size * head_dim * dtype_bytes


def same_memory(cache: CacheConfig, page_bytes: int, new_page_bytes: int) -> CacheConfig:
    """``cache`` with as many pages of ``new_page_bytes`` as its ``num_pages`` pages of ``page_bytes`` take (rounded
    down): fixed page memory, other pages (fp8 pages: about twice as many)."""
    return dataclasses.replace(cache, num_pages=cache.num_pages * page_bytes // new_page_bytes)


def _pages_for(mean_len: float, *, num_kv_heads: int, page_size: int, full_requests: float) -> int:
    return int(np.ceil(full_requests * -(-mean_len // page_size))) * num_kv_heads


def seed_footprint(num_requests: int, *, scale: float, spread: float = SEED_SPREAD, num_kv_heads: int,
                   page_size: int, full_requests: float, max_seqs: int) -> tuple[int, int]:
    """Estimate, without drawing it, what ``seed_workload`` + ``cache_for`` + a :class:`Scheduler` serving the
    workload take: ``(host bytes, pages per layer)``. Host bytes count the token arrays, the block tables, the
    page and slot lists and the too-long check's per-position arrays (the terms that grow with the arguments)."""
    mean = scale * (SEED_PROMPT_MEAN + SEED_OUTPUT_MEAN) + 2  # + rounding of both lengths
    longest = math.ceil(scale * (SEED_PROMPT_MEAN + SEED_OUTPUT_MEAN) * (1 + spread)) + 2
    pages = _pages_for(mean, num_kv_heads=num_kv_heads, page_size=page_size, full_requests=full_requests)
    host = (num_requests * (8 * mean + 1024)  # prompt + request buffer (int32), Python objects
            + pages * 48  # owner arrays (int32 x 2) and free-list entries
            + (max_seqs + 1) * num_kv_heads * (4 * -(-longest // page_size) + 8) + 64 * max_seqs  # tables, slots
            + 64 * num_kv_heads * longest)  # _check_fits: a few i64[longest, H_kv] arrays
    return int(host), pages


def check_servable(workload: list[RequestSpec], cache: CacheConfig, attention: AttentionConfig, *,
                   max_num_batched_tokens: int, pool: str, recycle: str) -> None:
    """Raise ``ValueError`` (a :class:`~kvjax.errors.RequestTooLongError` naming the request) unless a scheduler
    with this configuration accepts every request of ``workload``."""
    sched = Scheduler(cache, attention, max_num_batched_tokens=max_num_batched_tokens, pool=pool, recycle=recycle)
    for i, w in enumerate(workload):
        try:
            sched.add_request(w.prompt, w.max_new_tokens)
        except ValueError as err:
            raise type(err)(f"request {i} (prompt {w.prompt.size}, output {w.max_new_tokens}) cannot be served "
                            f"with recycle={recycle}, pool={pool}: {err}") from None


# ---- prefix-sharing workloads (the prefix-cache simulator) ---------------------------------------------------
def system_prompt_workload(num_users: int, *, system_len: int, user_len: int, output_len: int, vocab: int = 32_000,
                           seed: int = 0) -> list[RequestSpec]:
    """``num_users`` requests = one shared system prompt of ``system_len`` tokens + a user message of
    ``user_len`` tokens (lengths in ``user_len * [0.5, 1.5]``), each answering ``output_len`` tokens."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, vocab, system_len, dtype=np.int32)
    lens = np.maximum(1, np.rint(user_len * rng.uniform(0.5, 1.5, num_users))).astype(int)
    return [RequestSpec(np.concatenate([system, rng.integers(1, vocab, n, dtype=np.int32)]), output_len)
            for n in lens]


def multi_turn_workload(num_conversations: int, *, turns: int, first_len: int, message_len: int, output_len: int,
                        vocab: int = 32_000, seed: int = 0) -> list[RequestSpec]:
    """Conversations of ``turns`` requests: turn ``t + 1``'s prompt = turn ``t``'s prompt + its answer + a new
    message of ``message_len`` tokens, and it arrives when turn ``t`` finishes (answers are fixed in advance)."""
    rng = np.random.default_rng(seed)
    out: list[RequestSpec] = []
    for _ in range(num_conversations):
        prompt, prev = rng.integers(1, vocab, first_len, dtype=np.int32), -1
        for _ in range(turns):
            answer = rng.integers(1, vocab, output_len, dtype=np.int32)
            out.append(RequestSpec(prompt, output_len, answer, prev))
            prev = len(out) - 1
            prompt = np.concatenate([prompt, answer, rng.integers(1, vocab, message_len, dtype=np.int32)])
    return out


def few_shot_workload(num_requests: int, *, tasks: int, shots: int, shot_len: int, question_len: int,
                      output_len: int, vocab: int = 32_000, seed: int = 0) -> list[RequestSpec]:
    """Few-shot prompts: each request picks one of ``tasks`` fixed prefixes (instruction + ``shots`` examples
    of ``shot_len`` tokens) and appends its own question of ``question_len`` tokens."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, vocab, shots * shot_len + shot_len // 2, dtype=np.int32) for _ in range(tasks)]
    return [RequestSpec(np.concatenate([prefixes[int(rng.integers(tasks))],
                                        rng.integers(1, vocab, question_len, dtype=np.int32)]), output_len)
            for _ in range(num_requests)]
