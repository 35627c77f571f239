"""Toy Qwen3.5: logits parity with Hugging Face ``Qwen3_5ForCausalLM``, loading errors, shared model pieces.

HF parity: a tiny random config (GDN + gated full attention, GQA in both, partial RoPE, a sequence longer than
one GDN chunk) is saved with ``save_pretrained`` and loaded with ``kvjax.models.load_pretrained``; every HF
parameter (norm scales included) is re-drawn at random so that no term can hide behind an init of 0 or 1.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file  # noqa: E402

from helpers.hf import VOCAB, hf_config, saved_hf_model, write_ckpt  # noqa: E402
from kvjax.errors import CheckpointError  # noqa: E402
from kvjax.models import load_pretrained  # noqa: E402
from kvjax.models.common.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from kvjax.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM  # noqa: E402

TOL = 1e-4  # f32 max abs logit difference (issue 7)


def test_logits_match_hf(tmp_path, rng):
    hf, path = saved_hf_model(tmp_path, seed=int(rng.integers(1 << 30)))
    model = load_pretrained(path)
    assert isinstance(model, Qwen3_5ForCausalLM)
    assert model.config.gdn_layers == (0, 2) and model.config.attention.group_size == 2
    ids = rng.integers(0, VOCAB, (2, 70))  # 70 > one 64-token GDN chunk
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    from flax import nnx

    out = np.asarray(nnx.jit(lambda m, x: m.logits(x))(model, jnp.asarray(ids, jnp.int32)))
    assert out.shape == (2, 70, VOCAB) and out.dtype == np.float32
    assert np.abs(ref).max() > 1.0  # logits are not trivially small
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


def test_tied_embeddings_load_and_match(tmp_path, rng):
    hf, path = saved_hf_model(tmp_path, seed=int(rng.integers(1 << 30)), tie_word_embeddings=True,
                              num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    assert "lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
    model = load_pretrained(path)
    assert model.lm_head is None
    ids = rng.integers(0, VOCAB, (1, 9))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    from flax import nnx

    logits = nnx.jit(lambda m, x: m.logits(x))
    np.testing.assert_allclose(np.asarray(logits(model, jnp.asarray(ids, jnp.int32))), ref, atol=TOL, rtol=0)
    # SWA heads (research option) on the same weights: identical to HF while every key is inside the window
    # (positions < 4), different once the window of KV head 0 excludes keys
    swa = load_pretrained(path, window=(4, 0), sinks=(1, 0))
    assert swa.config.attention.window == (4, 0) and model.config.attention.window == (0, 0)
    out = np.asarray(logits(swa, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(out[:, :4], ref[:, :4], atol=TOL, rtol=0)
    assert np.abs(out[:, 6:] - ref[:, 6:]).max() > 1e-3
    with pytest.raises(CheckpointError, match="window"):
        load_pretrained(path, window=(4,))


def test_multimodal_checkpoint_loads_text_tower(tmp_path):
    """``Qwen3_5ForConditionalGeneration`` checkpoints: the text tower loads, the vision tower is skipped."""
    torch.manual_seed(1)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2,
                  num_position_embeddings=16)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=hf_config().to_dict(), vision_config=vision))
    hf.save_pretrained(tmp_path / "mm")
    model = load_pretrained(tmp_path / "mm")
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    np.testing.assert_array_equal(np.asarray(model.model.embed_tokens[...]),
                                  sd["model.language_model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(model.model.layers[2].linear_attn.in_proj_qkv.kernel[...]),
                                  sd["model.language_model.layers.2.linear_attn.in_proj_qkv.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), sd["lm_head.weight"].T)


# ------------------------------------------------------------------------------------------ bad checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A valid tiny checkpoint (config dict + tensors) to corrupt in various ways."""
    tmp = tmp_path_factory.mktemp("good")
    _, path = saved_hf_model(tmp, seed=5)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return config, load_file(os.path.join(path, "model.safetensors"))


def test_missing_tensor_is_named(tmp_path, saved):
    config, tensors = saved
    name = "model.layers.2.linear_attn.A_log"
    bad = {k: v for k, v in tensors.items() if k != name}
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.linear_attn\.A_log'"):
        load_pretrained(write_ckpt(tmp_path / "c", config, bad))


def test_misshaped_tensor_is_named(tmp_path, saved):
    config, tensors = saved
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = {**tensors, name: np.zeros((tensors[name].shape[0] + 1, tensors[name].shape[1]), np.float32)}
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(33, 32\), expected \(32, 32\)"):
        load_pretrained(write_ckpt(tmp_path / "c", config, bad))


def test_unexpected_tensor_is_named(tmp_path, saved):
    config, tensors = saved
    bad = {**tensors, "model.layers.9.mlp.up_proj.weight": np.zeros((2, 2), np.float32)}
    with pytest.raises(CheckpointError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        load_pretrained(write_ckpt(tmp_path / "c", config, bad))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "unknown architecture"),
        ({"hidden_size": None}, "hidden_size"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"layer_types": ["linear_attention", "moe", "linear_attention", "full_attention"]}, "moe"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"linear_num_value_heads": 3}, "num_v_heads"),
        ({"num_attention_heads": "4"}, "num_attention_heads"),
    ],
)
def test_bad_config_is_rejected(tmp_path, saved, change, match):
    config, tensors = saved
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(write_ckpt(tmp_path / "c", {**config, **change}, tensors))


def test_missing_files(tmp_path, saved):
    config, _ = saved
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(tmp_path / "empty")
    with open(tmp_path / "empty" / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(tmp_path / "empty")


def test_swa_option_is_validated():
    base = Qwen3_5Config.from_hf(hf_config().to_dict())
    assert base.attention.window == (0, 0)  # off by default
    assert base.with_swa((5, 0), (1, 0)).attention.swa_heads == (0,)
    with pytest.raises(ValueError, match="window"):
        base.with_swa((5,))


# ------------------------------------------------------------------------------------------ shared pieces


def test_yarn_inv_freq_matches_hf(rng):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
    cfg = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=2, qk_rope_head_dim=16,
                                        max_position_embeddings=2560, rope_parameters=dict(rope))
    cfg.head_dim = 16
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    freq, factor = rope_inv_freq(16, rope, max_position_embeddings=2560)
    np.testing.assert_allclose(freq, ref_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(ref_factor, rel=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_matches_hf(rng, interleaved):
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as ds
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qw

    t, h, d, rot = 7, 3, 16, 8 if not interleaved else 16
    inv_freq, _ = rope_inv_freq(d, {"rope_theta": 500.0, "partial_rotary_factor": rot / d})
    pos = rng.integers(0, 1000, t).astype(np.int32)
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    cos, sin = rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_freq))
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin, interleaved=interleaved))
    ang = torch.tensor(pos, dtype=torch.float32)[:, None] * torch.tensor(inv_freq)
    emb = torch.cat([ang, ang], -1)
    xt = torch.tensor(x).transpose(0, 1)[None]  # [1, H, T, D]
    fn = ds.apply_rotary_pos_emb_interleave if interleaved else qw.apply_rotary_pos_emb
    ref, _ = fn(xt, xt, emb.cos()[None], emb.sin()[None])
    np.testing.assert_allclose(got, ref[0].transpose(0, 1).numpy(), atol=1e-5, rtol=0)
