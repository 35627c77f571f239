"""What an engine is built from: its settings checked and resolved against the model, before anything is built.

:func:`settle` merges the options (an :class:`~kvjax.engine.options.EngineOptions` and keyword settings over it),
checks the model, the cache config and the tokenizer, places the model on a mesh (:func:`kvjax.engine.runner.engine_model`),
decides the cache geometry (the given ``CacheConfig`` checked against the device memory, or one sized from it:
:mod:`kvjax.engine.sizing`), the prefix cache and its host tier, the eos ids and the step's token budget. Every
check raises (``ValueError`` naming the value; ``TypeError`` for an unknown setting) before any cache, scheduler
or compiled step exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from kvjax.config import CacheConfig
from kvjax.engine.args import cache_options, check_cache_dtype, check_eos, prefix_config
from kvjax.engine.drafting import check_head
from kvjax.engine.host_tier import host_tier_config
from kvjax.engine.options import EngineOptions
from kvjax.engine.runner import engine_model
from kvjax.engine.sizing import CacheSizing, check_cache_fits, default_max_seqs, size_cache
from kvjax.models.interface import CausalLM
from kvjax.models.sharding import ShardedModel
from kvjax.sched.drafter import Drafter, make_drafter
from kvjax.sched.prefix_cache import PrefixCacheConfig


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """An engine's settings, checked and resolved (:func:`settle`)."""

    options: EngineOptions  # the options in use (keyword settings applied)
    sharded: ShardedModel | None  # the model placed on the mesh (None: one device)
    cache_config: CacheConfig  # given, or sized (per device on a mesh)
    cache_sizing: CacheSizing | None  # how it was sized (None: given)
    cache_args: dict  # init_caches' keywords: pages, page size, slots (with checkpoint slots), dtype, options
    prefix: PrefixCacheConfig | None  # prefix caching, with its host tier (None: off)
    drafter: Drafter | None  # speculative decoding's drafter (None: off)
    draft_head: Any  # the MTP layers every step drafts with (speculative="mtp"; kvjax.engine.drafting); None: none
    eos_token_ids: tuple[int, ...]  # the ids that end every request
    max_num_batched_tokens: int  # the step's token budget
    page_shards: int  # model shards of the page pool (1 but on a mesh whose pages go over "model")


def settle(model: CausalLM, cache_config: CacheConfig | None, mesh: jax.sharding.Mesh | None, tokenizer: Any,
           options: EngineOptions | None, settings: dict[str, Any]) -> EngineSetup:
    """The :class:`EngineSetup` of ``Engine(model, cache_config, mesh=, tokenizer=, options=, **settings)`` (see
    the module docstring and :class:`~kvjax.engine.engine.Engine`)."""
    if cache_config is not None and not isinstance(cache_config, CacheConfig):
        raise ValueError(f"cache_config must be a CacheConfig or None, got {type(cache_config).__name__}")
    if not isinstance(model, ShardedModel) and (not isinstance(model, CausalLM) or not isinstance(model, nnx.Module)):
        raise ValueError(f"model must be an nnx.Module implementing kvjax.models.interface.CausalLM, got "
                         f"{type(model).__name__}")
    if options is not None and not isinstance(options, EngineOptions):
        raise ValueError(f"options must be an EngineOptions or None, got {type(options).__name__}")
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(EngineOptions)})
    if unknown:
        raise TypeError(f"Engine got unknown settings {unknown}; settings are EngineOptions fields: "
                        f"{[f.name for f in dataclasses.fields(EngineOptions)]}")
    o = dataclasses.replace(options or EngineOptions(), **settings)
    drafter = None if o.speculative is None else make_drafter(o.speculative)
    sharded = engine_model(model, mesh)
    head = check_head(model, o.speculative)
    head_local = head if sharded is None or head is None else sharded.local_head(head)  # what one device holds
    params = nnx.state(model) if sharded is None else sharded.params
    cache_dtype = check_cache_dtype(o.cache_dtype, params)
    local = model if sharded is None else sharded.local  # what one device holds
    cache_opts = cache_options(local, o.cache_options, o.kv_cache_dtype)  # init_caches' extra keywords
    sizing = None
    device = None if sharded is None else sharded.mesh.devices.flat[0]
    prefix = prefix_config(model, o.prefix_caching, o.prefix_checkpoints, o.prefix_recycle,
                           cache_config.max_seqs if cache_config is not None else default_max_seqs(device))
    num_ckpts = prefix.num_checkpoints if prefix is not None else 0
    verify_positions = 0 if o.speculative is None else o.speculative.num_draft_tokens + 1
    if cache_config is None:
        sizing = size_cache(local, dtype=cache_dtype, memory_fraction=o.memory_fraction, cache_options=cache_opts,
                            num_checkpoints=num_ckpts, device=device, head=head_local,
                            verify_positions=verify_positions)
        cache_config = sizing.cache_config
    else:
        if o.memory_fraction is not None:
            raise ValueError(f"memory_fraction={o.memory_fraction!r} sizes the cache only without a cache_config; "
                             "got both")
        check_cache_fits(local, cache_config, num_ckpts, cache_dtype, cache_opts, device, head=head_local,
                         verify_positions=verify_positions)
    prefix = host_tier_config(prefix, o.host_cache_bytes, local, page_size=cache_config.page_size, dtype=cache_dtype,
                              cache_options=cache_opts, sharded=sharded)
    eos_token_id = o.eos_token_id
    if isinstance(eos_token_id, str) and eos_token_id == "auto":
        generation = getattr(model, "generation_config", None)
        eos_token_id = None if generation is None else generation.eos_token_ids
    if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                      and callable(getattr(tokenizer, "decode", None))):
        raise ValueError(f"tokenizer must have encode(text) -> ids and decode(ids) -> text (a transformers "
                         f"tokenizer, e.g. kvjax.models.load_tokenizer), got {type(tokenizer).__name__}")
    eos_token_ids = check_eos(eos_token_id, int(model.vocab_size))
    max_num_batched_tokens = o.max_num_batched_tokens
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(256, cache_config.max_seqs)
    page_shards = sharded.model_size if sharded is not None and sharded.plan.pages_over_model else 1
    cache_args = dict(num_pages=cache_config.num_pages, page_size=cache_config.page_size,
                      max_seqs=cache_config.max_seqs + num_ckpts, dtype=cache_dtype, **cache_opts)
    return EngineSetup(o, sharded, cache_config, sizing, cache_args, prefix, drafter, head, eos_token_ids,
                       max_num_batched_tokens, page_shards)
