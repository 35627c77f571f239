"""The engine's device side: parameters, caches and the one jitted step, on one device or a mesh of any shape.

One step function serves every configuration (:func:`device_step`): it unpacks the step's packed inputs, feeds
the previous step's sampled tokens, restores GDN checkpoints, runs the model once (or a decode burst of sub-steps,
:mod:`kvjax.engine.burst`), saves checkpoints and samples. :class:`Runner` jits it once per engine:

- **One device** (no mesh): the model's own graph and parameters; the packed buffer ``i32[N]`` goes to the call as
  numpy (the call's one host -> device copy) and the sampled tokens come back as ``i32[R]``.
- **A ``("data", "model")`` mesh** of ``D x M`` devices (:mod:`kvjax.models.sharding`): the same function runs
  per device under ``shard_map`` on the local model (heads, columns and vocabulary over ``"model"``; one data
  shard's rows, pages and GDN slots per ``"data"`` index). The data shards' plans, padded to one bucket, are
  packed into one ``i32[D, N]`` buffer placed over ``"data"`` with one ``device_put``; each device takes its KV
  heads' columns of the tables; the tokens ``i32[D, R]`` come out of ``shard_map`` over ``"data"`` and are
  resharded to every device (every process reads the same tokens). A ``1 x 1`` mesh is this path on one device.
  MTP layers (``speculative="mtp"``) are split like the model's layers (:meth:`ShardedModel.local_head` /
  :meth:`~ShardedModel.shard_head`, their leaves after the model's) and their drafts come back ``i32[D, B, K]``.

``R = max_seqs * burst``: row ``b``'s token of sub-step ``j`` is at ``j * max_seqs + b``
(:attr:`kvjax.sched.plan.StepPlan.token_stride`), whatever the step's row bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.engine import sampling
from kvjax.engine.burst import pad_tokens, run_burst
from kvjax.engine.drafting import Drafting, StepTokens, draft, head_caches
from kvjax.engine.inputs import PackLayout, decode_only, local_page_ids, pack_plans
from kvjax.engine.step import TraceCounter
from kvjax.engine.verify import checkpoint_copy, verify_burst, verify_step
from kvjax.inputs import DEVICE_FIELDS, StepInputs
from kvjax.models.interface import ModelCaches
from kvjax.models.sharding import DATA, MODEL, ShardedModel, shard_map, shard_model
from kvjax.sched.plan import StepPlan, pad_plan
from kvjax.state import gdn_checkpoints


def device_step(model_step: Callable, params: Any, caches: ModelCaches, unpacked: tuple, prev_tokens: jax.Array,
                layout: PackLayout, greedy_only: bool, *, unroll: bool = True,
                localize: Callable[[StepInputs], StepInputs] | None = None,
                drafting: Drafting | None = None) -> tuple[jax.Array | StepTokens, ModelCaches]:
    """One engine step on one device's share (traceable).

    ``model_step(params, caches, inputs) -> (f32[B, vocab] logits, caches)``; ``unpacked``: the step's
    ``(StepInputs, SampleInputs, CheckpointCopies | None)`` (:meth:`PackLayout.unpack` of its packed buffer);
    ``prev_tokens``: i32[R], the previous step's sampled tokens (token ``t``
    becomes ``prev_tokens[prev_index[t]]`` where that index is ``>= 0``). Checkpoint copies restore GDN
    checkpoints into the rows' slots before the model and save rows' states after it (each skipped under
    ``lax.cond`` when the step has none). ``greedy_only`` (static): argmax only. ``unroll``: a burst's sub-steps
    as straight-line code (one CUDA graph) rather than a loop (faster to compile). ``localize``: this device's
    view of the inputs (its KV heads' table columns on a mesh). Returns ``(i32[R] tokens, caches)``: row ``b``'s
    token of sub-step ``j`` at ``j * (R // layout.burst) + b``, zeros elsewhere. ``drafting`` (an engine that drafts
    on the device, no bursts): the model step gives its hidden states too and the MTP drafts follow the sampled
    tokens: ``(StepTokens(tokens, drafts i32[B, K]), caches)`` (:mod:`kvjax.engine.drafting`).
    """
    inputs, rows, copies = unpacked
    if localize is not None:
        inputs = localize(inputs)
    fed = prev_tokens[jnp.clip(rows.prev_index, 0, prev_tokens.shape[0] - 1)]
    inputs = dataclasses.replace(inputs, token_ids=jnp.where(rows.prev_index >= 0, fed, inputs.token_ids))

    def pick(logits: jax.Array, counters: jax.Array) -> jax.Array:  # i32[B]
        if greedy_only:  # top-k / top-p change no greedy row
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        keys = sampling.row_keys(rows.seeds, rows.streams, counters)
        return sampling.sample(logits, keys, rows.temperature, rows.top_k, rows.top_p)  # filter under lax.cond

    if layout.burst > 1:  # a burst plan is all decodes: no checkpoint copy (restores and saves come with prompts)
        return run_burst(model_step, pick, params, caches, inputs, rows.burst_len, layout.burst, layout.page_size,
                         prev_tokens.shape[0] // layout.burst, unroll=unroll)
    if copies is not None and caches.gdn is not None:
        caches = checkpoint_copy(caches, copies.restore, gdn_checkpoints.restore, copies.restore, inputs.gdn_slots)
    if drafting is None:
        logits, caches = model_step(params, caches, inputs)
    else:
        logits, hidden, caches = drafting.hidden_step(params, caches, inputs)
    if copies is not None and caches.gdn is not None:
        caches = checkpoint_copy(caches, copies.save, gdn_checkpoints.save, inputs.gdn_slots, copies.save)
    tokens = pick(logits, rows.counters)
    out = pad_tokens(tokens, prev_tokens.shape[0])
    if drafting is None:
        return out, caches
    drafts, caches = draft(drafting, params, caches, hidden, inputs, inputs.logits_indices, tokens, rows.next_ids)
    return StepTokens(out, drafts), caches


def layout_step(model_step: Callable, params: Any, caches: ModelCaches, unpacked: tuple, prev_tokens: jax.Array,
                layout: PackLayout, greedy_only: bool, *, unroll: bool, drafting: Drafting | None,
                localize: Callable[[StepInputs], StepInputs] | None = None, ngram: tuple[int, int] | None = None
                ) -> tuple[jax.Array | StepTokens, ModelCaches]:
    """One device's step of whatever ``layout`` packs (traceable; on a mesh, one data shard's under ``shard_map``):
    a verification burst (:func:`~kvjax.engine.verify.verify_burst`, with the MTP ``drafting``, or without it the
    n-gram lookup of sizes ``ngram``), a
    verification step (:func:`~kvjax.engine.verify.verify_step`) or an ordinary step or decode burst
    (:func:`device_step`), the last two drafting where the rule drafts (``layout.draft``)."""
    if layout.spec and layout.burst > 1:
        return verify_burst(model_step, params, caches, unpacked, layout, greedy_only, drafting, localize=localize,
                            ngram=ngram)
    drafts = drafting if layout.draft else None  # the MTP layer runs where the rule drafts
    if layout.spec:  # rows of a data shard without drafts: draft_len 0
        return verify_step(model_step, params, caches, unpacked, prev_tokens, layout, greedy_only, drafting=drafts,
                           localize=localize)
    return device_step(model_step, params, caches, unpacked, prev_tokens, layout, greedy_only, unroll=unroll,
                       localize=localize, drafting=drafts)


def engine_model(model: Any, mesh: Mesh | None) -> ShardedModel | None:
    """The :class:`ShardedModel` an engine runs (``None`` on one device without a mesh): ``model`` itself if it is
    one, else ``shard_model(model, mesh)``. ``ValueError`` for a mesh that is not a ``("data", "model")``
    ``Mesh`` or differs from the sharded model's own."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model') or None, got {mesh!r:.80}")
    if isinstance(model, ShardedModel):
        if mesh is not None and mesh is not model.mesh:
            raise ValueError("mesh= differs from the ShardedModel's own mesh (pass one or the other)")
        return model
    return None if mesh is None else shard_model(model, mesh)


