"""``EngineOptions``: an engine's settings as one frozen dataclass, checked when built; ``Engine(**settings)`` and
``Engine(options=...)`` are the same engine, and a bad or unknown setting is refused before anything is built."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from helpers.models import VOCAB, random_model, tiny_config
from kvjax.config import CacheConfig
from kvjax.engine.engine import Engine
from kvjax.engine.options import AUTO_BURST, EngineOptions

CACHE = CacheConfig(page_size=4, num_pages=48, max_seqs=4, max_blocks_per_seq=8)
SETTINGS = dict(recycle="timely", decode_burst=2, max_num_batched_tokens=16, token_buckets=(16,), row_buckets=(4,),
                block_buckets=(8,), overlap=False)


def test_settings_and_options_make_the_same_engine():
    model = random_model(tiny_config(window=(6, 0), sinks=(2, 0)), seed=3)
    prompts = [np.random.default_rng(i).integers(0, VOCAB, 5 + 3 * i).tolist() for i in range(5)]
    by_name = Engine(model, CACHE, **SETTINGS)
    opts = EngineOptions(**SETTINGS)
    by_object = Engine(model, CACHE, options=dataclasses.replace(opts, decode_burst=1), decode_burst=2)
    assert by_name.options == by_object.options == opts
    assert by_name.decode_burst == 2 and by_name.recycle == "timely" and not by_name.overlap
    assert by_name.generate(prompts, 7) == by_object.generate(prompts, 7)


def test_auto_burst_resolves_and_options_are_frozen():
    opts = EngineOptions()
    assert opts.decode_burst == "auto" and opts.burst == AUTO_BURST
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.overlap = False  # type: ignore[misc]
    assert EngineOptions(token_buckets=[np.int64(16), 32]).token_buckets == (16, 32)


@pytest.mark.parametrize("field, value, match", [
    ("overlap", "no", "overlap must be True or False, got 'no'"),
    ("debug", 1, "debug must be True or False"),
    ("decode_burst", 0, "decode_burst must be 'auto' or an int in"),
    ("decode_burst", "8", "decode_burst must be 'auto'"),
    ("max_traces", 0, "max_traces must be None or an int"),
    ("token_buckets", (32, 16), r"token_buckets must be None or ascending ints >= 1 ending at "
                                r"max_num_batched_tokens, got \(32, 16\)"),
    ("row_buckets", 4, "row_buckets must be None or ascending ints"),
    ("prefix_recycle", "lazy", "prefix_recycle must be one of"),
    ("prefix_checkpoints", 2, "prefix_checkpoints / prefix_recycle need prefix_caching=True"),
    ("cache_options", ["indexer_fp8"], "cache_options must be None or a dict"),
])
def test_a_bad_setting_names_itself(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineOptions(**{field: value})


def test_engine_refuses_unknown_settings_and_bad_options_before_building():
    model = random_model(tiny_config(), seed=1)
    with pytest.raises(TypeError, match=r"unknown settings \['decode_bursts'\]"):
        Engine(model, CACHE, decode_bursts=4)
    with pytest.raises(ValueError, match="options must be an EngineOptions"):
        Engine(model, CACHE, options={"overlap": False})
    with pytest.raises(ValueError, match="row_buckets must be ascending ints >= 1 ending at max_seqs=4"):
        Engine(model, CACHE, row_buckets=(2,))
