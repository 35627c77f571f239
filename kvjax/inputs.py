"""``StepInputs``: everything one jitted model step reads besides the parameters and the caches.

One step serves a mixed, ragged batch: prefill chunks and decode tokens of up to ``B`` sequences, ``T`` tokens
in all, token-major. ``B``, ``T`` and ``max_blocks`` come from static buckets (the scheduler pads), so a long
run compiles a handful of times. Padding rows have ``cu_seqlens`` length 0, GDN slot 0 (PAD), all-``-1``
block tables; padding tokens (past ``cu_seqlens[-1]``) have slot mapping ``-1`` and write nothing.

This module sits at the bottom of the package (no JAX): the host scheduler (:mod:`kvjax.sched.plan`) builds
these fields, the models (:mod:`kvjax.models.interface`, which registers the class as a pytree) read them, and
the engine packs and unpacks them (:mod:`kvjax.engine.inputs`). :meth:`StepInputs.validate` is the host-side
check of one step's inputs (``Engine(debug=True)``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kvjax.config import AttentionConfig
from kvjax.errors import InvalidPlanError

Array = Any  # np.ndarray on the host, jax.Array inside a jitted step


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Device inputs of one step: arrays (numpy on the host, ``jax.Array`` inside a step) plus one static flag
    (``decode_only``, ``max_query_len``). A JAX pytree once :mod:`kvjax.models.interface` is imported (the arrays
    are its leaves, :data:`STATIC_FIELDS` its static metadata)."""

    token_ids: Array  # i32[T]: input token of each step token (padding tokens: any valid id, e.g. 0)
    positions: Array  # i32[T]: absolute position of each token in its sequence (RoPE)
    cu_seqlens: Array  # i32[B+1]: query start offsets of each row; padding rows have length 0
    seq_lens: Array  # i32[B]: context length of each row *including* this step's tokens (0 for padding)
    gdn_slots: Array  # i32[B]: GDN state slot of each row (1..max_seqs); 0 = PAD row
    has_initial_state: Array  # bool[B]: row already has computed tokens (read its GDN state)
    block_tables: Array  # i32[B, Hkv, max_blocks]: page of each (row, KV head, block); -1 = hole
    slot_mapping: Array  # i32[T, Hkv]: page * page_size + offset where each new K/V goes; -1 = skip
    logits_indices: Array  # i32[B]: token index (into T) whose logits each row returns
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # static (part of the treedef, so it selects a trace): every live row has exactly one token; models then
    # use their decode kernels (GDN recurrent + conv update). False is always correct, True only for decode.
    max_query_len: int = dataclasses.field(default=0, metadata=dict(static=True))
    # static: 0, or a bound J on every row's tokens with every live row continuing its state (a verification
    # burst's sub-step); models then take their few-token paths (paged attention by the split-KV decode kernel,
    # the GDN verification kernel). 0 is always correct.

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]

    def validate(self, *, num_pages: int, page_size: int, max_slots: int, vocab_size: int | None = None,
                 attention: AttentionConfig | None = None, shared_pages: bool = False,
                 page_groups: np.ndarray | None = None) -> None:
        """Host-side (``debug=True``) check of one step's inputs; raises :class:`InvalidPlanError` naming the
        row, head or token.

        Checks shapes, dtypes and id ranges; that every live row's positions run ``seq_len - q .. seq_len - 1``
        and ``has_initial_state == (seq_len > q)``; that its logits index lies in its own tokens; that its
        context fits the table width; that no page appears twice in the tables; that every real token writes,
        on every head, exactly its own position of a page of its own row's table (padding tokens write
        nothing; a token whose block is a hole writes nothing either); with ``attention`` (the model's layout:
        per-head ``window``/``sinks``), that no block a query of this step attends (its own block included) is
        a ``-1`` hole (SWA heads may have holes outside their window and sinks); with
        ``vocab_size``, that every token id lies in ``[0, vocab_size)``.

        ``max_slots`` is the GDN pool size including slot 0 (``max_seqs + 1``). ``shared_pages`` (prefix
        caching): a page may appear in several rows at one (head, block), read-only (not written this step);
        otherwise no page appears twice.

        ``page_groups`` (one data shard of a mesh step, pages split over ``"model"``): ``int[Hkv]``, the model
        shard whose pool of ``num_pages`` pages holds each head's pages; the ids of head ``h`` are local to pool
        ``page_groups[h]``, so ranges are checked per pool and uniqueness per (pool, page).
        """
        a = {name: np.asarray(getattr(self, name)) for name in DEVICE_FIELDS}
        t, b = a["token_ids"].shape[0], a["seq_lens"].shape[0]
        expect = {
            "token_ids": (t,), "positions": (t,), "cu_seqlens": (b + 1,), "seq_lens": (b,), "gdn_slots": (b,),
            "has_initial_state": (b,), "logits_indices": (b,),
        }
        for name, shape in expect.items():
            if a[name].shape != shape:
                raise InvalidPlanError(f"StepInputs.{name} has shape {a[name].shape}, expected {shape}")
        for name in ("token_ids", "positions", "cu_seqlens", "seq_lens", "gdn_slots", "block_tables",
                     "slot_mapping", "logits_indices"):
            if a[name].dtype != np.int32:
                raise InvalidPlanError(f"StepInputs.{name} must be int32, got {a[name].dtype}")
        if a["has_initial_state"].dtype != np.bool_:
            raise InvalidPlanError(f"StepInputs.has_initial_state must be bool, got {a['has_initial_state'].dtype}")
        bt, sm = a["block_tables"], a["slot_mapping"]
        if bt.ndim != 3 or bt.shape[0] != b:
            raise InvalidPlanError(f"StepInputs.block_tables must be [B={b}, Hkv, max_blocks], got {bt.shape}")
        if sm.shape != (t, bt.shape[1]):
            raise InvalidPlanError(f"StepInputs.slot_mapping must be [T={t}, Hkv={bt.shape[1]}], got {sm.shape}")
        cu = a["cu_seqlens"]
        if cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] > t:
            raise InvalidPlanError(f"StepInputs.cu_seqlens must start at 0, be non-decreasing and <= T={t}: {cu}")
        n_new = np.diff(cu)
        if (a["seq_lens"] < n_new).any():
            raise InvalidPlanError(f"StepInputs.seq_lens {a['seq_lens']} shorter than new tokens {n_new}")
        if ((bt < -1) | (bt >= num_pages)).any():
            raise InvalidPlanError(f"StepInputs.block_tables has page ids outside [-1, {num_pages})")
        if ((sm < -1) | (sm >= num_pages * page_size)).any():
            raise InvalidPlanError(f"StepInputs.slot_mapping has entries outside [-1, {num_pages * page_size})")
        if page_groups is not None:  # local ids -> one id space over all pools, then the one-pool checks
            base = np.asarray(page_groups, np.int64) * num_pages  # i64[Hkv]
            if base.shape != (bt.shape[1],):
                raise InvalidPlanError(f"page_groups must have one entry per KV head ({bt.shape[1]}), got "
                                       f"{base.shape}")
            a["block_tables"] = bt = np.where(bt >= 0, bt + base[None, :, None], -1).astype(np.int32)
            a["slot_mapping"] = sm = np.where(sm >= 0, sm + base[None, :] * page_size, -1).astype(np.int32)
        slots = a["gdn_slots"]
        if ((slots < 0) | (slots >= max_slots)).any():
            raise InvalidPlanError(f"StepInputs.gdn_slots {slots} outside [0, {max_slots})")
        active = n_new > 0
        if (slots[active] == 0).any():
            raise InvalidPlanError(f"StepInputs.gdn_slots: a row with tokens uses the PAD slot 0: {slots}")
        live = slots[active]
        if len(np.unique(live)) != len(live):
            raise InvalidPlanError(f"StepInputs.gdn_slots: two rows share a slot: {slots}")
        if self.decode_only and (((n_new > 1) | ((n_new == 0) & (a["gdn_slots"] > 0))).any()
                                 or (np.diff(n_new) > 0).any()):
            raise InvalidPlanError(
                f"StepInputs.decode_only but rows have {n_new} tokens (slots {a['gdn_slots']}): every row with "
                "a slot must have exactly one token, padding rows (slot 0) none, and come after the live rows"
            )
        if self.decode_only and (active & ~a["has_initial_state"].astype(bool)).any():
            raise InvalidPlanError(
                f"StepInputs.decode_only but live rows {np.flatnonzero(active & ~a['has_initial_state']).tolist()} "
                "have no initial state: the decode kernels continue every live row (a fresh row takes the prefill "
                "path)"
            )
        J = self.max_query_len
        if J and ((n_new > J).any() or (active & ~a["has_initial_state"].astype(bool)).any()):
            raise InvalidPlanError(
                f"StepInputs.max_query_len={J} but rows have {n_new} tokens (has_initial_state "
                f"{a['has_initial_state'].astype(int).tolist()}): every row at most {J} tokens, every live row "
                "continuing its state"
            )
        li = a["logits_indices"]
        if ((li < 0) | (li >= max(t, 1))).any():
            raise InvalidPlanError(f"StepInputs.logits_indices {li} outside [0, {t})")
        if vocab_size is not None:
            tok = a["token_ids"]
            if tok.size and (tok.min() < 0 or tok.max() >= vocab_size):
                bad = np.flatnonzero((tok < 0) | (tok >= vocab_size))
                raise InvalidPlanError(f"StepInputs.token_ids outside [0, vocab_size={vocab_size}) at tokens "
                                       f"{bad[:8].tolist()}: {tok[bad[:8]].tolist()}")
        _check_rows(a, cu, page_size, attention, shared_pages)

    @classmethod
    def from_numpy(cls, *, decode_only: bool = False, **arrays) -> "StepInputs":
        """Build from host arrays (ints cast to int32, ``has_initial_state`` to bool); no validation."""
        fields = set(DEVICE_FIELDS)
        if set(arrays) != fields:
            raise InvalidPlanError(f"StepInputs needs exactly {sorted(fields)}, got {sorted(arrays)}")
        out = {name: np.asarray(value, np.bool_ if name == "has_initial_state" else np.int32)
               for name, value in arrays.items()}
        return cls(**out, decode_only=bool(decode_only))


