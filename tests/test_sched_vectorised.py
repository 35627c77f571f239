"""The scheduler's vectorised host path: the per-slot row table, batch allocation and the recycle skip match the
one-request-at-a-time rules they replace, and an overlapped run with eos, aborts, preemption and a rollback keeps
every request's tokens where a per-position oracle puts them."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvjax.config import AttentionConfig, CacheConfig
from kvjax.sched import Scheduler, Status
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.recycle import recycle_out_of_window
from kvjax.sched.request import Request, RowTable

ATT = AttentionConfig.with_swa_fraction(8, 4, 8, swa_fraction=0.5, window=9, sinks=2)


def allocator(pool: str, shards: int = 1, num_pages: int = 4096) -> BlockAllocator:
    cache = CacheConfig(page_size=4, num_pages=num_pages, max_seqs=16, max_blocks_per_seq=64)
    return BlockAllocator(cache, ATT, pool, shards)


@pytest.mark.parametrize("pool,shards", [("shared", 1), ("partitioned", 1), ("shared", 2), ("partitioned", 2)])
def test_allocate_rows_gives_the_pages_of_row_by_row_allocation(rng, pool, shards):
    a, b = allocator(pool, shards), allocator(pool, shards)
    for _ in range(6):
        rows = rng.permutation(np.arange(1, 17))[: rng.integers(1, 17)]
        upto = a.num_blocks[rows] * 4 + rng.integers(0, 14, rows.size)
        assert a.allocate_rows(rows, upto)
        for r, n in zip(rows.tolist(), upto.tolist()):
            b.allocate(r, n)
        np.testing.assert_array_equal(a.tables, b.tables)
        np.testing.assert_array_equal(a.owner_row, b.owner_row)
        np.testing.assert_array_equal(a.owner_head, b.owner_head)
        np.testing.assert_array_equal(a.num_blocks, b.num_blocks)
        assert a._free == b._free
        a.check_integrity()


@pytest.mark.parametrize("pool,shards", [("shared", 1), ("partitioned", 2)])
def test_free_rows_frees_what_row_by_row_frees(rng, pool, shards):
    """``free_rows`` (a burst's finished rows at once) leaves the tables, owners and free lists of ``free_row``
    called row by row, also after recycling punched holes into the rows; a repeated row is refused unchanged."""
    a = allocator(pool, shards)
    rows = np.arange(1, 17)
    a.allocate_rows(rows, rng.integers(1, 60, 16))
    recycle_out_of_window(a, rows, a.num_blocks[rows] * 4)
    b = copy.deepcopy(a)
    done = rng.permutation(rows)[:9]
    assert a.free_rows(done.tolist()) == sum(b.free_row(int(r)) for r in done)
    for name in ("tables", "owner_row", "owner_head", "num_blocks", "recycled_upto", "recycle_due"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a._free == b._free
    a.check_integrity()
    before = a.tables.copy()
    with pytest.raises(ValueError, match="distinct"):
        a.free_rows([int(rows[0]), int(rows[0])])
    np.testing.assert_array_equal(a.tables, before)


def test_append_is_reserve_then_resolve(rng):
    """``RowTable.append`` (a verification's accepted tokens) leaves the table and returns the stop index of
    ``reserve_burst`` followed by ``resolve_burst`` of the same tokens, stop ids inside the runs included; a row with
    a reserved token is refused, nothing changed."""
    for _ in range(40):
        K, J = 6, int(rng.integers(1, 7))
        tables = [RowTable(8, width=16), RowTable(8, width=16)]
        prompts = [(rng.integers(0, 9, int(rng.integers(1, 20))), int(rng.integers(J, 30))) for _ in range(K)]
        for table in tables:
            for i, (p, n) in enumerate(prompts):
                table.bind(Request(i, p, n, eos_token_id=[3, 5]), i + 1)
        slots = rng.permutation(np.arange(1, K + 1))
        counts = rng.integers(1, J + 1, K)
        tokens = np.where(np.arange(J) < counts[:, None], rng.integers(0, 9, (K, J)), -1)  # stop ids 3, 5 in runs
        first = tables[0].append(slots, tokens)
        tables[1].reserve_burst(slots, np.arange(K), counts, 8, 7)
        want = tables[1].resolve_burst(slots, 7, np.arange(K), 8, tokens)
        np.testing.assert_array_equal(first, want)
        for name in ("tokens", "num_tokens", "num_pending"):
            np.testing.assert_array_equal(getattr(tables[0], name), getattr(tables[1], name), err_msg=name)
    tables[1].reserve(slots[:1], np.zeros(1, np.int64), 8)
    before = tables[1].tokens.copy()
    with pytest.raises(ValueError, match="reserved"):
        tables[1].append(slots, tokens)
    np.testing.assert_array_equal(tables[1].tokens, before)


def test_allocate_rows_declines_without_change_when_short_or_too_long():
    a = allocator("shared", num_pages=16)  # 16 pages = 4 blocks on 4 heads
    assert a.allocate_rows(np.array([1]), np.array([8]))  # 2 blocks * 4 heads: 8 pages left
    before = (a.tables.copy(), list(a._free[0]))
    assert not a.allocate_rows(np.array([2, 3]), np.array([8, 4]))  # 3 blocks * 4 heads = 12 pages > 8
    assert not a.allocate_rows(np.array([2]), np.array([4 * 65]))  # past max_blocks_per_seq
    np.testing.assert_array_equal(a.tables, before[0])
    assert a._free[0] == before[1] and a.num_blocks[2] == 0


def test_recycle_due_skips_only_rows_with_nothing_to_free(rng):
    a = allocator("shared")
    rows = np.arange(1, 17)
    L = rng.integers(0, 40, 16)
    a.allocate_rows(rows, L + 8)
    b = copy.deepcopy(a)
    for _ in range(40):
        recycle_out_of_window(a, rows, L)
        b.recycle_due[:] = 0  # b checks every row every step
        recycle_out_of_window(b, rows, L)
        np.testing.assert_array_equal(a.tables, b.tables)
        assert a._free == b._free
        L = L + rng.integers(0, 3, 16)
        a.allocate_rows(rows, L + 8)
        b.allocate_rows(rows, L + 8)
    assert a.recycled_upto[1:, a.swa_heads].sum() > 16  # blocks were recycled


def test_a_request_round_trips_through_its_row(rng):
    req = Request(3, rng.integers(1, 40, 5), 6, eos_token_id=7)
    req.append(11)
    req.reserve(4, 2)
    own = (req.token_ids.copy(), req.num_tokens, req.pending, req.output_ids.tolist())
    table = RowTable(max_seqs=4, width=4, max_pending=1)  # both widths grow on bind
    table.bind(req, 2)
    assert (req.slot, req.num_tokens, req.pending, req.output_ids.tolist()) == (2, own[1], own[2], own[3])
    np.testing.assert_array_equal(req.token_ids, own[0])
    req.num_computed = 6
    assert table.num_computed[2] == 6 and not req.resolve(12) and req.output_ids.tolist() == [11, 12]
    assert req.reserve(5, 0) is False and req.pending == [(5, 0)]
    table.check_integrity([req])
    table.unbind(req)
    assert table.request_id[2] == -1 and req._rows is None
    assert (req.num_tokens, req.num_computed, req.pending, req.output_ids.tolist()) == (8, 6, [(5, 0)], [11, 12])
    assert req.resolve(7) and req.output_ids.tolist() == [11, 12, 7] and req.num_tokens == 8


def oracle(rid: int, pos: np.ndarray) -> np.ndarray:
    """The token 'sampled' at position ``pos`` of request ``rid`` (eos = 3 about one time in 40)."""
    return (rid * 7919 + pos * 104729) % 40 + 1


@pytest.mark.parametrize("recycle,pool", [("none", "shared"), ("timely", "shared"), ("timely", "partitioned")])
def test_an_overlapped_run_puts_every_token_where_the_oracle_does(rng, recycle, pool):
    cache = CacheConfig(page_size=4, num_pages=96, max_seqs=6, max_blocks_per_seq=24)
    sched = Scheduler(cache, ATT, max_num_batched_tokens=16, pool=pool, recycle=recycle)
    reqs = [sched.add_request(rng.integers(1, 40, rng.integers(1, 30)), int(rng.integers(1, 40)), eos_token_id=3)
            for _ in range(24)]
    aborted, prev, steps, rolled_back = set(), None, 0, False
    while sched.has_unfinished() or sched.has_unresolved():
        plan = sched.schedule() if sched.has_unfinished() else None
        if plan is not None:
            sched.advance(plan)
        if prev is not None:
            sched.resolve(prev, oracle(np.array(prev.request_ids + (0,) * prev.seq_lens.size)[: prev.seq_lens.size],
                                       prev.seq_lens.astype(np.int64)))
        prev = plan
        sched.check_integrity()
        steps += 1
        if steps % 17 == 0 and sched.running:
            victim = sched.running[int(rng.integers(len(sched.running)))]
            aborted.add(victim.request_id)
            sched.abort(victim.request_id)
            sched.check_integrity()
        if steps == 40 and not rolled_back:
            sched.rollback()  # as after a fault: the plan in flight is lost, its requests recompute
            prev, rolled_back = None, True
            sched.check_integrity()
        assert steps < 5000
    assert sched.num_preemptions > 0 and rolled_back
    for req in reqs:
        if req.request_id not in aborted:
            assert_oracle_output(req)


def assert_oracle_output(req: Request) -> None:
    """``req`` finished with nothing reserved, its outputs the oracle's tokens up to the first eos (3)."""
    assert req.status is Status.FINISHED and not req.pending
    want = oracle(req.request_id, np.arange(req.prompt_len, req.prompt_len + req.max_new_tokens))
    end = int(np.argmax(want == 3)) + 1 if (want == 3).any() else want.size
    assert req.output_ids.tolist() == want[:end].tolist(), req


def burst_sampled(plan) -> np.ndarray:
    """The oracle's tokens of a plan, sub-step ``j`` of row ``b`` at ``j * B + b`` (position ``seq_lens[b] + j``)."""
    B = plan.seq_lens.size
    rids = np.array(plan.request_ids + (0,) * B)[:B]
    return np.concatenate([oracle(rids, plan.seq_lens.astype(np.int64) + j) for j in range(plan.burst)])


def per_sub_step(sched: Scheduler) -> Scheduler:
    """``sched`` made to reserve and resolve a burst one sub-step at a time (the loops the one-pass row-table
    methods replace)."""
    table = sched.rows

    def reserve_burst(slots, plan_rows, counts, stride, step):
        done = [table.reserve(slots, plan_rows, step)]
        for j in range(1, int(counts.max()) if counts.size else 0):
            keep = counts > j
            done.append(table.reserve(slots[keep], plan_rows[keep] + j * stride, step))
        return np.concatenate(done)

    table.reserve_burst = reserve_burst
    sched.ledger._resolve_burst = lambda plan, tokens: None
    return sched


@pytest.mark.parametrize("recycle", ["none", "timely"])
def test_an_overlapped_burst_run_matches_sub_step_by_sub_step_and_the_oracle(rng, recycle):
    """Decode bursts of 4 with eos inside bursts, requests ending inside a burst, aborts between a plan's advance
    and its resolve: the one-pass reserve / resolve gives the same plans (rows, slots, pages) and finishing order
    as the per-sub-step loops, and every request's tokens are the oracle's up to its eos."""
    cache = CacheConfig(page_size=4, num_pages=160, max_seqs=6, max_blocks_per_seq=24)
    scheds = [Scheduler(cache, ATT, max_num_batched_tokens=16, recycle=recycle) for _ in range(2)]
    per_sub_step(scheds[1])
    one_pass, eos_hits = scheds[0].rows.resolve_burst, []

    def resolve_burst(*args):
        first = one_pass(*args)
        eos_hits.append(first is not None and bool((first < args[-1].shape[1]).any()))
        return first

    scheds[0].rows.resolve_burst = resolve_burst
    prompts = [(rng.integers(1, 40, rng.integers(1, 30)), int(rng.integers(1, 60))) for _ in range(160)]
    reqs = [[s.add_request(p, n, eos_token_id=3) for p, n in prompts] for s in scheds]
    aborted, prev, steps, bursts = set(), [None, None], 0, 0
    while scheds[0].has_unfinished() or scheds[0].has_unresolved():
        plans = [s.schedule(4) if s.has_unfinished() else None for s in scheds]
        if plans[0] is not None:
            a, b = plans
            for f in ("token_ids", "gdn_slots", "block_tables", "seq_lens"):
                np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
            assert a.request_ids == b.request_ids and a.burst == b.burst
            bursts += a.burst > 1
            done = [s.advance(p) for s, p in zip(scheds, plans)]
            assert [r.request_id for r in done[0]] == [r.request_id for r in done[1]]
        if steps % 13 == 5 and scheds[0].running:  # abort between advance and resolve
            victim = scheds[0].running[int(rng.integers(len(scheds[0].running)))].request_id
            aborted.add(victim)
            for s in scheds:
                s.abort(victim)
        if prev[0] is not None:
            done = [s.resolve(p, burst_sampled(p)) for s, p in zip(scheds, prev)]
            assert [r.request_id for r in done[0]] == [r.request_id for r in done[1]]
        prev = plans
        for s in scheds:
            s.check_integrity()
        steps += 1
        assert steps < 5000
    assert bursts > 10 and sum(eos_hits) > 2 and aborted
    for got, ref in zip(*reqs):
        assert (got.status, got.output_ids.tolist()) == (ref.status, ref.output_ids.tolist())
        if got.request_id not in aborted:
            assert_oracle_output(got)
