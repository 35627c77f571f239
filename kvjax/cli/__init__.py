"""The command line, ``python -m kvjax <command>`` (or the ``kvjax`` script): one module per command.

``main`` dispatches to ``info`` (devices and each op's kernel choice), ``simulate`` (the host-only capacity
simulator over :mod:`kvjax.sched.simulate`) and ``run`` (the main job: a toy Qwen3.5 served through the engine);
``args`` holds the checked argument types they share (a bad value fails before any work, in one line on stderr,
exit status 2).

Importing this package imports neither jax nor a command: each command is imported when it runs.
"""

__all__ = ["main"]  # the module: kvjax.cli.main.main(argv) is the entry point
