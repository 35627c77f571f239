"""Default cache sizing: what ``Engine(model)`` allocates when it is given no :class:`CacheConfig`.

Cost model, read from the model itself: ``jax.eval_shape`` of ``model.init_caches`` (nothing is allocated) at
two page counts and two slot counts gives

    bytes(num_pages, max_seqs) = page_bytes * num_pages + slot_bytes * (max_seqs + 1 + num_checkpoints) + fixed

where ``page_bytes`` sums one page of every paged role of every layer (Qwen3.5: the K and V pages of each
attention layer; DeepSeek-V3.2: the MLA latent page plus the DSA indexer pages) and ``slot_bytes`` one slot of
the per-sequence state (Qwen3.5's GDN conv + SSM state of every linear-attention layer; 0 for DeepSeek).
With prefix caching the GDN pool also holds ``num_checkpoints`` checkpoint slots: pages and checkpoints share
one budget (the pages are what is left after every slot). With speculative decoding a verification step holds each
row's GDN and conv states after each of its ``K + 1`` positions (:mod:`kvjax.state.gdn_spec`) beside the pool:
``verify_positions = K + 1`` more slots per sequence, paid for before the pages too (the memory is transient, the
budget is not).

Budget: ``memory_fraction`` (default 0.9, like vLLM's ``gpu_memory_utilization`` but of the memory still free
after the parameters) of the device's free memory, ``bytes_limit - bytes_in_use`` of
``jax.local_devices()[0].memory_stats()``; a fixed :data:`CPU_BUDGET` where the device reports no limit (CPU).
The pages are what the budget holds after ``max_seqs + 1`` state slots; ``max_blocks_per_seq`` covers
``max_seq_len`` tokens (at most what the pool could give one sequence on every KV head).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from kvjax.config import INT32_MAX, CacheConfig, is_int
from kvjax.models.interface import CausalLM

DEFAULT_MEMORY_FRACTION = 0.9
CPU_BUDGET = 64 << 20  # bytes of cache on a device that reports no memory limit
PAGE_SIZE = 16
MAX_SEQS = {"cpu": 8, "accelerator": 32}
MAX_SEQ_LEN = {"cpu": 2048, "accelerator": 8192}


@dataclasses.dataclass(frozen=True)
class CacheSizing:
    """A sized :class:`CacheConfig` and how it was derived."""

    cache_config: CacheConfig
    budget_bytes: int  # cache memory allowed
    budget_source: str  # where the budget came from
    page_bytes: int  # one page index across every paged role of every layer
    slot_bytes: int  # one per-sequence state slot across every layer (0 without recurrent layers)
    fixed_bytes: int  # cache bytes independent of pages and slots
    num_checkpoints: int = 0  # GDN checkpoint slots beside the max_seqs + 1 sequence slots (prefix caching)
    verify_slots: int = 0  # state slots a verification step holds beside the pool (speculative decoding)

    @property
    def cache_bytes(self) -> int:
        c = self.cache_config
        return self.page_bytes * c.num_pages + self.slot_bytes * (c.max_seqs + 1 + self.num_checkpoints) \
            + self.fixed_bytes

    def describe(self) -> str:
        """One line: the chosen geometry, its bytes and the budget."""
        c = self.cache_config
        return (f"cache sized from {self.budget_source}: {c.num_pages} pages of {c.page_size} tokens "
                f"({_mib(self.page_bytes * c.num_pages)}, {self.page_bytes} B per page over all layers), "
                f"{c.max_seqs} sequences + {self.num_checkpoints} checkpoints "
                f"({_mib(self.slot_bytes * (c.max_seqs + 1 + self.num_checkpoints))} of per-sequence state), "
                f"{c.max_blocks_per_seq} blocks = {c.max_seq_len} tokens per sequence; {_mib(self.cache_bytes)} "
                f"of a {_mib(self.budget_bytes)} budget"
                + (f" ({_mib(self.slot_bytes * self.verify_slots)} kept for a verification step's states)"
                   if self.verify_slots and self.slot_bytes else ""))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_memory_fraction(value: Any) -> float:
    """A number in ``(0, 1]`` as a float; ``ValueError`` naming the value otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"memory_fraction must be a number in (0, 1] (a share of the free device memory), got "
                         f"{value!r}")
    return float(value)


