"""Child processes of the tests: several processes of one ``jax.distributed`` run (a free port for the coordinator
and a launcher that starts every process at once and waits for all of them), the environment that gives a child
the tests' persistent compilation cache, and a pytest child on more host CPU devices (:func:`pytest_on_cpu_devices`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile


def compile_cache_env() -> dict[str, str]:
    """JAX's environment variables that point a child process (a command, a script, a notebook kernel: anything that
    does not load ``conftest``) at this process's persistent compilation cache, the tests' (conftest), with the same
    thresholds; empty where it is off (``KVJAX_TEST_JAX_CACHE=""``). A hit is the executable the child would compile,
    so nothing it computes changes; a command's own ``--compile-cache`` still takes precedence."""
    import jax

    cache = jax.config.jax_compilation_cache_dir
    if not cache:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def child_env() -> dict[str, str]:
    """This process's environment for a child JAX process of its own: ``XLA_FLAGS`` removed (the child gets its own
    CPU devices) and the tests' compilation cache passed on (:func:`compile_cache_env`)."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | compile_cache_env()


def free_port() -> int:
    """A TCP port free on localhost now (the coordinator's)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(commands: list[list[str]], *, cwd: str, timeout: float = 300) -> list[str]:
    """Start every command at once (one process each, ``XLA_FLAGS`` removed so each gets its own CPU devices, the
    tests' compilation cache passed on: :func:`compile_cache_env`) and wait for all; returns each one's output
    (stdout and stderr). Output goes to files, not pipes, so no process can block on a full pipe while another waits
    for it at a barrier. ``AssertionError`` with the tail of every output if a process fails; processes left running
    at the timeout are killed."""
    env = child_env()
    files = [tempfile.TemporaryFile("w+") for _ in commands]
    procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, text=True)
             for cmd, f in zip(commands, files)]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = []
    for f in files:
        f.seek(0)
        logs.append(f.read())
        f.close()
    codes = [p.returncode for p in procs]
    assert all(c == 0 for c in codes), f"return codes {codes}\n" + "\n".join(log[-3000:] for log in logs)
    return logs


def pytest_on_cpu_devices(selection: list[str], *, inner: str, devices: int, cwd: str, flags: tuple[str, ...] = (),
                          timeout: float = 600) -> str:
    """Run ``pytest -q -x`` on ``selection`` (test files or node ids) in a child process that sees ``devices`` host
    CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``, added to this process's flags) and has the
    environment variable ``inner`` set to ``"1"`` (the child's tests skip or run on it); ``flags``: more pytest
    arguments. Returns the child's stdout; ``AssertionError`` with the tails of its output if it fails."""
    flag = f"--xla_force_host_platform_device_count={devices}"
    env = {**os.environ, inner: "1", "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *flags, *selection],
                       env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    return r.stdout
