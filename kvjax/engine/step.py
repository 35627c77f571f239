"""The jitted model step, the one builder the engine and the tests use: :func:`make_step`.

A model is a :class:`kvjax.models.interface.CausalLM`: ``forward_step(caches, inputs: StepInputs) ->
(f32[B, vocab], caches)``. One call serves a mixed batch of prefill chunks and decode tokens. Shapes come from
the scheduler's buckets, so a run compiles once per distinct ``(T, B, max_blocks, decode_only)`` bucket (and,
when sampling, per greedy / sampling mode).

Each :class:`ModelStep` is its own ``jax.jit`` with its own trace counter: nothing is cached between steps
built separately (an :class:`~kvjax.engine.engine.Engine` builds one and keeps it for its lifetime).

Typical use::

    graphdef, params = nnx.split(model)
    step = make_step(graphdef)               # jitted; caches (argument 1) donated
    logits, caches = step(params, caches, inputs)
    step.num_traces                          # compilations so far
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.engine.inputs import PackLayout, StepInputs
from kvjax.engine import sampling
from kvjax.engine.burst import run_burst
from kvjax.models.interface import ModelCaches
from kvjax.state import gdn_checkpoints


class ModelStep:
    """A model graph's jitted step and how many times it was traced (= compiled).

    ``sample=False``: ``step(params, caches, inputs) -> (logits f32[B, vocab], caches)``.
    ``sample=True`` (the engine's form): ``step(params, caches, buf i32[N], prev_tokens i32[R], layout,
    greedy_only) -> (tokens i32[R], caches)``. ``buf`` is the step's packed inputs and ``layout`` (static) their
    :class:`~kvjax.engine.inputs.PackLayout`: :class:`StepInputs`, the rows' sampling arrays and (prefix
    caching) the GDN checkpoint copies. Token ``t`` becomes ``prev_tokens[prev_index[t]]`` where that index is
    ``>= 0`` (the previous step's sampled tokens, still on the device), then the model step and
    :func:`kvjax.engine.sampling.sample` (``greedy_only``, static: argmax only) run in one dispatch. Row ``b``'s
    token comes back at index ``b`` of an array shaped like ``prev_tokens`` (``R >= B``; rows past ``B``: 0), so
    it can feed the next step whatever its row bucket, and only ``i32[R]`` needs to reach the host. A decode
    burst (``layout.burst > 1``, :mod:`kvjax.engine.burst`) runs its sub-steps and returns sub-step ``j``'s
    token of row ``b`` at ``j * B + b`` (``R >= burst * B``). Checkpoint
    copies restore GDN checkpoints into the rows' slots before the model and save rows' states into checkpoints
    after it (each skipped, under ``lax.cond``, when the step has no such copy).

    ``param_def``: ``params`` is passed as the flat list of its leaves (``jax.tree.leaves``) and rebuilt from
    this treedef inside the jit, so a call does not walk the model's parameter tree on the host.
    """

    def __init__(self, graphdef: nnx.GraphDef, *, sample: bool = False, max_traces: int | None = None,
                 donate: bool = True, param_def: Any = None) -> None:
        self.num_traces = 0
        self.sample = sample

        def count(inputs: StepInputs) -> None:
            self.num_traces += 1  # runs once per trace, never on a cached call
            if max_traces is not None and self.num_traces > max_traces:
                raise AssertionError(f"model step traced {self.num_traces} times, more than max_traces={max_traces}"
                                     f" (an input shape outside the buckets?): T={inputs.num_tokens}, "
                                     f"B={inputs.num_rows}, decode_only={inputs.decode_only}")

        def model_step(params: nnx.State, caches: ModelCaches, inputs: StepInputs):
            if param_def is not None:
                params = jax.tree.unflatten(param_def, params)
            return nnx.merge(graphdef, params).forward_step(caches, inputs)

        def forward(params: nnx.State, caches: ModelCaches, inputs: StepInputs):
            count(inputs)
            return model_step(params, caches, inputs)

        def forward_and_sample(params, caches, buf: jax.Array, prev_tokens: jax.Array, layout: PackLayout,
                               greedy_only: bool):
            inputs, rows, copies = layout.unpack(buf)
            count(inputs)
            fed = prev_tokens[jnp.clip(rows.prev_index, 0, prev_tokens.shape[0] - 1)]
            inputs = dataclasses.replace(inputs, token_ids=jnp.where(rows.prev_index >= 0, fed, inputs.token_ids))

            def pick(logits: jax.Array, counters: jax.Array) -> jax.Array:  # i32[B]
                if greedy_only:
                    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
                return sampling.sample(logits, sampling.row_keys(rows.seeds, rows.streams, counters),
                                       rows.temperature)

            if layout.burst > 1:
                tokens, caches = run_burst(model_step, pick, params, caches, inputs, rows.burst_len, layout.burst,
                                           layout.page_size)
                return jnp.zeros_like(prev_tokens).at[: tokens.shape[0]].set(tokens), caches
            if copies is not None and caches.gdn is not None:
                caches = _copy(caches, copies.restore, gdn_checkpoints.restore, copies.restore, inputs.gdn_slots)
            logits, caches = model_step(params, caches, inputs)
            if copies is not None and caches.gdn is not None:
                caches = _copy(caches, copies.save, gdn_checkpoints.save, inputs.gdn_slots, copies.save)
            tokens = pick(logits, rows.counters)
            return jnp.zeros_like(prev_tokens).at[: tokens.shape[0]].set(tokens), caches

        fn: Callable = forward_and_sample if sample else forward
        self._fn = jax.jit(fn, donate_argnums=(1,) if donate else (), static_argnums=(4, 5) if sample else ())

    def __call__(self, *args: Any) -> tuple[jax.Array, ModelCaches]:
        return self._fn(*args)


def _copy(caches: ModelCaches, which: jax.Array, fn: Callable, *args: jax.Array) -> ModelCaches:
    """``caches`` with ``fn(caches.gdn, *args)`` applied where ``which`` (i32[B]) names any checkpoint."""
    gdn = jax.lax.cond((which >= 0).any(), lambda g: fn(g, *args), lambda g: g, caches.gdn)
    return dataclasses.replace(caches, gdn=gdn)


def make_step(graphdef: nnx.GraphDef, *, sample: bool = False, max_traces: int | None = None,
              donate: bool = True, param_def: Any = None) -> ModelStep:
    """A new jitted step for one model graph (see :class:`ModelStep` for both call forms).

    ``donate``: the caches' buffers are donated (updated in place; do not reuse the old caches).
    ``max_traces``: a further trace raises ``AssertionError`` (so a test can prove that bucketed shapes do not
    recompile); counted per step object.
    ``param_def``: pass ``params`` as ``jax.tree.leaves(params)`` (see :class:`ModelStep`).
    """
    return ModelStep(graphdef, sample=sample, max_traces=max_traces, donate=donate, param_def=param_def)