def memory_budget(memory_fraction: float, device: Any = None) -> tuple[int, str]:
    """``(bytes, where from)``: ``memory_fraction`` of ``device``'s free memory (default: the first device),
    or :data:`CPU_BUDGET` where it reports no limit."""
    device = device if device is not None else jax.local_devices()[0]
    stats = _memory_stats(device)
    limit = stats.get("bytes_limit")
    if not limit:
        return CPU_BUDGET, f"the fixed {device.platform} budget ({_mib(CPU_BUDGET)})"
    free = max(int(limit) - int(stats.get("bytes_in_use", 0)), 0)
    return int(memory_fraction * free), f"{memory_fraction:g} x {_mib(free)} free on {device.device_kind}"


def _memory_stats(device: Any) -> dict:
    """``device.memory_stats()``, or ``{}`` where the backend reports none."""
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        return {}


def device_memory(device: Any = None) -> int:
    """Bytes a cache may at most take on ``device`` (default: the first device): its memory limit, or the host's
    physical memory where it reports none (CPU)."""
    limit = _memory_stats(device if device is not None else jax.local_devices()[0]).get("bytes_limit")
    return int(limit) if limit else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def verify_slots(max_seqs: int, verify_positions: int) -> int:
    """State slots a verification step holds beside the pool: ``verify_positions`` (``K + 1``; 0 without speculative
    decoding) per sequence."""
    if not is_int(verify_positions) or verify_positions < 0:
        raise ValueError(f"verify_positions must be an int >= 0, got {verify_positions!r}")
    return max_seqs * verify_positions


def check_cache_fits(model: CausalLM, cache: CacheConfig, num_checkpoints: int, dtype: Any,
                     cache_options: dict | None, device: Any = None, head: Any = None,
                     verify_positions: int = 0) -> None:
    """``ValueError`` before anything is allocated when the caches of ``cache`` (with ``num_checkpoints`` GDN
    checkpoint slots and a verification step's ``verify_positions`` per sequence; bytes from
    :func:`cache_bytes_model`) exceed the memory of one device (:func:`device_memory`)."""
    page, slot, fixed = cache_bytes_model(model, page_size=cache.page_size, dtype=dtype, cache_options=cache_options,
                                          head=head)
    extra = verify_slots(cache.max_seqs, verify_positions)
    need = page * cache.num_pages + slot * (cache.max_seqs + 1 + num_checkpoints + extra) + fixed
    have = device_memory(device)
    if need > have:
        raise ValueError(f"the caches need {need / 2**30:.1f} GiB ({cache.num_pages} pages, {cache.max_seqs} "
                         f"sequences + {num_checkpoints} checkpoint slots + {extra} verification state slots), more "
                         f"than the device's {have / 2**30:.1f} GiB: lower num_pages, max_seqs, prefix_checkpoints "
                         "or num_draft_tokens")


def cache_bytes_model(model: CausalLM, *, page_size: int, dtype: Any, cache_options: dict | None = None,
                      head: Any = None) -> tuple[int, int, int]:
    """``(page_bytes, slot_bytes, fixed_bytes)`` of ``model``'s caches (see the module docstring); ``head``: MTP
    layers (:class:`~kvjax.models.interface.DraftHead`) whose pools take pages beside the model's."""
    def caches(num_pages: int, max_seqs: int):
        main = model.init_caches(num_pages=num_pages, page_size=page_size, max_seqs=max_seqs, dtype=dtype,
                                 **(cache_options or {}))
        return main if head is None else (main, head.init_caches(
            num_pages=num_pages, page_size=page_size, dtype=dtype,
            kv_cache_dtype=(cache_options or {}).get("kv_cache_dtype", "auto")))

    def total(num_pages: int, max_seqs: int) -> int:
        shapes = jax.eval_shape(lambda: caches(num_pages, max_seqs))
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(shapes))

    base = total(1, 1)
    page, slot = total(2, 1) - base, total(1, 2) - base
    return page, slot, base - page - 2 * slot


