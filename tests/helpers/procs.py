"""Several processes of one ``jax.distributed`` run, for the multi-process tests: a free port for the coordinator and
a launcher that starts every process at once and waits for all of them."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile


def free_port() -> int:
    """A TCP port free on localhost now (the coordinator's)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(commands: list[list[str]], *, cwd: str, timeout: float = 300) -> list[str]:
    """Start every command at once (one process each, ``XLA_FLAGS`` removed so each gets its own CPU devices) and
    wait for all; returns each one's output (stdout and stderr). Output goes to files, not pipes, so no process can
    block on a full pipe while another waits for it at a barrier. ``AssertionError`` with the tail of every output
    if a process fails; processes left running at the timeout are killed."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
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
