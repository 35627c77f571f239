"""Cache specs per attention kind, create_kv_cache layouts, deterministic names/order, host (offload) caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.state.registry import (
    ROLE_PRIORITY, DSACacheSpec, GQACacheSpec, MLACacheSpec, cache_layout, cache_names, copy_caches,
    create_caches, create_host_caches, create_kv_cache, host_sharding,
)


def _specs():
    return [
        GQACacheSpec(layer=0, num_kv_heads=4, page_size=16, head_dim=32),
        MLACacheSpec(layer=1, page_size=16, kv_lora_rank=64, rope_dim=16, dtype=jnp.float32),
        DSACacheSpec(layer=2, page_size=16, kv_lora_rank=256, rope_dim=32, index_head_dim=128),
        GQACacheSpec(layer=3, num_kv_heads=2, page_size=16, head_dim=8, dtype=jnp.float32),
    ]


def test_layouts_per_kind():
    gqa, mla, dsa, _ = _specs()
    p = 5
    cache = create_kv_cache(gqa, p)
    assert list(cache) == ["key", "value"]
    for a in cache.values():
        assert a.shape == (p, 16, 32) and a.dtype == jnp.bfloat16
    cache = create_kv_cache(mla, p)
    assert list(cache) == ["key"] and cache["key"].shape == (p, 16, 80) and cache["key"].dtype == jnp.float32
    cache = create_kv_cache(dsa, p)
    want = {
        "key": ((p, 16, 256), jnp.float8_e4m3fn),
        "key_scale": ((p, 16, 2), jnp.float32),
        "key_rope": ((p, 16, 32), jnp.bfloat16),
        "indexer": ((p, 16, 128), jnp.float8_e4m3fn),
        "indexer_scale": ((p, 16, 1), jnp.float32),
    }
    assert list(cache) == list(want)  # role-priority order
    assert {r: (a.shape, a.dtype) for r, a in cache.items()} == want
    for a in cache.values():
        assert not np.asarray(a, np.float32).any()  # created zero-filled
    # DeepSeek defaults: the seed's per-token bytes (656 key + 132 indexer)
    full = cache_layout(DSACacheSpec(layer=0, page_size=64), 1)
    per_token = {r: np.prod(s.shape[2:]) * jnp.dtype(s.dtype).itemsize for r, s in full.items()}
    assert per_token["key"] + per_token["key_scale"] + per_token["key_rope"] == 656
    assert per_token["indexer"] + per_token["indexer_scale"] == 132


def test_names_and_order_are_deterministic(rng):
    specs = _specs()
    first = create_caches(specs, 3)
    want = ["key_caches_0", "value_caches_0", "key_caches_1", "key_caches_2", "key_scale_caches_2",
            "key_rope_caches_2", "indexer_caches_2", "indexer_scale_caches_2", "key_caches_3", "value_caches_3"]
    assert list(first) == want == cache_names(specs)
    for _ in range(3):
        shuffled = [specs[i] for i in rng.permutation(len(specs))]
        again = create_caches(shuffled, 3)
        assert list(again) == want
        assert [(a.shape, a.dtype) for a in again.values()] == [(a.shape, a.dtype) for a in first.values()]
    # order follows (layer, role priority): roles of one layer appear in ROLE_PRIORITY order
    for layer in range(4):
        roles = [n.rsplit("_caches_", 1)[0] for n in want if n.endswith(f"_caches_{layer}")]
        assert roles == sorted(roles, key=ROLE_PRIORITY.index)


def test_spec_and_controller_errors():
    with pytest.raises(ValueError, match=r"GQACacheSpec.head_dim must be an int >= 1, got 0"):
        GQACacheSpec(layer=0, num_kv_heads=2, page_size=4, head_dim=0)
    with pytest.raises(ValueError, match=r"MLACacheSpec.layer must be an int >= 0, got -1"):
        MLACacheSpec(layer=-1, page_size=4)
    with pytest.raises(ValueError, match=r"kv_lora_rank=500 must be a multiple of quant_block=128"):
        DSACacheSpec(layer=0, page_size=4, kv_lora_rank=500)
    with pytest.raises(ValueError, match=r"several cache specs for layer\(s\) \[1\]"):
        create_caches([MLACacheSpec(layer=1, page_size=4), GQACacheSpec(1, 2, 4, 8)], 2)
    with pytest.raises(ValueError, match="num_pages must be an int >= 1, got 0"):
        create_kv_cache(MLACacheSpec(layer=0, page_size=4), 0)
    with pytest.raises(ValueError, match="unknown cache spec"):
        create_kv_cache({"layer": 0}, 2)


def test_host_caches_on_this_platform(rng):
    specs = _specs()[:2]
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" in kinds:  # jax 0.10.2 CPU exposes pinned host memory
        host = create_host_caches(specs, 2)
        assert list(host) == cache_names(specs)
        assert all(a.sharding.memory_kind == "pinned_host" for a in host.values())
        dev = {n: jnp.asarray(rng.standard_normal(a.shape), a.dtype) for n, a in create_caches(specs, 2).items()}
        off = copy_caches(dev, memory_kind="pinned_host")
        back = copy_caches(off, memory_kind=device.default_memory().kind)
        for name in dev:
            assert off[name].sharding.memory_kind == "pinned_host"
            np.testing.assert_array_equal(np.asarray(back[name], np.float32), np.asarray(dev[name], np.float32))
    else:
        with pytest.raises(ValueError, match=f"platform '{device.platform}'"):
            create_host_caches(specs, 2)
    # a memory kind the platform does not have: a clear error naming the platform and its kinds
    with pytest.raises(ValueError, match=rf"platform '{device.platform}' .* does not expose; its memory kinds"):
        host_sharding(device, "hbm_of_the_future")
