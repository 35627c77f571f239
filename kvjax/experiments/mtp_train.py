"""An MTP head for the retrieval toy: a short optax run with the main model frozen, and its acceptance.

The MTP layer (:mod:`kvjax.models.qwen3_5.mtp`) at position ``t`` sees the main model's final-normed hidden
state ``h_t`` and the true next token ``x_{t+1}`` and predicts ``x_{t+2}`` (teacher-forced, as MTP layers are
trained). On :class:`~kvjax.experiments.tasks.RetrievalTask` the tokens two ahead that can be predicted are the
answers: at the position before a query the MTP layer reads the query token and must find the store token of
that key through its own attention over its K/V of the context. Loss: cross-entropy on those positions
(``on="answers"``, default) or on every position (``on="all"``). :func:`mtp_acceptance` measures how often the
MTP layer's greedy token is the true token two ahead: the acceptance a one-token draft would get from a
verifier that produces the true sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvjax.experiments.tasks import RetrievalTask
    from kvjax.models.qwen3_5 import Qwen3_5ForCausalLM
    from kvjax.models.qwen3_5.mtp import Qwen3_5MTP

TARGETS = ("answers", "all")


def two_ahead(task: RetrievalTask, x: np.ndarray, mask: np.ndarray, *, on: str = "answers"
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From a batch of :meth:`RetrievalTask.sample` (tokens ``i32[n, L]``, answer mask ``bool[n, L]``): the MTP
    inputs' next tokens ``i32[n, L-2]`` (``x_{t+1}``), targets ``i32[n, L-2]`` (``x_{t+2}``) and loss weights
    ``f32[n, L-2]`` for positions ``t = 0 .. L-3``: 1 where ``x_{t+2}`` is an answer (``on="answers"``) or
    everywhere (``on="all"``)."""
    if on not in TARGETS:
        raise ValueError(f"on must be one of {TARGETS}, got {on!r}")
    x = np.asarray(x)
    weights = mask[:, 1:-1] if on == "answers" else np.ones((x.shape[0], x.shape[1] - 2), bool)
    return x[:, 1:-1], x[:, 2:], weights.astype(np.float32)


def train_mtp(model: Qwen3_5ForCausalLM, task: RetrievalTask, *, steps: int = 300, batch: int = 32,
              lr: float = 1e-2, warmup: int = 30, seed: int = 0, on: str = "answers",
              mtp: Qwen3_5MTP | None = None) -> tuple[Qwen3_5MTP, dict[str, np.ndarray]]:
    """Train MTP layers for ``model`` (frozen) on fresh batches of ``task``: AdamW, warmup-cosine, the loss of
    :func:`two_ahead`. ``mtp``: the layers to start from (default :func:`kvjax.models.qwen3_5.mtp.init` with
    ``seed``; not modified). Returns ``(trained MTP layers, {"loss": f32[steps], "accuracy": f32[steps]})``
    (accuracy: teacher-forced greedy hits on the weighted positions of each training batch)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kvjax.experiments.tasks import optimizer
    from kvjax.models.qwen3_5.mtp import init

    optax, opt = optimizer("kvjax.experiments.mtp_train", steps=steps, batch=batch, lr=lr, warmup=warmup)
    two_ahead(task, np.zeros((1, 3), np.int32), np.zeros((1, 3), bool), on=on)  # validates `on` first
    main_def, main_params = nnx.split(model)
    graphdef, params = nnx.split(mtp if mtp is not None else init(model.config, seed=seed))
    opt_state = opt.init(params)

    def loss_fn(p, frozen, x, nxt, tgt, w):
        main = nnx.merge(main_def, frozen)
        hidden = jax.lax.stop_gradient(main.hidden_states(x))[:, :-2]  # [n, L-2, H]: h_t, t = 0 .. L-3
        m = nnx.merge(graphdef, p)
        logits = m.logits(main, m.dense(main, hidden, nxt))  # f32[n, L-2, vocab]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
        hit = jnp.argmax(logits, axis=-1) == tgt
        return (ce * w).sum() / w.sum(), (hit * w).sum() / w.sum()

    @jax.jit
    def update(p, s, frozen, x, nxt, tgt, w):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, frozen, x, nxt, tgt, w)
        upd, s = opt.update(grads, s, p)
        return optax.apply_updates(p, upd), s, loss, acc

    rng = np.random.default_rng(seed)
    losses, accs = np.zeros(steps, np.float32), np.zeros(steps, np.float32)
    for i in range(steps):
        x, _, m, _ = task.sample(rng, batch)
        nxt, tgt, w = two_ahead(task, x, m, on=on)
        params, opt_state, loss, acc = update(params, opt_state, main_params, x, nxt, tgt, w)
        losses[i], accs[i] = float(loss), float(acc)
    return nnx.merge(graphdef, params), {"loss": losses, "accuracy": accs}


def mtp_acceptance(model: Qwen3_5ForCausalLM, mtp: Qwen3_5MTP, task: RetrievalTask, *, n: int = 256,
                   seed: int = 1) -> dict[str, float]:
    """On ``n`` fresh sequences of ``task``: ``{"acceptance": float, "chance": float, "positions": int}``, the
    fraction of answer positions whose token the MTP layer predicts greedily from two back (``h_t`` and the true
    ``x_{t+1}``), against chance ``1 / num_values``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    x, _, m, _ = task.sample(np.random.default_rng(seed), n)
    nxt, tgt, w = two_ahead(task, x, m)

    @nnx.jit
    def predict(main, layers, x, nxt):
        hidden = main.hidden_states(x)[:, :-2]
        return jnp.argmax(layers.logits(main, layers.dense(main, hidden, nxt)), axis=-1)

    pred = np.asarray(jax.device_get(predict(model, mtp, jnp.asarray(x), jnp.asarray(nxt))))
    sel = w > 0
    return {"acceptance": float((pred[sel] == tgt[sel]).mean()), "chance": 1.0 / task.num_values,
            "positions": int(sel.sum())}
