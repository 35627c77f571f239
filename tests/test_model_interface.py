"""The model interface the engine uses: both families satisfy ``CausalLM``, keep their state in one
``ModelCaches`` pytree kind, and the engine names no model class and owns its compiled step.

Independent checks: the caches' leaves are compared with the layouts the registry and the GDN pool describe,
the engine's imports are read from its source (AST), and trace counts are compared across two engines.
"""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.config import AttentionConfig, CacheConfig, GDNConfig
from kvjax.engine.engine import Engine
from kvjax.inputs import StepInputs
from kvjax.models.deepseek import DeepseekConfig, DeepseekV32
from kvjax.models.deepseek.attention import StepMeta
from kvjax.models.interface import CausalLM, ModelCaches
from kvjax.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, init_random

ENGINE_DIR = pathlib.Path(__file__).resolve().parents[1] / "kvjax" / "engine"
PAGES, PAGE, SEQS = 6, 4, 3


def qwen(layer_types=("linear_attention", "full_attention")) -> Qwen3_5ForCausalLM:
    return init_random(Qwen3_5Config(
        vocab_size=37, hidden_size=32, intermediate_size=48, layer_types=layer_types,
        attention=AttentionConfig(4, 2, 16, window=(5, 0), sinks=(1, 0)), gdn=GDNConfig(2, 4, 8, 8, 4),
        rope_theta=10000.0, partial_rotary_factor=0.5), seed=1)


def deepseek() -> DeepseekV32:
    config = DeepseekConfig(
        vocab_size=41, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
        q_lora_rank=40, kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
        index_n_heads=4, index_head_dim=16, index_topk=6, max_position_embeddings=64,
        rope_parameters=(("rope_theta", 10000.0), ("rope_type", "default")),
    )
    return nnx.eval_shape(lambda: DeepseekV32(config, rngs=nnx.Rngs(0)))  # no parameters needed here


def test_both_families_satisfy_the_protocol():
    q, d = qwen(), deepseek()
    for model, vocab in ((q, 37), (d, 41)):
        assert isinstance(model, CausalLM) and isinstance(model, nnx.Module)
        assert model.vocab_size == vocab
    assert q.attention_layout() == q.config.attention  # KV heads with their window/sinks
    assert q.attention_layout().window == (5, 0)
    assert d.attention_layout() == AttentionConfig(1, 1, 32 + 8)  # one latent head of width R + r
    assert not isinstance(object(), CausalLM)


def test_caches_are_one_pytree_kind_with_the_registry_layouts():
    q, d = qwen(), deepseek()
    cq = q.init_caches(num_pages=PAGES, page_size=PAGE, max_seqs=SEQS, dtype=jnp.float32)
    cd = d.init_caches(num_pages=PAGES, page_size=PAGE, max_seqs=SEQS, dtype=jnp.float32)
    assert type(cq) is type(cd) is ModelCaches
    # Qwen3.5: K/V pools of the attention layer (index 1), one single-head pool per KV head, and the GDN pool
    assert sorted(cq.pages) == ["key_caches_1", "value_caches_1"]
    assert cq.pages["key_caches_1"].shape == (PAGES, PAGE, 16)  # one single-head pool shared by the KV heads
    assert cq.gdn.conv.shape == (1, SEQS + 1, 2 * 2 * 8 + 4 * 8, 3) and cq.gdn.ssm.shape == (1, SEQS + 1, 4, 8, 8)
    assert cq.gdn.ssm.dtype == jnp.float32
    # DeepSeek: latent key + fp8 indexer roles per layer, no per-slot state
    assert list(cd.pages) == [f"{r}_caches_{i}" for i in range(2) for r in ("key", "indexer", "indexer_scale")]
    assert cd.pages["key_caches_0"].shape == (PAGES, PAGE, 40) and cd.gdn is None
    assert cd.pages["indexer_caches_1"].dtype == jnp.float8_e4m3fn
    # a pytree: tree_map keeps the structure, and the leaves are exactly the arrays above
    for caches in (cq, cd):
        mapped = jax.tree.map(lambda x: x, caches)
        assert type(mapped) is ModelCaches
        assert jax.tree.structure(mapped) == jax.tree.structure(caches)
        expect = len(caches.pages) + (0 if caches.gdn is None else 2)
        assert len(jax.tree.leaves(caches)) == expect
    with pytest.raises(TypeError):
        q.init_caches(num_pages=PAGES, page_size=PAGE, max_seqs=SEQS, dtype=jnp.float32, kind="mla")


