"""The engine's step on a ``("data", "model")`` device mesh: :class:`MeshStep` and :func:`mesh_inputs`.

Layout: :mod:`kvjax.models.sharding` (phase A). The engine on a mesh of ``D x M`` devices (issue #20, phase B):

- **One scheduler per data shard.** Each data shard is an independent engine batch with its own
  :class:`~kvjax.sched.scheduler.Scheduler`: its own ``max_seqs`` GDN slots, its own pages, its own queues. A
  request goes to the data shard with the fewest unfinished requests when it is queued (lowest index on ties),
  and stays there (preemption requeues it on its shard). Chosen over one scheduler emitting per-shard plans
  because every scheduler feature (chunked prefill, recycling, preemption, eos, aborts, overlap, rollback)
  then works per shard unchanged, and the single-device engine is the ``D = 1`` case of the same code.
- **Pages per model shard.** ``CacheConfig.num_pages`` is the pool of *one device*. Where the ``"model"`` axis
  splits the KV heads (Qwen3.5), each scheduler's allocator holds ``M`` pools with global page ids (``shards=M``
  in :mod:`kvjax.sched.blocks`: one free list per model shard, serving only its heads; recycling per head as
  before); :func:`mesh_inputs` turns the tables into each device's local ids with one vectorised subtraction
  of ``BlockAllocator.page_base``. DeepSeek's latent pages are replicated over ``"model"``: one pool per data
  shard.
- **One step.** Every scheduler plans each engine step (an idle shard plans an empty batch); the plans are
  padded to the largest bucket of any shard (:func:`kvjax.sched.plan.pad_plan`), stacked ``[D, ...]`` and placed
  with the sharded model's input shardings in one ``jax.device_put``; the jitted :class:`MeshStep` feeds the
  previous step's tokens, runs :meth:`ShardedModel.forward`, samples on the global logits ``f32[D, B, vocab]``
  and returns the tokens ``i32[D, max_seqs]`` *replicated* on every device, so that every process reads the same
  tokens. Sampling keys depend only on (seed, prompt index, tokens so far): tokens equal one device's.
- **Several processes** (``jax.distributed.initialize``, one controller per process over a global mesh): every
  process runs the same engine and the same deterministic schedulers on the same calls, so every process
  builds the same plans (no broadcast); each places only its devices' shards of them and reads the replicated
  tokens from its own devices. Requests, aborts and their order must be the same in every process.
- Not on a mesh: prefix caching (``ValueError`` naming ``prefix_caching``) and sizing without a ``CacheConfig``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.engine import sampling
from kvjax.engine.inputs import SampleInputs, StepInputs, decode_only
from kvjax.config import CacheConfig
from kvjax.models.sharding import DATA, ShardedModel, shard_model
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.plan import DEVICE_FIELDS, StepPlan, pad_plan


def mesh_model(model, mesh: Mesh | None, cache_config: CacheConfig | None, prefix_caching: bool
               ) -> ShardedModel | None:
    """The engine's :class:`ShardedModel` (``None`` on one device): ``model`` itself if sharded already, else
    ``shard_model(model, mesh)``. ``ValueError`` for a second mesh, prefix caching or no ``cache_config``."""
    sharded = model if isinstance(model, ShardedModel) else None
    if sharded is not None and mesh is not None and mesh is not sharded.mesh:
        raise ValueError("mesh= differs from the ShardedModel's own mesh (pass one or the other)")
    if mesh is None and sharded is None:
        return None
    if prefix_caching:
        raise ValueError("prefix_caching=True is not supported on a mesh (Engine(mesh=...)); run without it")
    if cache_config is None:
        raise ValueError("Engine(mesh=...) needs a cache_config (num_pages per device, max_seqs per data shard); "
                         "sizing from free memory is for one device")
    return sharded if sharded is not None else shard_model(model, mesh)


class MeshStep:
    """``step(params, caches, inputs, rows, prev_tokens, greedy_only) -> (tokens i32[D, R], caches)``.

    ``inputs``: :class:`StepInputs` with a leading ``[D]`` axis; ``rows``: :class:`SampleInputs`, each field
    ``[D, ...]``; ``prev_tokens``: the previous step's ``i32[D, R]`` (token ``t`` of shard ``d`` becomes
    ``prev_tokens[d, rows.prev_index[d, t]]`` where that index is ``>= 0``); ``greedy_only`` (static): argmax
    only. Row ``b`` of shard ``d`` samples ``tokens[d, b]`` (rows past ``B``: 0), replicated on every device.
    The caches are donated; ``num_traces`` counts compilations (``max_traces``: a further one raises).
    """

    def __init__(self, sharded: ShardedModel, *, max_traces: int | None = None) -> None:
        self.num_traces = 0
        replicated = NamedSharding(sharded.mesh, P())

        def forward_and_sample(params, caches, inputs: StepInputs, rows: SampleInputs, prev_tokens, greedy_only):
            self.num_traces += 1
            if max_traces is not None and self.num_traces > max_traces:
                raise AssertionError(f"mesh step traced {self.num_traces} times, more than max_traces={max_traces}"
                                     f" (an input shape outside the buckets?): T={inputs.token_ids.shape[1]}, "
                                     f"B={inputs.seq_lens.shape[1]}, decode_only={inputs.decode_only}")
            idx = jnp.clip(rows.prev_index, 0, prev_tokens.shape[1] - 1)
            fed = jnp.take_along_axis(prev_tokens, idx, axis=1)
            inputs = dataclasses.replace(inputs, token_ids=jnp.where(rows.prev_index >= 0, fed, inputs.token_ids))
            logits, caches = sharded.forward(params, caches, inputs)  # f32[D, B, vocab]
            d, b, v = logits.shape
            flat = logits.reshape(d * b, v)
            if greedy_only:
                tokens = jnp.argmax(flat, axis=-1).astype(jnp.int32)
            else:
                keys = sampling.row_keys(rows.seeds.reshape(-1), rows.streams.reshape(-1), rows.counters.reshape(-1))
                tokens = sampling.sample(flat, keys, rows.temperature.reshape(-1))
            # replicated, so that every process reads them: reshard (explicit mesh axes), constraint (auto axes)
            tokens = jax.sharding.reshard(tokens.reshape(d, b), replicated)
            out = jnp.pad(tokens, ((0, 0), (0, prev_tokens.shape[1] - b)))
            return jax.lax.with_sharding_constraint(out, replicated), caches

        self._fn = jax.jit(forward_and_sample, donate_argnums=(1,), static_argnums=(5,))

    def __call__(self, *args):
        return self._fn(*args)


def no_tokens(sharded: ShardedModel, max_seqs: int) -> jax.Array:
    """``i32[D, max_seqs]`` zeros, replicated: the "previous step" of the first step."""
    return jax.device_put(np.zeros((sharded.data_size, max_seqs), np.int32), NamedSharding(sharded.mesh, P()))


def pad_plans(plans: Sequence[StepPlan]) -> list[StepPlan]:
    """The data shards' plans padded to their largest ``T``, ``B`` and block-table width (each a bucket)."""
    T = max(p.token_ids.shape[0] for p in plans)
    B = max(p.seq_lens.shape[0] for p in plans)
    nblk = max(p.block_tables.shape[2] for p in plans)
    return [pad_plan(p, T, B, nblk) for p in plans]


