"""Hyper-parameters of the toy Qwen3.5 text model (HF ``Qwen3_5TextConfig`` field names), read from a HF config dict.

The model is :mod:`kvjax.models.qwen3_5.model`, its layers :mod:`kvjax.models.qwen3_5.layers`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kvjax.config import AttentionConfig, GDNConfig
from kvjax.errors import CheckpointError
from kvjax.models.common.checkpoint import config_get

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config:
    """Static shape config of the text model (hashable: it is part of the jit-static graph)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    attention: AttentionConfig  # full-attention layers (window/sinks: SWA heads, research option)
    gdn: GDNConfig  # linear-attention layers
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Qwen3_5Config.{name} must be an int >= 1, got {v!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if not self.layer_types:
            raise ValueError("Qwen3_5Config.layer_types is empty")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"Qwen3_5Config.layer_types has unknown entries {bad}; allowed {LAYER_TYPES}")
        for name, ok, want in (("rms_norm_eps", lambda v: v >= 0, ">= 0"), ("rope_theta", lambda v: v > 0, "> 0"),
                               ("partial_rotary_factor", lambda v: 0 < v <= 1, "in (0, 1]")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"Qwen3_5Config.{name} must be a finite number {want}, got {v!r}")
        rotary = int(self.attention.head_dim * self.partial_rotary_factor)
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"rotary dim int(head_dim={self.attention.head_dim} * partial_rotary_factor="
                f"{self.partial_rotary_factor}) = {rotary} must be even and >= 2"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def with_swa(self, window: tuple[int, ...], sinks: tuple[int, ...] = ()) -> "Qwen3_5Config":
        """Same model with per-KV-head ``window``/``sinks`` in every full-attention layer (research option)."""
        a = self.attention
        return dataclasses.replace(
            self, attention=AttentionConfig(a.num_q_heads, a.num_kv_heads, a.head_dim, window=window, sinks=sinks)
        )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Qwen3_5Config":
        """From an HF ``config.json`` dict (``qwen3_5_text``, or ``qwen3_5`` whose ``text_config`` is used).

        Raises :class:`CheckpointError` naming the missing or invalid key.
        """
        if cfg.get("model_type") == "qwen3_5" or "text_config" in cfg:
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise CheckpointError(f"qwen3_5 config needs a 'text_config' object, got {text!r}")
            outer_tie = cfg.get("tie_word_embeddings")  # the wrapper's flag governs its lm_head
            cfg = text if outer_tie is None else {**text, "tie_word_embeddings": outer_tie}
        try:
            act = config_get(cfg, "hidden_act", "silu", kind=str)
            if act != "silu":
                raise CheckpointError(f"config hidden_act={act!r} is not supported (only 'silu')")
            n_layers = config_get(cfg, "num_hidden_layers", kind=int)
            layer_types = cfg.get("layer_types")
            if layer_types is None:
                interval = config_get(cfg, "full_attention_interval", 4, kind=int)
                if interval < 1:
                    raise CheckpointError(f"config full_attention_interval must be an int >= 1, got {interval!r}")
                layer_types = [
                    "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
                ]
            if not isinstance(layer_types, list) or len(layer_types) != n_layers:
                raise CheckpointError(
                    f"config layer_types must be a list of num_hidden_layers={n_layers} entries, got {layer_types!r}"
                )
            hidden = config_get(cfg, "hidden_size", kind=int)
            n_heads = config_get(cfg, "num_attention_heads", kind=int)
            if n_heads < 1:
                raise CheckpointError(f"config key 'num_attention_heads' must be an int >= 1, got {n_heads!r}")
            rope = dict(cfg.get("rope_parameters") or {})
            rope_type = rope.get("rope_type", "default")
            if rope_type != "default":
                raise CheckpointError(f"config rope_parameters.rope_type={rope_type!r} is not supported")
            theta = rope.get("rope_theta", cfg.get("rope_theta"))
            if theta is None:
                raise CheckpointError("config has no rope_theta (rope_parameters.rope_theta)")
            prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
            return cls(
                vocab_size=config_get(cfg, "vocab_size", kind=int),
                hidden_size=hidden,
                intermediate_size=config_get(cfg, "intermediate_size", kind=int),
                layer_types=tuple(layer_types),
                attention=AttentionConfig(
                    n_heads,
                    config_get(cfg, "num_key_value_heads", kind=int),
                    config_get(cfg, "head_dim", hidden // n_heads, kind=int),
                ),
                gdn=GDNConfig(
                    config_get(cfg, "linear_num_key_heads", kind=int),
                    config_get(cfg, "linear_num_value_heads", kind=int),
                    config_get(cfg, "linear_key_head_dim", kind=int),
                    config_get(cfg, "linear_value_head_dim", kind=int),
                    config_get(cfg, "linear_conv_kernel_dim", 4, kind=int),
                ),
                rms_norm_eps=float(config_get(cfg, "rms_norm_eps", 1e-6, kind=(int, float))),
                rope_theta=float(theta),
                partial_rotary_factor=float(prf),
                attention_bias=bool(config_get(cfg, "attention_bias", False, kind=bool)),
                tie_word_embeddings=bool(config_get(cfg, "tie_word_embeddings", False, kind=bool)),
            )
        except CheckpointError:
            raise
        except ValueError as err:  # a kvjax config rejected a value
            raise CheckpointError(f"invalid Qwen3.5 config: {err}") from err