STATIC_FIELDS = ("decode_only", "max_query_len")
"""The static fields of :class:`StepInputs` (part of a step's treedef: each value selects its own trace)."""

DEVICE_FIELDS = tuple(f.name for f in dataclasses.fields(StepInputs) if f.name not in STATIC_FIELDS)
"""The array fields of :class:`StepInputs`, in order (the scheduler's :class:`~kvjax.sched.plan.StepPlan` has
each under the same name)."""


def _check_sharing(bt: np.ndarray, sm: np.ndarray, ps: int) -> None:
    """A page sits at one (head, block) of the tables; several rows may hold it there (a prefix-cached block,
    read-only), but a page this step writes (``slot_mapping``) is in one entry only."""
    r, h, k = np.nonzero(bt >= 0)
    pages = bt[r, h, k].astype(np.int64)
    uniq, counts = np.unique(pages, return_counts=True)
    where = np.unique(np.stack([pages, h, k]), axis=1)
    if where.shape[1] != len(uniq):
        dup = np.unique(where[0])[np.bincount(np.searchsorted(np.unique(where[0]), where[0])) > 1]
        raise InvalidPlanError(f"StepInputs.block_tables: pages {dup[:8].tolist()} appear at more than one "
                               "(head, block) or twice in a row")
    written = np.unique(sm[sm >= 0] // ps)
    shared = uniq[counts > 1]
    both = np.intersect1d(written, shared)
    if len(both):
        raise InvalidPlanError(f"StepInputs.block_tables: pages {both[:8].tolist()} are written this step and appear "
                               "in more than one (row, head, block) entry")


def _check_rows(a: dict[str, np.ndarray], cu: np.ndarray, page_size: int, attention: AttentionConfig | None,
                shared_pages: bool = False) -> None:
    """The per-row consistency checks of :meth:`StepInputs.validate` (``a``: its fields as numpy arrays)."""
    bt, sm, seq, pos = a["block_tables"], a["slot_mapping"], a["seq_lens"], a["positions"]
    ps, (b, hkv, nblk) = page_size, bt.shape
    if shared_pages:
        _check_sharing(bt, sm, ps)
    else:
        pages = bt[bt >= 0]
        uniq, counts = np.unique(pages, return_counts=True)
        if (counts > 1).any():
            raise InvalidPlanError(f"StepInputs.block_tables: pages {uniq[counts > 1][:8].tolist()} appear in more "
                                   "than one (row, head, block) entry")
    if attention is not None and attention.num_kv_heads != hkv:
        raise InvalidPlanError(f"StepInputs.block_tables has {hkv} heads, the attention layout "
                               f"{attention.num_kv_heads}")
    window = np.asarray(attention.window if attention is not None else (), np.int64)
    sinks = np.asarray(attention.sinks if attention is not None else (), np.int64)
    sm_real = np.full(sm.shape, -1, np.int64)
    for r in range(b):
        lo, hi = int(cu[r]), int(cu[r + 1])
        q, L = hi - lo, int(seq[r])
        if q == 0:
            if L or (bt[r] != -1).any():
                raise InvalidPlanError(f"StepInputs row {r} has no tokens but seq_len {L} or block-table pages")
            continue
        start = L - q
        if -(-L // ps) > nblk:
            raise InvalidPlanError(f"StepInputs row {r}: seq_len {L} needs {-(-L // ps)} blocks of {ps}, the table "
                                   f"covers {nblk}")
        if (pos[lo:hi] != np.arange(start, L)).any():
            raise InvalidPlanError(f"StepInputs row {r}: positions {pos[lo:hi].tolist()} are not {start}..{L - 1} "
                                   f"(seq_len {L}, {q} new tokens)")
        if bool(a["has_initial_state"][r]) != (start > 0):
            raise InvalidPlanError(f"StepInputs row {r}: has_initial_state={bool(a['has_initial_state'][r])} but "
                                   f"{start} tokens precede this step's {q}")
        if not lo <= a["logits_indices"][r] < hi:
            raise InvalidPlanError(f"StepInputs row {r}: logits index {a['logits_indices'][r]} outside its tokens "
                                   f"[{lo}, {hi})")
        for h in range(hkv if attention is not None else 0):
            w, s = int(window[h]), int(sinks[h])
            first = 0 if w == 0 else max(start - w + 1, 0) // ps  # first block the step's first query attends
            need = set(range(first, -(-L // ps))) | (set(range(-(-min(s, L) // ps))) if w else set())
            holes = sorted(k for k in need if bt[r, h, k] < 0)
            if holes:
                kind = "full" if w == 0 else f"SWA (window {w}, sinks {s})"
                raise InvalidPlanError(f"StepInputs row {r}, {kind} head {h}: blocks {holes[:8]} it attends are "
                                       f"-1 holes (seq_len {L}, {q} new tokens)")
        p = pos[lo:hi].astype(np.int64)
        page = bt[r][:, p // ps].T.astype(np.int64)  # i64[q, Hkv]; a hole (-1) writes nothing
        sm_real[lo:hi] = np.where(page >= 0, page * ps + (p % ps)[:, None], -1)
    live = np.zeros(sm.shape[0], bool)
    live[: int(cu[-1])] = True
    bad = np.argwhere(sm != np.where(live[:, None], sm_real, -1))
    if len(bad):
        t, h = bad[0]
        want = sm_real[t, h] if live[t] else -1
        raise InvalidPlanError(f"StepInputs.slot_mapping[{t}, {h}] = {sm[t, h]}, expected {want} (a real token writes "
                               f"its position {pos[t]} into its own row's page, padding writes -1); {len(bad)} such "
                               "entries")
