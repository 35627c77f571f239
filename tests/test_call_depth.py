"""The way down from a model layer to a kernel is short and never climbs back: counted with ``inspect``.

A decode step of each toy model runs on CPU with the device reported as an H100 (so ``impl="auto"`` picks the
GPU kernels) and ``pl.pallas_call`` replaced by a recorder that returns zeros of the kernel's output shapes
(nothing is compiled or run). For every kernel the step reaches, the recorder keeps the kvjax frames on the
stack: from the innermost model frame (the layer) to the function calling ``pallas_call`` there must be at most
:data:`MAX_FRAMES` of them, and each module is entered once (no return to a module left lower down). JAX's
caches are cleared before and after, so the kernels' Python bodies are traced here and the zero outputs never
reach another test.
"""

from __future__ import annotations

import inspect
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import kvjax
import kvjax.ops.backends as backends
from kvjax.base.device import NAMED

from helpers.models import random_model, tiny_config, tiny_deepseek

MAX_FRAMES = 6  # the layer's frame, the state / op frames, the kernel's entry and its pallas_call builder
ROOT = os.path.dirname(kvjax.__file__)


@pytest.fixture
def recorded(monkeypatch):
    """``{kernel name: [(module, function), ...] outermost first}`` of every ``pallas_call`` made."""
    seen: dict[str, list[tuple[str, str]]] = {}

    def record(kernel, out_shape=None, **kwargs):
        frames = [(os.path.relpath(f.filename, ROOT), f.function) for f in inspect.stack(0)
                  if f.filename.startswith(ROOT + os.sep)]
        name = kwargs.get("name") or getattr(kernel, "__name__", None) or getattr(kernel.func, "__name__", "?")
        seen[name] = frames[::-1]
        return lambda *args: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

    monkeypatch.setattr(pl, "pallas_call", record)
    monkeypatch.setattr(backends, "current_device", lambda: NAMED["h100"])
    jax.clear_caches()
    yield seen
    jax.clear_caches()


def from_layer(frames: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The frames from the innermost model frame down (the layer that calls into state / ops)."""
    last = max(i for i, (module, _) in enumerate(frames) if module.startswith("models" + os.sep))
    return frames[last:]


def check_path(name: str, frames: list[tuple[str, str]]) -> None:
    path = from_layer(frames)
    shown = " -> ".join(f"{m}:{f}" for m, f in path)
    assert len(path) <= MAX_FRAMES, f"{name}: {len(path)} frames from the layer to pallas_call: {shown}"
    modules = [m for m, _ in path]
    runs = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    assert len(runs) == len(set(runs)), f"{name}: a module is entered twice: {shown}"


def decode_inputs(rows: int, hkv: int, page_size: int, max_blocks: int, seq_lens) -> types.SimpleNamespace:
    """The step inputs' fields for one decode token per row (what ``forward_step`` reads); row ``b``, KV head
    ``h`` owns pages ``(b * hkv + h) * max_blocks + j``."""
    seq_lens = np.asarray(seq_lens, np.int32)
    pos = seq_lens - 1
    tables = (np.arange(rows * hkv * max_blocks, dtype=np.int32)).reshape(rows, hkv, max_blocks)
    page = tables[np.arange(rows), :, pos // page_size]  # [rows, hkv]
    return types.SimpleNamespace(
        token_ids=jnp.arange(rows, dtype=jnp.int32) + 3, positions=jnp.asarray(pos),
        cu_seqlens=jnp.arange(rows + 1, dtype=jnp.int32), seq_lens=jnp.asarray(seq_lens),
        gdn_slots=jnp.arange(1, rows + 1, dtype=jnp.int32), has_initial_state=jnp.ones(rows, bool),
        block_tables=jnp.asarray(tables), slot_mapping=jnp.asarray(page * page_size + (pos % page_size)[:, None]),
        logits_indices=jnp.arange(rows, dtype=jnp.int32), decode_only=True, max_query_len=0,
    )


def test_qwen_decode_step_reaches_its_kernels_within_the_budget(recorded):
    """GDN conv update, GDN slot decode and paged attention decode from the Qwen3.5 layers."""
    model = random_model(tiny_config(), seed=0, dtype=jnp.bfloat16)
    hkv = model.attention_layout().num_kv_heads
    caches = model.init_caches(num_pages=2 * hkv * 4, page_size=4, max_seqs=4, dtype=jnp.bfloat16)
    model.forward_step(caches, decode_inputs(2, hkv, 4, 4, [3, 9]))
    kernels = {name.partition("_s1_")[0] for name in recorded}  # the paged kernel's name carries its tiling
    assert kernels == {"conv_update_slots", "gdn_decode_slots", "kvjax_paged_decode"}, sorted(recorded)
    for name, frames in recorded.items():
        check_path(name, frames)


def test_deepseek_decode_step_reaches_its_kernels_within_the_budget(recorded):
    """The DSA indexer and the sparse MLA decode kernel from the DeepSeek attention layer."""
    model = tiny_deepseek(seed=0, rope_dim=16)
    caches = model.init_caches(num_pages=2 * 4, page_size=16, dtype=jnp.float32)
    model.forward_step(caches, decode_inputs(2, 1, 16, 4, [5, 40]))
    assert set(recorded) == {"dsa_indexer_scores", "mla_sparse_decode_stage1"}, sorted(recorded)
    for name, frames in recorded.items():
        check_path(name, frames)


def test_mla_decode_op_reaches_its_kernel_within_the_budget(recorded, rng):
    """:func:`kvjax.ops.mla.mla_decode` (no model layer calls it: the caller counts as the layer's frame)."""
    from kvjax.ops.mla import mla_decode

    b, h, rank, rope, page, blocks = 2, 16, 64, 16, 16, 4
    latent = jnp.asarray(rng.standard_normal((b * blocks, page, rank + rope)), jnp.bfloat16)
    tables = jnp.arange(b * blocks, dtype=jnp.int32).reshape(b, 1, blocks)
    mla_decode(jnp.asarray(rng.standard_normal((b, h, rank)), jnp.bfloat16),
               jnp.asarray(rng.standard_normal((b, h, rope)), jnp.bfloat16), latent, tables,
               jnp.asarray([7, 50], jnp.int32), scale=0.1)
    assert recorded, "no kernel reached"
    for name, frames in recorded.items():
        assert len(frames) + 1 <= MAX_FRAMES, f"{name}: {frames}"
