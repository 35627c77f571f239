"""``EngineOptions``: every setting of an :class:`~kvjax.engine.engine.Engine` besides the model, its cache geometry,
its mesh and its tokenizer, as one frozen dataclass checked when it is built.

``Engine(model, cache, recycle="timely", decode_burst=1)`` builds one from its keyword arguments;
``Engine(model, cache, options=opts)`` takes a ready one (``dataclasses.replace(opts, ...)`` for a sweep). What can be
checked without the model is checked here (``ValueError`` naming the field and the value); what depends on the model
or the cache (the cache dtype's default, ``eos_token_id="auto"``, the prefix checkpoints a model can have, the last
bucket of each set) is checked by the engine, before it builds anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from kvjax.config import INT32_MAX, check_kv_cache_dtype, is_int
from kvjax.sched.drafter import SpeculativeConfig
from kvjax.sched.prefix_cache import RECYCLE_MODES

MAX_BURST = 64
AUTO_BURST = 8  # decode sub-steps per dispatch of decode_burst="auto"


def check_flag(name: str, value: Any) -> bool:
    """``True`` or ``False`` (numpy bools accepted); ``ValueError`` naming ``name`` for anything else (``'no'``,
    0, None)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_burst(value: Any) -> int:
    """``decode_burst``: ``"auto"`` (:data:`AUTO_BURST`) or an int in ``[1, MAX_BURST]`` (1: no bursts)."""
    if isinstance(value, str) and value == "auto":
        return AUTO_BURST
    if not is_int(value) or not 1 <= value <= MAX_BURST:
        raise ValueError(f"decode_burst must be 'auto' or an int in [1, {MAX_BURST}], got {value!r}")
    return int(value)


BUCKET_ENDS = {"token_buckets": "max_num_batched_tokens", "row_buckets": "max_seqs",
               "block_buckets": "max_blocks_per_seq"}  # what each bucket set must end at (checked by the engine)


