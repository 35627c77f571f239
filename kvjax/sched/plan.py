"""``StepPlan``: one step's fixed-shape host arrays, padded to static buckets, and the builder.

Buckets. ``T`` (tokens) is the smallest entry of ``token_buckets(max_num_batched_tokens)`` = powers of two from
16 below the budget, then the budget itself (budget 2048: 16, 32, …, 1024, 2048). ``B`` (rows) is the smallest
entry of ``seq_buckets(max_seqs)`` = powers of two from 8 below ``max_seqs``, then ``max_seqs``. The block
axis is the smallest entry of ``pow2_buckets(max_blocks_per_seq, 8)`` (powers of two from 8, then
``max_blocks_per_seq``) that covers every row's context. A long run therefore compiles
``len(T set) * len(B set) * len(block set)`` shapes at most.

Padding. Tokens past ``cu_seqlens[num_seqs]``: token id 0, position 0, slot mapping ``-1`` on every head.
Rows past ``num_seqs``: ``cu_seqlens`` length 0, ``seq_lens`` 0, GDN slot 0 (PAD), ``has_initial_state``
False, all-``-1`` block tables, ``logits_indices`` 0, ``sample_mask`` False.
Every array is built fresh from the requests scheduled this step, so a batch row never carries a previous
request's slot id or blocks.

Sampling. ``logits_indices[b]`` is the token (index into ``T``) whose logits row ``b`` returns: its last token
for a real row (always in ``[0, T)``, as :class:`kvjax.inputs.StepInputs` requires) and 0 for padding.
``sample_mask[b]`` is True iff that token is the last known token of the request (end of prefill or a decode),
i.e. the sampled token is appended; a mid-prefill chunk's logits are discarded.

Tokens not known yet. A token reserved by the previous step (sampled there, still on the device: the engine plans
step N+1 while step N runs) has ``token_ids`` 0 and ``prev_index`` = the index of that token among the previous
step's sampled tokens (its plan row ``b``; ``j * max_seqs + b`` for sub-step ``j`` of a burst); the jitted step takes it
from that step's sampled array before the model runs. Every other token has ``prev_index`` -1. Feeding a reserved
token of an older step is refused (``ValueError``): only the previous step's tokens reach the device step.

GDN checkpoints (prefix caching). ``ckpt_restore[b]``: the checkpoint slot the step copies into row ``b``'s GDN
slot before the model (a cache hit resumes from it); ``ckpt_save[b]``: the checkpoint slot it copies row ``b``'s
state into after the model (a cached prompt block completed here). ``-1`` = no copy (always, without caching);
both are ``i32[B]``, so they never add a compilation. ``prefix_hit_tokens`` (prompt tokens admitted from the cache)
and ``prefill_tokens`` (prompt positions computed this step) are counts for the metrics.

Decode bursts. A plan with ``burst_len`` (every real row one decode token) runs ``burst_len[b]`` model sub-steps
for row ``b`` in one device step: sub-step ``j`` feeds the token sub-step ``j - 1`` sampled, at the next
position, and samples the step's token ``j * max_seqs + b`` (``StepPlan.token_stride``). The arrays above describe sub-step 0; the device advances
them (:mod:`kvjax.engine.burst`). The blocks of every sub-step's position are allocated and the tables cover them.
A verification burst (``spec_span``, with ``draft_len``) is a verification plan of sub-step 0 whose tables cover
each row's ``spec_span`` positions ("Verification bursts" in :mod:`kvjax.sched.spec`).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from kvjax.inputs import DEVICE_FIELDS
from kvjax.sched.blocks import BlockAllocator
from kvjax.sched.request import RowTable

def pow2_buckets(limit: int, smallest: int) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``limit``, then ``limit``."""
    out, b = [], smallest
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out) + (limit,)


def token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    return pow2_buckets(max_num_batched_tokens, 16)


