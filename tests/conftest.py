"""Shared pytest setup: XLA CPU threads, the ``gpu`` marker, hypothesis profiles, random keys."""

from __future__ import annotations

import os
import zlib

# The Mosaic GPU interpreter (test_prefill_mosaic_interpret) runs each warpgroup as a computation on XLA's CPU
# thread pool and blocks those threads in barrier waits: with the pool sized to 2 cores it can deadlock. NPROC
# sizes that pool; it must be set before JAX creates its CPU client.
os.environ.setdefault("NPROC", "8")

import jax  # noqa: E402
import numpy as np
import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=False)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
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
