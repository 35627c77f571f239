"""Speculative-decoding test helpers: a drafter whose drafts are the true continuation, corrupted half of the time."""

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
