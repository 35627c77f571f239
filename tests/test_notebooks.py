"""Execute every notebook top to bottom (nbclient, kernel ``python3``) and check the committed files: build.py's
cells, with the outputs of the CI-size run (``python notebooks/build.py --execute``).

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

from helpers.procs import compile_cache_env

NB_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(p.name for p in NB_DIR.glob("*.ipynb"))


def _builder():
    spec = importlib.util.spec_from_file_location("nb_build", NB_DIR / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MAX_NOTEBOOK_BYTES = 1_500_000  # one notebook with its committed outputs (PNG figures, cut text)


def test_notebooks_are_built_and_carry_their_ci_size_outputs():
    """The committed notebooks are build.py's cells, executed at CI size (``python notebooks/build.py --execute``):
    every code cell ran, in order, without an error, figures are PNG only, and each file stays small."""
    build = _builder()
    assert NOTEBOOKS == sorted(build.NOTEBOOKS), "notebooks/ differs from notebooks/build.py's list"
    for name, cells in build.NOTEBOOKS.items():
        nb = nbformat.read(NB_DIR / name, as_version=4)
        assert [c.source for c in nb.cells] == [c.source for c in cells], \
            f"{name} is out of date: rerun python notebooks/build.py --execute {name}"
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
            f"{name} was not executed top to bottom: python notebooks/build.py --execute {name}"
        outputs = [o for c in code for o in c.outputs]
        assert not [o for o in outputs if o.output_type == "error"], f"{name}: committed with an error"
        assert nb.metadata["kvjax"]["size"] == "small" and nb.metadata["kvjax"]["commit"], name
        for o in outputs:
            if o.output_type in ("display_data", "execute_result") and "image/png" in o.data:
                assert not {"image/svg+xml", "text/html"} & set(o.data), f"{name}: a figure kept beside its PNG"
            text = o.get("text", "") if o.output_type == "stream" else ""
            assert len(text) <= build.MAX_TEXT + 200, f"{name}: a stream output of {len(text)} characters"
        assert (NB_DIR / name).stat().st_size <= MAX_NOTEBOOK_BYTES, f"{name}: over {MAX_NOTEBOOK_BYTES} bytes"


def test_tidy_keeps_png_and_cuts_long_text():
    build = _builder()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0].outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="a" * (3 * build.MAX_TEXT)),
        nbformat.v4.new_output("display_data", data={"image/png": "iVBO", "image/svg+xml": "<svg/>",
                                                     "text/plain": "<Figure>"}),
    ]
    nb.cells[0].metadata["execution"] = {"iopub.execute_input": "2026-11-26T00:00:00Z"}
    build.tidy(nb)
    stream, figure = nb.cells[0].outputs
    assert len(stream.text) < build.MAX_TEXT + 100 and "characters cut" in stream.text
    assert set(figure.data) == {"image/png", "text/plain"} and "execution" not in nb.cells[0].metadata


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, monkeypatch):
    monkeypatch.setenv("KVJAX_NB_SIZE", os.environ.get("KVJAX_NB_SIZE", "small"))
    # the kernel takes the tests' persistent compilation cache (conftest) through JAX's environment variables: a
    # notebook's engines compile the same step again and again (each Engine jits its own); a hit is the same
    # executable, so no output changes. It runs no Mosaic GPU interpreter, so XLA's CPU pool keeps its default size
    # (conftest's NPROC=8 is for that interpreter; on 2 cores it slowed the speculative notebook's training by 1/4)
    monkeypatch.delenv("NPROC", raising=False)
    for key, value in compile_cache_env().items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NB_DIR / name, as_version=4)  # its committed outputs are replaced as the cells run
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