class Runner:
    """Parameters, caches and the one jitted step of an engine (see the module docstring).

    ``step(caches, buf, prev_tokens, layout, greedy_only) -> (tokens, caches)`` (caches donated; ``tokens``:
    ``i32[R]`` on one device, ``i32[D, R]`` replicated on a mesh); :meth:`pack` builds ``buf`` and ``layout``
    from the data shards' plans. ``num_traces`` counts compilations (``max_traces``: a further one raises
    ``AssertionError``).
    """

    def __init__(self, model: Any, sharded: ShardedModel | None, *, max_seqs: int, burst: int,
                 max_traces: int | None = None, spec: int = 0, head: Any = None,
                 ngram: tuple[int, int] | None = None) -> None:
        self.sharded = sharded
        self.max_seqs, self.burst = max_seqs, burst
        self.spec = spec  # K of speculative decoding's verification steps (kvjax.engine.verify); 0: none
        self.head = head  # the MTP layers every step drafts K tokens with (kvjax.engine.drafting); None: none
        self.ngram = ngram  # (max_ngram, min_ngram): verification bursts draft by lookup (kvjax.engine.ngram); None
        self.counter = TraceCounter("engine step", max_traces)
        if sharded is None:
            graphdef, params = nnx.split(model)
            self.data_size, self.model_size = 1, 1
            platform = jax.local_devices()[0].platform
        else:
            graphdef, params = sharded.graphdef, sharded.params
            self.data_size, self.model_size = sharded.data_size, sharded.model_size
            platform = sharded.mesh.devices.flat[0].platform
        # parameters passed as their flat leaves: no host walk of the tree per call (the MTP layers' after the model's)
        self.params, param_def = jax.tree.flatten(params)
        n_model = len(self.params)
        # a burst's sub-steps unrolled where they make one CUDA graph: on a GPU without collectives in the step. A
        # CPU compiles a loop faster; with KV heads over "model" the psums split XLA's graphs anyway, and on 1x2 the
        # loop took the same step time with 0.6x the host's issue time and half the compile (HISTORY runs 129, 133)
        unroll = platform != "cpu" and self.model_size == 1

        def model_of(leaves: list):
            return nnx.merge(graphdef, jax.tree.unflatten(param_def, leaves[:n_model]))

        def model_step(leaves: list, caches: ModelCaches, inputs: StepInputs):
            return model_of(leaves).forward_step(caches, inputs)

        drafting = None
        self.head_local = None  # the MTP layers one device runs (on a mesh: ShardedModel.local_head)
        if head is not None:
            if sharded is None:
                self.head_local = head
                head_def, head_params = nnx.split(head)
            else:  # split over the mesh like the model's layers, parameters placed by the model's rules
                self.head_local = sharded.local_head(head)
                head_def, head_params = nnx.split(self.head_local)[0], sharded.shard_head(head)
            head_leaves, head_tree = jax.tree.flatten(head_params)
            self.params = self.params + head_leaves

            def propose(leaves, caches: ModelCaches, hidden, inputs: StepInputs, sampled):
                layers = nnx.merge(head_def, jax.tree.unflatten(head_tree, leaves[n_model:]))
                drafts, pages = layers.propose(model_of(leaves), caches.pages, hidden, inputs, sampled, num_draft=spec)
                return drafts, dataclasses.replace(caches, pages=pages)

            drafting = Drafting(lambda leaves, caches, inputs: model_of(leaves).forward_step_hidden(caches, inputs),
                                propose)

        def step(leaves, caches, buf, prev_tokens, layout: PackLayout, greedy_only: bool):
            self.counter.count(f"T={layout.shape('token_ids')[-1]}, B={layout.shape('seq_lens')[-1]}, "
                               f"decode_only={layout.decode_only}, burst={layout.burst}, spec={layout.spec}, "
                               f"draft={layout.draft}")
            if sharded is None:
                return layout_step(model_step, leaves, caches, layout.unpack(buf), prev_tokens, layout, greedy_only,
                                   unroll=unroll, drafting=drafting, ngram=ngram)
            return self._on_mesh(model_step, leaves, caches, buf, prev_tokens, layout, greedy_only, unroll, drafting)

        self._fn = jax.jit(step, donate_argnums=(1,), static_argnums=(4, 5))
        if sharded is None:
            self.no_tokens = jnp.zeros(max_seqs * burst, jnp.int32)  # i32[R]: the "previous step" of none
        else:
            self.no_tokens = jax.device_put(np.zeros((self.data_size, max_seqs * burst), np.int32),
                                            NamedSharding(sharded.mesh, P()))  # i32[D, R], replicated
            self._buf_sharding = NamedSharding(sharded.mesh, P(DATA))

    @property
    def num_traces(self) -> int:
        return self.counter.num_traces

    def init_caches(self, model: Any, **cache_args: Any) -> ModelCaches:
        """Zeroed caches (on a mesh: ``num_pages`` per device, leading data / model axes; see
        :mod:`kvjax.models.sharding`); with MTP layers, their pools beside the model's."""
        if self.sharded is not None:
            return self.sharded.init_caches(**cache_args, head=self.head_local)
        caches = model.init_caches(**cache_args)
        if self.head is None:
            return caches
        return dataclasses.replace(caches, pages={**caches.pages, **head_caches(self.head, cache_args)})

    def step(self, caches: ModelCaches, buf: np.ndarray | jax.Array, prev_tokens: jax.Array, layout: PackLayout,
             greedy_only: bool) -> tuple[jax.Array | StepTokens, ModelCaches]:
        """Dispatch one step (asynchronous); ``caches`` are donated: use only the returned ones. With MTP layers
        (``head``) the tokens come as :class:`~kvjax.engine.drafting.StepTokens` (with each row's drafts)."""
        return self._fn(self.params, caches, buf, prev_tokens, layout, greedy_only)

    def lower(self, caches: ModelCaches, buf: np.ndarray | jax.Array, prev_tokens: jax.Array, layout: PackLayout,
              greedy_only: bool) -> jax.stages.Lowered:
        """The step :meth:`step` would run for these arguments, lowered (``.as_text()``: its StableHLO;
        ``.compile()``: XLA's program), without running it or counting a trace."""
        with self.counter.paused():
            return self._fn.lower(self.params, caches, buf, prev_tokens, layout, greedy_only)

    def _on_mesh(self, model_step, leaves, caches, buf, prev_tokens, layout, greedy_only, unroll, drafting):
        """The step on the mesh: each device runs :func:`layout_step` on its data shard's inputs (its KV heads'
        columns of the tables) under ``shard_map``; with ``drafting`` (the MTP layers, split like the model's) the
        tokens come as ``StepTokens`` whose drafts are ``i32[D, B, K]``. The tokens (and drafts) are returned
        replicated."""
        sharded = self.sharded
        specs = sharded.cache_specs(caches)
        split_heads = sharded.plan.pages_over_model and sharded.model_size > 1

        def localize(inputs: StepInputs) -> StepInputs:  # this device's KV heads' columns of the tables
            if not split_heads:
                return inputs
            h = inputs.block_tables.shape[1] // sharded.model_size
            first = jax.lax.axis_index(MODEL) * h
            return dataclasses.replace(
                inputs, block_tables=jax.lax.dynamic_slice_in_dim(inputs.block_tables, first, h, axis=1),
                slot_mapping=jax.lax.dynamic_slice_in_dim(inputs.slot_mapping, first, h, axis=1))

        def local(leaves, caches, unpacked, prev):
            unpacked = jax.tree.map(lambda x: x[0], unpacked)  # this data shard's inputs
            tokens, new = layout_step(model_step, leaves, sharded.local_caches(caches), unpacked, prev[0], layout,
                                      greedy_only, unroll=unroll, drafting=drafting, localize=localize,
                                      ngram=self.ngram)
            return jax.tree.map(lambda x: x[None], tokens), sharded.global_caches(new)

        # the packed buffer is unpacked in the global view (slices of the data-sharded i32[D, N]: no communication),
        # so the per-device function takes typed arrays, as the model's own sharded step does
        unpacked = layout.unpack(buf)
        in_specs = ([x.sharding.spec for x in self.params], specs, jax.tree.map(lambda _: P(DATA), unpacked), P(DATA))
        tokens, caches = shard_map(local, sharded.mesh, in_specs, (P(DATA), specs))(leaves, caches, unpacked,
                                                                                    prev_tokens)
        # replicated, so that every process reads them: reshard (explicit mesh axes), constraint (auto axes)
        replicated = NamedSharding(sharded.mesh, P())
        tokens = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(jax.sharding.reshard(x, replicated),
                                                                         replicated), tokens)
        return tokens, caches

    # ---- inputs --------------------------------------------------------------------------------------------
    def shape(self, plans: Sequence[StepPlan]) -> list[StepPlan]:
        """The data shards' plans padded to their largest ``T``, ``B`` and block-table width (one data shard:
        the plan itself)."""
        if len(plans) == 1:
            return list(plans)
        T = max(p.token_ids.shape[0] for p in plans)
        B = max(p.seq_lens.shape[0] for p in plans)
        nblk = max(p.block_tables.shape[2] for p in plans)
        return [pad_plan(p, T, B, nblk) for p in plans]

    def pack(self, plans: Sequence[StepPlan], samplings: Sequence[dict[str, np.ndarray]], *, page_base: np.ndarray,
             page_size: int, use_decode_path: bool, checkpoints: bool,
             next_ids: Sequence[np.ndarray] | None = None,
             history: Sequence[tuple[np.ndarray, np.ndarray]] | None = None
             ) -> tuple[np.ndarray | jax.Array, PackLayout]:
        """The step's packed inputs from the shaped plans (:meth:`shape`) and their rows' sampling arrays
        (:func:`~kvjax.engine.inputs.pack_plans`): ``i32[N]`` numpy on one device, ``i32[D, N]`` placed over
        ``"data"`` on a mesh, and the layout. A burst step (some plan has ``burst_len``, or ``spec_span``: a
        verification burst) runs ``self.burst`` sub-steps; a verification step (some plan has ``draft_len``) packs its
        drafts (``layout.spec = K``); a runner with MTP layers drafts where some plan's ``spec_k > 0``. Page ids
        become local to each device's pool (``page_base``: ``i64[Hkv]``, the first global page id
        of each KV head's pool). ``next_ids``: per plan ``i32[B]``, the known token after each row's step tokens
        (a drafting runner: :func:`kvjax.sched.spec.next_tokens`). ``history``: per plan ``(i32[B, L], i32[B])``, the
        rows' known tokens of a verification burst that drafts by n-gram lookup (:func:`kvjax.sched.spec.histories`;
        packed only for a verification burst)."""
        vburst = any(p.spec_span is not None for p in plans)
        burst = self.burst if vburst or any(p.burst_len is not None for p in plans) else 1
        spec = self.spec if any(p.draft_len is not None for p in plans) else 0
        if self.head is not None and next_ids is None:  # every drafting step packs them: -1, the sampled tokens
            next_ids = [np.full(p.seq_lens.shape[0], -1, np.int32) for p in plans]
        buf, layout = pack_plans(plans, samplings,
                                 decode_only=decode_only(plans, use_decode_path) and not vburst,
                                 checkpoints=checkpoints, burst=burst, page_size=page_size, page_base=page_base,
                                 spec=spec, next_ids=next_ids,
                                 draft=self.head is not None and any(p.spec_k > 0 for p in plans),
                                 history=history if vburst and spec else None)
        if self.sharded is None:
            return buf[0], layout
        return jax.device_put(buf, self._buf_sharding), layout

    def device_inputs(self, plans: Sequence[StepPlan], page_base: np.ndarray, num_pages: int, page_size: int,
                      use_decode_path: bool) -> list[tuple[StepInputs, np.ndarray | None]]:
        """Each shaped plan's :class:`StepInputs` as the devices' pools see them (host arrays; for
        :meth:`StepInputs.validate`) with the pool of each KV head (``None``: one pool)."""
        flag = decode_only(plans, use_decode_path)
        groups = page_base // num_pages if page_base.any() else None
        out = []
        for plan in plans:
            host = {name: np.asarray(getattr(plan, name), np.bool_ if name == "has_initial_state" else np.int32)
                    for name in DEVICE_FIELDS}
            if page_base.any():
                host["block_tables"], host["slot_mapping"] = local_page_ids(host["block_tables"],
                                                                            host["slot_mapping"], page_base, page_size)
            out.append((StepInputs(**host, decode_only=flag), groups))
        return out
