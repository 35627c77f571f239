"""The sharded step (:mod:`kvjax.models.sharding`) on CPU meshes: same logits and caches as one device.

JAX fixes its CPU device count when it starts, so the mesh tests run in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (``test_sharding_on_8_cpu_devices``; measured ~3 s of
start-up over the tests themselves), leaving the rest of the suite on its usual single device.

For meshes 1x2, 2x1, 2x2 and 1x4 (data x model) each data shard runs its own batch (own planner, pages, GDN
slots): prefill chunks, decode steps, SWA heads whose blocks are recycled into ``-1`` holes and reused. Every
step's logits equal a single-device step on that shard's batch within 1e-5 (f32); at the end every live
token's K/V row (read on the device owning its head), every GDN slot and every latent row equal the single-device
caches; the step compiles once per bucket; each device holds total / N of the caches (total / D for DeepSeek's
latent pages, replicated over ``"model"``).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

from helpers.models import MESH_FAMILIES as FAMILIES
from helpers.models import VOCAB, mesh_deepseek_model, mesh_qwen_model
from helpers.planner import MAX_SEQS, NUM_PAGES, PAGE, Planner
from helpers.procs import pytest_on_cpu_devices
from kvjax.engine.step import make_step
from kvjax.models.sharding import ShardedModel, shard_model

INNER = os.environ.get("KVJAX_SHARDING_INNER") == "1"
inner = pytest.mark.skipif(not INNER, reason="runs in the 8-device subprocess of test_sharding_on_8_cpu_devices")
TOL = 1e-5
MESHES = [(1, 2), (2, 1), (2, 2), (1, 4)]


@pytest.mark.slow
def test_sharding_on_8_cpu_devices():
    if INNER:
        pytest.skip("already inside the 8-device run")
    pytest_on_cpu_devices([__file__], inner="KVJAX_SHARDING_INNER", devices=8, cwd=os.path.dirname(__file__))


@pytest.fixture(scope="module")
def built():
    """Each family's model and its single-device step (compiled once for all meshes)."""
    out = {}
    for name, build in FAMILIES.items():
        model = build()
        graphdef, params = nnx.split(model)
        out[name] = model, params, make_step(graphdef)
    return out


def _caches(model, **kw):
    return model.init_caches(num_pages=NUM_PAGES, page_size=PAGE, max_seqs=MAX_SEQS, **kw)


def _run(family, model, params, step1, sharded: ShardedModel, rng):
    """Drive D independent batches through the sharded step and D single-device steps; compare every step."""
    a = model.attention_layout()
    d_size = sharded.data_size
    # one token bucket: every data shard's plan has T = 16
    planners = [Planner(rng, a.num_kv_heads, a.window, a.sinks, t_buckets=(16,)) for _ in range(d_size)]
    lengths = [rng.integers(10, 15, 3) for _ in range(d_size)]
    seqs = [[rng.integers(0, VOCAB, n).astype(np.int32) for n in ls] for ls in lengths]
    chunks = [[4, 3], [5], [2, 2, 2]]
    refs = [_caches(model) for _ in range(d_size)]
    caches = sharded.init_caches(num_pages=NUM_PAGES, page_size=PAGE, max_seqs=MAX_SEQS)
    traces = []

    def forward(params, caches, inputs):
        traces.append(inputs.decode_only)  # once per trace
        return sharded.forward(params, caches, inputs)

    step = jax.jit(forward, donate_argnums=(1,))
    cursors = [[0, 0, 0] for _ in range(d_size)]
    for p in planners:
        for sid in range(3):
            p.add(sid)
    steps = 0
    while True:
        plans = []
        for d, p in enumerate(planners):
            work = []
            for sid in range(3):
                c = cursors[d][sid]
                n = min(chunks[sid][steps] if steps < len(chunks[sid]) else 1, len(seqs[d][sid]) - c)
                if n > 0:
                    work.append((sid, seqs[d][sid][c:c + n]))
                    cursors[d][sid] += n
            plans.append(p.plan(work)[0] if work else None)
        if any(x is None for x in plans):
            break
        want = []
        for d in range(d_size):
            logits, refs[d] = step1(params, refs[d], plans[d])
            want.append(np.asarray(logits))
        got, caches = step(sharded.params, caches, sharded.shard_inputs(plans))
        np.testing.assert_allclose(np.asarray(got), np.stack(want), atol=TOL, rtol=0, err_msg=f"step {steps}")
        for p in planners:
            p.recycle()
        last = plans
        steps += 1
    assert steps >= 5 and len(traces) <= 2  # one prefill + one decode-only trace for the whole run
    if family == "qwen3_5":
        assert sum(p.recycled for p in planners) >= 2  # SWA holes appeared
    _check_caches(sharded, caches, refs, last)
    return caches


