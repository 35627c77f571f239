"""A new user's first hour (issue 33), as commands: ``python -m kvjax run`` (cpu preset, small), ``simulate``,
``info``, ``--help``, and README's Python snippet. Each command runs in a fresh process, the way README shows it,
so that the path cannot rot unnoticed. About 20 s of CPU, most of it the small run's compilation."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.bench import import_bench

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def kvjax(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m kvjax ARGS`` in a fresh process on the CPU, from ``cwd``; fails the test on a non-zero exit."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "kvjax", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"python -m kvjax {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_run_cpu_preset_small(tmp_path):
    args = ("run", "--requests", "3", "--repeats", "2", "--json", "run.json", "--no-progress", "--compile-cache", "cc")
    proc = kvjax(*args, cwd=tmp_path)
    assert "timely / none:" in proc.stdout and "identical tokens in every run and repeat: yes" in proc.stdout
    doc = json.loads((tmp_path / "run.json").read_text())
    meta = doc["meta"]
    assert meta["command"][3:] == list(args)
    assert doc["compile_cache"] == str(tmp_path / "cc")
    cached = sorted(p.name for p in (tmp_path / "cc").iterdir())
    assert cached, "the persistent compilation cache stayed empty"
    # A second run of the same steps loads every executable from the cache: it writes no new entry.
    kvjax("run", "--requests", "3", "--repeats", "1", "--no-progress", "--compile-cache", "cc", cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "cc").iterdir()) == cached
    assert meta["kvjax"] and meta["jax"] and meta["device"] and meta["seed"] == 0 and meta["date"]
    for policy in ("none", "timely"):
        rates = doc["results"][policy]["generated_tokens_per_s_repeats"]
        assert len(rates) == 2 and all(r > 0 for r in rates)
    assert doc["identical_tokens"] is True and doc["config"]["requests"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cc", "run.json"]  # nothing else written beside them


def test_simulate_and_info_json_on_stdout(tmp_path):
    doc = json.loads(kvjax("simulate", "--requests", "4", "--scale", "0.02", "--json", "-", cwd=tmp_path).stdout)
    assert len(doc["results"]) == 4 and doc["meta"]["command"][3] == "simulate"
    text = kvjax("simulate", "--requests", "4", "--scale", "0.02", "--prefix-caching", cwd=tmp_path).stdout
    assert "keep_tail" in text and "hit rate" in text
    info = kvjax("info", cwd=tmp_path).stdout
    assert info.startswith("kvjax ") and "kernel choice for" in info and "paged_attention:" in info
    assert not list(tmp_path.iterdir())  # no command wrote a file it was not asked for


def test_help_of_every_command(tmp_path):
    for args in ((), ("run",), ("simulate",), ("info",)):
        text = kvjax(*args, "--help", cwd=tmp_path).stdout
        assert "usage: python -m kvjax" in text and "``" not in text


def _readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_python_snippet_parses_and_its_imports_exist():
    blocks = _readme_python_blocks()
    assert blocks, "README has no python block"
    for block in blocks:
        tree = ast.parse(block)  # a syntax error in README fails here
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"README imports {alias.name} from {node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


def test_readme_engine_methods_exist():
    """Every ``engine.<method>(`` and ``Engine(..., <keyword>=`` README's snippet uses exists on ``Engine``."""
    import inspect

    from kvjax.engine import Engine

    snippet = "\n".join(_readme_python_blocks())
    for name in set(re.findall(r"\bengine\.(\w+)\(", snippet)):
        assert callable(getattr(Engine, name, None)), f"README calls engine.{name}(), which Engine does not have"
    import dataclasses

    from kvjax.engine.options import EngineOptions

    params = set(inspect.signature(Engine).parameters) | {f.name for f in dataclasses.fields(EngineOptions)}
    calls = [n for n in ast.walk(ast.parse(snippet))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Engine"]
    assert calls
    for call in calls:
        for kw in call.keywords:
            assert kw.arg in params, f"README passes Engine({kw.arg}=...), which Engine does not take"


@pytest.mark.parametrize("path", ["docs/architecture.md", "docs/contracts.md", "benchmarks/RESULTS.md"])
def test_readme_links_exist(path):
    assert path in README and (ROOT / path).is_file()
    assert "../shared/" not in README  # README must not point outside the repository


def test_readme_cpu_run_row_is_rendered_from_its_stored_runs():
    """Issue 33: every README figure comes from a run that is kept with its command, commit, device and date."""
    readme_figures = import_bench("readme_figures")
    runs = json.loads(readme_figures.RUNS.read_text())
    assert runs and all(r["preset"] == "cpu" and r["meta"]["git"] and r["meta"]["date"] for r in runs)
    assert all(r["meta"]["command"][3] == "run" for r in runs)
    assert readme_figures.readme_row(README) == readme_figures.render(runs)
    with pytest.raises(ValueError, match="cpu --json"):
        readme_figures.trimmed({"preset": "gpu", "results": {}})
