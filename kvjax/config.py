"""Frozen, validated configuration dataclasses.

Every config checks itself in ``__post_init__`` and raises :class:`ValueError` naming the field and the
offending value. Nothing is clamped or silently corrected.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


INT32_MAX = 2**31 - 1  # device indices (positions, slot mapping, windows) are int32


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _require_int(obj: object, name: str, *, minimum: int, maximum: int = INT32_MAX) -> None:
    """Check field ``name`` is an int in ``[minimum, maximum]`` and store it as a Python ``int``."""
    value = getattr(obj, name)
    if not is_int(value):
        raise ValueError(f"{type(obj).__name__}.{name} must be an int, got {value!r}")
    if not minimum <= value <= maximum:
        bound = f">= {minimum}" if value < minimum else f"<= {maximum}"
        raise ValueError(f"{type(obj).__name__}.{name} must be {bound}, got {value}")
    object.__setattr__(obj, name, int(value))


def _require_multiple(obj: object, name: str, of_name: str) -> None:
    value, base = getattr(obj, name), getattr(obj, of_name)
    if value % base:
        raise ValueError(
            f"{type(obj).__name__}.{name}={value} must be a multiple of {of_name}={base}"
        )


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """One Gated DeltaNet layer: q/k heads ``Hk``, value heads ``Hv`` (a multiple of ``Hk``).

    ``conv_dim = 2 * Hk * K + Hv * V`` is the width of the causal conv over the concatenated q, k, v.
    """

    num_k_heads: int  # Hk
    num_v_heads: int  # Hv
    head_k_dim: int  # K
    head_v_dim: int  # V
    conv_kernel_size: int = 4  # W

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            _require_int(self, name, minimum=1)
        _require_int(self, "conv_kernel_size", minimum=2)
        _require_multiple(self, "num_v_heads", "num_k_heads")

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """A (gated) softmax attention layer with per-KV-head sliding windows and sinks.

    ``window[h] == 0`` means KV head ``h`` is a full-attention head. Query position ``i`` attends key ``j``
    iff ``j <= i`` and (``i - j < window`` or ``j < sinks``). ``window``/``sinks`` default to all-full heads.
    """

    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    window: tuple[int, ...] = ()  # i32[Hkv]; () -> all zeros
    sinks: tuple[int, ...] = ()  # i32[Hkv]; () -> all zeros

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim"):
            _require_int(self, name, minimum=1)
        _require_multiple(self, "num_q_heads", "num_kv_heads")
        for name in ("window", "sinks"):
            try:
                value = tuple(getattr(self, name)) or (0,) * self.num_kv_heads
            except TypeError:
                raise ValueError(f"AttentionConfig.{name} must be a sequence of num_kv_heads ints, got "
                                 f"{getattr(self, name)!r}") from None
            if len(value) != self.num_kv_heads:
                raise ValueError(
                    f"AttentionConfig.{name} has {len(value)} entries, expected num_kv_heads="
                    f"{self.num_kv_heads}: {value!r}"
                )
            for h, v in enumerate(value):
                if not is_int(v) or v < 0:
                    raise ValueError(f"AttentionConfig.{name}[{h}] must be an int >= 0, got {v!r}")
                if v > INT32_MAX:  # the kernels take window / sinks as int32
                    raise ValueError(f"AttentionConfig.{name}[{h}] must be an int in [0, {INT32_MAX}], got {v!r}")
            object.__setattr__(self, name, tuple(int(v) for v in value))
        for h, (w, s) in enumerate(zip(self.window, self.sinks)):
            if w == 0 and s > 0:
                raise ValueError(
                    f"AttentionConfig.sinks[{h}]={s} on a full-attention head (window[{h}]=0): "
                    "sinks only make sense for sliding-window heads"
                )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def swa_heads(self) -> tuple[int, ...]:
        return tuple(h for h, w in enumerate(self.window) if w > 0)

    @classmethod
    def with_swa_fraction(
        cls, num_q_heads: int, num_kv_heads: int, head_dim: int, *, swa_fraction: float, window: int,
        sinks: int = 0,
    ) -> "AttentionConfig":
        """The first ``round(swa_fraction * Hkv)`` KV heads are SWA (``window``, ``sinks``); the rest full."""
        if isinstance(swa_fraction, bool) or not isinstance(swa_fraction, (int, float, np.integer, np.floating)) \
                or not 0.0 <= swa_fraction <= 1.0:
            raise ValueError(f"swa_fraction must be a number in [0, 1], got {swa_fraction!r}")
        if not is_int(window) or not is_int(sinks):
            raise ValueError(f"window and sinks must be ints, got window={window!r}, sinks={sinks!r}")
        if swa_fraction > 0 and window < 1:
            raise ValueError(f"window must be >= 1 when swa_fraction > 0, got {window}")
        n_swa = round(swa_fraction * num_kv_heads)
        return cls(
            num_q_heads, num_kv_heads, head_dim,
            window=(window,) * n_swa + (0,) * (num_kv_heads - n_swa),
            sinks=(sinks,) * n_swa + (0,) * (num_kv_heads - n_swa),
        )


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """DeepSeek multi-head latent attention. The cache holds ``kv_lora_rank + qk_rope_head_dim`` per token."""

    num_heads: int  # H
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    q_lora_rank: int | None = 1536  # None: q is projected directly from the hidden state

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _require_int(self, name, minimum=1)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None:
            _require_int(self, "q_lora_rank", minimum=1)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class DSAIndexerConfig:
    """DeepSeek-V3.2 lightning indexer: ``num_heads`` query heads of ``head_dim`` over one fp8 key per token."""

    num_heads: int = 64
    head_dim: int = 128
    topk: int = 2048
    quant_block: int = 128  # one f32 scale per this many fp8 values

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "topk", "quant_block"):
            _require_int(self, name, minimum=1)
        _require_multiple(self, "head_dim", "quant_block")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged cache geometry shared by the host allocators and the device pools."""

    page_size: int  # tokens per page
    num_pages: int  # pages in each layer's pool
    max_seqs: int  # GDN slots 1..max_seqs (slot 0 = PAD); also the batch-row limit
    max_blocks_per_seq: int  # width of a block-table row

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_seqs", "max_blocks_per_seq"):
            _require_int(self, name, minimum=1)
        if self.num_pages * self.page_size > INT32_MAX:
            raise ValueError(f"CacheConfig: num_pages * page_size = {self.num_pages} * {self.page_size} must be <= "
                             f"{INT32_MAX}: the int32 slot mapping addresses page * page_size + offset")
        if self.max_seq_len > INT32_MAX:
            raise ValueError(f"CacheConfig: max_seq_len = page_size * max_blocks_per_seq = {self.page_size} * "
                             f"{self.max_blocks_per_seq} must be <= {INT32_MAX} (int32 positions)")

    @property
    def max_seq_len(self) -> int:
        return self.page_size * self.max_blocks_per_seq


def as_tuple(values: int | Sequence[int], n: int, name: str) -> tuple[int, ...]:
    """Broadcast an int or check a length-``n`` sequence of ints; raises ``ValueError`` naming ``name``."""
    if is_int(values):
        return (int(values),) * n
    try:
        out = tuple(values)
    except TypeError:
        raise ValueError(f"{name} must be an int or a sequence of {n} ints, got {values!r}") from None
    for i, v in enumerate(out):
        if not is_int(v):
            raise ValueError(f"{name}[{i}] must be an int, got {v!r}")
    out = tuple(int(v) for v in out)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries, expected {n}: {out!r}")
    return out


KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}  # vLLM's names -> kvjax's two kinds


def check_kv_cache_dtype(value: object) -> str:
    """``kv_cache_dtype`` as vLLM names it: ``"auto"`` (K/V pages in the cache dtype) or ``"fp8"`` / ``"fp8_e4m3"``
    (float8_e4m3fn pages with per-page f32 scales); returns ``"auto"`` or ``"fp8"``, ``ValueError`` naming the value
    otherwise (``"fp8_e5m2"`` included: kvjax has no e5m2 pages)."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {value!r}")
    return KV_CACHE_DTYPES[value]