def seq_buckets(max_seqs: int) -> tuple[int, ...]:
    return pow2_buckets(max_seqs, 8)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= ``n``; raises ``ValueError`` if ``n`` exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step's inputs (numpy; :meth:`device_arrays` are its :class:`~kvjax.inputs.StepInputs` fields) plus host bookkeeping."""

    token_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    cu_seqlens: np.ndarray  # i32[B+1]
    seq_lens: np.ndarray  # i32[B]: context length including this step's tokens; 0 for padding rows
    gdn_slots: np.ndarray  # i32[B]: 1..max_seqs; 0 (PAD) for padding rows
    has_initial_state: np.ndarray  # bool[B]
    block_tables: np.ndarray  # i32[B, H_kv, max_blocks_bucket]; -1 holes
    slot_mapping: np.ndarray  # i32[T, H_kv]: page * page_size + offset; -1 skip
    logits_indices: np.ndarray  # i32[B]: in [0, T)
    sample_mask: np.ndarray  # bool[B]: row appends its sampled token
    query_lens: np.ndarray  # i32[B]: tokens of each row this step (0 for padding)
    prev_index: np.ndarray  # i32[T]: row of the previous step's sampled tokens that is this token; -1 = token_ids
    ckpt_restore: np.ndarray  # i32[B]: checkpoint slot copied into the row's GDN slot before the model; -1 none
    ckpt_save: np.ndarray  # i32[B]: checkpoint slot the row's GDN state is copied into after the model; -1 none
    prefix_hit_tokens: int  # prompt tokens of this step's admissions served from the prefix cache
    prefill_tokens: int  # tokens at prompt positions computed this step
    request_ids: tuple  # request id of rows 0..num_seqs-1
    num_tokens: int  # real tokens (<= T)
    num_seqs: int  # real rows (<= B)
    step: int  # scheduler step that produced this plan
    burst_len: np.ndarray | None = None  # i32[B]: a decode burst's sub-steps of each row (0 padding); None: 1 step
    stride: int = 0  # a burst's sub-step stride in the sampled tokens (``max_seqs``); 0: ``B``
    draft_len: np.ndarray | None = None  # i32[B]: a verification step's drafts of each row (its last tokens); None
    spec_span: np.ndarray | None = None  # i32[B]: a verification burst's positions allocated to each row from its
    # first (0 padding); None: not one (see "Verification bursts" in kvjax.sched.spec)
    spec_k: int = 0  # the drafts per row the step-cost rule chose at this plan (0: none; kvjax.sched.spec)
    spec_steps: int = 0  # a verification burst's sub-steps (its result: i32[spec_steps * B * (K + 2)]); 0: not one

    @property
    def token_stride(self) -> int:
        """Sub-step ``j`` of row ``b`` samples the step's token ``j * token_stride + b``: ``max_seqs`` for a burst
        (independent of the row bucket, so data shards padded to one bucket keep their numbering), ``B``
        otherwise (only ``j = 0`` exists)."""
        return self.stride or self.seq_lens.shape[0]

    @property
    def burst(self) -> int:
        """Sub-steps of the plan (1, or a decode burst's longest row): sub-step ``j`` of row ``b`` samples the
        step's token ``j * token_stride + b``."""
        return 1 if self.burst_len is None else max(int(self.burst_len.max()), 1)

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The fields of the plan's :class:`~kvjax.inputs.StepInputs` (``StepInputs.from_numpy`` takes them)."""
        return {name: getattr(self, name) for name in DEVICE_FIELDS}


