"""Tiny toy models the tests share: a four-layer Qwen3.5 (GDN + full attention), two-layer DeepSeek-V3.2s and the
sharding tests' models (:data:`MESH_FAMILIES`, head counts that divide 1, 2 and 4 model devices)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.config import AttentionConfig, GDNConfig
from kvjax.models.common.checkpoint import assign_params
from kvjax.models.deepseek import DeepseekConfig, DeepseekV32
from kvjax.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, init_random

VOCAB = 61  # prime: the sharded lm_head pads it to 62 / 64 on 2 / 4 model devices
FOUR_LAYERS = ("linear_attention", "full_attention", "linear_attention", "full_attention")


def tiny_config(window=(), sinks=(), layer_types=FOUR_LAYERS) -> Qwen3_5Config:
    """Qwen3.5 with hidden 32, 4 query / 2 KV heads of 16, GDN Hk=2 Hv=4 K=V=8, conv width 4."""
    return Qwen3_5Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, layer_types=layer_types,
        attention=AttentionConfig(4, 2, 16, window=window, sinks=sinks),
        gdn=GDNConfig(2, 4, 8, 8, 4), rope_theta=10000.0, partial_rotary_factor=0.5,
    )


def random_model(config: Qwen3_5Config, seed: int, dtype=jnp.float32) -> Qwen3_5ForCausalLM:
    """A model whose every parameter (norm scales included) is random, so no term can hide."""
    model = init_random(config, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    values = {p: 0.3 * rng.standard_normal(v.get_value().shape) for p, v in nnx.to_flat_state(nnx.state(model))}
    return assign_params(model, values)


def qwen_swa_model(seed: int = 0) -> Qwen3_5ForCausalLM:
    """Tiny 2-layer Qwen3.5 (GDN + gated attention) whose KV head 0 is SWA (window 6, 2 sinks); all params random
    (the model the engine tests serve)."""
    return random_model(tiny_config(window=(6, 0), sinks=(2, 0), layer_types=("linear_attention", "full_attention")),
                        seed)


def mesh_qwen_model() -> Qwen3_5ForCausalLM:
    """Two-layer Qwen3.5 with 8 query / 4 KV heads (SWA on heads 0 and 2, a sink on head 0) and 4 / 8 GDN heads:
    every head count divides 1, 2 and 4 model devices (the sharding tests' meshes); all parameters random."""
    cfg = Qwen3_5Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, layer_types=("linear_attention", "full_attention"),
        attention=AttentionConfig(8, 4, 16, window=(5, 0, 6, 0), sinks=(1, 0, 0, 0)), gdn=GDNConfig(4, 8, 8, 8, 4),
        rope_theta=10000.0, partial_rotary_factor=0.5,
    )
    return random_model(cfg, seed=5)


def mesh_deepseek_model() -> DeepseekV32:
    """Two-layer DeepSeek-V3.2 (a dense and a sparse MoE layer: 4 routed experts in 2 groups, a shared one) with 4
    heads; its constructors' parameters, the norms and biases moved away from 1 / 0."""
    cfg = DeepseekConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=4,
        index_head_dim=16, index_topk=5, rope_parameters=(("rope_theta", 10000.0), ("rope_type", "default")),
        mlp_layer_types=("dense", "sparse"), moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1,
    )
    model = DeepseekV32(cfg, rngs=nnx.Rngs(7))
    rng = np.random.default_rng(7)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # norms and biases away from 1 / 0
        if var[...].ndim == 1:
            var[...] = var[...] + 0.3 * rng.standard_normal(var[...].shape).astype(np.float32)
    return model


MESH_FAMILIES = {"qwen3_5": mesh_qwen_model, "deepseek": mesh_deepseek_model}


def tiny_deepseek_config(rope_dim: int = 8) -> DeepseekConfig:
    """The tiny DeepSeek-V3.2 (MLA + DSA indexer, top-6) the engine tests serve; ``rope_dim=16`` gives shapes the
    Triton-tiled MLA kernels take (powers of two >= 16)."""
    return DeepseekConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
        q_lora_rank=40, kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=rope_dim, v_head_dim=16,
        index_n_heads=4, index_head_dim=16, index_topk=6, max_position_embeddings=64,
        rope_parameters=(("rope_theta", 10000.0), ("rope_type", "default")),
    )


def tiny_deepseek(seed: int = 5, rope_dim: int = 8) -> DeepseekV32:
    """:func:`tiny_deepseek_config` with its constructors' random parameters (float32)."""
    return nnx.jit(lambda: DeepseekV32(tiny_deepseek_config(rope_dim), rngs=nnx.Rngs(seed)))()
