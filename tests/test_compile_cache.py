"""``python -m kvjax run``'s persistent compilation cache (issue 33 item 5, :mod:`kvjax.cli.compile_cache`): where
it lives, bad directories refused before any work, and JAX's settings left alone unless the command turns it on.
The end-to-end check (a second run loads every compiled step and writes nothing new) is in
``tests/test_new_user.py``."""

from __future__ import annotations

import os

import jax
import pytest

import kvjax.cli.run as cli_run
from kvjax.cli import compile_cache
from kvjax.errors import UsageError


def test_default_dir_precedence(tmp_path):
    home = os.path.expanduser("~")
    assert compile_cache.default_dir({}) == os.path.join(home, ".cache", "kvjax", "jax")
    assert compile_cache.default_dir({"XDG_CACHE_HOME": "/x"}) == "/x/kvjax/jax"
    assert compile_cache.default_dir({"XDG_CACHE_HOME": "/x", "KVJAX_COMPILE_CACHE": str(tmp_path)}) == str(tmp_path)
    for off in ("off", "", "0", "None"):
        assert compile_cache.default_dir({"KVJAX_COMPILE_CACHE": off}) is None


def test_prepare_creates_the_directory_and_names_a_bad_one(tmp_path):
    want = tmp_path / "a" / "b"
    assert compile_cache.prepare(str(want)) == str(want) and want.is_dir()
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(UsageError, match=r"--compile-cache '.*file': exists and is not a directory"):
        compile_cache.prepare(str(afile))
    with pytest.raises(UsageError, match="cannot create"):
        compile_cache.prepare(str(afile / "sub"))


def test_resolve_flags(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="not both"):
        compile_cache.resolve(str(tmp_path), True)
    assert compile_cache.resolve(None, True) == (None, None)
    assert compile_cache.resolve(str(tmp_path / "c"), False) == (str(tmp_path / "c"), None)
    monkeypatch.setenv("KVJAX_COMPILE_CACHE", str(tmp_path / "env"))
    assert compile_cache.resolve(None, False) == (str(tmp_path / "env"), None)
    (tmp_path / "f").write_text("x")  # an unusable default: a note, and the run goes on without the cache
    monkeypatch.setenv("KVJAX_COMPILE_CACHE", str(tmp_path / "f"))
    path, note = compile_cache.resolve(None, False)
    assert path is None and "without the persistent compilation cache" in note and "not a directory" in note
    monkeypatch.setenv("KVJAX_COMPILE_CACHE", "off")
    assert compile_cache.resolve(None, False) == (None, None)


@pytest.mark.parametrize("argv", [["--compile-cache", "{file}"], ["--compile-cache", "{dir}", "--no-compile-cache"]])
def test_run_refuses_a_bad_cache_before_any_work(tmp_path, capsys, argv):
    (tmp_path / "file").write_text("x")
    argv = [a.format(file=tmp_path / "file", dir=tmp_path) for a in argv]
    before = jax.config.jax_compilation_cache_dir
    assert cli_run.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("not a directory" in err or "not both" in err)
    assert jax.config.jax_compilation_cache_dir == before  # nothing set


def test_run_help_documents_the_cache():
    text = cli_run.build_parser().format_help()
    assert "--compile-cache DIR" in text and "--no-compile-cache" in text and "KVJAX_COMPILE_CACHE" in text
