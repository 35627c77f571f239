"""JAX's persistent compilation cache for the command line (``run --compile-cache DIR`` / ``--no-compile-cache``).

Every new :class:`kvjax.engine.Engine` traces and compiles its step again (seconds to tens of seconds on a CPU).
With a persistent cache, XLA's compiled executables are written to a directory and a later process that compiles
the same computation (same code, shapes, jax version, device) loads them instead. Only the command-line entry
turns it on: library code never sets JAX's global configuration. A script or notebook turns it on itself, before
its first compilation::

    import jax
    jax.config.update("jax_compilation_cache_dir", "/home/me/.cache/kvjax/jax")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)

Where the cache lives (first that applies): ``--compile-cache DIR``; the environment variable
``KVJAX_COMPILE_CACHE``; ``$XDG_CACHE_HOME/kvjax/jax``; ``~/.cache/kvjax/jax``. ``--no-compile-cache`` (or
``KVJAX_COMPILE_CACHE=off``) turns it off.
"""

from __future__ import annotations

import os
from typing import Mapping

from kvjax.errors import UsageError

ENV = "KVJAX_COMPILE_CACHE"
OFF = ("", "0", "off", "none", "false", "no")  # values of ``KVJAX_COMPILE_CACHE`` that turn the cache off
MIN_COMPILE_TIME_S = 0.2  # executables that took less to compile are not worth a file


def default_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The cache directory when ``--compile-cache`` is not given: ``$KVJAX_COMPILE_CACHE`` (None where it is one of
    :data:`OFF`), else ``$XDG_CACHE_HOME/kvjax/jax``, else ``~/.cache/kvjax/jax``."""
    env = os.environ if environ is None else environ
    if ENV in env:
        value = env[ENV].strip()
        return None if value.lower() in OFF else os.path.expanduser(value)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvjax", "jax")


def prepare(directory: str, flag: str = "--compile-cache") -> str:
    """Create ``directory`` if needed and return its absolute path; :class:`UsageError` naming it (and ``flag``,
    where the value came from) if it is a file or cannot be created or written."""
    path = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {directory!r}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {directory!r}: cannot create the directory ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {directory!r}: the directory is not writable")
    return path


def resolve(directory: str | None, disabled: bool) -> tuple[str | None, str | None]:
    """``(cache directory or None, a note for stderr or None)`` for the flags ``--compile-cache`` (``directory``)
    and ``--no-compile-cache`` (``disabled``). An explicit directory that cannot be used raises
    :class:`UsageError`; a default one only gives a note (the run goes on without the cache)."""
    if disabled:
        if directory is not None:
            raise UsageError("give --compile-cache DIR or --no-compile-cache, not both")
        return None, None
    if directory is not None:
        return prepare(directory), None
    default = default_dir()
    if default is None:
        return None, None
    try:
        return prepare(default, f"compile cache ({ENV} or the default)"), None
    except UsageError as e:
        return None, f"note: running without the persistent compilation cache: {e}"


def enable(directory: str) -> None:
    """Point JAX's persistent compilation cache at ``directory`` (a process-wide setting: only for the command
    line's entry, before the first compilation)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
