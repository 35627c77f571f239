"""A model step on a ``("data", "model")`` device mesh: :func:`shard_model` -> :class:`ShardedModel`.

Layout (issue #20, phase A). The mesh is ``jax.sharding.Mesh(devices, ("data", "model"))`` of ``D x M`` devices.

- ``"model"`` (tensor parallel): attention query and KV heads, GDN key/value heads and their conv channels,
  MLP (and expert) columns, and the vocabulary of the embedding and LM head (padded with zero rows / columns to
  a multiple of ``M``; the logits are all-gathered and sliced to the true vocabulary inside the step, so a
  padded entry never reaches a sampler). Column-parallel projections are split on their output axis (axis 1
  of a ``Linear`` kernel ``[in, out]``, axis 0 of a ``TorchLinear`` weight ``[out, in]``), row-parallel ones
  (``o_proj``, ``out_proj``, ``down_proj``) on their input axis and summed over ``"model"`` by the op
  :func:`kvjax.ops.collective.all_reduce` (``ShardedModel(all_reduce=)``: its ``impl``, ``"auto"`` by default);
  norms, routers and the DSA indexer are replicated. A head count (or MLP width) that ``M`` does not divide is
  a ``ValueError`` naming both numbers. Rules: :func:`param_spec`; family details: ``model.shard_plan``.
- ``"data"``: batch rows. Each data shard is an independent ragged batch with its own pages and GDN slots:
  the step's inputs are ``StepInputs`` whose every array has a leading ``[D]`` axis (row ``d`` = the batch of
  data shard ``d``, as the single-device scheduler would build it), and the caches have a leading ``[D]`` axis.
- **Pages per device** (Qwen3.5): each device's pool holds only its KV heads' pages. A paged role is
  ``[D, M, P, page_size, F]`` (device ``(d, m)`` holds ``[P, page_size, F]``); KV head ``h`` lives on
  ``m = h // (Hkv / M)`` and the page ids in its block-table column ``block_tables[d, :, h]`` (and
  ``slot_mapping[d, :, h]``) index that device's pool. ``P`` is per device: ``M`` devices hold ``M * P`` pages.
- **Head placement**: ``h`` above counts the KV heads of :meth:`ShardedModel.attention_layout`, the model's heads
  in the device-major order of :func:`kvjax.sched.blocks.head_placement` (``plan.kv_order``), not the model's
  own order: a contiguous split of ``(w, w, 0, 0)`` over 2 devices would put both full heads on device 1, whose
  pool then fills first while device 0's sits half empty (fewer running requests than one device with the same
  total pages). Placed, each device holds one SWA and one full head. The parameters are permuted to match (each KV
  head with its GQA query heads' ``q_proj`` columns and ``o_proj`` rows, its ``k_proj`` / ``v_proj`` columns and
  its window / sinks), so block tables built for ``attention_layout()`` (the engine's scheduler's) are all the
  step needs; nothing is permuted per step. Where the counts do not allow the same mix (3 SWA + 1 full over 2
  devices) one device holds more of the heavy heads whatever the order; equal shards mean equal ``P``, so extra
  pages for that device cost ``M`` times as much physical memory (see ``kvjax.sched.blocks``).
- **DeepSeek's single latent head** cannot be split by head: its pages are ``[D, P, page_size, F]``, split
  over ``"data"`` (each data shard's rows attend their own pages: data-parallel attention) and replicated
  over ``"model"``, where each device attends its share of the query heads over the same latent pages (the
  vLLM tensor-parallel MLA layout; SGLang's DP attention, rows split over both axes, would cut the cache per
  device by ``M`` more but all-gathers the tokens around every MLP: a later option). Chosen because the
  absorbed MLA decode is per query head, so splitting heads needs no cache communication at all.
- GDN pool: ``conv [D, L, S+1, conv_dim, W-1]`` split on the channel axis (channels in the device-major order
  of the plan's permutation, :attr:`ShardedModel.perms`), ``ssm f32[D, L, S+1, Hv, K, V]`` on the head axis.

The step runs every layer per device through ``shard_map`` on local shapes (the Pallas kernels, or the
references on CPU, see each device's heads and pages only; no cache is ever gathered): inside, a *local* model
(:mod:`kvjax.models.common.parallel`) of the same class with the local config runs its own ``forward_step``.

Interface for the engine (phase B)::

    sharded = shard_model(model, mesh)            # or load_pretrained(path, mesh=mesh)
    caches = sharded.init_caches(num_pages=P, page_size=ps, max_seqs=S)   # P pages per device
    inputs = sharded.shard_inputs([inputs_0, ..., inputs_{D-1}])            # one StepInputs per data shard
    logits, caches = sharded.forward(sharded.params, caches, inputs)      # traceable: f32[D, B, vocab]
    # the engine's step: kvjax.engine.runner.Runner (the same local model under shard_map)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.models.common.checkpoint import abstract_model, check_values
from kvjax.models.common.layers import Linear
from kvjax.models.common.parallel import ShardPlan
from kvjax.inputs import DEVICE_FIELDS
from kvjax.models.interface import ModelCaches
from kvjax.ops.collective import TABLE as ALL_REDUCE_TABLE
from kvjax.state.gdn_pool import GDNStatePool

DATA, MODEL = "data", "model"
COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "in_proj_qkv",
                    "in_proj_z", "in_proj_b", "in_proj_a", "lm_head"})  # split on the output axis
ROW = frozenset({"o_proj", "out_proj", "down_proj"})  # split on the input axis, psum after


def shard_map(f, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` (jax >= 0.10 / 0.11) or ``jax.experimental.shard_map.shard_map``, replication unchecked
    (the Pallas kernels carry no replication rule)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover (older jax)

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def param_spec(path: Sequence[Any]) -> P:
    """The ``PartitionSpec`` of a parameter from its path (``nnx.state`` path; rules in the module docstring)."""
    names = [str(p) for p in path]
    leaf, owner = names[-1], names[-2] if len(names) > 1 else ""
    if leaf == "embed_tokens":
        return P(MODEL, None)  # [V, H]: vocabulary rows
    if owner == "experts":  # gate_up_proj [E, 2I, D], down_proj [E, D, I]
        return P(None, MODEL, None) if leaf == "gate_up_proj" else P(None, None, MODEL)
    if leaf in ("kernel", "bias", "weight") and owner in COLUMN:  # weight: TorchLinear [out, in]
        return {"kernel": P(None, MODEL), "weight": P(MODEL, None), "bias": P(MODEL)}[leaf]
    if leaf in ("kernel", "bias") and owner in ROW:
        return P(MODEL, None) if leaf == "kernel" else P()
    if owner == "linear_attn" and leaf in ("conv_weight", "dt_bias", "A_log"):
        return P(MODEL) if leaf != "conv_weight" else P(MODEL, None)  # per value head / conv channel
    return P()


def _prepare(path: tuple, value: np.ndarray, plan: ShardPlan, xp: Any = np) -> np.ndarray:
    """Pad the vocabulary and permute fused channels so that a contiguous split gives each device its share
    (``xp``: ``numpy`` on the host, ``jax.numpy`` inside a jitted draw)."""
    names = tuple(str(p) for p in path)
    if names[-1] == "embed_tokens" or names[-2:] == ("lm_head", "kernel"):
        axis = 0 if names[-1] == "embed_tokens" else 1
        pad = [(0, 0)] * value.ndim
        pad[axis] = (0, plan.vocab_padded - value.shape[axis])
        value = xp.pad(value, pad)
    for suffix, (axis, perm) in plan.perms.items():
        if names[-len(suffix):] == suffix:
            value = xp.take(value, xp.asarray(perm), axis=axis)
    return value


class ShardedModel:
    """A model split over a ``("data", "model")`` mesh: sharded parameters, the local graph, sharded caches and
    the per-device step (see the module docstring for the layout).

    ``params``: the global parameter state (each array placed with the NamedSharding of :func:`param_spec`);
    ``graphdef``: the local model's graph (what each device runs); ``perms``: fused-channel orders.

    ``values``: ``{path: host array}`` (read on the host, padded / permuted there, each shard placed), or a
    traceable ``draw(path, shape) -> array`` of each parameter's global value (e.g. random weights): all drawn by
    one jitted call whose outputs have the parameters' shardings, so each device computes its own shards and
    nothing crosses the host (every process of a multi-process mesh runs the same call).

    ``all_reduce``: the ``impl`` of every sum over ``"model"`` (the row-parallel projections, the MoE's routed
    experts, the vocabulary-sharded embedding): ``"auto"`` (the op's backend table decides), ``"reference"``
    (XLA's ``psum``) or ``"mosaic"`` (the one-shot kernel); :func:`kvjax.ops.collective.all_reduce`.
    """

    def __init__(self, model_abstract: nnx.Module,
                 values: Mapping[tuple, Any] | Callable[[tuple, tuple[int, ...]], jax.Array], mesh: Mesh, *,
                 all_reduce: str = "auto"):
        if set(mesh.axis_names) != {DATA, MODEL}:
            raise ValueError(f"mesh axes must be ('data', 'model'), got {mesh.axis_names}")
        ALL_REDUCE_TABLE.validate_impl(all_reduce)
        self.all_reduce = all_reduce
        self.mesh = mesh
        self.data_size, self.model_size = mesh.shape[DATA], mesh.shape[MODEL]
        self.config = model_abstract.config
        self._layout = model_abstract.attention_layout()
        self.plan = plan = model_abstract.shard_plan(MODEL, self.model_size)
        self.perms = plan.perms
        if plan.kv_order:  # the heads in device-major order (with their windows / sinks)
            order = np.asarray(plan.kv_order)
            self._layout = dataclasses.replace(self._layout, window=tuple(np.asarray(self._layout.window)[order]
                                                                          .tolist()),
                                               sinks=tuple(np.asarray(self._layout.sinks)[order].tolist()))
        state = nnx.state(model_abstract)
        flat = dict(nnx.to_flat_state(state)) if callable(values) else check_values(state, values)
        paths = list(flat)
        shardings = [NamedSharding(mesh, param_spec(path)) for path in paths]
        dtypes = [flat[path].get_value().dtype for path in paths]
        if callable(values):  # a list in the parameters' order (a dict would sort its mixed str / int paths)
            def draw() -> list[jax.Array]:
                return [_prepare(path, values(path, tuple(flat[path].get_value().shape)).astype(dt), plan, jnp)
                        for path, dt in zip(paths, dtypes)]

            arrays = jax.jit(draw, out_shardings=shardings)()
        else:
            arrays = [jax.device_put(_prepare(path, np.asarray(values[path]).astype(dt), plan), sh)
                      for path, dt, sh in zip(paths, dtypes, shardings)]
        placed = [(path, flat[path].replace(value)) for path, value in zip(paths, arrays)]
        self.params = nnx.from_flat_state(placed)
        self.param_specs = jax.tree.map(lambda x: x.sharding.spec, self.params)
        dtype = next(iter(flat.values())).get_value().dtype
        local = self._local(lambda config: type(model_abstract)(config, rngs=nnx.Rngs(0), dtype=dtype))
        local.tp = dataclasses.replace(plan.tp, all_reduce=all_reduce) if self.model_size > 1 else None
        self.local = local
        self.graphdef = nnx.split(local)[0]

    def _local(self, build: Callable[[Any], nnx.Module]) -> nnx.Module:
        """The abstract local module ``build(config)`` of this mesh (the plan's local config over several model
        devices, its row-parallel projections and MLPs summing over ``"model"``; the global config over one)."""
        split = self.model_size > 1  # over one model device the local model is the model itself: no collective
        local = abstract_model(lambda: build(self.plan.local_config if split else self.config))
        for path, module in nnx.iter_modules(local):
            name = str(path[-1]) if path else ""
            if split and ((isinstance(module, Linear) and name in ROW) or (name == "mlp"
                                                                             and hasattr(module, "reduce_axis"))):
                module.reduce_axis = MODEL
                module.reduce_impl = self.all_reduce
        return local

    def local_head(self, head: nnx.Module) -> nnx.Module:
        """The abstract local module of a draft head (the MTP layers of :class:`kvjax.models.interface.DraftHead`,
        built as ``type(head)(config, num_layers=, rngs=, dtype=)``) each device runs, split like the model's own
        layers: the local config (its attention's query / KV heads and MLP columns over ``"model"``), row-parallel
        projections summed (its parameters: :meth:`shard_head`; its pools: :meth:`init_caches`)."""
        dtype = next(iter(jax.tree.leaves(nnx.state(head)))).dtype
        return self._local(lambda config: type(head)(config, num_layers=len(head.layers), rngs=nnx.Rngs(0),
                                                     dtype=dtype))

    def shard_head(self, head: nnx.Module) -> nnx.State:
        """A draft head's global parameter state placed by :func:`param_spec` like the model's (``fc`` and the
        norms replicated, attention heads and MLP columns over ``"model"``; the KV heads permuted by the plan's
        ``kv_order`` like the model's, so the heads of its pools follow the model's block tables); the local module
        that takes it: :meth:`local_head`."""
        flat = list(nnx.to_flat_state(nnx.state(head)))
        return nnx.from_flat_state([
            (path, var.replace(jax.device_put(_prepare(path, np.asarray(var.get_value()), self.plan),
                                              NamedSharding(self.mesh, param_spec(path))))) for path, var in flat])

    # ------------------------------------------------------------------------------------ description

    @property
    def vocab_size(self) -> int:
        return self.plan.tp.vocab_size

    def attention_layout(self):
        """The global block-table layout: all KV heads with their windows / sinks in the placed order
        (``plan.kv_order``: head ``h`` here is the model's head ``kv_order[h]``); column ``h``'s pages live on model
        shard :meth:`head_owner`. The engine's scheduler must build its tables for this layout (not the unsharded
        model's, whose head order may differ)."""
        return self._layout

    @property
    def kv_order(self) -> np.ndarray:
        """i64[Hkv]: the model's KV head behind each head of :meth:`attention_layout` (identity if unplaced)."""
        return np.asarray(self.plan.kv_order or range(self._layout.num_kv_heads), np.int64)

    def head_owner(self, head: int) -> int:
        """Model-axis index of the device whose page pool holds the pages of KV head ``head`` of
        :meth:`attention_layout` (0 for a latent head)."""
        if not self.plan.pages_over_model:
            return 0
        return head // self.plan.local_config.attention.num_kv_heads

    # ---------------------------------------------------------------------------------------- caches

    def _page_spec(self) -> P:
        return P(DATA, MODEL) if self.plan.pages_over_model else P(DATA)

    def cache_specs(self, caches: ModelCaches) -> ModelCaches:
        """``PartitionSpec`` tree of global caches (pages per device; GDN channels / heads over ``"model"``)."""
        gdn = None if caches.gdn is None else GDNStatePool(conv=P(DATA, None, None, MODEL, None),
                                                           ssm=P(DATA, None, None, MODEL, None, None))
        return ModelCaches(pages={k: self._page_spec() for k in caches.pages}, gdn=gdn)

    def init_caches(self, *, num_pages: int, page_size: int, head: nnx.Module | None = None,
                    **options: Any) -> ModelCaches:
        """Zeroed global caches, created in place on their devices: ``num_pages`` pages *per device* of each
        paged role, and the options of the family's ``init_caches`` (``max_seqs``, ``dtype``, ...). ``head``: a
        local draft head (:meth:`local_head`) whose page pools join the model's, laid out like them (its KV heads'
        pages on their model device)."""
        def local_caches() -> ModelCaches:
            caches = self.local.init_caches(num_pages=num_pages, page_size=page_size, **options)
            if head is None:
                return caches
            pools = head.init_caches(num_pages=num_pages, page_size=page_size,
                                     dtype=options.get("dtype", jnp.float32),
                                     kv_cache_dtype=options.get("kv_cache_dtype", "auto"))
            return dataclasses.replace(caches, pages={**caches.pages, **pools})

        local = jax.eval_shape(local_caches)
        d, m = self.data_size, self.model_size
        lead = (d, m) if self.plan.pages_over_model else (d,)
        shapes = ModelCaches(
            pages={k: jax.ShapeDtypeStruct((*lead, *v.shape), v.dtype) for k, v in local.pages.items()},
            gdn=None if local.gdn is None else GDNStatePool(
                conv=_widen(local.gdn.conv, d, m, axis=2), ssm=_widen(local.gdn.ssm, d, m, axis=2)),
        )
        zeros = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
                        out_shardings=self.shardings(shapes))  # each device creates only its shard
        return zeros()

    def shardings(self, caches: ModelCaches) -> ModelCaches:
        """``NamedSharding`` tree of global caches (the step's cache in/out shardings)."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.cache_specs(caches))

    @staticmethod
    def device_nbytes(caches: ModelCaches, device: jax.Device) -> int:
        """Bytes of ``caches`` held by ``device``."""
        return sum(s.data.nbytes for x in jax.tree.leaves(caches) for s in x.addressable_shards
                   if s.device == device)

    # ---------------------------------------------------------------------------------------- step

    def input_specs(self, inputs):
        """``PartitionSpec`` tree of global ``StepInputs``: every array over ``"data"`` on its leading axis; the
        per-KV-head ``block_tables [D, B, Hkv, max_blocks]`` and ``slot_mapping [D, T, Hkv]`` also over
        ``"model"`` on the head axis where pages are split by head (each device reads its heads' columns)."""
        specs = {name: P(DATA) for name in DEVICE_FIELDS}
        if self.plan.pages_over_model:
            specs.update(block_tables=P(DATA, None, MODEL), slot_mapping=P(DATA, None, MODEL))
        return dataclasses.replace(inputs, **specs)

    def shard_inputs(self, steps: Sequence[Any]):
        """One ``StepInputs`` per data shard (same bucket shapes) -> one with a leading ``[D]`` axis, placed.

        ``decode_only`` is kept only if every shard's step is decode-only (``False`` is always correct)."""
        if len(steps) != self.data_size:
            raise ValueError(f"need one StepInputs per data shard ({self.data_size}), got {len(steps)}")
        decode_only = all(s.decode_only for s in steps)
        steps = [dataclasses.replace(s, decode_only=decode_only) for s in steps]
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *steps)
        return jax.device_put(stacked, jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.input_specs(stacked)))

    def local_caches(self, caches: ModelCaches) -> ModelCaches:
        """Inside ``shard_map``: one device's block of global caches (leading data / model axes of size 1) as the
        local model's caches."""
        lead = 2 if self.plan.pages_over_model else 1
        return ModelCaches(pages={k: v.reshape(v.shape[lead:]) for k, v in caches.pages.items()},
                           gdn=None if caches.gdn is None else jax.tree.map(lambda x: x[0], caches.gdn))

    def global_caches(self, caches: ModelCaches) -> ModelCaches:
        """Inside ``shard_map``: the local model's caches as one device's block of the global caches."""
        lead = 2 if self.plan.pages_over_model else 1
        return ModelCaches(pages={k: v.reshape((1,) * lead + v.shape) for k, v in caches.pages.items()},
                           gdn=None if caches.gdn is None else jax.tree.map(lambda x: x[None], caches.gdn))

    def forward(self, params: nnx.State, caches: ModelCaches, inputs) -> tuple[jax.Array, ModelCaches]:
        """The sharded model step (traceable; jit it with the caches donated): ``inputs`` with a leading ``[D]``
        axis (:meth:`shard_inputs`) -> ``(logits f32[D, B, vocab_size], new caches)``; each data shard's logits and
        caches equal a single-device step on its batch. (The engine's step is
        :class:`kvjax.engine.runner.Runner`, the same local model under ``shard_map``.)"""
        specs = self.cache_specs(caches)
        graphdef = self.graphdef

        def local(params, caches, inputs):
            inputs = jax.tree.map(lambda x: x[0], inputs)
            logits, new = nnx.merge(graphdef, params).forward_step(self.local_caches(caches), inputs)
            return logits[None], self.global_caches(new)

        in_specs = (self.param_specs, specs, self.input_specs(inputs))
        return shard_map(local, self.mesh, in_specs, (P(DATA), specs))(params, caches, inputs)


def _widen(x: jax.ShapeDtypeStruct, d: int, m: int, *, axis: int) -> jax.ShapeDtypeStruct:
    shape = list(x.shape)
    shape[axis] *= m
    return jax.ShapeDtypeStruct((d, *shape), x.dtype)


def shard_model(model: nnx.Module, mesh: Mesh, *, all_reduce: str = "auto") -> ShardedModel:
    """Split ``model`` (a :class:`kvjax.models.interface.CausalLM` with ``shard_plan``) over ``mesh``: each
    parameter is read through host memory and placed with the NamedSharding of its rule (``all_reduce``: the
    sums' ``impl``, :class:`ShardedModel`). ``ValueError`` names a head count the ``"model"`` axis does not
    divide."""
    values = {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model))}
    return ShardedModel(model, values, mesh, all_reduce=all_reduce)
