"""Toy DeepSeek-V3.2 vs Hugging Face ``DeepseekV32ForCausalLM`` (torch CPU, float32), and loader errors.

Parity: a tiny random HF model (all-dense MLP, every parameter re-drawn so norms/biases matter) is written with
``save_pretrained``, read back with :func:`kvjax.models.load_pretrained`, and ``model.logits`` must match HF's
logits to max abs diff <= 1e-4. One config has ``index_topk`` below the sequence length (the indexer's top-k
selection decides the attention), with YaRN (mscale != mscale_all_dim); the other a dense top-k, default RoPE,
attention biases and tied embeddings.
"""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from kvjax.errors import CheckpointError  # noqa: E402
from kvjax.models import load_pretrained  # noqa: E402
from kvjax.models.deepseek import DeepseekV32  # noqa: E402

VOCAB, T = 83, 19

CONFIGS = {
    "sparse-yarn": dict(
        index_topk=5, attention_bias=False, tie_word_embeddings=False, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9,
                         "mscale_all_dim": 1.3, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
    ),
    "dense-bias-tied": dict(
        index_topk=64, attention_bias=True, tie_word_embeddings=True, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    ),
    "moe": dict(
        index_topk=7, first_k_dense_replace=1, moe_intermediate_size=24, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=3, n_shared_experts=2, routed_scaling_factor=1.7,
        max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def _hf_model(name: str, seed: int):
    cfg = transformers.DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
        qk_nope_head_dim=20, index_head_dim=32, index_n_heads=8, **{"first_k_dense_replace": 2, **CONFIGS[name]},
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:
                p.copy_(0.2 * noise + (1.0 if pname.endswith("weight") else 0.0))
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
        for bname, buf in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # routing bias: changes which experts are chosen
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory, HF model) for every config."""
    out = {}
    for i, name in enumerate(CONFIGS):
        model = _hf_model(name, seed=11 + i)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (str(path), model)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_hf(saved, rng, name):
    path, hf = saved[name]
    model = load_pretrained(path)
    assert isinstance(model, DeepseekV32)
    ids = rng.integers(0, VOCAB, size=(2, T))
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(model.logits(jnp.asarray(ids, jnp.int32)))
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    if hf.config.index_topk < T:
        # The top-k selection matters here: without it (top-k = T) HF's logits change.
        hf.config.index_topk = T
        for layer in hf.model.layers:
            layer.self_attn.indexer.index_topk = T
        with torch.no_grad():
            dense = hf(torch.from_numpy(ids)).logits.numpy()
        hf.config.index_topk = CONFIGS[name]["index_topk"]
        for layer in hf.model.layers:
            layer.self_attn.indexer.index_topk = hf.config.index_topk
        assert np.abs(dense - ref).max() > 1e-2


# ------------------------------------------------------------------------------------------- bad checkpoints


def _copy(saved, tmp_path, name="dense-bias-tied"):
    src = saved[name][0]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, fn):
    tensors = load_file(os.path.join(path, "model.safetensors"))
    fn(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _edit_config(path, fn):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    fn(cfg)
    with open(file, "w") as f:
        json.dump(cfg, f)


def test_missing_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name = "model.layers.1.self_attn.indexer.wk.weight"
    _edit_tensors(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.indexer\.wk\.weight"):
        load_pretrained(path)


def test_misshaped_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name = "model.layers.0.self_attn.kv_b_proj.weight"

    def cut(t):
        t[name] = t[name][:-1]

    _edit_tensors(path, cut)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight.*shape"):
        load_pretrained(path)


def test_unexpected_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)

    def add(t):
        t["model.layers.2.mlp.up_proj.weight"] = np.ones((96, 64), np.float32)

    _edit_tensors(path, add)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_pretrained(path)


def test_integer_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name = "model.norm.weight"

    def to_int(t):
        t[name] = t[name].astype(np.int32)

    _edit_tensors(path, to_int)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*int32"):
        load_pretrained(path)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda c: c.update(mlp_layer_types=["dense", "sparse"]), r"model\.layers\.1\.mlp\.gate\.weight"),
        (lambda c: c.update(mlp_layer_types=["dense", "sparse"], n_group=3), r"n_routed_experts.*n_group"),
        (lambda c: c.pop("kv_lora_rank"), r"kv_lora_rank"),
        (lambda c: c.update(q_lora_rank=None), r"q_lora_rank"),
        (lambda c: c.update(hidden_act="gelu"), r"hidden_act"),
        (lambda c: c.update(qk_rope_head_dim=15), r"qk_rope_head_dim"),
        (lambda c: c.update(architectures=["DeepseekV99ForCausalLM"], model_type="deepseek_v99"),
         r"unknown architecture.*DeepseekV99ForCausalLM"),
    ],
    ids=["moe-tensors-missing", "moe-groups", "missing-key", "no-q-lora", "act", "odd-rope", "unknown-arch"],
)
def test_bad_config_is_named(saved, tmp_path, edit, pattern):
    path = _copy(saved, tmp_path)
    _edit_config(path, edit)
    with pytest.raises(CheckpointError, match=pattern):
        load_pretrained(path)
