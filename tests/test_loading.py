"""Loading and model / cache configs reject bad values with a named error before building anything
(issue #17 items 9 and 11): integer-typed or non-finite checkpoint tensors, a non-float ``dtype``,
``full_attention_interval: 0``, negative ``rms_norm_eps``, ``partial_rotary_factor > 1``, integer cache dtypes.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file  # noqa: E402

from kvjax.config import AttentionConfig, GDNConfig  # noqa: E402
from kvjax.errors import CheckpointError  # noqa: E402
from kvjax.models import load_generation_config, load_pretrained, load_tokenizer  # noqa: E402
from kvjax.models.deepseek import DeepseekConfig  # noqa: E402
from kvjax.models.deepseek.loading import from_hf as deepseek_from_hf  # noqa: E402
from kvjax.models.qwen3_5 import Qwen3_5Config, init_random  # noqa: E402
from kvjax.state.registry import DSACacheSpec, GQACacheSpec, MLACacheSpec  # noqa: E402
from helpers.hf import saved_hf_model, write_ckpt  # noqa: E402


@pytest.fixture(scope="module")
def qwen_saved(tmp_path_factory):
    hf, path = saved_hf_model(tmp_path_factory.mktemp("q"), seed=3)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return config, load_file(os.path.join(path, "model.safetensors")), hf


NORM = "model.norm.weight"


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_])
def test_integer_tensor_in_float_parameter_is_named(tmp_path, qwen_saved, dtype):
    config, tensors, _ = qwen_saved
    bad = {**tensors, NORM: np.ones_like(tensors[NORM]).astype(dtype)}  # would be cast silently to 1.0
    with pytest.raises(CheckpointError, match=rf"model\.norm\.weight.*{np.dtype(dtype).name}"):
        load_pretrained(write_ckpt(tmp_path / "c", config, bad))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_tensor_is_named_unless_allowed(tmp_path, qwen_saved, value):
    config, tensors, _ = qwen_saved
    name = "model.layers.1.self_attn.q_proj.weight"
    w = tensors[name].copy()
    w[3, 5] = value
    path = write_ckpt(tmp_path / "c", config, {**tensors, name: w})
    with pytest.raises(CheckpointError, match=r"q_proj\.weight.*1 NaN / inf.*check_finite=False"):
        load_pretrained(path)
    model = load_pretrained(path, check_finite=False)  # the opt-out loads it as stored
    q = np.asarray(model.model.layers[1].self_attn.q_proj.kernel.get_value())
    assert np.isnan(q).sum() + np.isinf(q).sum() == 1


def test_finite_checkpoint_still_loads_and_matches(tmp_path, qwen_saved):
    config, tensors, hf = qwen_saved
    model = load_pretrained(write_ckpt(tmp_path / "c", config, tensors))
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (1, 9))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.logits(jnp.asarray(ids, jnp.int32))), want, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.int32, "int8", jnp.bool_, "no-such-dtype"])
def test_non_float_dtype_is_rejected(tmp_path, qwen_saved, dtype):
    config, tensors, _ = qwen_saved
    path = write_ckpt(tmp_path / "c", config, tensors)
    with pytest.raises(CheckpointError, match="dtype"):
        load_pretrained(path, dtype=dtype)
    cfg = Qwen3_5Config.from_hf(config)
    with pytest.raises(CheckpointError, match="dtype"):
        init_random(cfg, dtype=dtype)


@pytest.mark.parametrize("interval", [0, -4])
def test_full_attention_interval_below_one_is_rejected(tmp_path, qwen_saved, interval):
    config, tensors, _ = qwen_saved
    cfg = {k: v for k, v in config.items() if k != "layer_types"}
    cfg["full_attention_interval"] = interval
    with pytest.raises(CheckpointError, match="full_attention_interval"):
        load_pretrained(write_ckpt(tmp_path / "c", cfg, tensors))


@pytest.mark.parametrize("change, match", [
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": -0.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0, "partial_rotary_factor": 0.5}}, "rope_theta"),
])
def test_bad_qwen_config_values_are_rejected(tmp_path, qwen_saved, change, match):
    config, tensors, _ = qwen_saved
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(write_ckpt(tmp_path / "c", {**config, **change}, tensors))


@pytest.mark.parametrize("field, value", [("rms_norm_eps", -1e-5), ("partial_rotary_factor", 2.0),
                                          ("partial_rotary_factor", 0.0), ("rope_theta", -1.0)])
def test_qwen_config_dataclass_rejects(field, value):
    base = dict(vocab_size=11, hidden_size=32, intermediate_size=48, layer_types=("full_attention",),
                attention=AttentionConfig(4, 2, 16), gdn=GDNConfig(2, 4, 8, 8, 4))
    Qwen3_5Config(**base)
    with pytest.raises(ValueError, match=field):
        Qwen3_5Config(**base, **{field: value})


DEEPSEEK = dict(
    vocab_size=19, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2,
    index_head_dim=16, index_topk=4, rope_parameters=(("rope_theta", 10000.0), ("rope_type", "default")),
)


@pytest.mark.parametrize("eps", [-1e-6, float("inf")])
def test_deepseek_negative_eps_is_rejected(eps):
    DeepseekConfig(**DEEPSEEK)
    with pytest.raises(CheckpointError, match="rms_norm_eps"):
        DeepseekConfig(**DEEPSEEK, rms_norm_eps=eps)


def test_deepseek_non_finite_and_integer_tensors_are_named():
    cfg = transformers.DeepseekV32Config(
        vocab_size=19, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8,
        qk_nope_head_dim=8, index_head_dim=16, index_n_heads=2, index_topk=4, first_k_dense_replace=1,
    )
    torch.manual_seed(0)
    hf = transformers.DeepseekV32ForCausalLM(cfg)
    tensors = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    config = cfg.to_dict()
    deepseek_from_hf(config, tensors)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    bad = tensors[name].copy()
    bad[0, 0] = np.nan
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight.*NaN"):
        deepseek_from_hf(config, {**tensors, name: bad})
    deepseek_from_hf(config, {**tensors, name: bad}, check_finite=False)
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight.*int32"):
        deepseek_from_hf(config, {**tensors, name: tensors[name].astype(np.int32)})
    with pytest.raises(CheckpointError, match="dtype"):
        deepseek_from_hf(config, tensors, dtype=jnp.int32)


@pytest.mark.parametrize("make", [
    lambda d: GQACacheSpec(0, 2, 4, 16, dtype=d),
    lambda d: MLACacheSpec(0, 4, 16, 8, dtype=d),
    lambda d: DSACacheSpec(0, 4, 16, 8, 16, 16, rope_dtype=d),
], ids=["gqa", "mla", "dsa"])
def test_cache_spec_rejects_integer_dtype(make):
    for ok in (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn):
        make(ok)
    for bad in (jnp.int32, jnp.int8, jnp.bool_, "nope"):
        with pytest.raises(ValueError, match="floating dtype"):
            make(bad)


# ---- issue 31, bad input to the loader ---------------------------------------------------------------------------
@pytest.mark.parametrize("weight_map", [["model.safetensors"], None, {"model.norm.weight": 3}, "model.safetensors",
                                        {"model.norm.weight": None}], ids=["list", "null", "int", "str", "none-shard"])
def test_sharded_index_with_a_bad_weight_map_is_named(tmp_path, qwen_saved, weight_map):
    config, tensors, _ = qwen_saved
    path = write_ckpt(tmp_path / "c", config, tensors)
    os.replace(os.path.join(path, "model.safetensors"), os.path.join(path, "model-00001-of-00001.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with pytest.raises(CheckpointError, match="weight_map"):
        load_pretrained(path)


@pytest.mark.parametrize("heads", [0, -2])
def test_qwen_config_with_no_attention_heads_is_named(tmp_path, qwen_saved, heads):
    config, tensors, _ = qwen_saved
    with pytest.raises(CheckpointError, match=f"num_attention_heads.*{heads}"):
        load_pretrained(write_ckpt(tmp_path / "c", {**config, "num_attention_heads": heads}, tensors))


@pytest.mark.parametrize("theta", [-5, 0, float("nan"), float("inf")])
def test_deepseek_rope_theta_must_be_positive(theta):
    with pytest.raises(CheckpointError, match="rope_theta"):
        DeepseekConfig(**{**DEEPSEEK, "rope_parameters": (("rope_theta", theta), ("rope_type", "default"))})
    with pytest.raises(CheckpointError, match="rope_theta"):
        DeepseekConfig.from_hf({**_deepseek_hf_config(), "rope_theta": theta})


def _deepseek_hf_config() -> dict:
    return transformers.DeepseekV32Config(
        vocab_size=19, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8,
        qk_nope_head_dim=8, index_head_dim=16, index_n_heads=2, index_topk=4, first_k_dense_replace=1,
    ).to_dict() | {"rope_parameters": None}


@pytest.mark.parametrize("mesh", ["2x2", (2, 2), 4])
def test_load_pretrained_names_a_mesh_that_is_not_a_mesh(tmp_path, qwen_saved, mesh):
    config, tensors, _ = qwen_saved
    path = write_ckpt(tmp_path / "c", config, tensors)
    with pytest.raises(ValueError, match=rf"mesh must be a jax\.sharding\.Mesh.*{mesh!r}".replace("(", r"\(")
                       .replace(")", r"\)")):
        load_pretrained(path, mesh=mesh)


# ------------------------------------------------------------------ generation_config.json and the tokenizer (issue 33)


def _with_generation(tmp_path, qwen_saved, generation: dict | str | None, **config_changes):
    config, tensors, _ = qwen_saved
    path = write_ckpt(tmp_path / "c", {**config, **config_changes}, tensors)
    if generation is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            f.write(generation if isinstance(generation, str) else json.dumps(generation))
    return path


def test_generation_config_is_read_and_attached(tmp_path, qwen_saved):
    path = _with_generation(tmp_path, qwen_saved, {"eos_token_id": [7, 3, 7], "bos_token_id": 1, "pad_token_id": 0,
                                                   "temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True,
                                                   "transformers_version": "5.0.0"})
    gen = load_generation_config(path)
    assert gen.eos_token_ids == (7, 3) and gen.eos_token_id == 7 and gen.bos_token_id == 1 and gen.pad_token_id == 0
    assert (gen.temperature, gen.top_k, gen.top_p, gen.do_sample, gen.max_new_tokens) == (0.6, 20, 0.95, True, None)
    assert gen.source.endswith("generation_config.json")
    model = load_pretrained(path)
    assert model.generation_config == gen


def test_generation_config_falls_back_to_config_json(tmp_path, qwen_saved):
    path = _with_generation(tmp_path, qwen_saved, None, eos_token_id=5, bos_token_id=None)
    gen = load_pretrained(path).generation_config
    assert gen.eos_token_ids == (5,) and gen.bos_token_id is None and gen.source.endswith("config.json")
    nested = _with_generation(tmp_path / "n", qwen_saved, None, eos_token_id=None, text_config={"eos_token_id": [4]})
    assert load_generation_config(nested).eos_token_id == 4
    empty = _with_generation(tmp_path / "e", qwen_saved, None, eos_token_id=None, pad_token_id=None)
    assert load_generation_config(empty).eos_token_id is None


@pytest.mark.parametrize("generation, match", [
    ({"eos_token_id": -1}, r"generation_config\.json: eos_token_id must be a token id >= 0.*-1"),
    ({"eos_token_id": [2, "3"]}, r"eos_token_id must be a token id.*'3'"),
    ({"eos_token_id": True}, "eos_token_id must be a token id"),
    ({"bos_token_id": [1, 2]}, "bos_token_id must be one token id"),
    ({"temperature": "hot"}, "'temperature' must be"),
    ({"top_p": 1.5}, "top_p out of range, got 1.5"),
    ({"top_k": 2.0}, "'top_k' must be"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ("{not json", "cannot parse"),
])
def test_bad_generation_config_is_named(tmp_path, qwen_saved, generation, match):
    path = _with_generation(tmp_path, qwen_saved, generation)
    with pytest.raises(CheckpointError, match=match):
        load_generation_config(path)
    with pytest.raises(CheckpointError, match=match):  # before the weights are read
        load_pretrained(path)


def test_eos_outside_the_vocabulary_is_named(tmp_path, qwen_saved):
    config = qwen_saved[0]
    path = _with_generation(tmp_path, qwen_saved, {"eos_token_id": [1, config["vocab_size"]]})
    with pytest.raises(CheckpointError, match=rf"eos_token_id {config['vocab_size']} is outside the vocabulary"):
        load_pretrained(path)


def test_engine_stops_at_the_checkpoints_eos(tmp_path, qwen_saved):
    """The eos of generation_config.json, given to the engine, ends a greedy request at the token the model
    picks first (found with the uncached forward), and a request without eos runs to max_new_tokens."""
    from kvjax.config import CacheConfig
    from kvjax.engine import Engine

    config = qwen_saved[0]
    prompt = np.random.default_rng(1).integers(0, config["vocab_size"], 12)
    plain = load_pretrained(write_ckpt(tmp_path / "plain", {**config, "eos_token_id": None}, qwen_saved[1]))
    first = int(np.argmax(np.asarray(plain.logits(jnp.asarray(prompt[None], jnp.int32)))[0, -1]))
    path = _with_generation(tmp_path, qwen_saved, {"eos_token_id": [first]})
    model = load_pretrained(path)
    cache = CacheConfig(page_size=8, num_pages=16, max_seqs=2, max_blocks_per_seq=4)
    engine = Engine(model, cache, eos_token_id=model.generation_config.eos_token_id, decode_burst=1)
    assert engine.generate([prompt], max_new_tokens=6)[0] == [first]
    assert len(Engine(plain, cache, decode_burst=1).generate([prompt], max_new_tokens=6)[0]) == 6


def _save_word_tokenizer(path) -> dict[str, int]:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "</s>": 1, "the": 2, "page": 3, "is": 4, "free": 5}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    fast.save_pretrained(path)
    return vocab


def test_load_tokenizer_from_the_folder_offline(tmp_path, qwen_saved, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _with_generation(tmp_path, qwen_saved, None)
    assert load_tokenizer(path) is None  # no tokenizer file: None, not an error
    vocab = _save_word_tokenizer(path)
    tok = load_tokenizer(path)
    ids = tok("the page is free")["input_ids"]
    assert ids == [vocab[w] for w in ("the", "page", "is", "free")]
    assert tok.decode(ids) == "the page is free" and tok.eos_token_id == vocab["</s>"]
    assert tok("the moon")["input_ids"] == [2, 0]  # unknown word -> [UNK]


def test_load_tokenizer_names_a_broken_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot load the tokenizer in '.*'"):
        load_tokenizer(tmp_path)
