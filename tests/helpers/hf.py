"""A tiny Hugging Face Qwen3.5 checkpoint for the loading tests (needs torch and transformers: importers skip
without them first)."""

from __future__ import annotations

import json
import os

import torch
import transformers
from safetensors.numpy import save_file

VOCAB = 97


def hf_config(**overrides):
    """A tiny ``transformers`` Qwen3.5 text config (4 layers: GDN + gated full attention, GQA in both, partial RoPE);
    ``overrides`` replace its fields."""
    kw = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return transformers.Qwen3_5TextConfig(**kw)


def saved_hf_model(tmp_path, seed: int, **overrides):
    """``(hf_model, path)``: a :func:`hf_config` model whose every parameter (norm scales included) is re-drawn at
    random, saved with ``save_pretrained`` under ``tmp_path / "ckpt"``."""
    torch.manual_seed(seed)
    hf = transformers.Qwen3_5ForCausalLM(hf_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.2))
    path = tmp_path / "ckpt"
    hf.save_pretrained(path)
    return hf, path


def write_ckpt(path, config, tensors):
    """A checkpoint folder at ``path``: ``config`` as config.json, ``tensors`` as model.safetensors."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path
