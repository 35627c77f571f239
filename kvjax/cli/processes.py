"""``kvjax run`` over several processes (``jax.distributed``, JAX's multi-controller runtime: NCCL between GPUs,
gloo between CPU processes), started once per process with ``--coordinator HOST:PORT --num-processes N
--process-id I``.

Two ways to use the processes' devices:

- **One engine per process** (no ``--mesh`` / ``--devices``): data parallelism the way vLLM and SGLang run it, one
  independent engine per device. Each process serves its share of the workload's requests (:func:`shares`: about
  equal tokens) on its own device with its own scheduler, so the host work of each step is spread over the
  processes' CPU cores. The processes
  meet only at a barrier before each repeat (so their walls overlap) and at the end, when process 0 gathers every
  request's tokens and each process's figures (:func:`combine`).
- **One mesh over every process's devices** (``--mesh`` / ``--devices``): every process runs the same engine on the
  global mesh and plans every data shard's steps (the host work is repeated, not split), in lockstep.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Sequence

import jax
import numpy as np

from kvjax.errors import UsageError

MAX_HOST_DEVICES = 64  # most CPU devices a process asks JAX for (each one is a thread pool)

# the figures each process contributes to the combined summary, and how they combine
SUMMED = ("generated_tokens", "generated_tokens_per_s", "computed_tokens", "prefill_tokens", "running_mean",
          "running_peak", "preemptions", "generated_tokens_per_step", "prefix_hit_tokens")
MAXED = ("steps", "sub_steps", "compile_time_s", "step_time_median_s", "page_util_peak")
AVERAGED = ("page_util_mean", "host_share", "host_total_share")


def parse_mesh(spec: str) -> tuple[int, int]:
    """``"DxM"`` -> ``(D, M)``; :class:`UsageError` unless both are ints >= 1."""
    try:
        d, m = (int(x) for x in spec.lower().split("x"))
        assert d >= 1 and m >= 1
    except (ValueError, AssertionError):
        raise UsageError(f"--mesh must be DATAxMODEL with ints >= 1 (e.g. 2x2), got {spec!r}") from None
    return d, m


def start_processes(args: argparse.Namespace, spec: str | None) -> int:
    """Join the multi-process run of ``--coordinator`` (``jax.distributed``, before any other JAX use): gloo
    collectives between CPU processes; on CPU each process asks for its share of the mesh ``spec``'s devices (one
    device per process without a mesh: one engine each). Returns the number of processes (1 without
    ``--coordinator``); :class:`UsageError` for an incomplete or inconsistent set of flags."""
    flags = (args.coordinator, args.num_processes, args.process_id)
    if all(f is None for f in flags):
        if args.local_devices is not None:
            raise UsageError("--local-devices needs --coordinator, --num-processes and --process-id")
        return 1
    if any(f is None for f in flags):
        raise UsageError("a multi-process run needs all of --coordinator HOST:PORT, --num-processes N and "
                         "--process-id I")
    n, i = args.num_processes, args.process_id
    if i >= n:
        raise UsageError(f"--process-id must be < --num-processes {n}, got {i}")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--coordinator must be HOST:PORT (port 1-65535), got {args.coordinator!r}")
    d, m = (n, 1) if spec is None else parse_mesh(spec)
    if d * m % n:
        raise UsageError(f"--mesh / --devices {spec}: the devices must split evenly over --num-processes {n}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes only; a GPU uses NCCL
    jax.config.update("jax_num_cpu_devices", min(d * m // n, MAX_HOST_DEVICES))
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=n, process_id=i,
                               local_device_ids=args.local_devices)
    return n


def shares(workload: Sequence, processes: int) -> list[list[int]]:
    """Which requests of ``workload`` each process serves (one engine per process): its indices, in workload order.
    Requests chained by ``after`` stay in one process; chains go, largest first, to the process with the fewest
    tokens (prompt + output) so far, so the processes finish together (a round-robin split leaves the slowest
    process's wall, which the run's rate is over, longer). Deterministic: every process computes the same."""
    root = []
    for i, w in enumerate(workload):
        after = getattr(w, "after", -1)
        root.append(root[after] if 0 <= after < i else i)
    chains: dict[int, list[int]] = {}
    for i, r in enumerate(root):
        chains.setdefault(r, []).append(i)
    cost = {r: sum(workload[i].total_len for i in idx) for r, idx in chains.items()}
    load, out = [0] * processes, [[] for _ in range(processes)]
    for r in sorted(chains, key=lambda r: (-cost[r], r)):
        p = min(range(processes), key=lambda p: (load[p], p))
        load[p] += cost[r]
        out[p].extend(chains[r])
    return [sorted(o) for o in out]


def my_share(workload: Sequence, share: list[list[int]]) -> list:
    """This process's requests of ``workload`` (its part of ``share``, :func:`shares`), ``after`` renumbered to the
    share's order."""
    mine = share[jax.process_index()]
    local = {g: j for j, g in enumerate(mine)}
    return [dataclasses.replace(w, after=local[w.after]) if getattr(w, "after", -1) >= 0 else w
            for w in (workload[g] for g in mine)]


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (a collective over every process's devices)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def gather_outputs(mine: list[list[int]], share: list[list[int]]) -> list[list[int]]:
    """Every request's tokens, in workload order, from each process's ``mine`` (its requests' tokens, in the order
    of its part of ``share``, :func:`shares`); the same list in every process."""
    from jax.experimental import multihost_utils

    rows = max(len(s) for s in share)
    width = max((len(o) for o in mine), default=0)
    width = int(np.max(multihost_utils.process_allgather(np.asarray([width], np.int32))))
    buf = np.full((rows, width + 1), -1, np.int32)  # i32[rows, 1 + width]: length, then the tokens
    for r, out in enumerate(mine):
        buf[r, 0] = len(out)
        buf[r, 1: 1 + len(out)] = out
    every = np.asarray(multihost_utils.process_allgather(buf))  # i32[N, rows, 1 + width]
    tokens: list[list[int]] = [[] for _ in range(sum(len(s) for s in share))]
    for p, idx in enumerate(share):
        for r, g in enumerate(idx):
            tokens[g] = every[p, r, 1: 1 + every[p, r, 0]].tolist()
    return tokens


def combine(summary: dict, repeats: int) -> dict:
    """The run's summary from each process's (one engine each): tokens, rates, running requests and preemptions
    summed, steps and step times the largest, shares averaged; ``generated_tokens_per_s_processes`` each process's
    rate; ``wall_s`` each repeat's slowest process and ``wall_tokens_per_s`` the tokens of every process over it
    (see :func:`wall_rate`). Every process gets the same dict."""
    from jax.experimental import multihost_utils

    keys = SUMMED + MAXED + AVERAGED
    vec = np.asarray([float(summary.get(k) or 0.0) for k in keys] + list(summary["wall_s"])
                     + list(summary["generated_tokens_per_s_repeats"]), np.float32)
    every = np.asarray(multihost_utils.process_allgather(vec), np.float64)  # f64[N, len(vec)]
    n = len(keys)
    out = dict(summary)
    for j, k in enumerate(keys):
        col = every[:, j]
        value = float(col.sum() if k in SUMMED else col.max() if k in MAXED else col.mean())
        out[k] = int(round(value)) if isinstance(summary.get(k), int) else value  # counts stay ints
    walls = every[:, n: n + repeats].max(0)  # f64[repeats]: the slowest process of each repeat
    rates = every[:, n + repeats:].sum(0)  # f64[repeats]: the processes' rates, summed
    out["wall_s"] = walls.tolist()
    out["generated_tokens_per_s_repeats"] = rates.tolist()
    out["generated_tokens_per_s"] = statistics.median(rates.tolist())
    out["generated_tokens_per_s_processes"] = every[:, keys.index("generated_tokens_per_s")].tolist()
    out["wall_tokens_per_s"] = wall_rate(out["generated_tokens"], out["wall_s"])
    return out


def wall_rate(tokens: int, walls: Sequence[float]) -> float:
    """Generated tokens over the wall time of a repeat, the median over the repeats after the first (which
    compiles; the only one where there is one repeat)."""
    walls = list(walls)[1:] or list(walls)
    return statistics.median(tokens / w for w in walls)
