"""Host-side cache manager and scheduler. Pure Python + numpy: this package never imports jax.

Modules, one concept each: ``slots`` (GDN slot allocator), ``blocks`` (head-wise page allocator and block tables,
pool policies ``shared`` / ``partitioned``), ``recycle`` (the SWA recycle rule and policies ``none`` / ``timely``),
``prefix_cache`` (the opt-in prefix cache: hash-chained prompt blocks, reference-counted shared pages, GDN
checkpoint slots, head-wise matches), ``request``, ``plan`` (``StepPlan`` and shape buckets), ``scheduler`` (with
``admission``: which queued requests start; ``burst``: decode-burst plans; ``rebuild``: a fresh scheduler after a
fault), ``workload`` and ``simulate`` (the capacity simulator behind ``python -m kvjax simulate``; its command line
is :mod:`kvjax.cli.simulate`), ``dispatch`` (one workload over several engines: the static and dynamic splits of
``kvjax run``'s processes, and their simulation behind ``simulate --processes``).

Bad input raises a ``ValueError`` (most often a :class:`kvjax.errors.KvjaxError`) naming the value, before
anything changes; integers may be Python or numpy ints.
"""

from kvjax.sched.blocks import POOLS, BlockAllocator
from kvjax.sched.plan import StepPlan, seq_buckets, token_buckets
from kvjax.sched.prefix_cache import PrefixCache, PrefixCacheConfig
from kvjax.sched.recycle import NoRecycle, RecyclePolicy, TimelyRecycle, recycle_out_of_window
from kvjax.sched.request import Request, Status
from kvjax.sched.scheduler import Scheduler
from kvjax.sched.slots import PAD_SLOT, SlotAllocator

__all__ = [
    "POOLS", "PAD_SLOT", "BlockAllocator", "NoRecycle", "PrefixCache", "PrefixCacheConfig", "RecyclePolicy", "Request", "Scheduler", "SlotAllocator",
    "Status", "StepPlan", "TimelyRecycle", "recycle_out_of_window", "seq_buckets", "token_buckets",
]
