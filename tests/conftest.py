"""Shared pytest setup: XLA CPU threads, the ``gpu`` marker, hypothesis profiles, random keys."""

from __future__ import annotations

import os
import zlib

# The Mosaic GPU interpreter (test_prefill_mosaic_interpret) runs each warpgroup as a computation on XLA's CPU
# thread pool and blocks those threads in barrier waits: with the pool sized to 2 cores it can deadlock. NPROC
# sizes that pool; it must be set before JAX creates its CPU client.
os.environ.setdefault("NPROC", "8")

import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np
import pytest
from hypothesis import settings

# Many tests compile the same computation (each Engine compiles its own step; test files rebuild the same models):
# XLA's persistent compilation cache, shared by the xdist workers, compiles each once. It keys on the HLO and
# the compile options, so a hit is the same executable; trace counts (what the no-recompilation tests assert)
# are unaffected. KVJAX_TEST_JAX_CACHE="" turns it off.
_cache_dir = os.environ.get("KVJAX_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "kvjax-test-jax-cache"))
if _cache_dir:
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# `python -m kvjax run` turns on its own persistent cache (~/.cache/kvjax/jax by default, kvjax.cli.compile_cache):
# commands the tests run, in this process or in a child, leave the user's cache and this process's JAX settings
# alone unless a test asks for a cache with --compile-cache.
os.environ.setdefault("KVJAX_COMPILE_CACHE", "off")

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=False)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    # the long-running tests (marked slow) first, in their order: under xdist's worksteal (pyproject) the workers
    # start on the long ones and steal short ones from each other's tails, so neither waits on the other's last test
    items.sort(key=lambda item: "slow" not in item.keywords)
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh numpy generator per test, seeded from the test id so failures reproduce."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