def build_plan(step: int, slots: np.ndarray, n: np.ndarray, rows: RowTable, blocks: BlockAllocator,
               t_buckets: tuple[int, ...], b_buckets: tuple[int, ...], blk_buckets: tuple[int, ...], *,
               restore: dict[int, int] | None = None, save: dict[int, int] | None = None,
               prefix_hit_tokens: int = 0, burst: np.ndarray | None = None, stride: int = 0,
               drafts: np.ndarray | None = None, spec_span: np.ndarray | None = None, spec_k: int = 0,
               spec_steps: int = 0) -> StepPlan:
    """Lay out the requests bound to rows ``slots`` (``i64[nseq]``, in plan-row order) with ``n[b]`` tokens
    each this step (``i64[nseq]``; blocks already allocated) as a padded plan, reading their state from
    ``rows``. ``restore`` / ``save``: {request id: checkpoint slot} (see the module docstring). ``burst``
    (``i64[nseq]``, rows of one token each): a decode burst, row ``b`` running ``burst[b]`` sub-steps (its blocks
    allocated for them; the tables cover them; ``stride``: its sampled-token stride, ``max_seqs``). ``drafts``
    (``i64[nseq]``, speculative decoding): row ``b``'s last ``drafts[b]`` tokens are draft tokens written in its
    row of ``rows.tokens`` past ``num_tokens`` (counted in ``n``); the row samples when it computes through them
    and the plan's ``draft_len`` says how many (see "Verification" in :mod:`kvjax.sched.spec`). ``spec_span``
    (``i64[nseq]``, with ``drafts``): a verification burst, row ``b``'s blocks allocated for ``spec_span[b]``
    positions from its first this step (the tables cover them) in ``spec_steps`` sub-steps. ``spec_k``: the rule's
    draft length. Raises
    ``ValueError`` if a row would feed a reserved token of a step older than the previous one."""
    nseq = len(slots)
    start = rows.num_computed[slots]  # i64[nseq]: first position computed this step
    num_tokens = rows.num_tokens[slots]  # i64[nseq]
    num_resolved = num_tokens - rows.num_pending[slots]  # i64[nseq]: positions >= this are reserved tokens
    ntok = int(n.sum())
    T, B = bucket(max(ntok, 1), t_buckets), bucket(max(nseq, 1), b_buckets)
    ps = blocks.page_size

    cu = np.zeros(B + 1, np.int32)
    cu[1: nseq + 1] = np.cumsum(n)
    cu[nseq + 1:] = ntok
    seq_lens = np.zeros(B, np.int32)
    seq_lens[:nseq] = start + n
    query_lens = np.zeros(B, np.int32)
    query_lens[:nseq] = n
    gdn_slots = np.zeros(B, np.int32)
    gdn_slots[:nseq] = slots
    has_init = np.zeros(B, bool)
    has_init[:nseq] = start > 0

    if ntok == nseq and (n == 1).all():  # one token per row (decodes)
        tok_row, pos = np.arange(nseq), start
    else:
        tok_row = np.repeat(np.arange(nseq), n)  # i64[ntok]: plan row of each token
        pos = np.arange(ntok, dtype=np.int64) - np.repeat(cu[:nseq].astype(np.int64) - start, n)  # i64[ntok]
    tok_slot = slots[tok_row]  # i64[ntok]
    token_ids = np.zeros(T, np.int32)
    token_ids[:ntok] = rows.tokens[tok_slot, pos]  # reserved tokens read as their placeholder 0
    prev_index = np.full(T, -1, np.int32)
    # i64[K]: tokens whose value a step samples (drafts, past num_tokens, are known)
    reserved = np.flatnonzero((pos >= num_resolved[tok_row]) & (pos < num_tokens[tok_row]))
    if reserved.size:
        k = pos[reserved] - num_resolved[tok_row[reserved]]  # i64[K]: index among the row's reserved tokens
        src = rows.pend_step[tok_slot[reserved], k]
        if (src != step - 1).any():
            j = int(np.flatnonzero(src != step - 1)[0])
            raise ValueError(f"request {int(rows.request_id[tok_slot[reserved[j]]])}: token {int(pos[reserved[j]])} "
                             f"was sampled by step {int(src[j])} and is not resolved; step {step} can only take "
                             f"the previous step's ({step - 1}) sampled tokens")
        prev_index[reserved] = rows.pend_row[tok_slot[reserved], k]
    positions = np.zeros(T, np.int32)
    positions[:ntok] = pos

    burst_len = None
    span = seq_lens
    if burst is not None:
        burst_len = np.zeros(B, np.int32)
        burst_len[:nseq] = burst
        span = seq_lens + np.maximum(burst_len - 1, 0)
    span_len = None
    if spec_span is not None:
        span_len = np.zeros(B, np.int32)
        span_len[:nseq] = spec_span
        span = np.maximum(seq_lens, np.where(span_len > 0, seq_lens - query_lens + span_len, 0))
    nblk = bucket(max(int(-(-span.max() // ps)), 1), blk_buckets)
    block_tables = blocks.tables[gdn_slots, :, :nblk]  # fancy index: a copy; row 0 (PAD) is all -1
    slot_mapping = np.full((T, blocks.num_heads), -1, np.int32)
    pages = block_tables[tok_row, :, pos // ps]  # i32[ntok, H_kv]
    slot_mapping[:ntok] = pages * ps + (pos % ps)[:, None]

    logits_indices = np.zeros(B, np.int32)
    logits_indices[:nseq] = cu[1: nseq + 1] - 1
    sample_mask = np.zeros(B, bool)
    extra = np.zeros(nseq, np.int64) if drafts is None else np.asarray(drafts, np.int64)  # i64[nseq]
    sample_mask[:nseq] = start + n == num_tokens + extra
    draft_len = None
    if drafts is not None:
        draft_len = np.zeros(B, np.int32)
        draft_len[:nseq] = extra
    request_ids = tuple(rows.request_id[slots].tolist())
    ckpt_restore, ckpt_save = np.full(B, -1, np.int32), np.full(B, -1, np.int32)
    for ckpt, chosen in ((ckpt_restore, restore), (ckpt_save, save)):
        if chosen:
            ckpt[:nseq] = [chosen.get(rid, -1) for rid in request_ids]
    prompt_end = rows.prompt_len[slots]
    prefill = int(np.maximum(np.minimum(start + n, prompt_end) - start, 0).sum())
    return StepPlan(token_ids=token_ids, positions=positions, cu_seqlens=cu, seq_lens=seq_lens, gdn_slots=gdn_slots,
                    has_initial_state=has_init, block_tables=block_tables, slot_mapping=slot_mapping,
                    logits_indices=logits_indices, sample_mask=sample_mask, query_lens=query_lens,
                    prev_index=prev_index, ckpt_restore=ckpt_restore, ckpt_save=ckpt_save,
                    prefix_hit_tokens=int(prefix_hit_tokens), prefill_tokens=prefill,
                    request_ids=request_ids, num_tokens=ntok,
                    num_seqs=nseq, step=step, burst_len=burst_len, stride=int(stride) if burst is not None else 0,
                    draft_len=draft_len, spec_span=span_len, spec_k=int(spec_k),
                    spec_steps=int(spec_steps) if spec_span is not None else 0)


def pad_plan(plan: StepPlan, num_tokens: int, num_rows: int, num_blocks: int) -> StepPlan:
    """``plan`` padded to larger buckets ``T = num_tokens``, ``B = num_rows``, ``num_blocks`` table columns (with
    the module's padding values), so that the plans of several data shards stack into one step. Host
    bookkeeping (request ids, counts, step) is unchanged; ``ValueError`` if a bucket would shrink."""
    T, B, nblk = plan.token_ids.shape[0], plan.seq_lens.shape[0], plan.block_tables.shape[2]
    if num_tokens < T or num_rows < B or num_blocks < nblk:
        raise ValueError(f"pad_plan: ({T}, {B}, {nblk}) does not fit ({num_tokens}, {num_rows}, {num_blocks})")
    dt, db = num_tokens - T, num_rows - B

    def rows(x: np.ndarray, value) -> np.ndarray:
        return np.concatenate([x, np.full((db, *x.shape[1:]), value, x.dtype)])

    def toks(x: np.ndarray, value) -> np.ndarray:
        return np.concatenate([x, np.full((dt, *x.shape[1:]), value, x.dtype)])

    bt = np.full((num_rows, plan.block_tables.shape[1], num_blocks), -1, np.int32)
    bt[:B, :, :nblk] = plan.block_tables
    return dataclasses.replace(
        plan, token_ids=toks(plan.token_ids, 0), positions=toks(plan.positions, 0),
        cu_seqlens=rows(plan.cu_seqlens, plan.cu_seqlens[-1]), seq_lens=rows(plan.seq_lens, 0),
        gdn_slots=rows(plan.gdn_slots, 0), has_initial_state=rows(plan.has_initial_state, False), block_tables=bt,
        slot_mapping=toks(plan.slot_mapping, -1), logits_indices=rows(plan.logits_indices, 0),
        sample_mask=rows(plan.sample_mask, False), query_lens=rows(plan.query_lens, 0),
        prev_index=toks(plan.prev_index, -1), ckpt_restore=rows(plan.ckpt_restore, -1),
        ckpt_save=rows(plan.ckpt_save, -1), burst_len=None if plan.burst_len is None else rows(plan.burst_len, 0),
        draft_len=None if plan.draft_len is None else rows(plan.draft_len, 0),
        spec_span=None if plan.spec_span is None else rows(plan.spec_span, 0))