def test_step_meta_is_a_typed_pytree(rng):
    t, b, blocks = 7, 3, 4
    cu = np.array([0, 4, 5, 5], np.int32)
    positions = np.array([0, 1, 2, 3, 8, 0, 0], np.int32)
    tables = rng.integers(0, 9, (b, 1, blocks)).astype(np.int32)
    inputs = StepInputs.from_numpy(
        token_ids=np.zeros(t), positions=positions, cu_seqlens=cu, seq_lens=[4, 9, 0], gdn_slots=[0, 0, 0],
        has_initial_state=[False, True, False], block_tables=tables, slot_mapping=np.arange(t)[:, None],
        logits_indices=[3, 4, 0])
    meta = StepMeta.from_inputs(inputs, "reference")
    assert meta.impl == "reference" and len(jax.tree.leaves(meta)) == 6  # impl is static
    np.testing.assert_array_equal(meta.slots, [0, 1, 2, 3, 4, -1, -1])  # padding tokens write nothing
    np.testing.assert_array_equal(meta.token_lens, [1, 2, 3, 4, 9, 0, 0])
    np.testing.assert_array_equal(meta.token_tables[:5], tables[[0, 0, 0, 0, 1]])


# What the engine may import from kvjax.models: the protocol, and the family-agnostic mesh layer (issue #20).
ENGINE_MAY_IMPORT = ("kvjax.models.interface", "kvjax.models.sharding")


def test_engine_names_no_model_class():
    """The engine imports nothing from kvjax.models but the interface and the family-agnostic mesh layer, and
    never names a concrete class; the mesh layer names no model family either."""
    for path in sorted(ENGINE_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvjax.models"):
                assert node.module in ENGINE_MAY_IMPORT, (path.name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvjax.models") for a in node.names), path.name
        text = path.read_text()
        for name in ("Qwen3_5", "Deepseek", "_DEVICE_STEPS"):
            assert name not in text, (path.name, name)
    mesh_layer = ENGINE_DIR.parent / "models" / "sharding.py"
    for name in ("Qwen3_5", "Deepseek", "qwen3_5", "deepseek"):
        assert name not in mesh_layer.read_text(), ("sharding.py", name)


def test_engine_rejects_a_non_model():
    with pytest.raises(ValueError, match="CausalLM"):
        Engine(object(), CacheConfig(page_size=4, num_pages=8, max_seqs=2, max_blocks_per_seq=4))


def test_each_engine_owns_its_compiled_step(rng):
    """Two engines over one model: each traces its own step (a second engine does not reuse the first one's
    compilation, and its count starts at 0); both generate the same tokens."""
    model = qwen(layer_types=("full_attention",))
    cache = CacheConfig(page_size=4, num_pages=16, max_seqs=2, max_blocks_per_seq=4)
    prompts = [rng.integers(0, 37, 5).tolist(), rng.integers(0, 37, 3).tolist()]
    kw = dict(max_num_batched_tokens=8, use_decode_path=False, token_buckets=(8,), row_buckets=(2,),
              block_buckets=(4,), max_traces=1, decode_burst=1)
    first = Engine(model, cache, **kw)
    out = first.generate(prompts, 3)
    assert first.num_traces == 1
    second = Engine(model, cache, **kw)
    assert second.num_traces == 0 and first.num_traces == 1
    assert second.generate(prompts, 3) == out
    assert second.num_traces == 1 and first.num_traces == 1
    assert first.generate(prompts, 3) == out and first.num_traces == 1  # no retrace for a seen shape
