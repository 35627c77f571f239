"""What every command's ``--json`` carries, and where it goes.

``--json FILE`` means the same for ``run``, ``simulate`` and ``info``: write the JSON document to ``FILE``
(``-``: standard output, and then nothing else is printed there). Every document has a ``"meta"`` object
(:func:`provenance`): the command line, kvjax and jax versions, the git commit of the source tree (when it is a
git checkout), the device, the seed and the date, so that a figure can be traced to the run that produced it.

Stdlib only: ``simulate`` reports jax's version without importing it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from typing import Any

import kvjax


def git_commit(path: str | None = None) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the git checkout whose top directory is ``path`` (default: the
    directory holding kvjax's source), or None where it is not one or git is missing."""
    where = os.path.realpath(path or os.path.dirname(os.path.dirname(os.path.abspath(kvjax.__file__))))
    try:
        top = subprocess.run(["git", "-C", where, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=5)
        if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != where:
            return None  # not a checkout of kvjax (e.g. installed into a virtualenv that lies inside some repository)
        sha = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def provenance(command: str, argv: list[str], *, device: str, seed: int | None) -> dict[str, Any]:
    """The ``"meta"`` object of a command's JSON: command line, versions, git commit, device, seed, UTC date."""
    try:
        jax_version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        jax_version = None
    return {
        "command": ["python", "-m", "kvjax", command, *argv],
        "kvjax": kvjax.__version__,
        "jax": jax_version,
        "python": platform.python_version(),
        "git": git_commit(),
        "device": device,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "seed": seed,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(destination: str, document: dict[str, Any]) -> None:
    """Write ``document`` as indented JSON to the file ``destination`` (``-``: standard output)."""
    text = json.dumps(document, indent=1)
    if destination == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        with open(destination, "w") as f:
            f.write(text + "\n")