def local_arrays(plan: StepPlan, page_base: np.ndarray, page_size: int) -> dict[str, np.ndarray]:
    """The plan's ``StepInputs`` fields (host, int32 / bool) with each head's page ids local to its device's pool
    (``page_base``: ``i64[Hkv]``, the first global id of each head's pool)."""
    host = {name: np.asarray(getattr(plan, name), np.bool_ if name == "has_initial_state" else np.int32)
            for name in DEVICE_FIELDS}
    if page_base.any():
        bt, sm = host["block_tables"], host["slot_mapping"]
        host["block_tables"] = np.where(bt >= 0, bt - page_base[None, :, None], -1).astype(np.int32)
        host["slot_mapping"] = np.where(sm >= 0, sm - page_base[None, :] * page_size, -1).astype(np.int32)
    return host


def mesh_inputs(sharded: ShardedModel, plans: Sequence[StepPlan], samplings: Sequence[dict[str, np.ndarray]],
                page_base: np.ndarray, page_size: int, *, use_decode_path: bool = True
                ) -> tuple[StepInputs, SampleInputs]:
    """The step inputs of one plan per data shard (same bucket shapes: :func:`pad_plans`), stacked ``[D, ...]``
    and placed with the sharded model's input shardings in one ``jax.device_put`` (every array over ``"data"``;
    the tables' head axis over ``"model"`` where pages are split by head). ``samplings``: per shard, the
    ``seeds``, ``streams`` i32[B] and ``temperature`` f32[B] of its rows (:class:`SamplingTable`); a sampling
    row's token count is its ``seq_len``."""
    hosts = [local_arrays(p, page_base, page_size) for p in plans]
    host = {name: np.stack([h[name] for h in hosts]) for name in DEVICE_FIELDS}
    rows = {k: np.stack([s[k] for s in samplings]) for k in ("seeds", "streams", "temperature")}
    rows["counters"] = host["seq_lens"]
    rows["prev_index"] = np.stack([np.asarray(p.prev_index, np.int32) for p in plans])
    inputs = StepInputs(**host, decode_only=decode_only(plans, use_decode_path))
    mesh = sharded.mesh
    in_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), sharded.input_specs(inputs))
    row_shardings = {k: NamedSharding(mesh, P(DATA)) for k in rows}
    inputs, rows = jax.device_put((inputs, rows), (in_shardings, row_shardings))
    return inputs, SampleInputs(**rows)


def validate_shards(inputs: StepInputs, plans: Sequence[StepPlan] | None, blocks: BlockAllocator, **check) -> None:
    """``debug=True``: :meth:`StepInputs.validate` (``check``: its keyword arguments) of one device's ``inputs``
    (``plans=None``), or of each data shard's plan on a mesh, with pages unique per model-shard pool."""
    if plans is None:
        inputs.validate(**check)
        return
    for plan in plans:
        host = local_arrays(plan, blocks.page_base, check["page_size"])
        StepInputs(**host, decode_only=inputs.decode_only).validate(
            **check, page_groups=blocks.page_base // check["num_pages"])