def _check_caches(sharded: ShardedModel, caches, refs, last):
    """Every live token's rows (on its head's device), every GDN slot, equal the single-device caches."""
    for d, inputs in enumerate(last):
        bt, lens = np.asarray(inputs.block_tables), np.asarray(inputs.seq_lens)
        for name, pool in caches.pages.items():
            ref = np.asarray(refs[d].pages[name]).astype(np.float32)
            mine = np.asarray(pool.astype(np.float32))[d]
            for r, h, blk in zip(*np.nonzero(bt >= 0)):
                page, n = bt[r, h, blk], min(PAGE, lens[r] - blk * PAGE)
                local = mine[sharded.head_owner(h)] if sharded.plan.pages_over_model else mine
                # f32 round-off of the psum order; an fp8 role may round across one fp8 step (2**-3 relative)
                fp8 = pool.dtype.itemsize == 1
                np.testing.assert_allclose(local[page, :n], ref[page, :n], atol=TOL, rtol=2.0 ** -3 if fp8 else 0,
                                           err_msg=f"{name} shard {d} head {h}")
        if caches.gdn is not None:
            (axis, perm), = [v for k, v in sharded.perms.items() if k[-1] == "conv_weight"]
            conv = np.asarray(caches.gdn.conv)[d][:, :, np.argsort(perm)]
            np.testing.assert_allclose(conv, np.asarray(refs[d].gdn.conv), atol=TOL, rtol=0)
            np.testing.assert_allclose(np.asarray(caches.gdn.ssm)[d], np.asarray(refs[d].gdn.ssm), atol=TOL, rtol=0)


@inner
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("shape", MESHES, ids=[f"{d}x{m}" for d, m in MESHES])
def test_sharded_step_equals_one_device(family, shape, built, rng):
    model, params, step1 = built[family]
    d, m = shape
    mesh = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[: d * m])
    sharded = shard_model(model, mesh)
    caches = _run(family, model, params, step1, sharded, rng)
    total = sum(x.nbytes for x in jax.tree.leaves(caches))
    share = d * m if sharded.plan.pages_over_model else d  # DeepSeek's latent pages: replicated over "model"
    for dev in mesh.devices.ravel():
        assert ShardedModel.device_nbytes(caches, dev) == total // share
    # parameters: each device holds only its shard of a model-split matrix
    kernel = sharded.params["lm_head"]["kernel"][...]  # [H, V padded], columns over "model"
    assert kernel.shape[1] == -(-VOCAB // m) * m
    assert {s.data.shape[1] for s in kernel.addressable_shards} == {kernel.shape[1] // m}


@inner
def test_indivisible_head_count_is_named():
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    with pytest.raises(ValueError, match="num_key_value_heads=4 is not divisible by the 'model' mesh axis size 8"):
        shard_model(mesh_qwen_model(), mesh)
    mesh = jax.make_mesh((1, 3), ("data", "model"), devices=jax.devices()[:3])
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by the 'model' mesh axis size 3"):
        shard_model(mesh_deepseek_model(), mesh)


def _save_qwen(model, path) -> None:
    """``model`` as an HF ``save_pretrained`` directory (the loader's names; no torch needed)."""
    import json

    from safetensors.numpy import save_file

    from kvjax.models.qwen3_5.loading import _hf_name

    c, a, g = model.config, model.config.attention, model.config.gdn
    tensors = {}
    for p, var in nnx.to_flat_state(nnx.state(model)):
        name, transposed = _hf_name(p)
        value = np.asarray(var.get_value())
        if name.endswith("conv1d.weight"):
            value = value[:, None, :]
        tensors[name] = np.ascontiguousarray(value.T if transposed else value)
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=c.vocab_size,
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        layer_types=list(c.layer_types), num_attention_heads=a.num_q_heads, num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim, linear_num_key_heads=g.num_k_heads, linear_num_value_heads=g.num_v_heads,
        linear_key_head_dim=g.head_k_dim, linear_value_head_dim=g.head_v_dim,
        linear_conv_kernel_dim=g.conv_kernel_size, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta,
                             partial_rotary_factor=c.partial_rotary_factor),
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@inner
def test_load_pretrained_on_a_mesh_places_each_shard(tmp_path):
    """``load_pretrained(path, mesh=)`` gives the parameters ``shard_model`` gives, each shard on its device."""
    from kvjax.models import load_pretrained

    model = mesh_qwen_model()
    _save_qwen(model, str(tmp_path / "ckpt"))
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    loaded = load_pretrained(tmp_path / "ckpt", mesh=mesh, window=model.config.attention.window,
                             sinks=model.config.attention.sinks)
    want = shard_model(model, mesh)
    assert isinstance(loaded, ShardedModel) and loaded.vocab_size == VOCAB
    got, ref = dict(nnx.to_flat_state(loaded.params)), dict(nnx.to_flat_state(want.params))
    assert got.keys() == ref.keys()
    for path, var in got.items():
        x, y = var.get_value(), ref[path].get_value()
        assert x.sharding == y.sharding, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
        split = [n for n, axis in zip(x.shape, x.sharding.spec) if axis == "model"]
        for shard in x.addressable_shards:  # a model-split parameter: every device holds 1/2 of it
            assert shard.data.size == x.size // (2 if split else 1)
