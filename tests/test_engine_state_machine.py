"""Stateful property test of the engine (hypothesis ``RuleBasedStateMachine``) on a tiny f32 Qwen3.5 with an
SWA head, a page pool small enough to preempt, and timely recycling.

Rules add requests, abort them, step, inject a fault at each point of a step (before the device call, inside
it after the caches were donated, after it, inside the scheduler update; an exception or a
``KeyboardInterrupt``), and run two concurrent consumers (two streams consumed alternately, or ``generate``
inside a ``stream`` loop) while the manually added requests keep running. After every rule the allocator and
queue invariants hold (``Engine.check_integrity``). At the end every request that was not aborted has exactly
the tokens of the same request run alone (greedy), every event had the right position / finished flag, and
the engine is idle. It runs with the overlapped engine (the default: faults then hit with a step in flight),
the synchronous one, the overlapped one with decode bursts of 4, and that one with prefix caching over a host tier
(evicted blocks spill to host memory); one engine per mode (one compile, two with bursts) serves every example.

Speculative decoding (``SpecEngineMachine``, and with prefix caching over a host tier): a rule switches the engine's
drafter between none, prompt lookup (n-gram) and an oracle drafter (the alone run's continuation, one token
corrupted half of the time, so rows accept every count 0..K), each with K in {1, 2, 4} drafts per row (the engine is
built for K = 4: the verification step compiles once and shorter drafts fit it), alone or paced by the rule that
shortens drafts where they do not pay (``PacedDrafter``). After every rule the pages a row
holds never pass what its tokens and one verification row need, and the acceptance counts are prefixes (a draft is
accepted only after every draft before it); the tokens must still equal the alone run's. ``MTPEngineMachine``: the
same with ``speculative="mtp"`` (the successor model of ``helpers.spec``, its trained MTP layer drafting inside every
step: drafts kept and rejected), verification bursts of 4 sub-steps where a burst applies (plain decode bursts where no
draft is taken) and prefix caching over a host tier; a burst's step record counts the positions every sub-step verified.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvjax.engine.engine import Engine
from kvjax.sched.drafter import NgramDrafter, PacedDrafter, SpeculativeConfig, StepDrafter
from kvjax.sched.spec import SpecStats
from helpers.engine import make_engine, step_events
from helpers.faults import POINTS, FaultAt, Injected
from helpers.models import VOCAB, qwen_swa_model
from helpers.spec import successor_model

ROWS, WIDTH = 32, 40  # oracle batch: fixed shape, one compile (prompts <= 30 tokens + 8 new <= 40)


class Shared:
    """What every example of the module reuses: the models, one engine per mode and the alone-run outputs."""

    def __init__(self) -> None:
        self.model = qwen_swa_model()
        self.trained = None  # the successor model with its trained MTP layer (helpers.spec), built on first use
        self.engines: dict[tuple[bool, int, int, int, bool], Engine] = {}
        self.alone: dict[bool, dict[tuple[tuple, int], list[int]]] = {False: {}, True: {}}  # by mtp
        self.logits = nnx.jit(lambda m, x: m.logits(x))

    def model_of(self, mtp: bool):
        """The random model, or (``mtp``) the successor model whose trained MTP layer drafts (mostly accepted)."""
        if not mtp:
            return self.model
        if self.trained is None:
            pytest.importorskip("optax")
            self.trained = successor_model()[0]
        return self.trained

    def engine(self, overlap: bool, burst: int = 1, host: int = 0, spec: int = 0, mtp: bool = False) -> Engine:
        """The engine of a mode; ``host > 0``: with prefix caching and a host tier of that many bytes; ``spec > 0``:
        speculative decoding with up to that many drafts per row; ``mtp``: the successor model drafted by its
        trained MTP layer (every step drafts on the device)."""
        key = (overlap, burst, host, spec, mtp)
        if key not in self.engines:
            tier = dict(prefix_caching=True, host_cache_bytes=host) if host else {}
            if spec:
                tier["speculative"] = SpeculativeConfig(method="mtp" if mtp else "ngram", num_draft_tokens=spec)
            self.engines[key] = make_engine(self.model_of(mtp), overlap=overlap, decode_burst=burst, **tier)
        return self.engines[key]


@pytest.fixture(scope="module")
def shared() -> Shared:
    return Shared()


def run_alone(shared: Shared, keys: list[tuple[tuple, int]], mtp: bool = False) -> dict:
    """``{(prompt, max_new): tokens}`` of greedy decoding by whole-sequence ``model.logits`` (no cache, no
    batching effects: causal, each row alone; ``mtp``: the successor model's), computed for the keys not known yet."""
    model, known = shared.model_of(mtp), shared.alone[mtp]
    todo = sorted({k for k in keys if k not in known})
    for i in range(0, len(todo), ROWS):
        chunk = todo[i: i + ROWS]
        ids = np.zeros((ROWS, WIDTH), np.int32)
        lens = [len(p) for p, _ in chunk]
        for r, (p, _) in enumerate(chunk):
            ids[r, : len(p)] = p
        out = [[] for _ in chunk]
        for _ in range(max(n for _, n in chunk)):
            logits = np.asarray(shared.logits(model, jnp.asarray(ids)))
            for r, (_, n) in enumerate(chunk):
                if len(out[r]) < n:
                    tok = int(np.argmax(logits[r, lens[r] - 1]))
                    out[r].append(tok)
                    ids[r, lens[r]] = tok
                    lens[r] += 1
        known.update(zip(chunk, out))
    return known


def arm(engine: Engine, point: str, exc: type[BaseException]):
    """Make ``point`` of the next step raise ``exc`` once; returns (undo, fired list)."""
    from kvjax.sched.request import Request

    fired: list = []

    def once():
        if not fired:
            fired.append(1)
            raise exc("injected fault")

    if point == "before device":
        runner = engine.runner
        real = runner.pack
        runner.pack = lambda *a, **k: (once(), real(*a, **k))[1]
        return (lambda: delattr(runner, "pack")), fired
    if point == "inside device":
        runner = engine.runner
        real_call = runner.step
        runner.step = lambda *a: (real_call(*a), once())[0]
        return (lambda: delattr(runner, "step")), fired
    if point == "after device":
        sched = engine.scheduler
        real_resolve = sched.resolve
        sched.resolve = lambda *a, **k: (once(), real_resolve(*a, **k))[1]
        return (lambda: delattr(sched, "resolve")), fired
    real_resolve = Request.resolve
    calls: list = []

    def resolve(self, token):
        out = real_resolve(self, token)
        calls.append(1)
        if len(calls) == 2:
            once()
        return out

    Request.resolve = resolve
    return (lambda: setattr(Request, "resolve", real_resolve)), fired


def step_events_traced(engine: Engine, fault: FaultAt) -> list:
    """One ``engine.step()`` under ``fault``'s tracer (the step only: what the caller does with the returned
    outputs is the caller's), its outputs as :class:`TokenEvent` s (``collect`` checks their positions)."""
    outs = fault.run(engine.step)
    return [ev for out in outs for ev in out.events()]


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30).map(tuple)
max_news = st.integers(1, 8)


