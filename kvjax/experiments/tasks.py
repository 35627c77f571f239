"""A synthetic long-range retrieval task, a short optax training loop, and accuracy under recycle policies.

Task (:class:`RetrievalTask`). A sequence of ``length`` tokens: ``BOS``, then noise tokens among which
``num_pairs`` *store* tokens sit at random positions, then ``num_queries`` (query, answer) pairs. A store token
encodes a key and a value (``store(k, v)``, keys distinct within a sequence); a query token names a key; the
answer is the value token stored under that key. The model is scored on the answers (teacher-forced in
training; greedy in evaluation, where the prompt ends at the first query and the engine generates one token).
Answering needs attention from the query back to its store token, whatever the distance: a head that no
longer holds that position's page cannot answer, so the task measures exactly what evicting pages costs.

Model. A toy Qwen3.5 whose attention layers mix head-wise SWA heads (``window``, ``sinks``) and full heads, as
trained. :func:`train` fits it with optax (AdamW, warmup-cosine) on freshly drawn batches through
``model.logits``. The toy is attention-only (no GDN layer: a GDN state would carry the answer past any window and
hide the cost of eviction); the engine serves it with an empty GDN state pool.

Policies. ``none`` and ``timely`` honour every head's window, so they must generate the same tokens (asserted
by :func:`policy_accuracies`). :class:`EvictEarly` is deliberately lossy: it frees blocks of the chosen heads
(default all, full heads included) once they are older than ``keep`` tokens, although queries still need them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvjax.sched.recycle import free_blocks_before

if TYPE_CHECKING:
    from kvjax.config import CacheConfig
    from kvjax.models.qwen3_5 import Qwen3_5ForCausalLM
    from kvjax.sched.blocks import BlockAllocator
    from kvjax.sched.recycle import RecyclePolicy


@dataclasses.dataclass(frozen=True)
class RetrievalTask:
    """Token layout: 0 = BOS, ``1..noise`` noise, then store tokens ``(k, v)``, query tokens ``k``, answers ``v``."""

    length: int = 48  # tokens per training sequence
    num_pairs: int = 4  # store tokens per sequence (distinct keys)
    num_queries: int = 4  # (query, answer) pairs at the end
    num_keys: int = 8
    num_values: int = 8
    noise: int = 16  # noise token ids 1..noise

    def __post_init__(self) -> None:
        if not 1 <= self.num_pairs <= self.num_keys:
            raise ValueError(f"num_pairs must be in 1..num_keys={self.num_keys}, got {self.num_pairs}")
        if self.num_queries < 1 or self.noise < 1 or self.num_values < 2:
            raise ValueError(f"need num_queries >= 1, noise >= 1, num_values >= 2; got {self}")
        if self.context < self.num_pairs:
            raise ValueError(f"length={self.length} leaves {self.context} context positions for "
                             f"{self.num_pairs} store tokens")

    @property
    def context(self) -> int:
        """Positions ``1..context`` hold noise and store tokens."""
        return self.length - 1 - 2 * self.num_queries

    @property
    def store0(self) -> int:
        return 1 + self.noise

    @property
    def query0(self) -> int:
        return self.store0 + self.num_keys * self.num_values

    @property
    def answer0(self) -> int:
        return self.query0 + self.num_keys

    @property
    def vocab_size(self) -> int:
        return self.answer0 + self.num_values

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``n`` sequences: tokens ``i32[n, length]``, next-token targets ``i32[n, length]``, loss mask
        ``bool[n, length]`` (True where the next token is an answer) and, per query, the distance from the query
        to its store token ``i64[n, num_queries]``."""
        c, p, q = self.context, self.num_pairs, self.num_queries
        x = rng.integers(1, 1 + self.noise, (n, self.length)).astype(np.int32)
        x[:, 0] = 0
        keys = np.argsort(rng.random((n, self.num_keys)), axis=1)[:, :p]
        vals = rng.integers(0, self.num_values, (n, p))
        pos = np.argsort(rng.random((n, c)), axis=1)[:, :p] + 1
        np.put_along_axis(x, pos, self.store0 + keys * self.num_values + vals, axis=1)
        pick = rng.integers(0, p, (n, q))
        qpos = c + 1 + 2 * np.arange(q)
        x[:, qpos] = self.query0 + np.take_along_axis(keys, pick, 1)
        x[:, qpos + 1] = self.answer0 + np.take_along_axis(vals, pick, 1)
        mask = np.zeros((n, self.length), bool)
        mask[:, qpos] = True
        targets = np.roll(x, -1, axis=1)
        distance = qpos[None, :] - np.take_along_axis(pos, pick, 1)
        return x, targets, mask, distance

    def eval_set(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` prompts ending at the first query (``i32[n, context + 2]``), the answer token ``i32[n]`` and the
        query-to-store distance ``i64[n]``."""
        x, targets, _, distance = self.sample(rng, n)
        end = self.context + 1
        return x[:, : end + 1].copy(), targets[:, end].copy(), distance[:, 0].copy()


def task_model(task: RetrievalTask, *, window: Sequence[int], sinks: Sequence[int], hidden: int = 64,
               num_layers: int = 1, head_dim: int = 16, q_per_kv: int = 2, seed: int = 0) -> Qwen3_5ForCausalLM:
    """An attention-only toy Qwen3.5 for ``task`` with per-KV-head ``window`` / ``sinks`` (0 = full head)."""
    from kvjax.config import AttentionConfig, GDNConfig
    from kvjax.models.qwen3_5 import Qwen3_5Config, init_random

    kv = len(window)
    att = AttentionConfig(q_per_kv * kv, kv, head_dim, window=tuple(window), sinks=tuple(sinks))
    cfg = Qwen3_5Config(vocab_size=task.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                        layer_types=("full_attention",) * num_layers, attention=att, gdn=GDNConfig(1, 1, 8, 8, 4),
                        rope_theta=10_000.0, partial_rotary_factor=0.5)
    return init_random(cfg, seed=seed)


def optimizer(who: str, *, steps: int, batch: int, lr: float, warmup: int):
    """``(optax, AdamW)`` with a warm-up cosine schedule to ``lr`` over ``steps`` (weight decay 0.01), the toy
    trainings' optimizer; ``who`` names the caller in the error when optax (optional) is missing. ``ValueError``
    for ``steps`` or ``batch`` below 1."""
    try:
        import optax
    except ImportError:
        raise ImportError(f"{who} needs optax, an optional dependency: "
                          "pip install 'kvjax[notebooks]' (or pip install optax)") from None
    if steps < 1 or batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got {steps}, {batch}")
    return optax, optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup, steps), steps),
                              weight_decay=0.01)


def train(model: Qwen3_5ForCausalLM, task: RetrievalTask, *, steps: int, batch: int = 32, lr: float = 1e-2,
          warmup: int = 30, seed: int = 0) -> tuple[Qwen3_5ForCausalLM, dict[str, np.ndarray]]:
    """Train ``model`` on fresh batches of ``task`` (AdamW, warmup-cosine, loss on answer tokens only).

    Returns ``(trained model, history)`` with ``history = {"loss": f32[steps], "accuracy": f32[steps]}``
    (teacher-forced answer accuracy of each training batch). ``model`` itself is not modified.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    optax, opt = optimizer("kvjax.experiments.tasks.train", steps=steps, batch=batch, lr=lr, warmup=warmup)
    graphdef, params = nnx.split(model)
    opt_state = opt.init(params)

    def loss_fn(p, x, t, m):
        logits = nnx.merge(graphdef, p).logits(x)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, t)
        hit = jnp.argmax(logits, axis=-1) == t
        return (ce * m).sum() / m.sum(), (hit * m).sum() / m.sum()

    @jax.jit
    def update(p, s, x, t, m):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, x, t, m)
        upd, s = opt.update(grads, s, p)
        return optax.apply_updates(p, upd), s, loss, acc

    rng = np.random.default_rng(seed)
    hist = []  # the device's figures, read once at the end (no sync per step: the host samples ahead)
    for _ in range(steps):
        x, t, m, _ = task.sample(rng, batch)
        params, opt_state, loss, acc = update(params, opt_state, x, t, m.astype(np.float32))
        hist.append((loss, acc))
    losses, accs = np.asarray(jax.device_get(hist), np.float32).reshape(steps, 2).T
    return nnx.merge(graphdef, params), {"loss": losses, "accuracy": accs}


def greedy_answers(model: Qwen3_5ForCausalLM, prompts: np.ndarray) -> np.ndarray:
    """i32[n]: argmax of the last position's logits of each prompt (``i32[n, L]``), no cache (the oracle)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda p, x: jnp.argmax(nnx.merge(graphdef, p).logits(x)[:, -1], axis=-1))
    return np.asarray(fn(params, jnp.asarray(prompts, jnp.int32)))


def with_layout(model: Qwen3_5ForCausalLM, *, window: Sequence[int], sinks: Sequence[int]) -> Qwen3_5ForCausalLM:
    """The same weights under another per-KV-head ``window`` / ``sinks`` layout (e.g. every head full)."""
    from flax import nnx

    from kvjax.models.common.checkpoint import assign_params
    from kvjax.models.qwen3_5 import init_random

    other = init_random(model.config.with_swa(tuple(window), tuple(sinks)))
    return assign_params(other, {p: np.asarray(v.get_value())
                                 for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))})


class EvictEarly:
    """Lossy recycle policy: free a block of each chosen head once it is entirely older than ``keep`` tokens
    (and holds no position ``< sinks``), whatever that head's window. With ``keep`` below a head's window (or on
    a full head) queries lose keys they would attend to."""

    frees_swa_blocks = True

    def __init__(self, keep: int, *, heads: Sequence[int] | None = None, sinks: int = 0) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")
        self.keep, self.heads, self.sinks = keep, None if heads is None else tuple(heads), sinks
        scope = "all heads" if heads is None else f"heads {list(heads)}"
        self.name = f"evict>{keep} ({scope})"

    def recycle(self, blocks: BlockAllocator, rows: np.ndarray, num_computed: np.ndarray) -> int:
        heads = np.arange(blocks.num_heads) if self.heads is None else np.asarray(self.heads, np.int64)
        if len(rows) == 0 or len(heads) == 0:
            return 0
        return free_blocks_before(blocks, rows, heads, num_computed, self.keep, self.sinks)


def engine_answers(model: Qwen3_5ForCausalLM, prompts: np.ndarray, *, cache: CacheConfig,
                   recycle: str | RecyclePolicy, max_num_batched_tokens: int = 16, pool: str = "shared") -> tuple[np.ndarray, dict]:
    """Greedy next token of every prompt through the engine (chunked prefill under ``recycle``): ``i32[n]`` and
    the metrics summary. Asserts the engine is idle afterwards."""
    from kvjax.experiments.engine_runs import single_bucket_engine

    eng = single_bucket_engine(model, cache, recycle=recycle, pool=pool, max_num_batched_tokens=max_num_batched_tokens)
    out = eng.generate([p for p in np.asarray(prompts)], 1, progress=False)
    if not eng.is_idle():
        raise AssertionError("engine not idle after generate(): slots or pages leaked")
    return np.array([o[0] for o in out], np.int32), eng.metrics.summary(num_pages=cache.num_pages)


def policy_accuracies(model: Qwen3_5ForCausalLM, prompts: np.ndarray, answers: np.ndarray, *, cache: CacheConfig,
                      policies: dict,
                      max_num_batched_tokens: int = 16) -> dict:
    """Accuracy of ``model`` on ``(prompts, answers)`` under each named recycle policy (``{name: policy}``,
    ``"none"`` required). Returns ``{name: {"pred": i32[n], "correct": bool[n], "accuracy": float,
    "summary": dict}}``. Raises ``AssertionError`` if ``"timely"`` generated a token different from ``"none"``."""
    if "none" not in policies:
        raise ValueError("policies must include 'none' (the reference)")
    out = {}
    for name, policy in policies.items():
        pred, summary = engine_answers(model, prompts, cache=cache, recycle=policy,
                                       max_num_batched_tokens=max_num_batched_tokens)
        correct = pred == np.asarray(answers)
        out[name] = {"pred": pred, "correct": correct, "accuracy": float(correct.mean()), "summary": summary}
    if "timely" in out and not np.array_equal(out["timely"]["pred"], out["none"]["pred"]):
        diff = np.flatnonzero(out["timely"]["pred"] != out["none"]["pred"])
        raise AssertionError(f"timely recycling changed {len(diff)} generated tokens (first prompts {diff[:8]})")
    return out


def accuracy_by_distance(correct: np.ndarray, distance: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """f64[len(edges) - 1]: accuracy of the examples whose distance lies in ``[edges[i], edges[i+1])`` (NaN where
    a bin is empty)."""
    correct, distance = np.asarray(correct, np.float64), np.asarray(distance)
    out = np.full(len(edges) - 1, np.nan)
    for i in range(len(edges) - 1):
        sel = (distance >= edges[i]) & (distance < edges[i + 1])
        if sel.any():
            out[i] = correct[sel].mean()
    return out
