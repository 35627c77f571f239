"""``StepInputs.validate`` (``Engine(debug=True)``): every plan the scheduler builds passes (SWA heads with
recycled holes, a latent single-head layout), and each kind of corruption of one is caught.

Plans come from a real :class:`~kvjax.sched.Scheduler` driven without a model (sampled tokens drawn at
random), with timely recycling and a pool small enough to preempt.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.engine.inputs import decode_only
from kvjax.errors import InvalidPlanError
from kvjax.inputs import StepInputs
from kvjax.sched.scheduler import Scheduler

VOCAB = 50
PS = 4
CACHE = CacheConfig(page_size=PS, num_pages=40, max_seqs=4, max_blocks_per_seq=16)
SWA = AttentionConfig(4, 2, 16, window=(6, 0), sinks=(2, 0))  # head 0: SWA, head 1: full
LATENT = AttentionConfig(1, 1, 40)  # DeepSeek: one latent head


def plans(attention: AttentionConfig, seed: int = 0, steps: int = 60):
    """Yield every plan of a random workload (chunked prefill, decodes, recycling, preemption)."""
    rng = np.random.default_rng(seed)
    sched = Scheduler(CACHE, attention, max_num_batched_tokens=16, recycle="timely")
    for _ in range(6):
        sched.add_request(rng.integers(0, VOCAB, int(rng.integers(3, 40))), int(rng.integers(4, 20)))
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        yield plan
        sched.update(plan, rng.integers(0, VOCAB, plan.seq_lens.shape[0]))


def check(plan_or_arrays, attention: AttentionConfig) -> None:
    arrays = plan_or_arrays if isinstance(plan_or_arrays, dict) else plan_or_arrays.device_arrays()
    StepInputs.from_numpy(**arrays).validate(num_pages=CACHE.num_pages, page_size=PS, max_slots=CACHE.max_seqs + 1,
                                             vocab_size=VOCAB, attention=attention)


@pytest.mark.parametrize("attention", [SWA, LATENT], ids=["swa", "latent"])
def test_every_scheduler_plan_passes(attention):
    swa_holes = 0
    for plan in plans(attention):
        check(plan, attention)
        swa_holes += int((plan.block_tables[: plan.num_seqs, 0] == -1).sum()) if attention is SWA else 0
    if attention is SWA:
        assert swa_holes > 0  # recycled SWA blocks are legitimate holes


def _pick(attention):
    """A plan with two live rows, the first with > 3 blocks of context, and padding tokens; its arrays (copies)."""
    for plan in plans(attention, seed=1):
        n = plan.num_seqs
        if n >= 2 and plan.seq_lens[0] > 3 * PS and plan.num_tokens < plan.token_ids.shape[0]:
            return plan, {k: np.array(v) for k, v in plan.device_arrays().items()}
    raise AssertionError("no suitable plan")


def _row_tokens(plan, r):
    return np.arange(plan.cu_seqlens[r], plan.cu_seqlens[r + 1])


def corrupt(kind: str, plan, a: dict) -> None:
    bt, sm = a["block_tables"], a["slot_mapping"]
    h_full = bt.shape[1] - 1
    if kind == "page shared by two rows":
        bt[1, h_full, 0] = bt[0, h_full, 0]
    elif kind == "hole in a full head":
        bt[0, h_full, 1] = -1
    elif kind == "hole in an SWA head's sinks":
        bt[0, 0, 0] = -1
    elif kind == "hole in an SWA head's window":
        last = -(-int(plan.seq_lens[0]) // PS) - 1
        bt[0, 0, last] = -1
    elif kind == "seq_len beyond table":
        a["seq_lens"][0] = bt.shape[2] * PS + 1
    elif kind == "slot mapping into another row's page":
        t = _row_tokens(plan, 0)[-1]
        other = bt[1, h_full][bt[1, h_full] >= 0][0]
        sm[t, h_full] = other * PS + sm[t, h_full] % PS
    elif kind == "slot mapping at another offset":
        t = _row_tokens(plan, 0)[-1]
        sm[t, h_full] = (sm[t, h_full] // PS) * PS + (sm[t, h_full] + 1) % PS
    elif kind == "padding token writes":
        sm[-1, h_full] = bt[0, h_full, 0] * PS
    elif kind == "positions off by one":
        a["positions"][_row_tokens(plan, 0)[-1]] += 1
    elif kind == "token id = vocab":
        a["token_ids"][_row_tokens(plan, 1)[0]] = VOCAB
    elif kind == "negative token id":
        a["token_ids"][0] = -1
    elif kind == "has_initial_state wrong":
        a["has_initial_state"][0] = not a["has_initial_state"][0]
    elif kind == "logits index in another row":
        a["logits_indices"][0] = _row_tokens(plan, 1)[0]
    else:
        raise AssertionError(kind)


KINDS = ["page shared by two rows", "hole in a full head", "hole in an SWA head's sinks",
         "hole in an SWA head's window", "seq_len beyond table", "slot mapping into another row's page",
         "slot mapping at another offset", "padding token writes", "positions off by one", "token id = vocab",
         "negative token id", "has_initial_state wrong", "logits index in another row"]
MATCH = {"page shared by two rows": "more than one", "hole in a full head": "full head 1",
         "hole in an SWA head's sinks": "SWA", "hole in an SWA head's window": "SWA",
         "seq_len beyond table": "table covers", "slot mapping into another row's page": "slot_mapping",
         "slot mapping at another offset": "slot_mapping", "padding token writes": "slot_mapping",
         "positions off by one": "positions", "token id = vocab": "vocab_size", "negative token id": "vocab_size",
         "has_initial_state wrong": "has_initial_state", "logits index in another row": "logits index"}


@pytest.mark.parametrize("kind", KINDS)
def test_each_corruption_is_caught(kind):
    plan, a = _pick(SWA)
    check(a, SWA)  # the plan itself is valid
    corrupt(kind, plan, a)
    with pytest.raises(InvalidPlanError, match=MATCH[kind]):
        check(a, SWA)


@pytest.mark.parametrize("kind", ["page shared by two rows", "hole in a full head",
                                  "slot mapping into another row's page", "positions off by one"])
def test_latent_layout_corruption_is_caught(kind):
    plan, a = _pick(LATENT)
    check(a, LATENT)
    corrupt(kind, plan, a)
    with pytest.raises(InvalidPlanError):
        check(a, LATENT)


def test_decode_only_needs_live_rows_first():
    """A ``decode_only`` step puts its live rows first (the GDN layers read row ``b``'s token at ``b`` when
    ``T == B``): a plan's decode step passes, the same rows with an empty row moved in front are refused."""
    rng = np.random.default_rng(3)
    sched = Scheduler(CACHE, SWA, max_num_batched_tokens=16, recycle="timely")
    for _ in range(3):
        sched.add_request(rng.integers(0, VOCAB, 5), 8)
    for _ in range(20):
        plan = sched.schedule()
        if plan.num_seqs == 3 and (plan.query_lens[:3] == 1).all():
            break
        sched.update(plan, rng.integers(0, VOCAB, plan.seq_lens.shape[0]))
    else:
        raise AssertionError("no decode plan")
    a = {k: np.array(v) for k, v in plan.device_arrays().items()}
    kw = dict(num_pages=CACHE.num_pages, page_size=PS, max_slots=CACHE.max_seqs + 1, vocab_size=VOCAB, attention=SWA)
    StepInputs.from_numpy(decode_only=True, **a).validate(**kw)
    order = [3, 0, 1, 2]  # the padding row first: row 1's token is token 0
    for name in ("seq_lens", "gdn_slots", "has_initial_state", "block_tables", "logits_indices"):
        a[name] = a[name][order]
    a["cu_seqlens"] = np.concatenate([[0], np.cumsum((a["gdn_slots"] > 0).astype(np.int32))]).astype(np.int32)
    with pytest.raises(InvalidPlanError, match="come after the live rows"):
        StepInputs.from_numpy(decode_only=True, **a).validate(**kw)


