"""The Mosaic GPU interpreter with one compilation per kernel, not per CTA (jax < 0.11).

The interpreter runs each CTA's warpgroups on threads, each as an XLA computation that ``thread_map._run_jaxpr``
traces, lowers and compiles. Up to jax 0.10 that function jitted a function it defined locally, so no compilation
cache ever hit: every CTA of every call compiled the kernel body again (a few seconds each on a CPU, nearly all of
an interpreted kernel's time). jax 0.11.0 fixed it by making that function a module-level one (jax-ml/jax
aa5a46a, "Improve cache hits in Pallas interpret mode"); :func:`cache_thread_programs` installs the same fix on an
older jax, for one test, through pytest's ``monkeypatch``. It changes what is compiled when, never what runs.
"""

from __future__ import annotations

import jax


def _run(jaxpr, consts, *args):  # module-level: jit's caches key on it (the fix of jax-ml/jax aa5a46a)
    from jax._src import core as jax_core

    jax_core.eval_jaxpr(jaxpr, consts, *args)


def _run_jaxpr(jaxpr, consts, *args):
    jax.jit(_run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()(consts, *args)


def cache_thread_programs(monkeypatch=None) -> bool:
    """Give the Mosaic GPU interpreter jax 0.11's compilation caching where this jax lacks it. ``monkeypatch``:
    pytest's fixture, which undoes it after the test; ``None`` installs it for the rest of the process (a script).
    Returns whether it was installed (False on a jax that has the fix, or whose interpreter is laid out
    differently)."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        return False
    if hasattr(thread_map, "_run") or not hasattr(thread_map, "_run_jaxpr"):  # fixed upstream, or moved
        return False
    if monkeypatch is None:
        thread_map._run_jaxpr = _run_jaxpr
    else:
        monkeypatch.setattr(thread_map, "_run_jaxpr", _run_jaxpr)
    return True
