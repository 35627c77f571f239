"""``kvjax run`` over several processes (``jax.distributed``, JAX's multi-controller runtime: NCCL between GPUs,
gloo between CPU processes), started once per process with ``--coordinator HOST:PORT --num-processes N
--process-id I``.

Two ways to use the processes' devices:

- **One engine per process** (no ``--mesh`` / ``--devices``): data parallelism the way vLLM and SGLang run it, one
  independent engine per device. Each process serves its share of the workload's requests on its own device with
  its own scheduler, so the host work of each step is spread over the processes' CPU cores. The share is claimed
  while the run goes (:class:`Claims`: the next request, largest first, from a counter on the coordinator,
  whenever an engine has none waiting) or, with ``--share static``, fixed up front (:func:`shares`: about equal
  tokens); both splits are :mod:`kvjax.sched.dispatch`'s, which ``kvjax simulate --processes N`` simulates. The
  processes meet only at a barrier before each repeat (so their walls overlap), after each repeat, when every
  process gathers every request's tokens (:func:`gather_served`), and at the end, for each process's figures
  (:func:`combine`).
- **One mesh over every process's devices** (``--mesh`` / ``--devices``): every process runs the same engine on the
  global mesh and plans every data shard's steps (the host work is repeated, not split), in lockstep.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
from typing import Callable, Sequence

import jax
import numpy as np

from kvjax.errors import UsageError
from kvjax.sched.dispatch import chains, shares

MAX_HOST_DEVICES = 64  # most CPU devices a process asks JAX for (each one is a thread pool)

# the figures each process contributes to the combined summary, and how they combine
SUMMED = ("requests_served", "generated_tokens", "generated_tokens_per_s", "computed_tokens", "prefill_tokens",
          "running_mean", "running_peak", "preemptions", "generated_tokens_per_step", "prefix_hit_tokens")
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


class Claims:
    """A dynamic split (``--share dynamic``, the default): the processes claim the workload's :func:`chains`,
    largest first, one at a time while they run, from one counter that ``jax.distributed``'s coordinator keeps
    (``key_value_increment`` is atomic, so every chain goes to exactly one process). An engine takes a chain when
    it has no request waiting (:func:`kvjax.cli.run` serves), so a process that runs faster, or whose requests
    suffer fewer preemptions, serves more; a static split by tokens cannot see either (measured on two H200s, run
    252: the processes' rates 12-13% apart). Which process serves which request varies from run to run; each
    request's tokens do not (sampling keys follow the request's workload index).

    A claim is a round trip to the coordinator (2-3 ms on a CPU host here, about a GPU step), so a thread claims
    one chain ahead: :meth:`claim` hands over the chain claimed before and starts the next claim, and never waits
    unless ``wait``. ``name`` keys the counter: one per serve of the workload (a policy and repeat), the same string
    in every process. ``increment``: ``(key, n) -> new value``, the coordinator's counter by default (a test may
    pass its own)."""

    def __init__(self, workload: Sequence, name: str, increment: Callable[[str, int], int] | None = None):
        self.order = chains(workload)  # list of chains, largest first
        self.key = f"kvjax/claims/{name}"
        self.increment = increment or _coordinator_increment()
        self.done = not self.order
        self._ready: queue.Queue = queue.Queue(maxsize=1)  # the chain claimed ahead, or None: every chain is taken
        self._want = threading.Semaphore(0 if self.done else 1)
        if not self.done:
            threading.Thread(target=self._claim_ahead, daemon=True, name=f"claims {name}").start()

    def _claim_ahead(self) -> None:
        while True:
            self._want.acquire()
            try:
                n = int(self.increment(self.key, 1))  # 1 for the first claim of this key, over every process
            except BaseException as err:  # handed to claim(), which raises it
                self._ready.put(err)
                return
            chain = self.order[n - 1] if n <= len(self.order) else None
            self._ready.put(chain)
            if chain is None:
                return

    def claim(self, wait: bool = False) -> list[int]:
        """The next chain this process claimed (its workload indices); ``[]`` if the claim in flight has not come
        back (``wait``: wait for it) or every chain is taken (then ``done``)."""
        if self.done:
            return []
        try:
            got = self._ready.get(block=wait)
        except queue.Empty:
            return []
        if isinstance(got, BaseException):
            self.done = True
            raise got
        if got is None:
            self.done = True
            return []
        self._want.release()
        return got


def _coordinator_increment() -> Callable[[str, int], int]:
    """``jax.distributed``'s coordinator counter (``key_value_increment`` of its client); ``UsageError`` outside a
    multi-process run."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise UsageError("a dynamic share needs a multi-process run (--coordinator)")
    return client.key_value_increment


class StaticClaims:
    """A static split (``--share static``) behind :class:`Claims`'s interface: the first :meth:`claim` returns this
    process's whole part of :func:`shares` (every request queued at once), later ones ``[]``."""

    def __init__(self, workload: Sequence, processes: int, process: int):
        self.mine = shares(workload, processes)[process]
        self.done = not self.mine

    def claim(self, wait: bool = False) -> list[int]:
        """This process's share (workload indices) the first time, then ``[]`` (``wait``: as :meth:`Claims.claim`;
        nothing to wait for)."""
        out, self.mine, self.done = self.mine, [], True
        return out


