"""Config validation: good configs derive the right quantities, bad ones name the field and value."""

import dataclasses

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig, DSAIndexerConfig, GDNConfig, MLAConfig, as_tuple


def test_gdn_conv_dim_and_grouping():
    cfg = GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, conv_kernel_size=4)
    assert cfg.conv_dim == 2 * 2 * 16 + 4 * 8
    with pytest.raises(ValueError, match="num_v_heads=6 must be a multiple of num_k_heads=4"):
        GDNConfig(num_k_heads=4, num_v_heads=6, head_k_dim=16, head_v_dim=16)
    with pytest.raises(ValueError, match="conv_kernel_size must be >= 2, got 1"):
        GDNConfig(1, 1, 8, 8, conv_kernel_size=1)


def test_configs_are_frozen():
    cfg = CacheConfig(page_size=16, num_pages=8, max_seqs=4, max_blocks_per_seq=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 32
    assert cfg.max_seq_len == 64


def test_attention_windows_broadcast_and_validate():
    cfg = AttentionConfig(8, 4, 64)
    assert cfg.window == (0, 0, 0, 0) and cfg.sinks == (0, 0, 0, 0) and cfg.group_size == 2
    mixed = AttentionConfig.with_swa_fraction(8, 4, 64, swa_fraction=0.5, window=128, sinks=4)
    assert mixed.window == (128, 128, 0, 0) and mixed.sinks == (4, 4, 0, 0) and mixed.swa_heads == (0, 1)
    with pytest.raises(ValueError, match=r"window has 3 entries, expected num_kv_heads=4"):
        AttentionConfig(8, 4, 64, window=(1, 2, 3))
    with pytest.raises(ValueError, match=r"sinks\[1\]=2 on a full-attention head"):
        AttentionConfig(4, 2, 64, window=(8, 0), sinks=(2, 2))
    with pytest.raises(ValueError, match=r"window\[0\] must be an int >= 0, got -1"):
        AttentionConfig(4, 2, 64, window=(-1, 0))
    with pytest.raises(ValueError, match="num_q_heads=6 must be a multiple of num_kv_heads=4"):
        AttentionConfig(6, 4, 64)


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: CacheConfig(page_size=0, num_pages=1, max_seqs=1, max_blocks_per_seq=1), "page_size must be >= 1, got 0"),
        (lambda: CacheConfig(page_size=16, num_pages=1.5, max_seqs=1, max_blocks_per_seq=1), "num_pages must be an int, got 1.5"),
        (lambda: MLAConfig(num_heads=4, qk_rope_head_dim=63), "qk_rope_head_dim must be even"),
        (lambda: DSAIndexerConfig(head_dim=100), "head_dim=100 must be a multiple of quant_block=128"),
        (lambda: GDNConfig(num_k_heads=True, num_v_heads=1, head_k_dim=1, head_v_dim=1), "num_k_heads must be an int, got True"),
    ],
)
def test_bad_values_name_field_and_value(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_mla_dims():
    cfg = MLAConfig(num_heads=16)
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192


def test_as_tuple():
    assert as_tuple(3, 2, "w") == (3, 3)
    assert as_tuple([1, 2], 2, "w") == (1, 2)
    with pytest.raises(ValueError, match="w has 1 entries, expected 2"):
        as_tuple([1], 2, "w")


def test_as_tuple_rejects_non_int_entries():
    """A float or bool entry raises naming it instead of being truncated by ``int()``."""
    with pytest.raises(ValueError, match=r"w\[1\] must be an int, got 2\.5"):
        as_tuple([1, 2.5], 2, "w")
    with pytest.raises(ValueError, match=r"w\[0\] must be an int, got True"):
        as_tuple([True, 2], 2, "w")
    assert as_tuple(np.array([4, 5], np.int32), 2, "w") == (4, 5)
