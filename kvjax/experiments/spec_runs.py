"""Speculative decoding on a model that accepts drafts: a copy task, its trained toy, and engine runs side by side.

Task (:class:`CopyTask`). A sequence is ``BOS``, up to ``max_prefix`` random tokens (a context the answer ignores,
e.g. a system prompt shared by requests), then a random pattern of ``period`` distinct tokens repeated to ``length``
(``period`` uniform in ``[min_period, max_period]``); the loss is on every token after the pattern's first period,
which copies the token ``period`` back. A model that learns it (an induction head: find the current token one period
back, emit the one after it) answers by copying its prompt, so prompt-lookup (n-gram) drafts are what it would say:
their acceptance is the model's copy accuracy. The toy (:func:`copy_model`) is a Qwen3.5 with full rotary
embeddings, trained by :func:`kvjax.experiments.tasks.train` on attention layers only (the full-sequence forward
then differentiates on every device: the GDN ops' kernels have no gradient); :func:`with_idle_layers` appends a GDN
layer that changes no logit but runs in every serving step (its state kept, recorded per draft, rolled back).
:func:`train_copy` builds and trains it from a recipe. Teacher-forced accuracy is not what drafts meet: served,
the toy continues its own tokens, and after its first error it may leave the pattern, where no drafter follows it;
:func:`free_running` measures the greedy continuation against the prompt's period (:func:`greedy_generate`, no
cache). Periods up to 8 are learnt to near-perfect copying in a few thousand steps; periods to 16 stalled near
0.8 (the toy learns period-specific offsets before a general induction head).

Runs (:func:`spec_run`): one engine per (rows, speculation) serving ``requests`` copy prompts greedily; generated
tokens/s in steps that did not compile, and speculation's figures (acceptance per draft position, tokens per
verification step). :class:`NoisyDrafter` lowers the acceptance at will (each draft token replaced with a given
probability), to see where speculation stops paying.

MTP drafts (``speculative="mtp"``): :func:`copy_mtp` trains MTP layers for the toy (its attention layers frozen) with
:func:`kvjax.experiments.mtp_train.train_mtp` on the copied tokens: by default on the toy's own greedy tokens
(self-distillation) and with the second draft step chained on the layer's own hidden state, as the drafter runs it;
:func:`mtp_copy_accuracy` is their teacher-forced two-ahead accuracy per chained draft step (the acceptance per draft
position to expect); :func:`attach_mtp` gives them to the served model (the one with idle layers: its hidden states
are the trained model's).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kvjax.sched.drafter import FLAT_TOKENS

# the host phases of an engine step record (kvjax.engine.metrics.StepRecord) that spec_run sums
PHASES = ("t_schedule", "t_inputs", "t_dispatch", "t_wait", "t_update", "t_step", "t_exposed")
# the fields of each step record spec_run returns (``records``)
RECORD_FIELDS = ("step", "num_tokens", "num_seqs", "burst", "sub_steps", "generated", "verify_rows") + PHASES

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.engine.engine import Engine
    from kvjax.models.qwen3_5 import Qwen3_5ForCausalLM


@dataclasses.dataclass(frozen=True)
class CopyTask:
    """Token layout: 0 = ``BOS``, pattern tokens ``1..vocab-1`` (distinct within a period)."""

    vocab: int = 64
    length: int = 64  # tokens per training sequence
    min_period: int = 3
    max_period: int = 16
    max_prefix: int = 0  # random tokens before the pattern, 0..max_prefix

    def __post_init__(self) -> None:
        if not 1 <= self.min_period <= self.max_period < self.vocab:
            raise ValueError(f"need 1 <= min_period <= max_period < vocab, got {self}")
        if self.max_prefix < 0 or self.length < 2 * self.max_period + 2 + self.max_prefix:
            raise ValueError(f"length={self.length} must hold BOS, a prefix of {self.max_prefix} and two periods of "
                             f"{self.max_period}")

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``n`` sequences: tokens ``i32[n, length]``, next-token targets ``i32[n, length]``, loss mask
        ``bool[n, length]`` (where the next token copies one a period back) and the periods ``i64[n]``."""
        x = np.zeros((n, self.length), np.int32)
        mask = np.zeros((n, self.length), bool)
        periods = rng.integers(self.min_period, self.max_period + 1, n)
        starts = 1 + rng.integers(0, self.max_prefix + 1, n)
        for i, (p, s) in enumerate(zip(periods.tolist(), starts.tolist())):
            x[i, 1:s] = rng.integers(1, self.vocab, s - 1)
            x[i, s:] = np.resize(rng.permutation(self.vocab - 1)[:p] + 1, self.length - s)
            mask[i, s + p - 1: -1] = True
        return x, np.roll(x, -1, axis=1), mask, periods

    def prompts(self, rng: np.random.Generator, n: int, pattern_len: int, prefix: np.ndarray | None = None
                ) -> list[np.ndarray]:
        """``n`` prompts: ``BOS``, ``prefix`` (i32[P], shared by all; none by default), then ``pattern_len`` tokens of
        a pattern repeated at least twice; each ``i32[1 + P + pattern_len]``."""
        hi = min(self.max_period, pattern_len // 2)
        if hi < self.min_period:
            raise ValueError(f"pattern_len={pattern_len} holds no two periods of {self.min_period}")
        head = np.concatenate([[0], np.zeros(0) if prefix is None else np.asarray(prefix)]).astype(np.int32)
        return [np.concatenate([head, np.resize(rng.permutation(self.vocab - 1)[:p] + 1, pattern_len)]).astype(np.int32)
                for p in rng.integers(self.min_period, hi + 1, n).tolist()]


def copy_model(task: CopyTask, *, hidden: int = 64, layer_types: Sequence[str] = ("full_attention", "full_attention",
               "linear_attention"), heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               window: Sequence[int] = (), sinks: Sequence[int] = (), seed: int = 0, rope_theta: float = 10_000.0,
               rotary: float = 1.0, dtype: Any = None) -> Qwen3_5ForCausalLM:
    """A randomly initialised toy Qwen3.5 for ``task``: full rotary embeddings (the copy head finds the previous
    token by position), GDN layers of 2 key / 4 value heads of ``head_dim``, per-KV-head ``window`` / ``sinks``
    (SWA heads; empty: every head full)."""
    import jax.numpy as jnp

    from kvjax.config import AttentionConfig, GDNConfig
    from kvjax.models.qwen3_5 import Qwen3_5Config, init_random

    cfg = Qwen3_5Config(vocab_size=task.vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                        layer_types=tuple(layer_types),
                        attention=AttentionConfig(heads, kv_heads, head_dim, window=tuple(window), sinks=tuple(sinks)),
                        gdn=GDNConfig(2, 4, head_dim, head_dim, 4), rope_theta=rope_theta, partial_rotary_factor=rotary)
    return init_random(cfg, seed=seed, dtype=jnp.float32 if dtype is None else dtype)


def train_copy(task: CopyTask, model: dict, train: dict) -> tuple[Qwen3_5ForCausalLM, dict[str, np.ndarray] | None]:
    """The copy toy of a recipe: :func:`copy_model` of ``task`` with ``model``'s keyword arguments, trained by
    :func:`kvjax.experiments.tasks.train` with ``train``'s (``steps``, ``lr``, ``batch``, ``warmup``; ``steps=0``:
    untrained). Returns ``(model, training history or None)``."""
    from kvjax.experiments import tasks

    toy = copy_model(task, **model)
    kw = {"batch": 32, "warmup": min(30, train["steps"] // 2), **train}
    if not kw["steps"]:
        return toy, None
    return tasks.train(toy, task, **kw)


def with_idle_layers(model: Qwen3_5ForCausalLM, layer_types: Sequence[str] = ("linear_attention",),
                     seed: int = 1) -> Qwen3_5ForCausalLM:
    """``model`` with layers of ``layer_types`` appended that change nothing: random weights, except their output
    projections (the mixer's and the MLP's) are zero, so every logit is ``model``'s exactly while the serving step
    still runs them (a GDN layer keeps, records and rolls back its state). For training on an attention-only layout
    (whose full-sequence forward differentiates on every device) and serving a Qwen3.5-like hybrid."""
    import dataclasses as dc

    from flax import nnx

    from kvjax.models.common.checkpoint import assign_params
    from kvjax.models.qwen3_5 import init_random

    n = len(model.config.layer_types)
    cfg = dc.replace(model.config, layer_types=tuple(model.config.layer_types) + tuple(layer_types))
    dtype = model.lm_head.kernel.get_value().dtype
    out = init_random(cfg, seed=seed, dtype=dtype)
    trained = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    values = {}
    for p, v in nnx.to_flat_state(nnx.state(out, nnx.Param)):
        value = trained.get(p, np.asarray(v.get_value()))
        if p[:2] == ("model", "layers") and p[2] >= n and p[-2] in ("out_proj", "o_proj", "down_proj"):
            value = np.zeros_like(value)
        values[p] = value
    return assign_params(out, values)


def copy_accuracy(model: Qwen3_5ForCausalLM, task: CopyTask, rng: np.random.Generator, n: int = 64) -> float:
    """Teacher-forced accuracy of ``model`` on the copied tokens of ``n`` fresh sequences (no cache, jitted)."""
    import jax.numpy as jnp
    from flax import nnx

    x, t, m, _ = task.sample(rng, n)
    pred = np.asarray(nnx.jit(lambda main, x: jnp.argmax(main.logits(x), axis=-1))(model, jnp.asarray(x)))
    return float(((pred == t) & m).sum() / m.sum())


def prompt_period(prompt: np.ndarray, start: int = 1) -> int:
    """The smallest period of ``prompt[start:]`` (``i32[L]``; a pattern repeated at least twice: a period of at most
    half of it); ``ValueError`` where there is none."""
    body = np.asarray(prompt)[start:]
    for q in range(1, len(body) // 2 + 1):
        if (body[q:] == body[:-q]).all():
            return q
    raise ValueError(f"prompt[{start}:] repeats no pattern twice")


def greedy_generate(model: Qwen3_5ForCausalLM, prompts: Sequence[np.ndarray], max_new: int) -> np.ndarray:
    """i32[n, max_new]: each prompt (all of one length) continued greedily by ``model`` without a cache (the full
    sequence recomputed per token: the oracle of the engine's greedy decoding, in one jitted loop)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    x = np.stack([np.asarray(p, np.int32) for p in prompts])
    n, plen = x.shape
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(p, buf):
        m = nnx.merge(graphdef, p)

        def body(i, b):
            nxt = jnp.argmax(m.logits(b)[:, i - 1], axis=-1).astype(b.dtype)
            return b.at[:, i].set(nxt)

        return jax.lax.fori_loop(plen, plen + max_new, body, buf)

    buf = jnp.asarray(np.concatenate([x, np.zeros((n, max_new), np.int32)], axis=1))
    return np.asarray(run(params, buf))[:, plen:]


def free_running(model: Qwen3_5ForCausalLM, prompts: Sequence[np.ndarray], max_new: int, start: int = 1) -> dict:
    """How well ``model``'s free-running greedy continuation of copy prompts (:meth:`CopyTask.prompts`, one length,
    the pattern from ``start``) follows each prompt's period over ``max_new`` tokens: ``agreement`` (share of
    generated tokens equal to the periodic continuation at their position), ``perfect`` (share of sequences with no
    error), ``first_error`` (mean share of the tokens generated before the first error, 1 for a perfect one).
    Prompt lookup's drafts are accepted while the continuation stays periodic."""
    gen = greedy_generate(model, prompts, max_new)
    want = np.stack([np.resize(np.asarray(p)[start:][: prompt_period(p, start)],
                               len(p) - start + max_new)[len(p) - start:] for p in prompts])
    ok = gen == want
    first = np.where(ok.all(axis=1), max_new, np.argmin(ok, axis=1))
    return dict(agreement=float(ok.mean()), perfect=float(ok.all(axis=1).mean()),
                first_error=float(first.mean() / max_new))


class NoisyDrafter:
    """``drafter``'s drafts with each token replaced by another with probability ``rate`` (seeded): an acceptance
    knob. The proposal stays a point mass (what the engine's rejection sampling assumes)."""

    def __init__(self, drafter: Any, rate: float, vocab: int, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must lie in [0, 1], got {rate!r}")
        self.drafter, self.rate, self.vocab = drafter, float(rate), int(vocab)
        self.num_draft_tokens = drafter.num_draft_tokens
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens: np.ndarray, max_drafts: int) -> np.ndarray:
        d = np.asarray(self.drafter.propose(tokens, max_drafts), np.int32).copy()
        hit = self.rng.random(d.size) < self.rate
        d[hit] = (d[hit] + self.rng.integers(1, self.vocab, int(hit.sum()))) % self.vocab
        return d


def spec_engine(model: Qwen3_5ForCausalLM, prompts: Sequence[np.ndarray], max_new: int, *, rows: int,
                speculative: Any = None, cache: CacheConfig | None = None, recycle: str = "none",
                prefix_caching: bool = False, page_size: int = 16, max_num_batched_tokens: int | None = None,
                warmup: bool = True, one_shape: bool = False, **settings: Any) -> Engine:
    """The engine :func:`spec_run` times: ``rows`` rows, ``speculative`` (``Engine(speculative=)``; ``None``: plain
    decoding), ``recycle`` and ``prefix_caching``, on ``cache`` (default: pages of ``page_size`` for every row at
    once); with ``warmup``, ``prompts`` served once (``max_new`` tokens each: every step shape compiles; the prefix
    cache cleared after). ``one_shape``: every step padded to one token, row and block bucket, no decode path
    (fewest compiles: CPU runs). ``settings``: further :class:`~kvjax.engine.options.EngineOptions` fields."""
    from kvjax.config import CacheConfig
    from kvjax.engine.engine import Engine

    if cache is None:
        longest = max(len(p) for p in prompts) + max_new + 16  # + a verification row's drafts past the end
        blocks = -(-longest // page_size)
        heads = model.config.attention.num_kv_heads  # head-wise tables: a block of a row takes a page per KV head
        cache = CacheConfig(page_size=page_size, num_pages=rows * blocks * heads + 1, max_seqs=rows,
                            max_blocks_per_seq=blocks)
    budget = max_num_batched_tokens or max(256, rows * 8)
    shape = dict(token_buckets=(budget,), row_buckets=(cache.max_seqs,), block_buckets=(cache.max_blocks_per_seq,),
                 use_decode_path=False) if one_shape else {}
    eng = Engine(model, cache, recycle=recycle, max_num_batched_tokens=budget, speculative=speculative,
                 prefix_caching=prefix_caching, **shape, **settings)
    if warmup:
        eng.generate([np.asarray(p, np.int32) for p in prompts], max_new, progress=False)
        eng.clear_prefix_cache()
    return eng


def timed_pass(eng: Engine, prompts: Sequence[np.ndarray], max_new: int) -> tuple[float, list, list]:
    """One pass of ``prompts`` through ``eng`` (greedy, ``max_new`` tokens each; the prefix cache cleared after):
    ``(wall seconds, outputs, the pass's step records)``. ``AssertionError`` if the engine is not idle after it."""
    start = len(eng.metrics.records)
    t0 = time.perf_counter()
    outputs = eng.generate([np.asarray(p, np.int32) for p in prompts], max_new, progress=False)
    wall = time.perf_counter() - t0
    eng.clear_prefix_cache()
    if not eng.is_idle():
        raise AssertionError("engine not idle after generate(): slots or pages leaked")
    return wall, outputs, eng.metrics.records[start:]


def traced_pass(eng: Engine, prompts: Sequence[np.ndarray], max_new: int, trace_dir: str) -> dict:
    """One pass under ``jax.profiler`` tracing into ``trace_dir``: ``{wall_s, steps (sub-steps), engine_steps}``."""
    import jax

    with jax.profiler.trace(trace_dir):
        wall, _, recs = timed_pass(eng, prompts, max_new)
    return dict(wall_s=wall, steps=sum(sub_steps(r) for r in recs), engine_steps=len(recs))


def spec_run(model: Qwen3_5ForCausalLM, prompts: Sequence[np.ndarray], max_new: int, *, rows: int,
             flat_tokens: int = FLAT_TOKENS, repeats: int = 1, trace_dir: str | None = None, **kw: Any) -> dict:
    """Serve ``prompts`` greedily (``max_new`` tokens each) on :func:`spec_engine`'s engine (``rows`` and ``kw``:
    its arguments), ``repeats`` timed passes (each serving every prompt again); the figures
    (:func:`pass_figures`) are the median pass's by wall. ``trace_dir``: one more pass after the timed ones under
    ``jax.profiler`` tracing into that folder (:func:`traced_pass`; its figures in ``traced``)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    eng = spec_engine(model, prompts, max_new, rows=rows, **kw)
    passes = [timed_pass(eng, prompts, max_new) for _ in range(repeats)]
    traced = None if trace_dir is None else traced_pass(eng, prompts, max_new, trace_dir)
    return pass_figures(passes, rows, flat_tokens, traced)


def pass_figures(passes: Sequence[tuple[float, list, list]], rows: int, flat_tokens: int = FLAT_TOKENS,
                 traced: dict | None = None) -> dict:
    """The figures of the median of ``passes`` (:func:`timed_pass`'s) by wall: ``outputs`` (token lists), ``tok_s``
    (generated tokens / wall seconds of the pass), ``wall_s``, ``walls`` (every pass's, in order), ``steps`` (model
    sub-steps: a decode burst counts the sub-steps it ran), ``engine_steps`` (dispatches), ``phases`` (the host
    phases of :class:`~kvjax.engine.metrics.StepRecord`, ``t_schedule`` .. ``t_exposed``, summed over the pass's
    steps, seconds), ``records`` (each step record's :data:`RECORD_FIELDS`), ``tokens_per_step``,
    ``prompt_tokens_computed``, ``running_mean``, ``tok_per_cost`` (generated tokens per unit of the step-cost
    model ``max(T, flat_tokens)`` summed over the sub-steps, ``T`` the tokens each computed; one unit = one token
    of compute-bound work; :mod:`kvjax.sched.spec`), the speculative figures (``acceptance_rate``,
    ``acceptance_rate_per_position``, ``tokens_per_verify_row``, ``tokens_per_verify_step``, ``verify_steps``,
    ``drafts_proposed``, ``drafts_accepted``) and ``traced`` where given."""
    wall, outputs, recs = sorted(passes, key=lambda p: p[0])[len(passes) // 2]
    gen = sum(r.generated for r in recs)
    steps = sum(sub_steps(r) for r in recs)  # model sub-steps (a decode burst runs several in one engine step)
    cost = sum(sub_steps(r) * max((r.num_tokens if r.computed < 0 else r.computed) / sub_steps(r), flat_tokens)
               for r in recs)
    out = dict(outputs=outputs, rows=rows, tok_s=gen / wall, steps=steps, tokens_per_step=gen / max(steps, 1),
               prompt_tokens_computed=sum(r.prefill_tokens for r in recs), tok_per_cost=gen / max(cost, 1),
               running_mean=float(np.mean([r.running for r in recs])), wall_s=wall, engine_steps=len(recs),
               walls=[p[0] for p in passes],
               phases={k: float(sum(getattr(r, k) for r in recs)) for k in PHASES},
               records=[{k: getattr(r, k) for k in RECORD_FIELDS} for r in recs])
    if traced is not None:
        out["traced"] = traced
    verify = [r for r in recs if r.verify_rows]
    out.update(verify_steps=len(verify), drafts_proposed=sum(r.drafts_proposed for r in verify),
               drafts_accepted=sum(r.drafts_accepted for r in verify))
    if verify:
        width = max(len(r.drafts_proposed_at) for r in verify)
        at = np.zeros((2, width), np.int64)
        for r in verify:
            at[0, : len(r.drafts_proposed_at)] += r.drafts_proposed_at
            at[1, : len(r.drafts_accepted_at)] += r.drafts_accepted_at
        vrows = sum(r.verify_rows for r in verify)
        out.update(acceptance_rate=out["drafts_accepted"] / max(out["drafts_proposed"], 1),
                   acceptance_rate_per_position=[float(a / p) if p else float("nan") for p, a in zip(*at)],
                   tokens_per_verify_row=(vrows + out["drafts_accepted"]) / vrows,
                   tokens_per_verify_step=sum(r.generated for r in verify) / len(verify))
    return out


def sub_steps(record: Any) -> int:
    """The model sub-steps a step record ran (:attr:`kvjax.engine.metrics.StepRecord.ran`), at least 1."""
    return max(record.ran, 1)


def flat_tokens_from(rows: Sequence[int], sub_step_s: Sequence[float]) -> int | None:
    """The flat region of the speculation rule's step-cost model (``SpeculativeConfig(flat_tokens=)``,
    :mod:`kvjax.sched.spec`) measured for one model on one device: plain decoding's seconds per sub-step
    ``sub_step_s`` at each of ``rows`` (at least two distinct counts; a decode sub-step computes one token a row),
    fitted as ``a + b T`` by least squares. The flat region is ``a / b`` tokens, where a step costs twice its fixed
    part; ``None`` where the time does not grow with the tokens (``b <= 0``: flat over every measured count, so the
    default region stands). ``ValueError`` for fewer than two distinct row counts or mismatched lengths."""
    t = np.asarray(rows, np.float64)
    y = np.asarray(sub_step_s, np.float64)
    if t.shape != y.shape or t.ndim != 1 or np.unique(t).size < 2:
        raise ValueError(f"flat_tokens_from needs times at >= 2 distinct row counts, got rows={list(rows)} and "
                         f"{len(y)} times")
    b, a = np.polyfit(t, y, 1)
    if b <= 0 or a <= 0:
        return None
    return max(1, int(round(a / b)))


def copy_mtp(model: Qwen3_5ForCausalLM, task: CopyTask, *, steps: int, lr: float = 1e-2, batch: int = 32,
             seed: int = 0, targets: str = "greedy", depth: int = 2) -> tuple[Any, dict[str, np.ndarray] | None]:
    """MTP layers for the copy toy ``model`` (frozen; attention layers only, as :func:`copy_model` trains it):
    ``steps`` optax steps of :func:`kvjax.experiments.mtp_train.train_mtp` on the copied positions two ahead
    (``steps=0``: random layers). ``targets="greedy"``: self-distillation, the toy's own greedy tokens (what its
    verification accepts; ``"data"``: the true ones); ``depth``: draft steps chained in the loss (the second draft
    reads the MTP layer's own hidden state). Returns ``(layers, training history or None)``."""
    from kvjax.models.qwen3_5 import mtp as mtp_lib

    if not steps:
        return mtp_lib.init(model.config, seed=seed, dtype=model.model.embed_tokens[...].dtype), None
    from kvjax.experiments.mtp_train import train_mtp

    return train_mtp(model, task, steps=steps, batch=batch, lr=lr, warmup=min(30, steps // 2), seed=seed,
                     on="answers", targets=targets, depth=depth)


def mtp_copy_accuracy(model: Qwen3_5ForCausalLM, mtp: Any, task: CopyTask, rng: np.random.Generator,
                      n: int = 64, depth: int = 1, against: str = "data") -> float | list[float]:
    """Teacher-forced accuracy of the MTP layers ``mtp`` (no cache) on the copied tokens two ahead of ``n`` fresh
    sequences: position ``t`` reads ``h_t`` and the true ``x_{t+1}`` and predicts ``x_{t+2}``. ``depth > 1``: a list,
    the accuracy of each chained draft step ``1..depth`` (:func:`kvjax.experiments.mtp_train.chained`: step ``d``
    reads step ``d-1``'s hidden state, as the drafter does). ``against``: ``"data"`` (the true token) or
    ``"greedy"`` (the frozen model's own greedy token after ``x_{t+1}``: what its verification accepts)."""
    import jax.numpy as jnp
    from flax import nnx

    from kvjax.experiments.mtp_train import LABELS, chained, greedy_targets, two_ahead

    if against not in LABELS:
        raise ValueError(f"against must be one of {LABELS}, got {against!r}")
    x, _, m, _ = task.sample(rng, n)
    nxt, tgt, w = two_ahead(task, x, m)

    @functools.partial(nnx.jit, static_argnums=(4,))
    def predict(model, mtp, x, nxt, depth):  # one compiled call, not the forward's ops one by one
        full = model.hidden_states(x)
        steps = [jnp.argmax(mtp.logits(model, g), axis=-1) for g in chained(mtp, model, full[:, :-2], nxt, depth)]
        return steps, greedy_targets(model, full)

    steps, greedy = predict(model, mtp, jnp.asarray(x), jnp.asarray(nxt), depth)
    if against == "greedy":
        tgt = np.asarray(greedy)
    sel = w > 0
    out = [float((np.asarray(p)[sel] == tgt[sel]).mean()) for p in steps]
    return out if depth > 1 else out[0]


def attach_mtp(model: Qwen3_5ForCausalLM, mtp: Any) -> Qwen3_5ForCausalLM:
    """``model`` with ``mtp``'s parameters as its MTP layers (:func:`kvjax.models.qwen3_5.mtp.attach`), rebuilt for
    ``model``'s config (their caches come after its layers: a model with idle layers appended has more); returns
    ``model``."""
    from flax import nnx

    from kvjax.models.qwen3_5 import mtp as mtp_lib

    layers = mtp_lib.init(model.config, num_layers=mtp.num_layers, dtype=mtp.fc.kernel[...].dtype)
    nnx.update(layers, nnx.state(mtp))
    return mtp_lib.attach(model, layers)