def check_buckets(name: str, values: Sequence[int] | None) -> tuple[int, ...] | None:
    """``None``, or ``values`` as a tuple of ascending distinct ints >= 1 (``ValueError`` naming ``name``)."""
    if values is None:
        return None
    what = f"{name} must be None or ascending ints >= 1 ending at {BUCKET_ENDS[name]}"
    try:
        out = tuple(values)
    except TypeError:
        raise ValueError(f"{what}, got {values!r}") from None
    if (not out or any(not is_int(v) or v < 1 for v in out) or list(out) != sorted(set(out))):
        raise ValueError(f"{what}, got {out}")
    return tuple(int(v) for v in out)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How an engine schedules, sizes its cache, caches prefixes and dispatches steps.

    Fields (defaults in brackets):

    - ``overlap`` [True]: plan and dispatch step N+1 before reading step N's tokens; ``False``: the synchronous
      engine (each step's tokens are read and applied before the next step is planned). Same outputs either way.
    - ``decode_burst`` ["auto" = 8]: up to ``K`` decode steps per dispatch when every running request decodes and
      none could be admitted (:mod:`kvjax.engine.burst`); the host's work per token falls by about ``K``, the
      tokens are the same (a request that ends inside a burst computes a few sub-steps for nothing; an arrival
      waits up to ``K`` sub-steps). ``1``: single steps. :attr:`burst` is the resolved ``K``.
    - ``recycle`` ["none"]: ``"none"`` | ``"timely"`` or a policy object (:mod:`kvjax.sched.recycle`).
    - ``pool`` ["shared"]: ``"shared"`` | ``"partitioned"`` (:mod:`kvjax.sched.blocks`).
    - ``max_num_batched_tokens`` [``max(256, max_seqs)``]: token budget of one step.
    - ``watermark`` [0.01]: fraction of each pool kept free when admitting while others run.
    - ``memory_fraction`` [0.9]: share in ``(0, 1]`` of the free device memory a sized cache may take (only
      without a ``cache_config``; :mod:`kvjax.engine.sizing`).
    - ``cache_dtype`` [the parameters' float dtype]: K/V (or latent) pages and conv state: float32, bfloat16 or
      float16 (the GDN state is always float32).
    - ``cache_options`` [None]: extra keyword arguments of ``model.init_caches`` (e.g. ``{"indexer_fp8": False}``).
    - ``kv_cache_dtype`` ["auto"]: vLLM's option: ``"auto"`` (K/V pages in ``cache_dtype``) or ``"fp8"`` /
      ``"fp8_e4m3"`` (float8_e4m3fn K/V pages with one f32 scale per page, about half the bytes, so about twice
      the pages in the default sizing; :mod:`kvjax.state.kv_cache`); stored as ``"auto"`` or ``"fp8"``. Models
      whose ``init_caches`` takes ``kv_cache_dtype`` (Qwen3.5).
    - ``eos_token_id`` ["auto"]: a token id or up to 8 of them that end a request when sampled (delivered);
      ``None``: every request runs to its ``max_tokens``; ``"auto"``: ``model.generation_config.eos_token_ids``
      where the model has one (``load_pretrained`` attaches it), else ``None``.
    - ``prefix_caching`` [False]: share cached prompt blocks between requests; ``prefix_checkpoints`` [``max_seqs``
      for a model with GDN layers]: GDN checkpoint slots; ``prefix_recycle`` ["keep_tail"]: what happens to a cached
      page SWA recycling frees (``"keep_tail"`` | ``"eager"``). The last two only with ``prefix_caching``.
    - ``host_cache_bytes`` [0]: bytes of host memory for the prefix cache's host tier (0: none; only with
      ``prefix_caching``; on a mesh, per data shard): evicted pages and GDN checkpoints spill to pinned host memory
      and come back on a hit (:mod:`kvjax.engine.host_tier`).
    - ``token_buckets``, ``row_buckets``, ``block_buckets`` [powers of two]: the bucket sets of ``T``, ``B`` and the
      block-table width, ascending and ending at ``max_num_batched_tokens`` / ``max_seqs`` / ``max_blocks_per_seq``
      (fewer buckets: fewer compilations, more padding).
    - ``use_decode_path`` [True]: all-decode steps run the decode kernels (``StepInputs.decode_only``).
    - ``debug`` [False]: validate every step's inputs on the host before running it (slow).
    - ``max_traces`` [None]: fail (``AssertionError``) if the device step compiles more than this many times.
    - ``speculative`` [None]: speculative decoding: ``"ngram"`` (prompt lookup, K = 4), ``"mtp"`` (the model's MTP
      layer drafts inside every step, K = 4: a Qwen3.5 model with MTP layers, :mod:`kvjax.engine.drafting`), a
      :class:`~kvjax.sched.drafter.SpeculativeConfig` (method, ``num_draft_tokens`` K, n-gram sizes) or a
      :class:`~kvjax.sched.drafter.Drafter` object; stored as a ``SpeculativeConfig`` or ``None``. Decoding rows
      verify up to K drafts in one step (:mod:`kvjax.engine.verify`); the engine then runs synchronously (a step's
      drafts continue the previous step's accepted tokens), whatever ``overlap`` says; ``"ngram"`` and ``"mtp"``
      verify in bursts of ``decode_burst`` sub-steps (n-gram: the later sub-steps' drafts looked up on the device,
      :mod:`kvjax.engine.ngram`), a drafter object of another kind without decode bursts. Both run on a mesh too (every
      data shard's decoding rows verify in the same step; ``"mtp"``: the MTP layer split like the model's layers,
      each data shard drafting for its own rows; give the model itself with ``mesh=``, not a ``ShardedModel``).
    """

    overlap: bool = True
    decode_burst: int | str = "auto"
    recycle: Any = "none"
    pool: str = "shared"
    max_num_batched_tokens: int | None = None
    watermark: float = 0.01
    memory_fraction: float | None = None
    cache_dtype: Any = None
    cache_options: dict | None = None
    kv_cache_dtype: str = "auto"
    eos_token_id: int | Sequence[int] | str | None = "auto"
    prefix_caching: bool = False
    prefix_checkpoints: int | None = None
    prefix_recycle: str = "keep_tail"
    host_cache_bytes: int = 0
    token_buckets: tuple[int, ...] | None = None
    row_buckets: tuple[int, ...] | None = None
    block_buckets: tuple[int, ...] | None = None
    use_decode_path: bool = True
    debug: bool = False
    max_traces: int | None = None
    speculative: Any = None

    def __post_init__(self):
        object.__setattr__(self, "speculative", SpeculativeConfig.of(self.speculative))
        for name in ("overlap", "prefix_caching", "use_decode_path", "debug"):
            object.__setattr__(self, name, check_flag(name, getattr(self, name)))
        check_burst(self.decode_burst)
        for name in ("token_buckets", "row_buckets", "block_buckets"):
            object.__setattr__(self, name, check_buckets(name, getattr(self, name)))
        if self.max_traces is not None and (not is_int(self.max_traces) or not 1 <= self.max_traces <= INT32_MAX):
            raise ValueError(f"max_traces must be None or an int in [1, {INT32_MAX}], got {self.max_traces!r}")
        if self.cache_options is not None and not isinstance(self.cache_options, dict):
            raise ValueError(f"cache_options must be None or a dict of init_caches keyword arguments, got "
                             f"{self.cache_options!r}")
        object.__setattr__(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype))
        if self.cache_options and "kv_cache_dtype" in self.cache_options:
            raise ValueError(f"cache_options={self.cache_options!r}: give kv_cache_dtype as its own setting "
                             "(kv_cache_dtype='fp8'), not in cache_options")
        if self.prefix_recycle not in RECYCLE_MODES:
            raise ValueError(f"prefix_recycle must be one of {RECYCLE_MODES}, got {self.prefix_recycle!r}")
        if not self.prefix_caching and (self.prefix_checkpoints is not None or self.prefix_recycle != "keep_tail"):
            raise ValueError("prefix_checkpoints / prefix_recycle need prefix_caching=True")
        if not is_int(self.host_cache_bytes) or self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be an int >= 0 (bytes of host memory), got "
                             f"{self.host_cache_bytes!r}")
        if self.host_cache_bytes and not self.prefix_caching:
            raise ValueError(f"host_cache_bytes={self.host_cache_bytes} needs prefix_caching=True (the host tier holds "
                             "what the prefix cache evicts)")

    @property
    def burst(self) -> int:
        """The decode sub-steps per dispatch ``decode_burst`` stands for (``"auto"``: :data:`AUTO_BURST`)."""
        return check_burst(self.decode_burst)
