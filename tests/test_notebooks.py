"""Execute every notebook top to bottom (nbclient, kernel ``python3``) and check the committed files.

Size: ``KVJAX_NB_SIZE`` (default ``small``, what CI runs on CPU; ``gpu`` for the bigger sweeps on a GPU
machine) is passed to the kernel through the environment. A notebook fails the test on any cell error,
including the assertions the notebooks make about their own results.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import nbformat  # the 'notebooks' extra (installed by .[dev])
import pytest
from nbclient import NotebookClient

NB_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(p.name for p in NB_DIR.glob("*.ipynb"))


def _builder():
    spec = importlib.util.spec_from_file_location("nb_build", NB_DIR / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_notebooks_are_built_and_stripped():
    build = _builder()
    assert NOTEBOOKS == sorted(build.NOTEBOOKS), "notebooks/ differs from notebooks/build.py's list"
    for name, cells in build.NOTEBOOKS.items():
        nb = nbformat.read(NB_DIR / name, as_version=4)
        assert [c.source for c in nb.cells] == [c.source for c in cells], \
            f"{name} is out of date: rerun python notebooks/build.py"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs not stripped"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, monkeypatch):
    monkeypatch.setenv("KVJAX_NB_SIZE", os.environ.get("KVJAX_NB_SIZE", "small"))
    nb = nbformat.read(NB_DIR / name, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
