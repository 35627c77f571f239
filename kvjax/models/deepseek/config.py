"""Hyper-parameters of a DeepSeek-V3.2 decoder (HF ``DeepseekV32Config`` field names), read from a HF config dict.

The model is :mod:`kvjax.models.deepseek.model` (the package re-exports :class:`DeepseekConfig`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from kvjax.config import DSAIndexerConfig, MLAConfig
from kvjax.errors import CheckpointError
from kvjax.models.common.checkpoint import config_get


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """Hyper-parameters of a DeepSeek-V3.2 decoder (HF ``DeepseekV32Config`` field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int  # H
    q_lora_rank: int  # the DSA indexer reads q_a_layernorm(q_a_proj(x)), so V3.2 always has one
    kv_lora_rank: int  # latent width (512 in DeepSeek)
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # r (64 in DeepSeek)
    v_head_dim: int
    index_n_heads: int  # Hi
    index_head_dim: int  # Di
    index_topk: int
    rope_parameters: tuple[tuple[str, Any], ...]  # HF rope_parameters dict as sorted items (hashable)
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    mlp_layer_types: tuple[str, ...] = ()  # "dense" | "sparse" per layer; () -> all dense
    # MoE ("sparse" layers; HF DeepseekV32MoE): routed experts + shared experts, sigmoid group-limited routing
    moe_intermediate_size: int = 1
    n_routed_experts: int = 1  # E
    num_experts_per_tok: int = 1  # experts per token
    n_group: int = 1  # expert groups (E % n_group == 0)
    topk_group: int = 1  # groups kept per token
    n_shared_experts: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"DeepseekConfig.{name} must be an int >= 1, got {value!r}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise CheckpointError(f"DeepseekConfig.rms_norm_eps must be a finite number >= 0, got {eps!r}")
        if self.qk_rope_head_dim % 2:
            raise CheckpointError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        theta = dict(self.rope_parameters).get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise CheckpointError(f"DeepseekConfig rope_parameters' rope_theta must be a finite number > 0, "
                                  f"got {theta!r}")
        types = tuple(self.mlp_layer_types) or ("dense",) * self.num_hidden_layers
        if len(types) != self.num_hidden_layers or set(types) - {"dense", "sparse"}:
            raise CheckpointError(
                f"mlp_layer_types must hold num_hidden_layers={self.num_hidden_layers} entries 'dense' / 'sparse', "
                f"got {list(self.mlp_layer_types)!r}"
            )
        object.__setattr__(self, "mlp_layer_types", types)
        if "sparse" in types:
            for name in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group",
                         "topk_group", "n_shared_experts"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise CheckpointError(f"DeepseekConfig.{name} must be an int >= 1, got {value!r}")
            per_group = self.n_routed_experts // self.n_group
            if self.n_routed_experts % self.n_group or per_group < 2:
                raise CheckpointError(
                    f"n_routed_experts={self.n_routed_experts} must be a multiple of n_group={self.n_group} with "
                    ">= 2 experts per group (groups are ranked by their top-2 scores)"
                )
            if self.topk_group > self.n_group or self.num_experts_per_tok > self.topk_group * per_group:
                raise CheckpointError(
                    f"topk_group={self.topk_group} / num_experts_per_tok={self.num_experts_per_tok} exceed "
                    f"n_group={self.n_group} / the {self.topk_group * per_group} experts of the kept groups"
                )
        if self.index_head_dim < self.qk_rope_head_dim:
            raise CheckpointError(
                f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim}"
            )

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_parameters)

    @property
    def mla(self) -> MLAConfig:
        return MLAConfig(self.num_attention_heads, self.kv_lora_rank, self.qk_rope_head_dim,
                         self.qk_nope_head_dim, self.v_head_dim, self.q_lora_rank)

    @property
    def indexer(self) -> DSAIndexerConfig:
        return DSAIndexerConfig(self.index_n_heads, self.index_head_dim, self.index_topk,
                                quant_block=self.quant_block)

    @property
    def quant_block(self) -> int:
        """Values per fp8 scale in the DSA cache: 128 for DeepSeek, smaller for toy widths."""
        return math.gcd(self.index_head_dim, self.kv_lora_rank, 128)

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim**-0.5``, times ``yarn_get_mscale(factor, mscale_all_dim)**2`` (HF yarn_apply_mscale)."""
        scale = self.mla.qk_head_dim ** -0.5
        rp = self.rope
        if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
            factor = float(rp["factor"])
            m = 1.0 if factor <= 1 else 0.1 * float(rp["mscale_all_dim"]) * math.log(factor) + 1.0
            scale = scale * m * m
        return scale

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "DeepseekConfig":
        """Parse a HF ``config.json`` dict; :class:`CheckpointError` names the offending key."""
        g = lambda key, default=..., kind=int: config_get(cfg, key, default, kind=kind)  # noqa: E731
        n_layers = g("num_hidden_layers")
        act = g("hidden_act", "silu", str)
        if act != "silu":
            raise CheckpointError(f"config key 'hidden_act' must be 'silu', got {act!r}")
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            n_dense = min(g("first_k_dense_replace", 3), n_layers)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        if not isinstance(mlp_types, list):
            raise CheckpointError(f"config key 'mlp_layer_types' must be a list, got {mlp_types!r}")
        moe = {}
        if "sparse" in mlp_types:
            moe = dict(
                moe_intermediate_size=g("moe_intermediate_size"), n_routed_experts=g("n_routed_experts"),
                num_experts_per_tok=g("num_experts_per_tok"), n_group=g("n_group", 1),
                topk_group=g("topk_group", 1), n_shared_experts=g("n_shared_experts", 1),
                norm_topk_prob=bool(g("norm_topk_prob", True, bool)),
                routed_scaling_factor=float(g("routed_scaling_factor", 1.0, (int, float))),
            )
        layer_types = cfg.get("layer_types") or ["indexed_attention"] * n_layers
        if any(t != "indexed_attention" for t in layer_types):
            raise CheckpointError(f"config key 'layer_types' must be all 'indexed_attention', got {layer_types!r}")
        if cfg.get("q_lora_rank") is None:
            raise CheckpointError("config key 'q_lora_rank' is required (DeepSeek-V3.2's indexer reads q_resid)")
        heads, kv_heads = g("num_attention_heads"), g("num_key_value_heads", None)
        if kv_heads not in (None, heads):
            raise CheckpointError(f"config key 'num_key_value_heads'={kv_heads} must equal num_attention_heads={heads}")
        rope = dict(g("rope_parameters", None, dict) or {})
        if not rope:
            rope = {"rope_type": "default", "rope_theta": g("rope_theta", 10000.0, (int, float))}
        rope.setdefault("rope_type", rope.get("type", "default"))
        if rope["rope_type"] == "yarn":
            rope.setdefault("original_max_position_embeddings", g("max_position_embeddings"))
        return cls(
            vocab_size=g("vocab_size"), hidden_size=g("hidden_size"), intermediate_size=g("intermediate_size"),
            num_hidden_layers=n_layers, num_attention_heads=heads, q_lora_rank=g("q_lora_rank"),
            kv_lora_rank=g("kv_lora_rank"), qk_nope_head_dim=g("qk_nope_head_dim"),
            qk_rope_head_dim=g("qk_rope_head_dim"), v_head_dim=g("v_head_dim"),
            index_n_heads=g("index_n_heads"), index_head_dim=g("index_head_dim"), index_topk=g("index_topk"),
            rope_parameters=tuple(sorted(rope.items())),
            max_position_embeddings=g("max_position_embeddings", 4096),
            rms_norm_eps=float(g("rms_norm_eps", 1e-6, (int, float))),
            attention_bias=bool(g("attention_bias", False, bool)),
            tie_word_embeddings=bool(g("tie_word_embeddings", False, bool)),
            mlp_layer_types=tuple(mlp_types), **moe,
        )
