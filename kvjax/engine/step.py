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

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.engine.inputs import StepInputs
from kvjax.engine import sampling
from kvjax.models.interface import ModelCaches


class ModelStep:
    """A model graph's jitted step and how many times it was traced (= compiled).

    ``sample=False``: ``step(params, caches, inputs) -> (logits f32[B, vocab], caches)``.
    ``sample=True``: ``step(params, caches, inputs, seeds i32[B], streams i32[B], counters i32[B],
    temperature f32[B], greedy_only) -> (tokens i32[B], caches)``: the model step followed by
    :func:`kvjax.engine.sampling.sample` (``greedy_only``, static: argmax only) in one dispatch, so only the
    tokens need to come back to the host.
    """

    def __init__(self, graphdef: nnx.GraphDef, *, sample: bool = False, max_traces: int | None = None,
                 donate: bool = True) -> None:
        self.num_traces = 0
        self.sample = sample

        def forward(params: nnx.State, caches: ModelCaches, inputs: StepInputs):
            self.num_traces += 1  # runs once per trace, never on a cached call
            if max_traces is not None and self.num_traces > max_traces:
                raise AssertionError(f"model step traced {self.num_traces} times, more than max_traces={max_traces}"
                                     f" (an input shape outside the buckets?): T={inputs.num_tokens}, "
                                     f"B={inputs.num_rows}, decode_only={inputs.decode_only}")
            return nnx.merge(graphdef, params).forward_step(caches, inputs)

        def forward_and_sample(params, caches, inputs, seeds, streams, counters, temperature, greedy_only):
            logits, caches = forward(params, caches, inputs)
            if greedy_only:
                tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            else:
                tokens = sampling.sample(logits, sampling.row_keys(seeds, streams, counters), temperature)
            return tokens, caches

        fn: Callable = forward_and_sample if sample else forward
        self._fn = jax.jit(fn, donate_argnums=(1,) if donate else (), static_argnums=(7,) if sample else ())

    def __call__(self, *args: Any) -> tuple[jax.Array, ModelCaches]:
        return self._fn(*args)


def make_step(graphdef: nnx.GraphDef, *, sample: bool = False, max_traces: int | None = None,
              donate: bool = True) -> ModelStep:
    """A new jitted step for one model graph (see :class:`ModelStep` for both call forms).

    ``donate``: the caches' buffers are donated (updated in place; do not reuse the old caches).
    ``max_traces``: a further trace raises ``AssertionError`` (so a test can prove that bucketed shapes do not
    recompile); counted per step object.
    """
    return ModelStep(graphdef, sample=sample, max_traces=max_traces, donate=donate)
