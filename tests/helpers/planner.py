"""A minimal host-side planner for the step tests, independent of ``kvjax.sched``: head-wise block tables, a
shared shuffled free list, shuffled rows and GDN slots, optional SWA recycling. ``test_step_qwen3_5`` drives one
model through it; ``test_sharding`` one per data shard."""

from __future__ import annotations

import numpy as np

from kvjax.inputs import StepInputs

PAGE = 4
NUM_PAGES = 48
MAX_SEQS = 6
MAX_BLOCKS = 12
ROWS = 4  # batch bucket (one row is padding at least part of the time)
T_BUCKETS = (8, 32)  # token buckets: decode-ish steps and prefill steps


class Planner:
    """Minimal host planner: head-wise tables, shared shuffled free list, optional SWA recycling; each plan's tokens
    are padded to the smallest of ``t_buckets`` that holds them."""

    def __init__(self, rng, hkv: int, window, sinks, t_buckets=T_BUCKETS):
        self.rng = rng
        self.t_buckets = tuple(t_buckets)
        self.hkv = hkv
        self.window, self.sinks = list(window) or [0] * hkv, list(sinks) or [0] * hkv
        self.free = list(rng.permutation(NUM_PAGES))
        self.tables: dict[int, np.ndarray] = {}
        self.slots = dict()
        self.free_slots = list(rng.permutation(np.arange(1, MAX_SEQS + 1)))
        self.done: dict[int, int] = {}  # tokens already computed
        self.recycled = 0
        self.reused = 0  # recycled pages handed out again (to any head / row)
        self.was_recycled: set[int] = set()
        self.signatures = set()  # (token bucket, decode_only) of every plan: one trace each

    def add(self, sid: int):
        self.tables[sid] = np.full((self.hkv, MAX_BLOCKS), -1, np.int32)
        self.slots[sid] = int(self.free_slots.pop())
        self.done[sid] = 0

    def finish(self, sid: int):
        for page in self.tables.pop(sid).ravel():
            if page >= 0:
                self.free.append(int(page))
        self.free_slots.append(self.slots.pop(sid))

    def plan(self, work: list[tuple[int, np.ndarray]]) -> tuple[StepInputs, list[tuple[int, int]]]:
        """work: [(sid, new token ids)] -> StepInputs (bucketed, rows shuffled; a decode step's live rows first, in
        shuffled order) and [(sid, logits position)]."""
        # a decode_only step: one token per row, every row continuing its state, live rows first (the contract)
        decode = all(len(t) == 1 and self.done[sid] > 0 for sid, t in work)
        rows = list(self.rng.permutation(len(work) if decode else ROWS))[: len(work)]
        total = sum(len(t) for _, t in work)
        t_pad = next(b for b in self.t_buckets if b >= total)
        tok = np.zeros(t_pad, np.int32)
        pos = np.zeros(t_pad, np.int32)
        smap = np.full((t_pad, self.hkv), -1, np.int32)
        cu = np.zeros(ROWS + 1, np.int32)
        seq_lens = np.zeros(ROWS, np.int32)
        slots = np.zeros(ROWS, np.int32)
        has_init = np.zeros(ROWS, bool)
        tables = np.full((ROWS, self.hkv, MAX_BLOCKS), -1, np.int32)
        logits_idx = np.zeros(ROWS, np.int32)
        expect = []
        row_of = {rows[i]: i for i in range(len(work))}
        t = 0
        for r in range(ROWS):
            cu[r] = t
            if r not in row_of:
                continue
            sid, new = work[row_of[r]]
            start, n = self.done[sid], len(new)
            table = self.tables[sid]
            for p in range(start, start + n):
                for h in range(self.hkv):
                    blk = p // PAGE
                    if table[h, blk] < 0:
                        table[h, blk] = self.free.pop()
                        self.reused += int(table[h, blk]) in self.was_recycled
                    smap[t + p - start, h] = table[h, blk] * PAGE + p % PAGE
            tok[t:t + n] = new
            pos[t:t + n] = np.arange(start, start + n)
            seq_lens[r], slots[r], has_init[r] = start + n, self.slots[sid], start > 0
            tables[r] = table
            logits_idx[r] = t + n - 1
            expect.append((r, sid, start + n - 1))
            t += n
        cu[ROWS] = t
        inputs = StepInputs.from_numpy(
            decode_only=decode, token_ids=tok, positions=pos, cu_seqlens=cu, seq_lens=seq_lens, gdn_slots=slots,
            has_initial_state=has_init, block_tables=tables, slot_mapping=smap, logits_indices=logits_idx,
        )
        inputs.validate(num_pages=NUM_PAGES, page_size=PAGE, max_slots=MAX_SEQS + 1)
        self.signatures.add((t_pad, inputs.decode_only))
        for sid, new in work:
            self.done[sid] += len(new)
        return inputs, expect

    def recycle(self):
        """Free SWA blocks no future query can see (outside window, no sink, not the block being written).

        Freed pages go to the end of the (otherwise shuffled) free list, so they are handed out next.
        """
        freed = []
        for sid, table in self.tables.items():
            n = self.done[sid]
            for h in range(self.hkv):
                w, s = self.window[h], self.sinks[h]
                if w == 0:
                    continue
                for blk in range(MAX_BLOCKS):
                    first, last = blk * PAGE, blk * PAGE + PAGE - 1
                    if table[h, blk] >= 0 and last <= n - w and first >= s and blk != (n - 1) // PAGE:
                        freed.append(int(table[h, blk]))
                        table[h, blk] = -1
                        self.recycled += 1
        self.was_recycled.update(freed)
        self.rng.shuffle(self.free)
        self.free.extend(self.rng.permutation(freed).tolist())
