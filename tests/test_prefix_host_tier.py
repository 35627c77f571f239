"""The prefix cache's host tier (numpy side): spills on eviction, loads on a hit, the host budget's LRU, and a
stateful property test of the two tiers.

Shadows stand in for the data: every device page records which (token, position) each offset holds when a row
writes it, every checkpoint slot the chain key whose state it holds when a step saves it. The copy log is executed
on the shadows (``land``) where the engine executes it: after the scheduler's calls of a plan, before its step
reads or writes anything. A block is on the device, on the host or in flight (a logged copy not landed), never
two at once; a row only reads attached pages after landing, and then every page and the restored checkpoint hold
exactly the prompt's blocks (so a copy read before it landed, or a spill of a page already overwritten, fails).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings, strategies as st

from kvjax.config import AttentionConfig
from kvjax.sched.host_tier import HostTier
from kvjax.sched.prefix_cache import PrefixCacheConfig
from helpers.prefix import PrefixMachine, Rig

PAGE_BYTES, CKPT_BYTES = 10, 7


class TierRig(Rig):
    """:class:`Rig` with a host tier: copies land on the shadows between the cache's calls and the step."""

    def __init__(self, att, *, host_pages: float = 8, **kw):
        kw.setdefault("gdn", True)
        kw.setdefault("num_checkpoints", 2 if kw["gdn"] else 0)
        super().__init__(att, host_bytes=int(host_pages * PAGE_BYTES) + 2 * CKPT_BYTES, page_bytes=PAGE_BYTES,
                         ckpt_bytes=CKPT_BYTES if kw["gdn"] else 0, **kw)
        self.host: dict[int, np.ndarray] = {}  # host id -> page shadow
        self.host_ckpt: dict[int, int] = {}  # host id -> chain key of the state
        self.ckpt_state = [-1] * (self.cache_cfg.max_seqs + 1 + self.pc.config.num_checkpoints)  # chain keys
        self.landed = {"out": 0, "in": 0, "drop": 0}

    def land(self) -> None:
        for op in self.pc.take_copies():
            self.landed[op.kind] += op.num_pages + op.num_ckpts
            for d, h in zip(op.pages_dev.tolist(), op.pages_host.tolist()):
                if op.kind == "out":
                    assert h not in self.host
                    self.host[h] = self.shadow[d].copy()
                else:
                    self.shadow[d] = self.host.pop(h)
            for d, h in zip(op.ckpts_dev.tolist(), op.ckpts_host.tolist()):
                if op.kind == "out":
                    self.host_ckpt[h] = self.ckpt_state[d]
                else:
                    self.ckpt_state[d] = self.host_ckpt.pop(h)
            if op.kind == "drop":
                for h in op.pages_host.tolist():
                    del self.host[h]
                for h in op.ckpts_host.tolist():
                    del self.host_ckpt[h]

    def start(self, row: int, prompt: np.ndarray):
        self.pc.begin_plan()
        m = self.pc.match(prompt)
        ckpt = self.pc.attach(row, m, prompt)
        self.land()
        self.check_attached(row, prompt, m.num_tokens // self.ps)
        if self.pc.config.gdn and m.num_tokens:
            assert ckpt >= 0 and self.ckpt_state[ckpt] == m.keys[m.num_tokens // self.ps - 1]
        self.progress[row], self.prompts[row] = m.num_tokens, prompt
        return m

    def step(self, row: int, n: int) -> int:
        self.pc.begin_plan()
        done, prompt = self.progress[row], self.prompts[row]
        stop = self.pc.next_stop(row, done)
        n = min(n, len(prompt) - done, (stop - done) if stop else n)
        self.b.allocate(row, done + n)
        pos = np.arange(done, done + n)
        pages = self.b.tables[row, :, pos // self.ps]  # i32[n, H]: what the step writes
        assert (self.b.owner_row[pages] == row).all(), "a row writes a page it does not own alone"
        slot = self.pc.publish(row, done + n)  # may make them shared: the plan's own step writes them
        self.land()  # the step runs after its copies
        self.shadow[pages, (pos % self.ps)[:, None]] = (prompt[pos] * 10**6 + pos)[:, None]
        if slot >= 0:
            self.ckpt_state[slot] = self.pc.rows[row].parent
        self.progress[row] = done + n
        self.policy.recycle(self.b, np.array([row]), np.array([done + n]))  # the next plan's first call
        self.land()
        return n

    def check(self) -> None:
        super().check()
        assert not self.pc.host.log, "copies logged outside a plan"
        held = sorted(h for e in self.pc.entries.values() for h in e.host[e.host >= 0].tolist())
        assert held == sorted(self.host), "the host shadow and the cache disagree on what the host holds"
        assert sorted(e.hckpt for e in self.pc.entries.values() if e.hckpt >= 0) == sorted(self.host_ckpt)


def test_config_and_tier_errors():
    with pytest.raises(ValueError, match="page_bytes >= 1"):
        PrefixCacheConfig(num_checkpoints=1, host_bytes=100)
    with pytest.raises(ValueError, match="host_bytes must be an int >= 0"):
        PrefixCacheConfig(num_checkpoints=1, host_bytes=-1)
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostTier(0, 1, 1)


def test_evicted_blocks_spill_and_come_back_from_the_host(rng):
    """A prompt evicted from the device by another is served again from the host: loaded into fresh pages, its
    checkpoint into a device slot, the right data in every page; the host copies are consumed."""
    att = AttentionConfig(4, 2, 8, window=(6, 0), sinks=(2, 0))
    r = TierRig(att, pages=12, host_pages=16, num_checkpoints=1)
    a, b = rng.integers(1, 99, 17), rng.integers(1, 99, 17)
    r.run(1, a)
    r.finish(1)
    r.run(1, b)  # needs a's pages and its only checkpoint slot: both spill
    r.finish(1)
    assert r.landed["out"] > 0 and r.pc.host.pages_out > 0 and r.pc.host.ckpts_out == 1
    m = r.pc.match(a)
    assert m.num_tokens == 16 and (m.host >= 0).any() and m.checkpoint == -1 and m.ckpt_host >= 0
    before = r.pc.hit_tokens_host
    r.start(2, a)  # lands the loads, then checks every page and the restored checkpoint
    loaded = len(np.unique(np.nonzero(m.host >= 0)[1]))  # blocks with a head on the host
    assert loaded > 0 and r.pc.hit_tokens_host - before == 4 * loaded and r.landed["in"] > 0
    e = r.pc.entries[m.keys[-1]]
    assert e.hckpt == -1 and e.ckpt >= 0 and (e.host < 0).all()
    r.finish(2)
    r.check()


def test_host_budget_evicts_its_least_recently_used(rng):
    att = AttentionConfig(2, 1, 8)
    r = TierRig(att, pages=6, host_pages=4, gdn=False)
    prompts = [rng.integers(1, 99, 13) for _ in range(6)]
    for p in prompts:
        r.run(1, p)
        r.finish(1)
        r.check()
        assert r.pc.host.used_bytes <= r.pc.host.capacity_bytes
    assert r.pc.host.evictions > 0 and r.landed["drop"] > 0
    assert r.pc.match(prompts[0]).num_tokens == 0  # the oldest is gone from both tiers
    assert r.pc.match(prompts[-1]).num_tokens == 12


def test_without_a_host_tier_nothing_is_logged(rng):
    r = Rig(AttentionConfig(2, 1, 8), pages=10, gdn=True, num_checkpoints=1)
    for _ in range(3):
        r.run(1, rng.integers(1, 99, 13))
        r.finish(1)
    assert r.pc.host is None and r.pc.take_copies() == ()


class TwoTierMachine(PrefixMachine):
    """Random requests over a few shared prefixes on a small device pool and a small host budget."""

    PAGES, BASES = (8, 24), 4

    def make_rig(self, data, att, **kw) -> TierRig:
        return TierRig(att, host_pages=att.num_kv_heads * data.draw(st.integers(0, 20)), **kw)


TestTwoTierMachine = TwoTierMachine.TestCase
TestTwoTierMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


def test_simulator_models_the_tier(capsys):
    """At the same device memory the host tier serves turns the device cache lost (more hits, fewer prompt
    tokens computed); the command refuses host-tier flags without --prefix-caching."""
    import json

    from kvjax.__main__ import main

    argv = ["simulate", "--prefix-caching", "--workload", "multi-turn", "--requests", "32", "--scale", "0.05",
            "--max-seqs", "4", "--max-tokens", "256", "--page-size", "16", "--window", "64", "--memory-requests", "3",
            "--check-every", "5", "--host-cache-gb", "4", "--json", "-"]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    keep, tier = results[2], results[3]
    assert (keep["mode"], keep["host_bytes"], tier["mode"], tier["host_bytes"]) == ("keep_tail", 0, "keep_tail", 4e9)
    assert tier["cached_tokens"] > keep["cached_tokens"] and tier["computed_tokens"] < keep["computed_tokens"]
    assert tier["host_hit_tokens"] > 0 and tier["bytes_out"] > 0 and tier["bytes_in"] > 0
    assert keep["host_hit_tokens"] == keep["bytes_out"] == 0
    assert main(["simulate", "--host-cache-gb", "1"]) == 2
    assert "need --prefix-caching" in capsys.readouterr().err
    assert main(["simulate", "--prefix-caching", "--page-bytes", "10"]) == 2
    assert "need --host-cache-gb" in capsys.readouterr().err
