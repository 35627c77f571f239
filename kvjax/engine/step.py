"""The jitted model step of the tests and benchmarks (:func:`make_step`), and the trace counter every jitted step
of the engine uses (:class:`TraceCounter`).

A model is a :class:`kvjax.models.interface.CausalLM`: ``forward_step(caches, inputs: StepInputs) ->
(f32[B, vocab], caches)``. One call serves a mixed batch of prefill chunks and decode tokens. Shapes come from
the scheduler's buckets, so a run compiles once per distinct ``(T, B, max_blocks, decode_only)`` bucket. The
engine's own step (token feed, sampling, bursts, checkpoint copies, any mesh) is
:class:`kvjax.engine.runner.Runner`.

Typical use::

    graphdef, params = nnx.split(model)
    step = make_step(graphdef)               # jitted; caches (argument 1) donated
    logits, caches = step(params, caches, inputs)
    step.num_traces                          # compilations so far
"""

from __future__ import annotations

import contextlib

import jax
from flax import nnx

from kvjax.inputs import StepInputs
from kvjax.models.interface import ModelCaches


class TraceCounter:
    """How many times a jitted function was traced (= compiled); ``count`` runs inside the traced function, so
    a cached call never reaches it. ``max_traces``: a further trace raises ``AssertionError`` (a test's proof that
    bucketed shapes do not recompile)."""

    def __init__(self, what: str, max_traces: int | None = None) -> None:
        self.what, self.max_traces, self.num_traces = what, max_traces, 0
        self._paused = False

    @contextlib.contextmanager
    def paused(self):
        """Traces inside this block (a ``.lower()`` for inspection) are not counted."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def count(self, detail: str) -> None:
        if self._paused:
            return
        self.num_traces += 1
        if self.max_traces is not None and self.num_traces > self.max_traces:
            raise AssertionError(f"{self.what} traced {self.num_traces} times, more than max_traces="
                                 f"{self.max_traces} (an input shape outside the buckets?): {detail}")


class ModelStep:
    """``step(params, caches, inputs) -> (logits f32[B, vocab], caches)``, jitted, with its :class:`TraceCounter`
    (``num_traces``)."""

    def __init__(self, graphdef: nnx.GraphDef, *, max_traces: int | None = None, donate: bool = True) -> None:
        self.counter = TraceCounter("model step", max_traces)

        def forward(params: nnx.State, caches: ModelCaches, inputs: StepInputs):
            self.counter.count(f"T={inputs.num_tokens}, B={inputs.num_rows}, decode_only={inputs.decode_only}")
            return nnx.merge(graphdef, params).forward_step(caches, inputs)

        self._fn = jax.jit(forward, donate_argnums=(1,) if donate else ())

    @property
    def num_traces(self) -> int:
        return self.counter.num_traces

    def __call__(self, params: nnx.State, caches: ModelCaches, inputs: StepInputs) -> tuple[jax.Array, ModelCaches]:
        return self._fn(params, caches, inputs)


def make_step(graphdef: nnx.GraphDef, *, max_traces: int | None = None, donate: bool = True) -> ModelStep:
    """A new jitted step for one model graph (see :class:`ModelStep`).

    ``donate``: the caches' buffers are donated (updated in place; do not reuse the old caches).
    ``max_traces``: a further trace raises ``AssertionError``; counted per step object.
    """
    return ModelStep(graphdef, max_traces=max_traces, donate=donate)
