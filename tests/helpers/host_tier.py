"""Host-tier test helper: random copy logs executed by a :class:`~kvjax.engine.host_tier.HostStore` against a numpy
replay of the same logs, on one device or on every data shard of a mesh."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from kvjax.engine.host_tier import HostStore
from kvjax.models.interface import ModelCaches
from kvjax.sched.host_tier import CopyOp


def op(kind: str, pd=(), ph=(), cd=(), ch=()) -> CopyOp:
    return CopyOp(kind, *(np.asarray(x, np.int64) for x in (pd, ph, cd, ch)))


def replay_logs(store: HostStore, caches: ModelCaches, rng: np.random.Generator, *, parts: int, pages: int,
                slots: int, page_at: Callable[[int, int], tuple], slot_at: Callable[[int, int], tuple],
                rounds: int = 12) -> ModelCaches:
    """``rounds`` steps of random logs (spills, loads, drops; a load may read a spill of the same log), one log per
    data shard of ``store``, executed by ``store`` and replayed in numpy on the global arrays; every array is
    compared after each step. Page ids are global over ``parts`` pools of ``pages`` (a load writes a page back
    into the pool it was spilled from); ``page_at(d, g)`` / ``slot_at(d, s)``: the numpy index of data shard
    ``d``'s page ``g`` in every paged role / of its GDN slot ``s`` in conv and ssm. Slot 0 is never used. Returns
    the caches after a last step that drops every host copy (the store must then hold nothing)."""
    shards = store.grid[0]
    host = {k: np.array(v) for k, v in caches.pages.items()}
    gdn = None if caches.gdn is None else {"conv": np.array(caches.gdn.conv), "ssm": np.array(caches.gdn.ssm)}
    held_p = [{} for _ in range(shards)]  # per shard: host id -> (pool, {role: page})
    held_c = [{} for _ in range(shards)]  # per shard: host id -> {conv, ssm: slot}
    next_id = [0] * shards

    def check(caches):
        for k in host:
            np.testing.assert_array_equal(np.asarray(caches.pages[k]), host[k], err_msg=k)
        if gdn is not None:
            for k in gdn:
                np.testing.assert_array_equal(np.asarray(getattr(caches.gdn, k)), gdn[k], err_msg=k)

    def spill(d):
        pd = rng.choice(parts * pages, int(rng.integers(1, min(8, parts * pages + 1))), replace=False)
        cd = rng.choice(np.arange(1, slots), int(rng.integers(0, 3)), replace=False) if gdn is not None else []
        ph = np.arange(next_id[d], next_id[d] + len(pd))
        ch = np.arange(next_id[d] + len(pd), next_id[d] + len(pd) + len(cd))
        next_id[d] += len(pd) + len(cd)
        for g, h in zip(pd, ph):
            held_p[d][h] = (g // pages, {k: v[page_at(d, g)].copy() for k, v in host.items()})
        for s, h in zip(cd, ch):
            held_c[d][h] = {k: v[slot_at(d, s)].copy() for k, v in gdn.items()}
        return op("out", pd, ph, cd, ch)

    def load(d):
        ph = rng.permutation(sorted(held_p[d]))[: int(rng.integers(0, min(len(held_p[d]), pages) + 1))]
        pools = np.array([held_p[d][h][0] for h in ph], np.int64)
        pd = np.zeros(len(ph), np.int64)
        for p in np.unique(pools):  # distinct pages of the pool each one was spilled from
            sel = pools == p
            pd[sel] = p * pages + rng.choice(pages, int(sel.sum()), replace=False)
        ch = rng.permutation(sorted(held_c[d]))[: int(rng.integers(0, len(held_c[d]) + 1))]
        cd = rng.choice(np.arange(1, slots), min(len(ch), slots - 1), replace=False) if len(ch) else []
        ch = ch[: len(cd)]
        for g, h in zip(pd, ph):
            for k, v in held_p[d].pop(h)[1].items():
                host[k][page_at(d, g)] = v
        for s, h in zip(cd, ch):
            for k, v in held_c[d].pop(h).items():
                gdn[k][slot_at(d, s)] = v
        return op("in", pd, ph, cd, ch)

    def drop(d):
        ph = rng.permutation(sorted(held_p[d]))[:2]
        for h in ph:
            del held_p[d][h]
        return op("drop", (), ph)

    for _ in range(rounds):
        logs = []
        for d in range(shards):
            ops = []
            for _ in range(int(rng.integers(1, 7))):
                kind = rng.choice(["out", "in", "drop"])
                if kind == "out":
                    ops.append(spill(d))
                elif kind == "in" and (held_p[d] or held_c[d]):
                    ops.append(load(d))
                elif kind == "drop" and held_p[d]:
                    ops.append(drop(d))
            logs.append(ops)
        caches = store.apply(caches, logs)
        check(caches)
    assert store.stats.pages_out > 0 and store.stats.pages_in > 0 and store.stats.bytes_in > 0
    caches = store.apply(caches, [[op("drop", (), sorted(held_p[d]), (), sorted(held_c[d]))] for d in range(shards)])
    assert not store.slabs and store.bytes_held == 0 and not store.live
    assert all(len(store.held(d)) == 0 for d in range(shards))
    return caches


def random_caches(caches: ModelCaches, rng: np.random.Generator) -> ModelCaches:
    """``caches`` (any placement) refilled with random values of their dtypes, placed as they were."""
    def fill(x):
        values = rng.standard_normal(x.shape).astype(np.float32).astype(x.dtype)
        return jax.device_put(values, x.sharding)
    return jax.tree.map(fill, caches)