def test_decode_only_needs_every_live_row_to_continue():
    """A ``decode_only`` step has no fresh row (the decode kernels continue every live row's state): a plan whose
    one-token rows include a first step is not ``decode_only``, and forcing the flag is refused."""
    rng = np.random.default_rng(4)
    sched = Scheduler(CACHE, SWA, max_num_batched_tokens=16, recycle="timely")
    for _ in range(2):
        sched.add_request(rng.integers(0, VOCAB, 1), 4)  # one-token prompts
    plan = sched.schedule()
    assert (plan.query_lens[: plan.num_seqs] == 1).all() and not plan.has_initial_state[: plan.num_seqs].any()
    assert not decode_only([plan], True)
    a = {k: np.array(v) for k, v in plan.device_arrays().items()}
    kw = dict(num_pages=CACHE.num_pages, page_size=PS, max_slots=CACHE.max_seqs + 1, vocab_size=VOCAB, attention=SWA)
    StepInputs.from_numpy(decode_only=False, **a).validate(**kw)
    with pytest.raises(InvalidPlanError, match="no initial state"):
        StepInputs.from_numpy(decode_only=True, **a).validate(**kw)
    sched.update(plan, rng.integers(0, VOCAB, plan.seq_lens.shape[0]))
    assert decode_only([sched.schedule()], True)


def test_max_query_len_bounds_every_row_and_needs_continuing_rows():
    """``max_query_len = J`` (a verification burst's sub-step): every row at most ``J`` tokens, every live row
    continuing its state; a prompt's first chunk breaks both, a decode step passes."""
    rng = np.random.default_rng(5)
    sched = Scheduler(CACHE, SWA, max_num_batched_tokens=16, recycle="timely")
    for _ in range(2):
        sched.add_request(rng.integers(0, VOCAB, 5), 4)
    kw = dict(num_pages=CACHE.num_pages, page_size=PS, max_slots=CACHE.max_seqs + 1, vocab_size=VOCAB, attention=SWA)
    plan = sched.schedule()
    a = {k: np.array(v) for k, v in plan.device_arrays().items()}
    first = StepInputs.from_numpy(**a)
    first.validate(**kw)
    for J in (8, 2):  # fresh rows (J = 8 holds their 5 tokens), then rows longer than J as well
        with pytest.raises(InvalidPlanError, match=f"max_query_len={J}"):
            dataclasses.replace(first, max_query_len=J).validate(**kw)
    sched.update(plan, rng.integers(0, VOCAB, plan.seq_lens.shape[0]))
    a = {k: np.array(v) for k, v in sched.schedule().device_arrays().items()}
    dataclasses.replace(StepInputs.from_numpy(**a), max_query_len=2).validate(**kw)