def share_claims(workload: Sequence, share: str, processes: int) -> Callable[[str], Claims | StaticClaims]:
    """``name -> claims`` for one serve of ``workload`` by this process: ``share`` ``"dynamic"`` (:class:`Claims`) or
    ``"static"`` (:class:`StaticClaims`, this process's part of :func:`shares` over ``processes``)."""
    if share == "dynamic":
        return lambda name: Claims(workload, name)
    if share == "static":
        return lambda name: StaticClaims(workload, processes, jax.process_index())
    raise ValueError(f"share must be 'dynamic' or 'static', got {share!r}")


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (a collective over every process's devices)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def gather_served(served: dict[int, list[int]], total: int) -> list[list[int]]:
    """Every request's tokens, in workload order (``total`` requests), from each process's ``served`` (workload
    index -> the tokens it generated for that request; every request served by exactly one process); the same list
    in every process. A collective: every process calls it."""
    from jax.experimental import multihost_utils

    mine = [len(served), max((len(o) for o in served.values()), default=0)]  # requests, longest output
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.int32))).reshape(-1, 2)
    counts, width = sizes[:, 0], int(sizes[:, 1].max())
    buf = np.full((max(int(counts.max()), 1), width + 2), -1, np.int32)  # i32[rows, 2 + width]: index, length, tokens
    for r, (g, out) in enumerate(sorted(served.items())):
        buf[r, :2] = g, len(out)
        buf[r, 2: 2 + len(out)] = out
    every = np.asarray(multihost_utils.process_allgather(buf))  # i32[N, rows, 2 + width]
    tokens: list[list[int] | None] = [None] * total
    for p, n in enumerate(counts):
        for g, length, *rest in every[p, : int(n)].tolist():
            if tokens[g] is not None:
                raise AssertionError(f"request {g} was served by two processes")
            tokens[g] = rest[:length]
    missing = [g for g, t in enumerate(tokens) if t is None]
    if missing:
        raise AssertionError(f"requests {missing[:8]} were served by no process")
    return tokens


def combine(summary: dict, repeats: int) -> dict:
    """The run's summary from each process's (one engine each): tokens, rates, running requests and preemptions
    summed, steps and step times the largest, shares averaged; ``generated_tokens_per_s_processes`` and
    ``requests_served_processes`` each process's rate and requests (of the last repeat); ``wall_s`` each repeat's
    slowest process, ``wall_net_s`` the slowest of the processes' walls less their compiling steps
    (``compile_s_repeats``), and ``wall_tokens_per_s`` the tokens of every process over that (see
    :func:`wall_rate`). Every process gets the same dict."""
    from jax.experimental import multihost_utils

    keys = SUMMED + MAXED + AVERAGED
    vec = np.asarray([float(summary.get(k) or 0.0) for k in keys] + list(summary["wall_s"])
                     + list(summary["generated_tokens_per_s_repeats"]) + list(summary["compile_s_repeats"]), np.float32)
    every = np.asarray(multihost_utils.process_allgather(vec), np.float64)  # f64[N, len(vec)]
    n = len(keys)
    out = dict(summary)
    for j, k in enumerate(keys):
        col = every[:, j]
        value = float(col.sum() if k in SUMMED else col.max() if k in MAXED else col.mean())
        out[k] = int(round(value)) if isinstance(summary.get(k), int) else value  # counts stay ints
    walls = every[:, n: n + repeats]  # f64[N, repeats]: each process's wall of each repeat
    rates = every[:, n + repeats: n + 2 * repeats].sum(0)  # f64[repeats]: the processes' rates, summed
    net = walls - every[:, n + 2 * repeats:]  # f64[N, repeats]: less the steps that compiled
    out["wall_s"] = walls.max(0).tolist()
    out["wall_net_s"] = net.max(0).tolist()
    out["generated_tokens_per_s_repeats"] = rates.tolist()
    out["generated_tokens_per_s"] = statistics.median(rates.tolist())
    out["generated_tokens_per_s_processes"] = every[:, keys.index("generated_tokens_per_s")].tolist()
    out["requests_served_processes"] = [int(x) for x in every[:, keys.index("requests_served")]]
    out["wall_tokens_per_s"] = wall_rate(out["generated_tokens"], out["wall_net_s"])
    return out


def wall_rate(tokens: int, walls: Sequence[float]) -> float:
    """Generated tokens over the wall time of a repeat, the median over the repeats after the first (which
    compiles; the only one where there is one repeat). The callers pass walls less the time of the steps that
    compiled (``wall_net_s``): with a dynamic share a process may meet a new bucket shape after the first repeat
    (seen on CPU: a 2 s compile in a 1.4 s repeat)."""
    walls = list(walls)[1:] or list(walls)
    return statistics.median(tokens / w for w in walls)