class EngineMachine(RuleBasedStateMachine):
    OVERLAP = True
    BURST = 1
    HOST = 0  # bytes of a host tier under a prefix cache (0: no prefix caching)
    SPEC = 0  # K of speculative decoding (0: off)
    MTP = False  # the drafts come from MTP layers inside the step
    EXAMPLES = 25  # hypothesis examples of 25 rules each

    def __init__(self, shared: Shared):
        super().__init__()
        self.shared = shared
        self.engine = shared.engine(self.OVERLAP, self.BURST, self.HOST, self.SPEC, self.MTP)
        self.engine.clear_prefix_cache()  # every example starts from the same state (no-op without caching)
        assert self.engine.is_idle()
        self.reqs: dict[int, dict] = {}  # request id -> prompt, max_new, tokens, finished, aborted
        self.consumer_runs: list = []  # (prompt, max_new, tokens) of the concurrent consumers' requests

    # ---- helpers -----------------------------------------------------------------------------------------
    def collect(self, events) -> None:
        for ev in events:
            r = self.reqs[ev.request_id]
            assert not r["aborted"] and not r["finished"], ev
            assert ev.position == len(r["tokens"]), ev
            r["tokens"].append(ev.token)
            r["finished"] = ev.finished
            assert ev.finished == (len(r["tokens"]) == r["max_new"]), ev

    def live(self) -> list[int]:
        return sorted(rid for rid, r in self.reqs.items() if not r["aborted"] and not r["finished"])

    def will_run(self, keys: list[tuple[tuple, int]]) -> None:
        """Requests ``(prompt, max_new)`` about to be added (the speculative machine's oracle drafter needs them)."""

    # ---- rules -------------------------------------------------------------------------------------------
    @rule(prompt=prompts, max_new=max_news)
    def add(self, prompt, max_new):
        self.will_run([(prompt, max_new)])
        rid = self.engine.add_request(list(prompt), max_new, index=len(self.reqs))
        self.reqs[rid] = dict(prompt=prompt, max_new=max_new, tokens=[], finished=False, aborted=False)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.live()))
        try:
            got = self.engine.abort(rid)
        except ValueError:  # it finished in a step cut short by a fault; its last event comes with the next step
            assert any(ev.request_id == rid and ev.finished for ev in self.engine.outputs.held)
            return
        r = self.reqs[rid]
        assert got[: len(r["tokens"])] == r["tokens"]
        r["aborted"] = True

    @rule()
    def step(self):
        if self.engine.has_unfinished():
            self.collect(step_events(self.engine))

    @rule(point=st.sampled_from(POINTS), exc=st.sampled_from([Injected, KeyboardInterrupt]))
    def fault(self, point, exc):
        if not self.engine.has_unfinished():
            return
        undo, fired = arm(self.engine, point, exc)
        try:
            self.collect(step_events(self.engine))
        except exc as err:
            assert fired and "injected" in str(err)
        finally:
            undo()

    @rule(n=st.integers(1, 1200), exc=st.sampled_from([Injected, KeyboardInterrupt]))
    def fault_anywhere(self, n, exc):
        """A fault at the ``n``-th line or call event of kvjax's code in one step (none if the step is shorter)."""
        if not self.engine.has_unfinished():
            return
        fault = FaultAt(n, exc)
        try:
            self.collect(step_events_traced(self.engine, fault))
        except exc as err:
            assert "injected" in str(err)

    @rule(a=st.lists(prompts, min_size=1, max_size=3), b=st.lists(prompts, min_size=1, max_size=3),
          max_new=max_news, nested=st.booleans())
    def two_consumers(self, a, b, max_new, nested):
        eng = self.engine
        self.will_run([(p, max_new) for p in a + b])
        out_a, out_b = [[] for _ in a], [[] for _ in b]
        if nested:  # generate inside a stream loop
            for ev in eng.stream([list(p) for p in a], max_new):
                out_a[ev.index].append(ev.token)
                if ev.index == 0 and ev.position == 0:
                    out_b = eng.generate([list(p) for p in b], max_new)
        else:  # two streams consumed alternately
            live = {0: eng.stream([list(p) for p in a], max_new), 1: eng.stream([list(p) for p in b], max_new)}
            while live:
                for k in list(live):
                    ev = next(live[k], None)
                    if ev is None:
                        del live[k]
                    else:
                        (out_a, out_b)[k][ev.index].append(ev.token)
        for p, got in [*zip(a, out_a), *zip(b, out_b)]:
            assert len(got) == max_new
            self.consumer_runs.append((p, max_new, got))

    @invariant()
    def integrity(self):
        self.engine.check_integrity()

    def teardown(self):
        eng = self.engine
        while eng.has_unfinished():
            self.collect(step_events(eng))
        self.collect(step_events(eng) if eng.outputs.held else [])
        eng.clear_prefix_cache()  # cached pages count as used (no-op without caching)
        assert eng.is_idle() and not eng.outputs.held
        runs = [(r["prompt"], r["max_new"], r["tokens"]) for r in self.reqs.values() if not r["aborted"]]
        assert all(r["finished"] for r in self.reqs.values() if not r["aborted"])
        runs += self.consumer_runs
        alone = run_alone(self.shared, [(p, n) for p, n, _ in runs], self.MTP)
        for p, n, got in runs:
            assert got == alone[p, n], (p, n)