def size_cache(model: CausalLM, *, dtype: Any, memory_fraction: float | None = None, page_size: int = PAGE_SIZE,
               max_seqs: int | None = None, max_seq_len: int | None = None, cache_options: dict | None = None,
               device: Any = None, num_checkpoints: int = 0, head: Any = None,
               verify_positions: int = 0) -> CacheSizing:
    """Size a :class:`CacheConfig` for ``model`` from a memory budget (see the module docstring).

    ``max_seqs`` / ``max_seq_len`` default to :data:`MAX_SEQS` / :data:`MAX_SEQ_LEN` of the platform (``cpu`` or
    ``accelerator``); ``num_checkpoints`` GDN checkpoint slots and a verification step's ``verify_positions`` slots
    per sequence (``K + 1`` with speculative decoding) are paid for before the pages; ``head``: MTP layers whose
    pools a page pays for too. Raises ``ValueError`` for a bad ``memory_fraction`` or size, or a budget that does not
    hold the state slots and one page per KV head.
    """
    memory_fraction = check_memory_fraction(DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction)
    device = device if device is not None else jax.local_devices()[0]
    kind = "cpu" if device.platform == "cpu" else "accelerator"
    max_seqs = default_max_seqs(device) if max_seqs is None else max_seqs
    max_seq_len = MAX_SEQ_LEN[kind] if max_seq_len is None else max_seq_len
    if not is_int(num_checkpoints) or num_checkpoints < 0:
        raise ValueError(f"num_checkpoints must be an int >= 0, got {num_checkpoints!r}")
    for name, v in (("page_size", page_size), ("max_seqs", max_seqs), ("max_seq_len", max_seq_len)):
        if not is_int(v) or not 1 <= v <= INT32_MAX:
            raise ValueError(f"{name} must be an int in [1, {INT32_MAX}], got {v!r}")
    extra = verify_slots(max_seqs, verify_positions)
    budget, source = memory_budget(memory_fraction, device)
    page_bytes, slot_bytes, fixed = cache_bytes_model(model, page_size=page_size, dtype=dtype,
                                                      cache_options=cache_options, head=head)
    heads = model.attention_layout().num_kv_heads
    left = budget - slot_bytes * (max_seqs + 1 + num_checkpoints + extra) - fixed
    num_pages = min(left // max(page_bytes, 1), INT32_MAX // page_size)
    if num_pages < heads:
        raise ValueError(f"cache budget {_mib(budget)} ({source}) holds {max(num_pages, 0)} pages after "
                         f"{max_seqs + 1 + num_checkpoints + extra} state slots of {slot_bytes} B; need at least "
                         f"{heads} (one per KV head): raise memory_fraction, lower max_seqs or num_draft_tokens, or pass a "
                         "CacheConfig")
    max_blocks = max(1, min(-(-max_seq_len // page_size), num_pages // heads))
    config = CacheConfig(page_size=page_size, num_pages=int(num_pages), max_seqs=max_seqs,
                         max_blocks_per_seq=int(max_blocks))
    return CacheSizing(config, budget, source, page_bytes, slot_bytes, fixed, int(num_checkpoints), int(extra))


def default_max_seqs(device: Any = None) -> int:
    """:data:`MAX_SEQS` of ``device``'s platform (default: the first device)."""
    device = device if device is not None else jax.local_devices()[0]
    return MAX_SEQS["cpu" if device.platform == "cpu" else "accelerator"]
