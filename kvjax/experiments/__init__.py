"""Reusable pieces of the notebooks in ``notebooks/``: sweeps, engine runs, the synthetic task, plots.

Modules, one concept each:

- ``size``: the notebooks' size parameter (``KVJAX_NB_SIZE=small|gpu``) and the presets it selects;
- ``sweeps``: capacity-simulator sweeps (SWA fraction, window, sinks, pool) and per-step traces;
- ``engine_runs``: the same comparison on a real (toy) model through :class:`kvjax.engine.engine.Engine`;
- ``prefix_runs``: prefix reuse at fixed memory (no recycling, recycling, prefix caching, both) on shared
  system prompt / multi-turn / few-shot workloads, through the real scheduler without a model and through the
  engine with the toy Qwen3.5;
- ``tasks``: a synthetic key-value retrieval task, a short optax training loop, accuracy under recycle
  policies, and a deliberately lossy policy (:class:`~kvjax.experiments.tasks.EvictEarly`);
- ``mtp_train``: an MTP head (:mod:`kvjax.models.qwen3_5.mtp`) trained on that task with the main model frozen,
  and its two-ahead acceptance;
- ``spec_runs``: speculative decoding on a model that accepts drafts: a copy task and its trained toy, engine runs
  priced with the step-cost model, a drafter whose acceptance is lowered at will;
- ``tour``: one small random case per public op, run under every implementation usable here; the benchmark list;
- ``plots``: matplotlib figures used by the notebooks.

Nothing here is imported by the library itself; ``matplotlib`` is needed only by ``plots``.
"""

from kvjax.experiments.size import Size, notebook_size

__all__ = ["Size", "notebook_size"]