class SyncEngineMachine(EngineMachine):
    OVERLAP = False


class BurstEngineMachine(EngineMachine):
    BURST = 4  # decode bursts of up to 4 sub-steps (kvjax/engine/burst.py)


class HostTierEngineMachine(EngineMachine):
    BURST = 4
    HOST = 1 << 20  # prefix caching whose evictions spill to a host tier (kvjax/engine/host_tier.py)


class AloneDrafter:
    """Drafts the alone run's continuation of the request (``alone``: ``{(prompt, max_new): tokens}`` of this
    example's requests, read when drafting; the longest known prompt that starts the request's tokens), the token at a
    random draft position replaced half of the time; none for an unknown prompt."""

    def __init__(self, alone: dict, k: int, seed: int) -> None:
        self.num_draft_tokens, self.alone, self.rng = k, alone, np.random.default_rng(seed)

    def propose(self, tokens, max_drafts):
        tokens = tuple(np.asarray(tokens).tolist())
        # a longer run of the same prompt continues a shorter one (greedy): the longest prompt, then the longest run
        known = [(p, toks) for (p, _), toks in self.alone.items() if tokens[: len(p)] == p]
        if not known:
            return np.zeros(0, np.int32)
        p, toks = max(known, key=lambda pt: (len(pt[0]), len(pt[1])))
        done = len(tokens) - len(p)
        d = list(toks[done: done + min(max_drafts, self.num_draft_tokens)])
        if d and self.rng.random() < 0.5:
            j = int(self.rng.integers(len(d)))
            d[j] = (d[j] + 1 + int(self.rng.integers(VOCAB - 1))) % VOCAB
        return np.asarray(d, np.int32)


