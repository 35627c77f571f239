"""Command lines (issue #17 item 10): every bad value fails fast, before any work, with one line on stderr and exit
status 2. Each case replaces the heavy steps (drawing the workload, building the model, simulating, serving) with
a function that fails the test if it is reached."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import kvjax.cli.run as cli_run
import kvjax.cli.simulate as simulate
from kvjax.__main__ import main as kvjax_main
from kvjax.cli.args import check_memory, comma_list, int_at_least, number_in, writable_file


def exit_status(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own exit (the contract allows either)
        return e.code


def one_line_error(capsys, main, argv: list[str]) -> str:
    status = exit_status(main, argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == 2, (status, captured.err)
    assert len(lines) == 1, captured.err
    assert not captured.out
    return lines[0]


def _no_work(*args, **kwargs):
    raise AssertionError("work started before the arguments were checked")


@pytest.fixture
def no_sim_work(monkeypatch):
    monkeypatch.setattr(simulate, "simulate", _no_work)
    monkeypatch.setattr(simulate, "simulate_dispatch", _no_work)


@pytest.fixture
def no_run_work(monkeypatch):
    for name in ("build_model", "run_policy", "save_plot"):
        monkeypatch.setattr(cli_run, name, _no_work)


SMALL_SIM = ["--requests", "2", "--scale", "0.01", "--max-seqs", "8", "--max-tokens", "64", "--page-size", "4"]


@pytest.mark.parametrize("argv, needle", [
    (["--page-size", "0"], "--page-size: must be an int >= 1, got '0'"),
    (["--recycle", ","], "--recycle"),
    (["--recycle", ""], "--recycle"),
    (["--recycle", "none,eager"], "'eager' is not one of none, timely"),
    (["--recycle", "none,none"], "repeated"),
    (["--pool", "shared,"], "--pool"),
    (["--pool", "private"], "'private' is not one of shared, partitioned"),
    (["--swa-fraction", ","], "--swa-fraction"),
    (["--swa-fraction", "0.5,1.5"], "'1.5'"),
    (["--swa-fraction", "nan"], "'nan'"),
    (["--check-every", "-1"], "--check-every: must be an int >= 0, got '-1'"),
    (["--scale", "nan"], "--scale: must be a finite scale > 0, got 'nan'"),
    (["--scale", "inf"], "'inf'"),
    (["--scale", "-1"], "'-1'"),
    (["--spread", "1"], "--spread"),
    (["--memory-requests", "0"], "--memory-requests"),
    (["--kv-heads", "0"], "--kv-heads"),
    (["--max-seqs", "0"], "--max-seqs"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--requests", "0"], "--requests"),
    (["--requests", "2.5"], "'2.5'"),
    (["--window", "-1"], "--window"),
    (["--sinks", "-1"], "--sinks"),
    (["--seed", "-1"], "--seed"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--window", str(2**31)], "window[0] must be an int in [0, 2147483647]"),
    (["--max-tokens", "4"], "max_num_batched_tokens=4 must be >= max_seqs=8"),
    (["--memory-requests", "0.01"], "cannot be served"),  # a request never fits: used to run the earlier configs
    (["--swa-fraction", "0,0.5", "--window", "0"], "window must be >= 1"),  # the 2nd layout is bad
])
def test_simulate_bad_values_fail_before_any_simulation(argv, needle, capsys, no_sim_work):
    line = one_line_error(capsys, simulate.main, SMALL_SIM + argv)
    assert line.startswith("simulate: ") and needle in line


@pytest.mark.parametrize("argv", [["--max-seqs", str(10**12)], ["--scale", "1e7"], ["--requests", str(10**12)],
                                  ["--memory-requests", "1e13"], ["--kv-heads", str(10**9)]])
def test_simulate_refuses_sizes_this_machine_cannot_hold(argv, capsys, monkeypatch, no_sim_work):
    monkeypatch.setattr(simulate, "seed_workload", _no_work)  # refused from the arguments alone
    line = one_line_error(capsys, simulate.main, argv)
    assert "needs about" in line and "TiB of host memory" in line


@pytest.mark.parametrize("argv, needle", [
    (["--scale", "nan"], "--scale: must be a finite scale > 0, got 'nan'"),
    (["--scale", "0"], "--scale"),
    (["--requests", "0"], "--requests: must be an int >= 1, got '0'"),
    (["--swa-fraction", "1.5"], "--swa-fraction"),
    (["--memory-requests", "-2"], "--memory-requests"),
    (["--memory-requests", "0.01"], "cannot be served"),  # used to raise a traceback after building the model
    (["--seed", "-1"], "--seed"),
    (["--preset", "tpu"], "--preset"),
    (["--json", "/nonexistent-dir/run.json"], "--json: cannot write '/nonexistent-dir/run.json'"),
    (["--plot", "/nonexistent-dir/run.png"], "--plot"),
    (["--plot", "run.notaformat"], "cannot write .notaformat files"),
    (["--flat-tokens", "256"], "--flat-tokens needs --speculative"),  # the default value, given: still refused
    (["--flat-tokens", "none"], "--flat-tokens needs --speculative"),
])
def test_run_bad_values_fail_before_any_work(argv, needle, capsys, no_run_work):
    line = one_line_error(capsys, cli_run.main, argv)
    assert line.startswith("run: ") and needle in line


def test_run_output_paths_that_are_directories_fail_before_any_work(tmp_path, capsys, no_run_work):
    for flag in ("--json", "--plot"):
        line = one_line_error(capsys, cli_run.main, [flag, str(tmp_path)])
        assert f"{flag}: '{tmp_path}' is a directory" in line


@pytest.mark.parametrize("argv", [["--scale", "1e6"], ["--requests", str(10**12)], ["--memory-requests", "1e9"]])
def test_run_refuses_sizes_this_machine_cannot_hold(argv, capsys, monkeypatch, no_run_work):
    monkeypatch.setattr(cli_run, "seed_workload", _no_work)
    line = one_line_error(capsys, cli_run.main, argv)
    assert "needs about" in line and "TiB of" in line


def test_dispatcher_unknown_command_and_bad_values(capsys):
    line = one_line_error(capsys, kvjax_main, ["serve"])
    assert line.startswith("python -m kvjax: ") and "'serve'" in line
    line = one_line_error(capsys, kvjax_main, ["simulate", "--page-size", "0"])
    assert line.startswith("simulate: ") and "--page-size" in line


# ---- the argument types themselves ------------------------------------------------------------------------------
def test_argument_types_accept_good_values_and_name_bad_ones():
    import argparse

    assert int_at_least(1)("3") == 3 and int_at_least(0, 5)("5") == 5
    assert number_in(0, 1)("0") == 0.0 and number_in(0, 1, high_open=True)("0.99") == 0.99
    assert comma_list(number_in(0, 1))("0.25, 1") == [0.25, 1.0]
    assert comma_list(("none", "timely"))("timely") == ["timely"]
    for parse, text in ((int_at_least(0, 5), "6"), (number_in(0, 1, high_open=True), "1"), (number_in(0), "-inf"),
                        (number_in(0, low_open=True), "0"), (comma_list(("a",)), "a,,a"), (int_at_least(1), "1e3")):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text).replace("+", r"\+")):
            parse(text)


def test_writable_file(tmp_path):
    import argparse

    assert writable_file(str(tmp_path / "new.json")) == str(tmp_path / "new.json")
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    assert writable_file(str(existing)) == str(existing)
    assert existing.read_text() == "{}"  # checking touches nothing
    assert not (tmp_path / "new.json").exists()
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        writable_file(str(tmp_path / "missing" / "x.json"))
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(argparse.ArgumentTypeError, match="not writable"):
            writable_file(str(ro / "x.json"))


def test_check_memory_names_the_size():
    check_memory(2**20, "a small run", available=2**30)
    with pytest.raises(ValueError, match=r"a big run needs about 2\.0 TiB of host memory, this machine has 1\.0 GiB"):
        check_memory(2 * 2**40, "a big run", available=2**30)


# ---- issue 31: simulate --prefix-caching sizes and flags a mode would ignore -------------------------------------
@pytest.fixture
def no_prefix_work(monkeypatch):
    monkeypatch.setattr(simulate, "simulate_prefix", _no_work)


@pytest.mark.parametrize("argv", [["--requests", str(10**9)], ["--scale", "1e5"], ["--scale", "1e7"],
                                  ["--max-seqs", str(10**9)], ["--workload", "multi-turn", "--scale", "1e6"],
                                  ["--workload", "few-shot", "--requests", str(10**10)]])
def test_simulate_prefix_refuses_sizes_this_machine_cannot_hold(argv, capsys, monkeypatch, no_prefix_work):
    for name in PREFIX_WORKLOAD_NAMES:  # refused from the arguments alone, before drawing the workload
        monkeypatch.setitem(simulate.PREFIX_WORKLOADS, name, _no_work)
    line = one_line_error(capsys, simulate.main, ["--prefix-caching", *argv])
    assert "needs about" in line and "of host memory" in line


PREFIX_WORKLOAD_NAMES = ("seed", "system-prompt", "multi-turn", "few-shot")


@pytest.mark.parametrize("workload", PREFIX_WORKLOAD_NAMES)
def test_prefix_lengths_bound_the_drawn_workload(workload):
    for requests, scale in ((8, 0.01), (13, 0.05)):
        w = simulate.PREFIX_WORKLOADS[workload](requests, scale, 0, 0.25)
        n, mean, longest, out = simulate.prefix_lengths(workload, requests, scale, 0.25)
        assert n == len(w) and out >= sum(x.max_new_tokens for x in w)
        assert longest >= max(x.total_len for x in w) and mean >= 0.9 * np.mean([x.total_len for x in w])


@pytest.mark.parametrize("argv, needle", [
    (["--prefix-caching", "--memory-requests", "0.01"], "cannot be served"),  # used to stall after starting
    (["--prefix-caching", "--recycle", "none"], "--recycle is not used with --prefix-caching"),
    (["--prefix-caching", "--recycle", "timely"], "--recycle is not used with --prefix-caching"),
    (["--prefix-caching", "--pool", "partitioned"], "--pool is not used with --prefix-caching"),
    (["--prefix-caching", "--pool=shared"], "--pool is not used with --prefix-caching"),
    (["--prefix-caching", "--swa-fraction", "0.5,1.0"], "takes one --swa-fraction"),
    (["--prefix-caching", "--workload", "few-shot", "--spread", "0.1"], "--spread applies to the seed workload"),
    (["--workload", "few-shot"], "--workload needs --prefix-caching"),
    (["--memory-requests", "0.01"], "cannot be served"),
    (["--max-seqs", str(10**9)], "needs about"),
    (["--share", "static"], "--share needs --processes above 1"),
    (["--processes", "2", "--share", "round-robin"], "--share"),
    (["--processes", "0"], "--processes"),
    (["--processes", "2", "--model-shards", "2"], "drop --model-shards"),
    (["--prefix-caching", "--processes", "2"], "--processes is not used with --prefix-caching"),
])
def test_simulate_refuses_before_any_work(argv, needle, capsys, no_sim_work, no_prefix_work):
    line = one_line_error(capsys, simulate.main, SMALL_SIM[:4] + argv)
    assert line.startswith("simulate: ") and needle in line


def test_simulate_prefix_uses_spread_on_the_seed_workload(capsys):
    base = ["--prefix-caching", "--requests", "3", "--scale", "0.005", "--page-size", "4", "--max-seqs", "4",
            "--max-tokens", "64", "--json", "-"]
    docs = []
    for spread in ("0", "0.5"):
        assert simulate.main(base + ["--spread", spread]) == 0
        docs.append(json.loads(capsys.readouterr().out))
    assert docs[0]["config"]["spread"] == 0 and docs[1]["config"]["spread"] == 0.5
    assert docs[0]["results"][0]["prompt_tokens"] != docs[1]["results"][0]["prompt_tokens"]


# ---- issue 31 / 33: run refuses what it cannot do, before building anything ---------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["--mesh", "100000x100000"], "--mesh 100000x100000 needs 10000000000 devices"),
    (["--mesh", "4096x4096"], "needs 16777216 devices"),
    (["--devices", "1000000"], "--mesh 1000000x1 needs 1000000 devices"),
    (["--devices", str(10**12)], f"needs {10**12} devices"),
    (["--devices", "10**12"], "--devices: must be an int >= 1, got '10**12'"),
    (["--preset", "gpu"], "--preset gpu needs a GPU and JAX sees only cpu devices"),
    (["--json", "/proc/x.json"], "--json: cannot write '/proc/x.json'"),
    (["--repeats", "0"], "--repeats"),
])
def test_run_refuses_before_building_anything(argv, needle, capsys, no_run_work):
    if "gpu" in argv and cli_run.jax.default_backend() == "gpu":
        pytest.skip("a GPU is here")
    line = one_line_error(capsys, cli_run.main, argv)
    assert line.startswith("run: ") and needle in line


def test_run_mesh_in_a_fresh_process_refuses_in_one_line():
    """The crash was in a fresh process: JAX asked for a million host devices (segfault / exit 127)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvjax", "run", "--devices", "1000000"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"run: --mesh 1000000x1 needs 1000000 devices, {cli_run.MAX_HOST_DEVICES} available (on CPU kvjax asks JAX "
        f"for at most {cli_run.MAX_HOST_DEVICES} host devices)"]


