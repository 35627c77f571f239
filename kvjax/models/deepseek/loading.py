"""DeepSeek-V3.2 parameters from a Hugging Face checkpoint: :func:`load` (the loader
:func:`kvjax.models.load_pretrained` dispatches to for ``DeepseekV32ForCausalLM`` / ``deepseek_v32``) and
:func:`from_hf` (a config dict and named tensors). Dense and MoE layers; experts fused or per-expert.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.errors import CheckpointError
from kvjax.models.common.checkpoint import (TensorSource, abstract_model, assign_params, check_param_dtype,
                                            load_safetensors, read_config)
from kvjax.models.deepseek.config import DeepseekConfig
from kvjax.models.deepseek.model import DeepseekV32
from kvjax.models.sharding import ShardedModel


def _param_values(config: DeepseekConfig, src: TensorSource) -> dict[tuple, np.ndarray]:
    """Every parameter path of :class:`DeepseekV32` -> its checked value from the checkpoint."""
    c = config
    vals: dict[tuple, np.ndarray] = {}

    def linear(path: tuple, name: str, d_in: int, d_out: int, bias: bool = False) -> None:
        vals[(*path, "kernel")] = src.take(f"{name}.weight", (d_out, d_in)).T
        if bias:
            vals[(*path, "bias")] = src.take(f"{name}.bias", (d_out,))

    def vector(path: tuple, name: str, dim: int) -> None:
        vals[path] = src.take(name, (dim,))

    vals[("embed_tokens",)] = src.take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    for i in range(c.num_hidden_layers):
        p, n = ("layers", i), f"model.layers.{i}"
        a, an = (*p, "self_attn"), f"{n}.self_attn"
        linear((*a, "q_a_proj"), f"{an}.q_a_proj", c.hidden_size, c.q_lora_rank, c.attention_bias)
        vector((*a, "q_a_layernorm", "weight"), f"{an}.q_a_layernorm.weight", c.q_lora_rank)
        linear((*a, "q_b_proj"), f"{an}.q_b_proj", c.q_lora_rank, c.num_attention_heads * c.mla.qk_head_dim)
        linear((*a, "kv_a_proj_with_mqa"), f"{an}.kv_a_proj_with_mqa", c.hidden_size, c.mla.latent_dim,
               c.attention_bias)
        vector((*a, "kv_a_layernorm", "weight"), f"{an}.kv_a_layernorm.weight", c.kv_lora_rank)
        linear((*a, "kv_b_proj"), f"{an}.kv_b_proj", c.kv_lora_rank,
               c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim))
        linear((*a, "o_proj"), f"{an}.o_proj", c.num_attention_heads * c.v_head_dim, c.hidden_size,
               c.attention_bias)
        ix, ixn = (*a, "indexer"), f"{an}.indexer"
        linear((*ix, "wq_b"), f"{ixn}.wq_b", c.q_lora_rank, c.index_n_heads * c.index_head_dim)
        linear((*ix, "wk"), f"{ixn}.wk", c.hidden_size, c.index_head_dim)
        vector((*ix, "k_norm", "weight"), f"{ixn}.k_norm.weight", c.index_head_dim)
        vector((*ix, "k_norm", "bias"), f"{ixn}.k_norm.bias", c.index_head_dim)
        linear((*ix, "weights_proj"), f"{ixn}.weights_proj", c.hidden_size, c.index_n_heads)
        if c.mlp_layer_types[i] == "sparse":
            e, inter = c.n_routed_experts, c.moe_intermediate_size
            vals[(*p, "mlp", "gate", "weight")] = src.take(f"{n}.mlp.gate.weight", (e, c.hidden_size))
            vector((*p, "mlp", "gate", "e_score_correction_bias"), f"{n}.mlp.gate.e_score_correction_bias", e)
            ex = f"{n}.mlp.experts"
            if src.has(f"{ex}.gate_up_proj"):  # fused in-memory layout
                gate_up = src.take(f"{ex}.gate_up_proj", (e, 2 * inter, c.hidden_size))
                down = src.take(f"{ex}.down_proj", (e, c.hidden_size, inter))
            else:  # per-expert layout, as save_pretrained writes it
                gate_up = np.stack([np.concatenate(
                    [src.take(f"{ex}.{j}.gate_proj.weight", (inter, c.hidden_size)),
                     src.take(f"{ex}.{j}.up_proj.weight", (inter, c.hidden_size))]) for j in range(e)])
                down = np.stack([src.take(f"{ex}.{j}.down_proj.weight", (c.hidden_size, inter)) for j in range(e)])
            vals[(*p, "mlp", "experts", "gate_up_proj")] = gate_up
            vals[(*p, "mlp", "experts", "down_proj")] = down
            mlp_path, mlp_name, width = (*p, "mlp", "shared_experts"), f"{n}.mlp.shared_experts", \
                inter * c.n_shared_experts
        else:
            mlp_path, mlp_name, width = (*p, "mlp"), f"{n}.mlp", c.intermediate_size
        for proj, d_in, d_out in (("gate_proj", c.hidden_size, width), ("up_proj", c.hidden_size, width),
                                  ("down_proj", width, c.hidden_size)):
            linear((*mlp_path, proj), f"{mlp_name}.{proj}", d_in, d_out)
        vector((*p, "input_layernorm", "weight"), f"{n}.input_layernorm.weight", c.hidden_size)
        vector((*p, "post_attention_layernorm", "weight"), f"{n}.post_attention_layernorm.weight", c.hidden_size)
    vector(("norm", "weight"), "model.norm.weight", c.hidden_size)
    if not c.tie_word_embeddings:
        linear(("lm_head",), "lm_head", c.hidden_size, c.vocab_size)
    return vals


def from_hf(config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *, dtype=jnp.float32,
            check_finite: bool = True, mesh=None):
    """Build a :class:`DeepseekV32` from a HF config dict and its named tensors; all checks happen first.

    Raises :class:`CheckpointError` naming a bad config key, a non-float ``dtype``, a missing / mis-shaped /
    non-float / non-finite (unless ``check_finite=False``) tensor or an unexpected tensor (e.g. layers beyond
    ``num_hidden_layers``, or MoE weights for a layer the config makes dense). ``mesh`` (a ``("data",
    "model")`` ``jax.sharding.Mesh``): a :class:`kvjax.models.sharding.ShardedModel` instead, each parameter's
    shards placed from host memory directly on their devices.
    """
    dtype = check_param_dtype(dtype)
    cfg = DeepseekConfig.from_hf(config)
    src = TensorSource(tensors, check_finite=check_finite)
    values = _param_values(cfg, src)
    ignore = ("lm_head.",) if cfg.tie_word_embeddings else ()
    extra = src.unused(ignore)
    if extra:
        raise CheckpointError(f"checkpoint has tensors the config does not describe: {extra[:8]}")
    if mesh is not None:
        return ShardedModel(abstract_model(lambda: DeepseekV32(cfg, rngs=nnx.Rngs(0), dtype=dtype)), values, mesh)
    model = DeepseekV32(cfg, rngs=nnx.Rngs(0), dtype=dtype)
    return assign_params(model, values)


def load(path: str, config: Mapping[str, Any] | None = None, *, dtype=jnp.float32,
         check_finite: bool = True, mesh=None):
    """Loader for :func:`kvjax.models.load_pretrained`: ``config.json`` + safetensors at ``path``."""
    if config is None:
        config = read_config(path)
    check_param_dtype(dtype)
    DeepseekConfig.from_hf(config)  # config errors before reading any tensor
    return from_hf(config, load_safetensors(path), dtype=dtype, check_finite=check_finite, mesh=mesh)
