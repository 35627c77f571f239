"""An MTP head for a toy (the retrieval toy; the copy toy of :mod:`kvjax.experiments.spec_runs`): a short optax run
with the main model frozen, and its acceptance.

The MTP layer (:mod:`kvjax.models.qwen3_5.mtp`) at position ``t`` sees the main model's final-normed hidden
state ``h_t`` and the true next token ``x_{t+1}`` and predicts ``x_{t+2}`` (teacher-forced, as MTP layers are
trained). On :class:`~kvjax.experiments.tasks.RetrievalTask` the tokens two ahead that can be predicted are the
answers: at the position before a query the MTP layer reads the query token and must find the store token of
that key through its own attention over its K/V of the context. Loss: cross-entropy on those positions
(``on="answers"``, default) or on every position (``on="all"``), against the true tokens or the frozen model's
own greedy ones (``targets="greedy"``: self-distillation, what EAGLE / MTP drafters are trained on: the verifier
accepts the model's tokens, not the data's), over ``depth`` draft steps chained as the drafter runs them
(:func:`chained`: a later draft reads the MTP layer's own hidden state, not the main model's).
:func:`mtp_acceptance` measures how often the MTP layer's greedy token is the true token two ahead: the
acceptance a one-token draft would get from a verifier that produces the true sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import jax

    from kvjax.experiments.tasks import RetrievalTask
    from kvjax.models.qwen3_5 import Qwen3_5ForCausalLM
    from kvjax.models.qwen3_5.mtp import Qwen3_5MTP

TARGETS = ("answers", "all")
LABELS = ("data", "greedy")


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


def greedy_targets(model: Qwen3_5ForCausalLM, full: jax.Array) -> jax.Array:
    """i32[n, L-2]: the model's own greedy token after ``x_{t+1}`` for ``t = 0 .. L-3`` (``full``: its hidden
    states ``[n, L, H]``): what its verification accepts two ahead of ``h_t`` (the ``"greedy"`` labels)."""
    import jax.numpy as jnp

    return jnp.argmax(model.project_vocab(full[:, 1:-1]), axis=-1).astype(jnp.int32)


def chained(mtp: Qwen3_5MTP, model: Qwen3_5ForCausalLM, hidden: jax.Array, next_ids: jax.Array,
            depth: int) -> list[jax.Array]:
    """The MTP layer's hidden states of draft steps ``1..depth`` over whole sequences, as the drafter chains them
    (:func:`kvjax.models.qwen3_5.mtp.mtp_propose`): step 1 is :meth:`Qwen3_5MTP.dense` on ``(h_t, x_{t+1})``; step
    ``d > 1`` at position ``t`` reads step ``d-1``'s output at ``t-1`` and ``x_{t+1}`` and attends step 1's K/V at
    positions ``< t`` and its own at ``t`` (exact for step 2; later steps see step 1's keys where the drafter has
    the intermediate steps'). Every step's output at ``t`` predicts ``x_{t+2}``. ``hidden [B, T, H]`` (the main
    model's), ``next_ids i32[B, T]``; returns ``depth`` arrays ``[B, T, H]``."""
    import jax
    import jax.numpy as jnp

    lay = mtp.layers[0]
    att = lay.self_attn
    c = att.cfg
    t = hidden.shape[1]
    cos, sin = mtp._cos_sin(jnp.arange(t, dtype=jnp.int32))
    _, _, k1, v1 = att.project(lay.input_layernorm(mtp.combine(model, next_ids, hidden)), cos, sin)
    out = [mtp.dense(model, hidden, next_ids)]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    w, sk = jnp.asarray(c.window, jnp.int32)[:, None, None], jnp.asarray(c.sinks, jnp.int32)[:, None, None]
    before = (j < i)[None] & ((w == 0) | (i - j < w) | (j < sk))  # [Hkv, T, T]: step 1's keys, strictly before
    b, hkv, g = hidden.shape[0], c.num_kv_heads, c.num_q_heads // c.num_kv_heads
    for _ in range(depth - 1):
        prev = jnp.concatenate([hidden[:, :1], out[-1][:, :-1]], axis=1)  # step d-1's output one position back
        u = mtp.combine(model, next_ids, prev)
        q, gate, k, v = att.project(lay.input_layernorm(u), cos, sin)
        qg = q.reshape(b, t, hkv, g, c.head_dim).astype(jnp.float32)
        s = jnp.einsum("bihgd,bjhd->bhgij", qg, k1.astype(jnp.float32)) * c.head_dim ** -0.5
        s = jnp.where(before[None, :, None], s, -jnp.inf)
        own = jnp.einsum("bihgd,bihd->bhgi", qg, k.astype(jnp.float32))[..., None] * c.head_dim ** -0.5
        p = jax.nn.softmax(jnp.concatenate([s, own], axis=-1), axis=-1)  # [B, Hkv, G, T, T+1]
        o = (jnp.einsum("bhgij,bjhd->bihgd", p[..., :t], v1.astype(jnp.float32))
             + jnp.einsum("bhgi,bihd->bihgd", p[..., t], v.astype(jnp.float32)))
        o = o.reshape(b, t, c.num_q_heads, c.head_dim).astype(u.dtype)
        out.append(mtp.norm(lay.mlp_block(u + att.finish(o, gate))))
    return out


def train_mtp(model: Qwen3_5ForCausalLM, task: RetrievalTask, *, steps: int = 300, batch: int = 32,
              lr: float = 1e-2, warmup: int = 30, seed: int = 0, on: str = "answers",
              mtp: Qwen3_5MTP | None = None, targets: str = "data",
              depth: int = 1) -> tuple[Qwen3_5MTP, dict[str, np.ndarray]]:
    """Train MTP layers for ``model`` (frozen) on fresh batches of ``task``: AdamW, warmup-cosine, the loss of
    :func:`two_ahead`. ``mtp``: the layers to start from (default :func:`kvjax.models.qwen3_5.mtp.init` with
    ``seed``; not modified). ``targets``: ``"data"`` (the true ``x_{t+2}``) or ``"greedy"`` (self-distillation:
    the frozen model's own greedy token after ``x_{t+1}``, what the verifier will accept). ``depth``: the loss
    summed over draft steps ``1..depth`` chained as the drafter runs them (:func:`chained`), so later drafts are
    trained on the MTP layer's own hidden states. Returns ``(trained MTP layers, {"loss": f32[steps],
    "accuracy": f32[steps]})`` (accuracy: teacher-forced greedy hits of draft step 1 on the weighted positions of
    each training batch)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kvjax.experiments.tasks import optimizer
    from kvjax.models.qwen3_5.mtp import init

    two_ahead(task, np.zeros((1, 3), np.int32), np.zeros((1, 3), bool), on=on)  # validates `on` first
    if targets not in LABELS:
        raise ValueError(f"targets must be one of {LABELS}, got {targets!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1, got {depth!r}")
    optax, opt = optimizer("kvjax.experiments.mtp_train", steps=steps, batch=batch, lr=lr, warmup=warmup)
    main_def, main_params = nnx.split(model)
    graphdef, params = nnx.split(mtp if mtp is not None else init(model.config, seed=seed))
    opt_state = opt.init(params)

    def loss_fn(p, frozen, x, nxt, tgt, w):
        main = nnx.merge(main_def, frozen)
        full = jax.lax.stop_gradient(main.hidden_states(x))  # [n, L, H]
        hidden = full[:, :-2]  # h_t, t = 0 .. L-3
        if targets == "greedy":  # the frozen model's own token after x_{t+1}
            tgt = greedy_targets(main, full).astype(tgt.dtype)
        m = nnx.merge(graphdef, p)
        total, acc = 0.0, None
        for g in chained(m, main, hidden, nxt, depth):
            logits = m.logits(main, g)  # f32[n, L-2, vocab]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
            total = total + (ce * w).sum() / w.sum()
            if acc is None:
                acc = ((jnp.argmax(logits, axis=-1) == tgt) * w).sum() / w.sum()
        return total / depth, acc

    @jax.jit
    def update(p, s, frozen, x, nxt, tgt, w):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, frozen, x, nxt, tgt, w)
        upd, s = opt.update(grads, s, p)
        return optax.apply_updates(p, upd), s, loss, acc

    rng = np.random.default_rng(seed)
    hist = []  # read once at the end (no sync per step)
    for _ in range(steps):
        x, _, m, _ = task.sample(rng, batch)
        nxt, tgt, w = two_ahead(task, x, m, on=on)
        params, opt_state, loss, acc = update(params, opt_state, main_params, x, nxt, tgt, w)
        hist.append((loss, acc))
    losses, accs = np.asarray(jax.device_get(hist), np.float32).reshape(steps, 2).T
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
