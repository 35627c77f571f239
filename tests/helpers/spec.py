"""Speculative-decoding test helpers: a drafter whose drafts are the true continuation, corrupted half of the time;
a task an MTP layer learns in a few optax steps."""

from __future__ import annotations

import numpy as np

from helpers.models import VOCAB


class OracleDrafter:
    """Proposes the expected continuation of a known prompt (``expect``: prompt tuple -> outputs), with the token at
    a random draft position replaced by another one half of the time (so acceptance runs 0..K)."""

    def __init__(self, prompts, expect, k: int, seed: int = 0) -> None:
        self.num_draft_tokens = k
        pairs = sorted(zip(prompts, expect), key=lambda pe: -len(pe[0]))  # the longest matching prompt first
        self.table = {tuple(p): list(e) for p, e in pairs}
        self.rng = np.random.default_rng(seed)
        self.proposed = 0

    def propose(self, tokens, max_drafts):
        tokens = list(np.asarray(tokens).tolist())
        for p, e in self.table.items():
            if tuple(tokens[: len(p)]) == p:
                done = len(tokens) - len(p)
                d = e[done: done + max_drafts]
                if d and self.rng.random() < 0.5:
                    j = int(self.rng.integers(len(d)))
                    d[j] = (d[j] + 1 + int(self.rng.integers(VOCAB - 1))) % VOCAB
                self.proposed += len(d)
                return np.asarray(d, np.int32)
        raise AssertionError(f"unknown prompt {tokens[:8]}")


class Successors:
    """Chains ``x_{i+1} = perm[x_i]`` from a random start, for a fixed permutation of the tokens ``1..VOCAB-1``: a
    task the tiny model and its MTP layer learn in a few optax steps (``sample`` as
    :meth:`kvjax.experiments.tasks.RetrievalTask.sample`: tokens, next tokens, loss mask, unused)."""

    def __init__(self, rng: np.random.Generator, length: int) -> None:
        self.perm = np.zeros(VOCAB, np.int32)
        self.perm[1:] = 1 + rng.permutation(VOCAB - 1)
        self.length = length

    def chains(self, starts: np.ndarray, length: int) -> np.ndarray:  # i32[n, length]
        x = np.zeros((starts.size, length), np.int32)
        x[:, 0] = starts
        for i in range(1, length):
            x[:, i] = self.perm[x[:, i - 1]]
        return x

    def sample(self, rng: np.random.Generator, n: int):
        x = self.chains(rng.integers(1, VOCAB, n), self.length + 1)
        return x[:, :-1], x[:, 1:], np.ones((n, self.length), bool), None


def successor_model(rng: np.random.Generator | int = 3, steps: int = 40):
    """The engine tests' hybrid tiny Qwen3.5 (GDN, then SWA attention: window 6, 2 sinks) trained on
    :class:`Successors` (``steps`` optax steps), with an MTP layer trained on the same task attached: a model whose
    MTP drafts are mostly, not always, accepted. ``rng``: the task's generator (or its seed; a caller drawing its
    prompts from it after the task gets the same draws every time). Returns ``(model, task)`` (``task``'s chains:
    prompts it continues; optax must be installed)."""
    from kvjax.experiments.mtp_train import train_mtp
    from kvjax.experiments.tasks import train
    from kvjax.models.qwen3_5 import mtp as mtp_lib
    from helpers.models import random_model, tiny_config

    task = Successors(np.random.default_rng(rng) if isinstance(rng, int) else rng, 12)
    model = random_model(tiny_config(window=(6, 0), sinks=(2, 0), layer_types=("linear_attention", "full_attention")),
                         seed=2)
    model, _ = train(model, task, steps=steps, lr=2e-2, warmup=min(10, steps // 2), seed=5)
    head, _ = train_mtp(model, task, steps=steps, lr=2e-2, warmup=min(10, steps // 2), on="all", seed=4)
    mtp_lib.attach(model, head)
    return model, task
