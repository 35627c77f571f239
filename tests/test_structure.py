"""The engine and the scheduler keep to their own state: checked on the source (``ast``), so it cannot rot.

- No module of ``kvjax/engine/`` reads or writes a name beginning with ``_`` of another object (a scheduler's,
  a request's, a runner's): only ``self._x`` / ``cls._x`` and dunders. Layers talk through public calls.
- No class in ``kvjax/engine/`` or ``kvjax/sched/`` inherits behaviour from another class of the project (no
  mixins): a part of the engine or the scheduler is an object the other owns. Bases from outside the project
  (``NamedTuple``, ``Protocol``, ``list``) and the project's errors are fine.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "kvjax"
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public despite the underscore


def _modules(*packages: str) -> list[pathlib.Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).glob("*.py"))


def private_uses(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of every attribute named ``_x`` (not a dunder, nor the named-tuple API) read or
    written on anything but ``self`` or ``cls``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and node.attr not in NAMEDTUPLE_API:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append((node.lineno, ast.unparse(node)))
    return sorted(out)


def project_classes() -> set[str]:
    """Names of the classes defined anywhere in ``kvjax/`` but its errors."""
    names = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.endswith("Error"):
                names.add(node.name)
    return names


def inherited_classes(source: str, project: set[str]) -> list[tuple[int, str, str]]:
    """``(line, class, base)`` of every class with a base among ``project`` (class names)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if ast.unparse(base).split(".")[-1].split("[")[0] in project:
                    out.append((node.lineno, node.name, ast.unparse(base)))
    return out


def test_the_checks_catch_what_they_forbid():
    assert private_uses("sched._preempt(req)\nself._ok = 1\nx.__class__\nself.a._b\nev._replace(a=1)") == [
        (1, "sched._preempt"), (4, "self.a._b")]
    project = {"Consumers", "Recovery", "Scheduler"}
    assert inherited_classes("class A(Consumers, Recovery): pass\nclass B(NamedTuple): pass\n"
                             "class C(Protocol): pass\nclass D(KvjaxError): pass\nclass E(list): pass", project) == [
        (1, "A", "Consumers"), (1, "A", "Recovery")]
    assert {"Engine", "Scheduler", "Ledger", "Outputs"} <= project_classes()


@pytest.mark.parametrize("path", _modules("engine"), ids=lambda p: p.name)
def test_engine_touches_no_private_name_of_another_object(path):
    assert private_uses(path.read_text()) == [], f"{path.name}: private names of other objects"


@pytest.fixture(scope="module")
def project() -> set[str]:
    return project_classes()


@pytest.mark.parametrize("path", _modules("engine", "sched"), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_mixins_in_engine_and_sched(path, project):
    assert inherited_classes(path.read_text(), project) == [], f"{path.name}: compose instead of inheriting"


def global_device_indexing(source: str) -> list[int]:
    """Lines that index ``jax.devices()`` (``jax.devices()[0]``)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "devices"
            and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "jax"]


def test_no_module_picks_a_device_from_the_global_list():
    """In a multi-process run ``jax.devices()[0]`` is process 0's device, which no other process can address (its
    ``memory_stats()`` raises): a module asks for ``jax.local_devices()`` (process 1 of the first 2-GPU run of
    ``kvjax run --coordinator`` died on it and left process 0 at its barrier). A mesh over every process's
    devices still takes ``jax.devices()`` whole."""
    assert global_device_indexing("import jax\nd = jax.devices()[0]\nm = jax.devices()\n") == [2]
    found = {str(p.relative_to(ROOT)): lines for p in sorted(ROOT.rglob("*.py"))
             if (lines := global_device_indexing(p.read_text()))}
    assert not found, found


TESTS = pathlib.Path(__file__).resolve().parent


def imports_of(source: str, modules: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` of every import (``import x``, ``from x import y``, at any depth) of a module whose top-level
    name is in ``modules``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in modules]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in modules:
            out.append((node.lineno, node.module))
    return out


def test_no_test_module_imports_another():
    """Shared test pieces live in ``tests/helpers/`` (or ``conftest.py`` fixtures), never in a test module: one that
    lends its helpers cannot change them for its own tests without breaking the borrowers, and a borrower ends up
    patching the lender's globals."""
    names = {p.stem for p in TESTS.glob("test_*.py")} | {"conftest"}
    assert imports_of("import test_a as a\ndef f():\n    from test_b.c import d\nimport helpers.x\n",
                      {"test_a", "test_b"}) == [(1, "test_a"), (3, "test_b.c")]
    found = {str(p.relative_to(TESTS)): hits for p in sorted(TESTS.rglob("*.py"))
             if (hits := imports_of(p.read_text(), names))}
    assert not found, found
