"""The engine's packed step inputs: :class:`kvjax.inputs.StepInputs` (the model's), ``SampleInputs`` and
``CheckpointCopies``, in one host buffer.

``SampleInputs``: the engine step's per-row sampling arrays and ``prev_index`` (tokens taken from the previous
step's sampled tokens on the device). ``CheckpointCopies``: the GDN checkpoint copies of a prefix-caching
step. :func:`pack_plans` packs all three from the data shards' plans into one ``i32[D, N]`` host buffer, which
the call of the jitted step moves in one host -> device copy (:class:`kvjax.engine.runner.Runner`); the step
unpacks it (:meth:`PackLayout.unpack`, slices only).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.inputs import DEVICE_FIELDS, StepInputs
from kvjax.sched.plan import StepPlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleInputs:
    """Per-row sampling and the tokens taken from the previous step (``sample=True`` steps)."""

    seeds: jax.Array  # i32[B]: sampling seed of each row's request
    streams: jax.Array  # i32[B]: its prompt index (sampling stream)
    counters: jax.Array  # i32[B]: its token count when sampling (the key's last fold-in)
    temperature: jax.Array  # f32[B]: 0 = greedy
    top_k: jax.Array  # i32[B]: sample among the top_k largest logits; 0 = off
    top_p: jax.Array  # f32[B]: then the smallest set reaching this probability mass; 1.0 = off
    prev_index: jax.Array  # i32[T]: token t is the previous step's sampled token at this index; -1 = token_ids[t]
    burst_len: jax.Array | None = None  # i32[B]: a decode burst's sub-steps of each row (kvjax.engine.burst)
    draft_len: jax.Array | None = None  # i32[B]: a verification step's drafts of each row (kvjax.engine.verify)
    spec_span: jax.Array | None = None  # i32[B]: a verification burst's positions allocated to each row
    spec_cap: jax.Array | None = None  # i32[B]: the drafts a verification burst's later sub-steps verify at most
    next_ids: jax.Array | None = None  # i32[B]: the known token after each row's last step token; -1: the sampled
    # one (steps of an engine that drafts on the device: kvjax.engine.drafting)
    history: jax.Array | None = None  # i32[B, L]: each row's known tokens (a verification burst's n-gram lookup)
    history_len: jax.Array | None = None  # i32[B]: their count (kvjax.engine.ngram)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CheckpointCopies:
    """GDN state copies of one step (prefix caching; see :mod:`kvjax.state.gdn_checkpoints`)."""

    restore: jax.Array  # i32[B]: checkpoint slot copied into row b's GDN slot before the model; -1 none
    save: jax.Array  # i32[B]: checkpoint slot row b's GDN state is copied into after the model; -1 none


PACK_ALIGN = 64  # int32 elements (256 bytes): each field starts aligned, as kernels' operands must be


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Where each input of a step sits in its packed ``i32[N]`` buffer (static: part of the step's trace key).

    ``fields``: ``(name, shape)`` in buffer order, each starting at a multiple of :data:`PACK_ALIGN` (the
    :class:`StepInputs`, :class:`SampleInputs` and, with ``checkpoints``, :class:`CheckpointCopies` fields;
    ``has_initial_state`` as 0/1, ``temperature`` and ``top_p`` as the bits of their float32)."""

    fields: tuple[tuple[str, tuple[int, ...]], ...]
    decode_only: bool
    checkpoints: bool
    burst: int = 1  # a decode burst's sub-steps (its ``burst_len`` packed too; see kvjax.engine.burst)
    page_size: int = 0  # the cache's page size (a burst computes its sub-steps' slot mapping)
    spec: int = 0  # K of a verification step (its ``draft_len`` packed too; see kvjax.engine.verify); 0: none
    draft: bool = False  # the step runs the MTP drafter (an engine that drafts on the device; kvjax.engine.drafting)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of packed field ``name`` (``KeyError`` if the layout has none)."""
        return dict(self.fields)[name]

    def unpack(self, buf: jax.Array) -> tuple[StepInputs, SampleInputs, CheckpointCopies | None]:
        """Inside the jitted step: the typed inputs of the packed ``buf`` (i32[N], or i32[D, N] of ``D`` data shards:
        every field then has a leading ``[D]`` axis; slices and bitcasts only). ``SampleInputs.counters`` is
        ``seq_lens``: a sampling row's token count is its context length."""
        out, off, lead = {}, 0, buf.shape[:-1]
        for name, shape in self.fields:
            n = int(np.prod(shape))
            out[name] = buf[..., off: off + n].reshape(lead + tuple(shape))
            off += -(-n // PACK_ALIGN) * PACK_ALIGN
        out["has_initial_state"] = out["has_initial_state"] != 0
        for name in ("temperature", "top_p"):
            out[name] = jax.lax.bitcast_convert_type(out[name], jnp.float32)
        inputs = StepInputs(**{f: out[f] for f in DEVICE_FIELDS}, decode_only=self.decode_only)
        rows = SampleInputs(seeds=out["seeds"], streams=out["streams"], counters=out["seq_lens"],
                            temperature=out["temperature"], top_k=out["top_k"], top_p=out["top_p"],
                            prev_index=out["prev_index"], burst_len=out.get("burst_len"),
                            draft_len=out.get("draft_len"), next_ids=out.get("next_ids"),
                            spec_span=out.get("spec_span"), spec_cap=out.get("spec_cap"),
                            history=out.get("history"), history_len=out.get("history_len"))
        copies = CheckpointCopies(out["ckpt_restore"], out["ckpt_save"]) if self.checkpoints else None
        return inputs, rows, copies


def decode_only(plans: Sequence[StepPlan], use_decode_path: bool) -> bool:
    """The static ``StepInputs.decode_only`` flag of a step: every real row of every plan (data shard) has one
    token and continues its GDN state (``has_initial_state``: a one-token prompt's first step takes the prefill
    path, so the decode kernels never start a row from zeros), and some plan has a row."""
    return bool(use_decode_path and any(p.num_seqs for p in plans)
                and all((p.query_lens[: p.num_seqs] == 1).all() and p.has_initial_state[: p.num_seqs].all()
                        for p in plans))


def pack_plans(plans: Sequence[StepPlan], samplings: Sequence[dict[str, np.ndarray]], *, decode_only: bool = False,
               checkpoints: bool = False, burst: int = 1, page_size: int = 0,
               page_base: np.ndarray | None = None, spec: int = 0,
               next_ids: Sequence[np.ndarray] | None = None, draft: bool = False,
               history: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> tuple[np.ndarray, PackLayout]:
    """One ``i32[D, N]`` host buffer, row ``d`` holding every input of the step of data shard ``d``'s plan (the
    plans padded to one shape: :meth:`kvjax.engine.runner.Runner.shape`), and its :class:`PackLayout`. Each field is
    stacked over the shards and written once (no per-shard packing).

    ``samplings``: per plan, ``seeds``, ``streams`` i32[B], ``temperature`` f32[B] and optionally ``top_k`` i32[B] and
    ``top_p`` f32[B] (:meth:`SamplingTable.rows`; absent: 0 and 1.0, off). Every layout packs all five, so whether a
    step uses top-k / top-p changes no trace.
    ``decode_only``: the step's static flag (:func:`decode_only` of every plan). ``checkpoints``: also pack the plans'
    GDN checkpoint copies (``ckpt_restore`` / ``ckpt_save``). ``burst > 1`` (a decode burst step, some plan has
    ``burst_len``): every plan packs ``burst_len`` (a plan without one, empty or of single decodes, runs one sub-step
    per row; a plan with prompt tokens is an ``AssertionError``), and the layout carries ``burst`` (the sub-steps
    the device runs: one trace whatever the rows' lengths) and the cache's ``page_size``. ``page_base``
    (``i64[Hkv]``, the first global page id of each KV head's pool, pages split over ``"model"``): the tables' and
    slot mapping's page ids become local to each head's pool. ``spec`` (K > 0, a verification step): every plan packs
    ``draft_len`` (zeros for a plan without one); with ``burst > 1`` too (a verification burst, some plan has
    ``spec_span``) every plan packs ``spec_span`` and ``spec_cap`` (its ``spec_k`` on its real rows) instead of
    ``burst_len``. ``next_ids`` (an engine that drafts on the device): per plan ``i32[B]``, the known token after
    each row's last step token (:func:`kvjax.sched.spec.next_tokens`). ``draft``: the layout's flag (the step runs
    the MTP drafter). ``history`` (a verification burst with the n-gram lookup on the device): per plan ``(i32[B, L],
    i32[B])``, its rows' known tokens and their count (:func:`kvjax.sched.spec.histories`; one ``L`` for all)."""
    if burst > 1 and page_size < 1:
        raise ValueError(f"a decode burst of {burst} sub-steps needs the cache's page_size, got {page_size}")
    longest = max(p.burst for p in plans)
    if longest > burst:
        raise ValueError(f"a decode burst of up to {longest} sub-steps needs burst >= that; got burst={burst}")

    B, D = plans[0].seq_lens.shape[0], len(plans)

    def stack(arrays: list) -> np.ndarray:  # [D, ...]; one shard: its array as it is (no D axis, no copy)
        return np.asarray(arrays[0]) if D == 1 else np.stack(arrays)

    def field(name: str) -> np.ndarray:  # [D, ...]: the plans' field (written into the int32 buffer as it is)
        return stack([getattr(p, name) for p in plans])

    def rows(name: str, default: float, dtype) -> np.ndarray:  # [D, B]: a sampling column
        return stack([np.asarray(s[name], dtype) if s.get(name) is not None else np.full(B, default, dtype)
                      for s in samplings])

    arrays = {name: field(name) for name in DEVICE_FIELDS}
    if page_base is not None and page_base.any():  # global page ids -> each head's pool's local ids
        arrays["block_tables"], arrays["slot_mapping"] = local_page_ids(arrays["block_tables"],
                                                                        arrays["slot_mapping"], page_base, page_size)
    arrays.update(seeds=rows("seeds", 0, np.int32), streams=rows("streams", 0, np.int32),
                  temperature=rows("temperature", 0.0, np.float32).view(np.int32), top_k=rows("top_k", 0, np.int32),
                  top_p=rows("top_p", 1.0, np.float32).view(np.int32), prev_index=field("prev_index"))
    if checkpoints:
        arrays.update(ckpt_restore=field("ckpt_restore"), ckpt_save=field("ckpt_save"))
    if burst > 1 and spec:
        arrays["spec_span"] = stack([p.spec_span if p.spec_span is not None else np.zeros(B, np.int32)
                                     for p in plans])
        arrays["spec_cap"] = stack([np.where(p.query_lens > 0, p.spec_k, 0).astype(np.int32) for p in plans])
    elif burst > 1:
        for p in plans:
            if p.burst_len is None and p.num_tokens != p.num_seqs:
                raise AssertionError(f"step {p.step}: a plan with prompt tokens in a burst step")
        arrays["burst_len"] = stack([p.burst_len if p.burst_len is not None else (p.query_lens > 0) for p in plans])
    if spec:
        arrays["draft_len"] = stack([p.draft_len if p.draft_len is not None else np.zeros(B, np.int32) for p in plans])
    if next_ids is not None:
        arrays["next_ids"] = stack([np.asarray(x, np.int32) for x in next_ids])
    if history is not None:
        arrays["history"] = stack([np.asarray(h, np.int32) for h, _ in history])
        arrays["history_len"] = stack([np.asarray(n, np.int32) for _, n in history])
    shapes = {name: a.shape if D == 1 else a.shape[1:] for name, a in arrays.items()}
    sizes = {name: -(-(a.size // D) // PACK_ALIGN) * PACK_ALIGN for name, a in arrays.items()}
    buf = np.zeros((D, sum(sizes.values())), np.int32)
    off = 0
    for name, a in arrays.items():
        buf[:, off: off + a.size // D] = a.reshape(D, -1)
        off += sizes[name]
    return buf, PackLayout(tuple(shapes.items()), bool(decode_only), checkpoints, burst, page_size if burst > 1 else 0,
                           int(spec), bool(draft))


def local_page_ids(block_tables: np.ndarray, slot_mapping: np.ndarray, page_base: np.ndarray, page_size: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``(block_tables, slot_mapping)`` (``i32[..., B, Hkv, nblk]``, ``i32[..., T, Hkv]``) with each KV head's page ids
    made local to its pool (``page_base``: ``i64[Hkv]``, the first global page id of each head's pool); ``-1``
    stays ``-1``."""
    bt = np.where(block_tables >= 0, block_tables - page_base[:, None], -1).astype(np.int32)
    sm = np.where(slot_mapping >= 0, slot_mapping - page_base * page_size, -1).astype(np.int32)
    return bt, sm


class SamplingTable:
    """Per-slot sampling parameters of the running requests, so a step's rows are gathered with numpy (a
    sampling row's token count, the last fold-in of its key, is its ``seq_len``: see :meth:`PackLayout.unpack`).

    ``rows(plan, tracked)`` returns ``seeds``, ``streams``, ``top_k`` i32[B] and ``temperature``, ``top_p`` f32[B]
    for the plan's rows (padding rows: zeros, ``top_p`` 1); a slot whose request changed since it was last seen
    is refreshed from ``tracked`` (the engine's request id -> :class:`~kvjax.engine.outputs.Tracked`, whose
    ``params`` are the request's :class:`~kvjax.engine.sampling.SamplingParams`). One table per data shard."""

    def __init__(self, num_slots: int) -> None:
        self.owner = np.full(num_slots, -1, np.int64)  # i64[S+1]: request id whose values the slot holds
        self.seeds = np.zeros(num_slots, np.int32)  # i32[S+1]
        self.streams = np.zeros(num_slots, np.int32)  # i32[S+1]
        self.temperature = np.zeros(num_slots, np.float32)  # f32[S+1]
        self.top_k = np.zeros(num_slots, np.int32)  # i32[S+1]: 0 = off
        self.top_p = np.ones(num_slots, np.float32)  # f32[S+1]: 1.0 = off

    def rows(self, plan: StepPlan, tracked: dict) -> dict[str, np.ndarray]:
        n, B = plan.num_seqs, plan.seq_lens.shape[0]
        slots = np.asarray(plan.gdn_slots[:n], np.int64)  # i64[n]
        rids = np.asarray(plan.request_ids, np.int64)  # i64[n]
        for b in np.flatnonzero(self.owner[slots] != rids):
            tr, s = tracked[int(rids[b])], slots[b]
            p = tr.params
            self.owner[s] = -1  # a refresh cut short leaves the slot to refresh again
            self.seeds[s], self.streams[s], self.temperature[s] = p.seed, tr.index, p.temperature
            self.top_k[s], self.top_p[s] = p.top_k, p.top_p
            self.owner[s] = rids[b]
        out = {}
        for name in ("seeds", "streams", "temperature", "top_k", "top_p"):
            col = getattr(self, name)
            out[name] = np.zeros(B, col.dtype) if name != "top_p" else np.ones(B, col.dtype)
            out[name][:n] = col[slots]
        return out
