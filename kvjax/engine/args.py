"""Host checks of the engine's request arguments, run before anything is queued, and of the settings that depend
on the model (cache dtype, eos ids, prefix checkpoints, buckets against the cache).

Every function raises ``ValueError`` naming the argument and the bad value, and changes nothing. The engine
calls them for every request of a ``generate`` / ``stream`` call before it queues the first one, so a bad
argument never leaves a request behind.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import INT32_MAX, is_int
from kvjax.models.interface import CausalLM
from kvjax.sched.prefix_cache import PrefixCacheConfig
from kvjax.sched.request import MAX_STOP_IDS, check_stop_ids

INT32_MIN = -(2**31)


def check_temperature(temperature: Any) -> float:
    """A finite real number >= 0 (0 = greedy) as a float."""
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer,
                                                                                 np.floating)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    value = float(temperature)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    return value


def check_seed(seed: Any) -> int:
    """An int in the int32 range (the device sampling keys take int32 seeds)."""
    if not is_int(seed) or not INT32_MIN <= seed <= INT32_MAX:
        raise ValueError(f"seed must be an int in [{INT32_MIN}, {INT32_MAX}], got {seed!r}")
    return int(seed)


def check_index(index: Any) -> int:
    """A prompt index: an int in ``[0, 2**31)`` (it selects the request's int32 sampling stream)."""
    if not is_int(index) or not 0 <= index <= INT32_MAX:
        raise ValueError(f"index must be an int in [0, {INT32_MAX}], got {index!r}")
    return int(index)


def check_max_new_tokens(value: Any, name: str = "max_new_tokens") -> int:
    """An int >= 1 (bools and floats such as ``2.5`` or ``8.0`` are refused)."""
    if not is_int(value) or not 1 <= value <= INT32_MAX:
        raise ValueError(f"{name} must be an int in [1, {INT32_MAX}], got {value!r}")
    return int(value)


def check_prompt(prompt: Any, vocab_size: int, name: str = "prompt") -> np.ndarray:
    """The prompt as ``i32[L]`` after checking it is a non-empty 1-d sequence of ints in ``[0, vocab_size)``."""
    try:
        arr = np.asarray(prompt)
    except (TypeError, ValueError) as err:  # ragged nesting
        raise ValueError(f"{name} must be a non-empty 1-d sequence of token ids, got {prompt!r:.80}: {err}") from None
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a non-empty 1-d sequence of int token ids, got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} has token ids outside [0, vocab_size={vocab_size}): min {lo}, max {hi}")
    return arr.astype(np.int32)


CACHE_DTYPES = ("float32", "bfloat16", "float16")


def check_cache_dtype(value: Any, params: Any) -> Any:
    """The engine's cache dtype: the parameters' float dtype for ``None``, else one of :data:`CACHE_DTYPES`
    (K/V or latent pages and the conv state; the GDN state is always float32)."""
    if value is None:
        return next(x.dtype for x in jax.tree_util.tree_leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES} or None, got {value!r}") from None
    if dtype.name not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES} or None, got {dtype.name} (fp8 K/V pages: "
                         "kv_cache_dtype='fp8'; DeepSeek's fp8 DSA cache: cache_options)")
    return dtype


def cache_options(model: CausalLM, options: dict | None, kv_cache_dtype: str) -> dict:
    """The keyword arguments the engine gives ``model.init_caches`` beside the geometry and dtype: ``options``
    plus ``kv_cache_dtype`` unless it is ``"auto"``; ``ValueError`` when the model's ``init_caches`` takes no
    ``kv_cache_dtype`` (fp8 K/V pages are GQA pages)."""
    out = dict(options or {})
    if kv_cache_dtype == "auto":
        return out
    if "kv_cache_dtype" not in inspect.signature(model.init_caches).parameters:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: {type(model).__name__}.init_caches takes no "
                         "kv_cache_dtype (fp8 K/V pages are GQA pages, e.g. Qwen3.5's; DeepSeek stores its latent "
                         "in fp8 with cache_options={'kind': 'dsa'})")
    out["kv_cache_dtype"] = kv_cache_dtype
    return out