class SpecEngineMachine(EngineMachine):
    """Speculative decoding (synchronous whatever ``OVERLAP`` says; no bursts), the drafter switched by a rule."""

    SPEC = 4
    EXAMPLES = 15  # its examples compute the alone runs of their requests first

    def __init__(self, shared: Shared):
        super().__init__(shared)
        self.alone: dict = {}  # this example's requests' alone runs (another example's prompts would change drafts)
        self.engine.pipeline.drafter = AloneDrafter(self.alone, self.SPEC, seed=0)  # until a rule switches it
        # the engine is shared by the examples: each starts from no drafting history, so that a paced drafter's
        # choices (which read the counts) and the counts' checks depend on this example's steps only
        self.engine.scheduler.spec_stats = SpecStats()

    def will_run(self, keys):
        alone = run_alone(self.shared, keys, self.MTP)
        self.alone.update({key: alone[key] for key in keys})

    @rule(method=st.sampled_from(["off", "ngram", "alone"]), k=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99),
          flat=st.sampled_from([None, 1, 6]))
    def speculate(self, method, k, seed, flat):
        """Drafts from now on: none, prompt lookup, or the alone run's (corrupted half of the time); K = ``k``;
        ``flat``: paced by the rule with that flat region (drafts shortened or off step by step)."""
        drafter = {"off": None, "ngram": NgramDrafter(k), "alone": AloneDrafter(self.alone, k, seed)}[method]
        if drafter is not None and flat is not None:
            drafter = PacedDrafter(drafter, flat)
        self.engine.pipeline.drafter = drafter

    @invariant()
    def verification_bounds(self):
        """A row holds no page past its tokens and one verification row (with bursts: one verification burst's span
        from the computed token before its last); acceptance is by prefix."""
        sched = self.engine.scheduler
        span = self.BURST * (self.SPEC + 1) - 1 if self.BURST > 1 else 1 + self.SPEC
        for r in sched.running:
            need = sched.blocks.blocks_for(max(r.num_tokens, r.num_computed + span))
            assert sched.blocks.num_blocks[r.slot] <= need, (r, sched.blocks.num_blocks[r.slot], need)
        st_ = sched.spec_stats
        assert (st_.accepted_at <= st_.proposed_at).all() and (np.diff(st_.accepted_at) <= 0).all(), st_
        assert st_.accepted == st_.accepted_at.sum() <= st_.proposed == st_.proposed_at.sum(), st_


