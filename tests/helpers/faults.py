"""Fault injection for the engine tests: the exception they raise, the four points of a step where
:func:`arm` makes the next step raise once, and :class:`FaultAt`, a tracer raising at the ``n``-th line or call
event of kvjax's own code."""

from __future__ import annotations

import inspect
import os
import sys

import kvjax
from kvjax.engine.engine import Engine
from kvjax.sched.request import Request, RowTable

KVJAX_DIR = os.path.dirname(os.path.abspath(kvjax.__file__))
POINTS = ["before device", "inside device", "after device", "inside update"]


class Injected(Exception):
    """The fault the tests inject (any exception but ``KeyboardInterrupt``)."""


def fail_device_step(engine: Engine, at: int, exc: type[BaseException] = Injected) -> None:
    """Make the ``at``-th device step of ``engine`` (counted from now) raise ``exc`` once, after it was dispatched
    (its caches donated)."""
    real, calls = engine.runner.step, []

    def step(*args):
        out = real(*args)
        calls.append(1)
        if len(calls) == at:
            raise exc("injected fault")
        return out

    engine.runner.step = step


def arm(monkeypatch, engine: Engine, point: str, exc: type[BaseException]) -> None:
    """Make ``point`` of the next step raise ``exc`` once."""
    fired = []

    def once():
        if not fired:
            fired.append(1)
            raise exc("injected fault")

    if point == "before device":
        real = engine.runner.pack
        monkeypatch.setattr(engine.runner, "pack", lambda *a, **k: (once(), real(*a, **k))[1])
    elif point == "inside device":  # after the caches were donated: their buffers are gone
        real_call = engine.runner.step
        monkeypatch.setattr(engine.runner, "step", lambda *a: (real_call(*a), once())[0])
    elif point == "after device":  # the step's tokens are read; before the scheduler applies them
        real_resolve = engine.scheduler.resolve
        monkeypatch.setattr(engine.scheduler, "resolve", lambda *a, **k: (once(), real_resolve(*a, **k))[1])
    elif point == "inside update":  # after some requests of the step took their tokens, before the rest
        real_resolve, real_rows = Request.resolve, RowTable.resolve
        calls = []

        def resolve(self, token):  # a request off the scheduler's row table (finished, left it)
            out = real_resolve(self, token)
            calls.append(1)
            if len(calls) == 2:
                once()
            return out

        def resolve_rows(self, slots, tokens):  # the running rows, all at once
            out = real_rows(self, slots, tokens)
            calls.append(1)
            if len(calls) == 2 or len(slots) > 1:
                once()
            return out

        monkeypatch.setattr(Request, "resolve", resolve)
        monkeypatch.setattr(RowTable, "resolve", resolve_rows)
    else:
        raise AssertionError(point)


class FaultAt:
    """A ``sys.settrace`` tracer counting the ``line`` and ``call`` events of frames in kvjax's own files; with
    ``at`` set it raises ``exc`` at that event (the tracer then stops, as Python disables a tracer that raised).
    A generator's ``call`` events (each resumption, and its close, where Python ignores an exception) are not
    counted; its lines are."""

    def __init__(self, at: int | None = None, exc: type[BaseException] = Injected) -> None:
        self.at, self.exc, self.events = at, exc, 0

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(KVJAX_DIR):
            return None
        if event == "line" or (event == "call" and not frame.f_code.co_flags & inspect.CO_GENERATOR):
            self.events += 1
            if self.events == self.at:
                raise self.exc(f"injected fault at event {self.at}")
        return self

    def run(self, fn):
        sys.settrace(self)
        try:
            return fn()
        finally:
            sys.settrace(None)
