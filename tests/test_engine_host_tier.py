"""The prefix cache's host tier in the engine: the jitted copies against numpy, and the engine's tokens with a
host tier equal to those without (float32), with every engine feature on.

Oracles: a numpy replay of the copy log (for :class:`HostStore`), the engine without a host tier and uncached
greedy decoding (for the engine).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine.host_tier import HostStore
from kvjax.models.interface import ModelCaches
from kvjax.sched.host_tier import CopyOp
from kvjax.state.gdn_pool import GDNStatePool


def _op(kind, pd=(), ph=(), cd=(), ch=()):
    return CopyOp(kind, *(np.asarray(x, np.int64) for x in (pd, ph, cd, ch)))


def test_copies_match_a_numpy_replay(rng):
    """Random logs of spills, loads and drops (a load may read a spill of the same log) move exactly the named
    pages and checkpoint slots, in order; the host memory is released once every id is consumed or dropped."""
    P, S = 12, 6
    pages = {"key_caches_1": rng.standard_normal((P, 4, 3)).astype(np.float32),
             "value_caches_1": rng.standard_normal((P, 4, 3)).astype(np.float32)}
    conv, ssm = rng.standard_normal((2, S, 5, 3)).astype(np.float32), rng.standard_normal((2, S, 2, 2, 2)).astype(
        np.float32)
    caches = ModelCaches(pages={k: jnp.asarray(v) for k, v in pages.items()},
                         gdn=GDNStatePool(conv=jnp.asarray(conv), ssm=jnp.asarray(ssm)))
    store = HostStore()
    host_p, host_c, next_id = {}, {}, 0
    for _ in range(12):
        ops = []
        for _ in range(int(rng.integers(1, 4))):
            kind = rng.choice(["out", "in", "drop"])
            if kind == "out":
                pd = rng.choice(P, int(rng.integers(1, 5)), replace=False)
                cd = rng.choice(np.arange(1, S), int(rng.integers(0, 3)), replace=False)
                ph, ch = np.arange(next_id, next_id + len(pd)), np.arange(next_id + len(pd), next_id + len(pd) + len(cd))
                next_id += len(pd) + len(cd)
                for d, h in zip(pd, ph):
                    host_p[h] = {k: v[d].copy() for k, v in pages.items()}
                for d, h in zip(cd, ch):
                    host_c[h] = (conv[:, d].copy(), ssm[:, d].copy())
                ops.append(_op("out", pd, ph, cd, ch))
            elif kind == "in" and (host_p or host_c):
                ph = rng.permutation(sorted(host_p))[: int(rng.integers(0, len(host_p) + 1))]
                pd = rng.choice(P, len(ph), replace=False)
                ch = rng.permutation(sorted(host_c))[: int(rng.integers(0, len(host_c) + 1))]
                cd = rng.choice(np.arange(1, S), min(len(ch), S - 1), replace=False)
                ch = ch[: len(cd)]
                for d, h in zip(pd, ph):
                    for k in pages:
                        pages[k][d] = host_p[h][k]
                    del host_p[h]
                for d, h in zip(cd, ch):
                    conv[:, d], ssm[:, d] = host_c.pop(h)
                ops.append(_op("in", pd, ph, cd, ch))
            elif kind == "drop" and host_p:
                ph = rng.permutation(sorted(host_p))[:2]
                for h in ph:
                    del host_p[h]
                ops.append(_op("drop", (), ph))
        caches = store.apply(caches, ops)
        for k in pages:
            np.testing.assert_array_equal(np.asarray(caches.pages[k]), pages[k])
        np.testing.assert_array_equal(np.asarray(caches.gdn.conv), conv)
        np.testing.assert_array_equal(np.asarray(caches.gdn.ssm), ssm)
    assert store.stats.pages_out > 0 and store.stats.pages_in > 0 and store.stats.bytes_in > 0
    caches = store.apply(caches, [_op("drop", (), sorted(host_p), (), sorted(host_c))])
    assert not store.batches and store.bytes_held == 0 and not store.where