class SpecHostTierEngineMachine(SpecEngineMachine):
    HOST = 1 << 20


class MTPEngineMachine(SpecEngineMachine):
    """``speculative="mtp"`` with verification bursts of 4 and prefix caching over a host tier: the successor model's
    trained MTP layer drafts inside every step (mostly accepted, on these random prompts not always; its pools share
    the main pools' pages, so preemption, aborts, recycling, faults and the host tier move them too); a rule switches
    the host side between taking the step's drafts (K = ``k`` of the device's 4, paced or not: verification bursts,
    and plain decode bursts where the rule drafts nothing) and none (plain decode bursts)."""

    MTP = True
    BURST = 4
    HOST = 1 << 20
    EXAMPLES = 8

    def __init__(self, shared: Shared):
        super().__init__(shared)
        self.engine.pipeline.drafter = StepDrafter(self.SPEC)

    @rule(method=st.sampled_from(["off", "mtp"]), k=st.sampled_from([1, 2, 4]), flat=st.sampled_from([None, 1, 6]))
    def speculate(self, method, k, flat):
        drafter = None if method == "off" else StepDrafter(k)
        if drafter is not None and flat is not None:
            drafter = PacedDrafter(drafter, flat)
        self.engine.pipeline.drafter = drafter


@pytest.mark.parametrize("machine", [EngineMachine, SyncEngineMachine, BurstEngineMachine, HostTierEngineMachine,
                                     SpecEngineMachine, SpecHostTierEngineMachine, MTPEngineMachine],
                         ids=["overlap", "sync", "burst", "host-tier", "spec", "spec-host-tier", "spec-mtp"])
def test_engine_state_machine(machine, shared):
    # derandomized: the coverage checks below (preemptions, faults, full bursts) hold for every run, not most runs
    run_state_machine_as_test(lambda: machine(shared), settings=settings(
        max_examples=machine.EXAMPLES, stateful_step_count=25, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    eng = shared.engine(machine.OVERLAP, machine.BURST, machine.HOST, machine.SPEC, machine.MTP)
    # one bucket set, greedy only: a single compile for every example (and one for the burst or verification steps;
    # with MTP layers, the ordinary and verification steps also without them, where the rule drafts nothing, and with
    # bursts both verification bursts and plain decode bursts)
    traces = 1 if machine.BURST == 1 and not machine.SPEC else 2
    assert traces <= eng.num_traces <= traces + 2 * machine.MTP + 2 * (machine.MTP and machine.BURST > 1)
    if machine.SPEC:  # verification steps ran; rows accepted none, some and all K of their drafts
        assert not eng.overlap and eng.decode_burst == machine.BURST
        recs = [r for r in eng.metrics.records if r.verify_rows]
        assert sum(r.drafts_accepted for r in recs) < sum(r.drafts_proposed for r in recs)
        assert eng.scheduler.num_preemptions > 0 and eng.num_recoveries > 0
        assert sum(r.drafts_accepted_at[machine.SPEC - 1] for r in recs if len(r.drafts_accepted_at) == machine.SPEC)
        if machine.BURST > 1:  # verification bursts ran, rows several sub-steps each, with drafts kept and rejected
            bursts = [r for r in recs if r.burst > 1]
            assert 0 < sum(r.drafts_accepted for r in bursts) < sum(r.drafts_proposed for r in bursts)
            assert any(r.verify_rows > r.num_seqs for r in bursts)
            # their records count every sub-step: 1 + k positions for each row and sub-step it ran
            assert all(r.computed == r.row_steps + r.drafts_proposed >= r.generated for r in bursts if r.generated)
            assert any(r.burst > 1 and not r.verify_rows for r in eng.metrics.records)  # and plain decode bursts
        return
    assert max(r.burst for r in eng.metrics.records) == machine.BURST  # bursts ran, at their full length
    assert eng.scheduler.num_preemptions > 0 and eng.num_recoveries > 0
    if machine.HOST:  # evicted blocks went to the host (loads: tests/test_engine_host_tier.py)
        assert sum(r.host_bytes_out for r in eng.metrics.records) > 0