def test_run_gpu_preset_with_force_passes_the_device_check(monkeypatch):
    monkeypatch.setattr(cli_run.jax, "default_backend", lambda: "cpu")
    cli_run.check_device("gpu", force=True)
    cli_run.check_device("cpu", force=False)
    with pytest.raises(ValueError, match="--force"):
        cli_run.check_device("gpu", force=False)


@pytest.mark.parametrize("command, module", [("run", cli_run), ("simulate", simulate)])
def test_help_shows_every_flag_with_text_and_defaults(command, module):
    parser = module.build_parser()
    text = parser.format_help()
    assert "``" not in text
    for action in parser._actions:
        assert action.help, action.option_strings
        if action.default not in (None, False) and action.option_strings != ["-h", "--help"]:
            assert "(default:" in (parser._get_formatter()._get_help_string(action) or ""), action.option_strings
    assert "'-' writes it to standard output" in " ".join(text.split())


def test_top_level_help_has_no_rst(capsys):
    assert kvjax_main(["--help"]) == 0
    assert "``" not in capsys.readouterr().out


def test_provenance_names_this_checkout_only(tmp_path):
    from kvjax.cli.output import git_commit, provenance

    meta = provenance("run", ["--seed", "3"], device="cpu", seed=3)
    assert meta["command"] == ["python", "-m", "kvjax", "run", "--seed", "3"] and meta["seed"] == 3
    assert meta["date"].endswith("+00:00") and meta["kvjax"] and meta["jax"]
    assert git_commit(str(tmp_path)) is None  # not a checkout
    inner = tmp_path / "sub"
    inner.mkdir()
    import subprocess

    if subprocess.run(["git", "init", "-q", str(tmp_path)], capture_output=True).returncode == 0:
        assert git_commit(str(inner)) is None  # inside a repository, but not its top: not kvjax's checkout