def check_prompts(prompts: Any, vocab_size: int) -> list[np.ndarray]:
    """The prompts of a ``generate`` / ``stream`` call as ``[i32[L]]``, every one checked (:func:`check_prompt`)."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError(f"prompts must be a sequence of prompts (each a sequence of token ids), got "
                         f"{type(prompts).__name__}")
    return [check_prompt(p, vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]


def check_eos(value: Any, vocab_size: int) -> tuple[int, ...]:
    """``Engine(eos_token_id=)`` after ``"auto"`` is resolved: ``None`` (no eos), a token id or a sequence of up to
    :data:`~kvjax.sched.request.MAX_STOP_IDS` of them, each in ``[0, vocab_size)``; as a tuple of distinct ids."""
    try:
        ids = check_stop_ids(value)
    except ValueError as err:
        raise ValueError(f"{err} ('auto', the default, takes model.generation_config's)") from None
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise ValueError(f"eos_token_id must be None or ints in [0, vocab_size={vocab_size}), got {value!r}")
    return ids


def stop_ids(eos: tuple[int, ...], params: Any, vocab_size: int, name: str = "stop_token_ids") -> tuple[int, ...]:
    """The ids that end a request: the engine's ``eos`` then ``params.stop_token_ids`` (a
    :class:`~kvjax.engine.sampling.SamplingParams`), distinct; ``ValueError`` naming ``name`` for an id outside
    ``[0, vocab_size)`` or more than :data:`~kvjax.sched.request.MAX_STOP_IDS` together."""
    bad = [i for i in params.stop_token_ids if i >= vocab_size]
    if bad:
        raise ValueError(f"{name}: {bad[0]} is outside the vocabulary [0, vocab_size={vocab_size})")
    ids = tuple(dict.fromkeys(eos + params.stop_token_ids))
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"{name}: with the engine's eos ids {eos} a request has {len(ids)} distinct stop ids, at "
                         f"most {MAX_STOP_IDS}")
    return ids


def prefix_config(model: CausalLM, on: bool, checkpoints: int | None, recycle: str, max_seqs: int
                   ) -> PrefixCacheConfig | None:
    """The scheduler's prefix-cache config for ``model`` (None when off; the options were checked by
    :class:`~kvjax.engine.options.EngineOptions`); ``ValueError`` for checkpoints the model cannot have."""
    if not on:
        return None
    shapes = jax.eval_shape(lambda: model.init_caches(num_pages=1, page_size=1, max_seqs=1, dtype=jnp.float32))
    gdn = shapes.gdn is not None and shapes.gdn.conv.shape[0] > 0
    if checkpoints is None:
        checkpoints = max_seqs if gdn else 0
    if not is_int(checkpoints) or not 0 <= checkpoints <= INT32_MAX:
        raise ValueError(f"prefix_checkpoints must be None or an int in [0, {INT32_MAX}], got {checkpoints!r}")
    if not gdn and checkpoints:
        raise ValueError(f"prefix_checkpoints={checkpoints!r}: {type(model).__name__} has no GDN layers, so no "
                         "recurrent state to checkpoint (use 0 or None)")
    return PrefixCacheConfig(num_checkpoints=checkpoints, gdn=gdn, recycle=recycle)


def set_buckets(schedulers: Sequence, cache_config, max_num_batched_tokens: int, token_buckets=None,
                row_buckets=None, block_buckets=None) -> None:
    """Replace the schedulers' bucket sets (``T``, ``B``, block-table width) by the given ones (ascending ints,
    checked by :class:`~kvjax.engine.options.EngineOptions`); ``ValueError`` unless each ends at
    ``max_num_batched_tokens``, ``max_seqs`` and ``max_blocks_per_seq``. ``None`` keeps a scheduler's default."""
    for name, values, last, last_name, attr in (
            ("token_buckets", token_buckets, max_num_batched_tokens, "max_num_batched_tokens", "t_buckets"),
            ("row_buckets", row_buckets, cache_config.max_seqs, "max_seqs", "b_buckets"),
            ("block_buckets", block_buckets, cache_config.max_blocks_per_seq, "max_blocks_per_seq", "blk_buckets")):
        if values is not None:
            if values[-1] != last:
                raise ValueError(f"{name} must be ascending ints >= 1 ending at {last_name}={last}, got {values}")
            for sched in schedulers:
                setattr(sched, attr, values)
