"""The outputs router's stream queues (:class:`kvjax.engine.outputs.Outputs`): a queue of per-token events (``stream``)
and a queue of whole step outputs (``generate``) deliver, roll back and drop the same tokens."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvjax.engine.outputs import Outputs, StepOutput, TokenEvent, Tracked


def _router(chunks: bool, rng: np.random.Generator):
    out = Outputs()
    box = out.open_stream([7, 8], chunks)
    given = {rid: rng.integers(0, 1000, n).tolist() for rid, n in ((7, 5), (8, 4))}  # each request's output
    trs = {rid: Tracked(i, None, SimpleNamespace(output_ids=np.asarray(given[rid]))) for i, rid in enumerate((7, 8))}
    for rid, tr in trs.items():
        out.track(rid, tr)
    return out, box, given, trs


def _tokens(entries) -> list[tuple[int, int]]:
    """(request id, token) of every token in a queue's entries, in order."""
    return [(e.request_id, t) for e in entries for t in (e.tokens if type(e) is StepOutput else [e.token])]


@pytest.mark.parametrize("chunks", [False, True], ids=["events", "chunks"])
def test_queues_deliver_roll_back_and_drop_the_same_tokens(chunks):
    rng = np.random.default_rng(0)
    out, box, given, trs = _router(chunks, rng)
    # 7 gets 3 + 2 tokens, 8 gets 4, in two steps; the second step is rolled back, then delivered again
    out.begin()
    out.deliver(trs[7], 7, given[7][:3], False, [])
    out.deliver(trs[8], 8, given[8][:4], False, [])
    first = list(box)
    out.begin()
    out.deliver(trs[7], 7, given[7][3:5], False, [])
    out.rollback()
    assert list(box) == first and trs[7].sent == 3
    out.deliver(trs[7], 7, given[7][3:5], False, [])
    assert all(type(e) is (StepOutput if chunks else TokenEvent) for e in box)
    assert _tokens(box) == [(7, t) for t in given[7][:3]] + [(8, t) for t in given[8][:4]] + \
        [(7, t) for t in given[7][3:5]]
    box.popleft()  # a consumer took 7's first entry: one token (events) or its first three (chunks)
    taken = 3 if chunks else 1
    # dropping 7 returns its output minus what still waits in the queue
    assert out.drop(7) == given[7][:taken]
    assert _tokens(box) == [(8, t) for t in given[8][:4]]
