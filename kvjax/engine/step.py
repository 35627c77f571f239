"""The jitted model step: ``step(params, caches, inputs) -> (logits, caches)`` with the caches donated.

A model is an NNX module with ``forward_step(caches, inputs: StepInputs) -> (f32[B, vocab], caches)`` (Qwen3.5
and DeepSeek both provide it). One call serves a mixed batch of prefill chunks and decode tokens. Shapes come
from the scheduler's buckets, so a run compiles once per distinct ``(T, B, max_blocks)`` bucket.

Typical use::

    graphdef, params = nnx.split(model)
    step = make_step(graphdef)               # jitted; caches (argument 1) donated
    logits, caches = step(params, caches, inputs)
"""

from __future__ import annotations

from typing import Any, Callable

import chex
import jax
from flax import nnx

from kvjax.engine.inputs import StepInputs


def _step_impl(graphdef: nnx.GraphDef, params: nnx.State, caches: Any, inputs: StepInputs):
    model = nnx.merge(graphdef, params)
    return model.forward_step(caches, inputs)


def make_step(graphdef: nnx.GraphDef, *, max_traces: int | None = None, donate: bool = True) -> Callable:
    """Jitted ``step(params, caches, inputs) -> (logits f32[B, vocab], caches)`` for one model graph.

    ``donate``: the caches' buffers are donated (updated in place; do not reuse the old caches).
    ``max_traces``: wrap in ``chex.assert_max_traces`` so a test can prove that bucketed shapes do not
    recompile (a further trace raises ``AssertionError``).
    """
    def fn(params, caches, inputs):
        return _step_impl(graphdef, params, caches, inputs)

    if max_traces is not None:
        fn = chex.assert_max_traces(fn, n=max_traces)
    return jax.jit(fn, donate_argnums=(1,) if donate else ())

