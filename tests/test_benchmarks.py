"""CPU smoke test of the benchmark frame (``benchmarks/runner.py``): a tiny case of every subject runs with
``impl="reference"`` (and ``"interpret"`` where cheap), is checked against the reference, and lands in the JSON
with every column; timing falls back to wall clock (the CPU profiler has no device records)."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """The benchmark modules, imported as the scripts import each other (``benchmarks/`` on ``sys.path``)."""
    before = set(sys.modules)
    sys.path.insert(0, str(BENCH))
    import case
    import runner
    import timing

    yield runner, case, timing
    sys.path.remove(str(BENCH))
    for name in set(sys.modules) - before:  # top-level names such as "conv", "engine": not the package's
        if not name.startswith(("kvjax", "jax", "numpy")) and getattr(sys.modules[name], "__file__", "") and \
                str(BENCH) in sys.modules[name].__file__:
            del sys.modules[name]


@pytest.mark.slow
def test_every_subject_runs_checks_and_writes_every_column(bench, tmp_path):
    runner, _, _ = bench
    out = tmp_path / "bench.json"
    one_each = ("gdn decode", "conv decode", "paged decode", "mla decode", "swiglu", "engine", "prefix multi-turn small",
                "prefix host tier", "scheduler")  # (the long-answers prefix case is the first one's code again)
    report = runner.run_subjects(list(runner.SUBJECTS), small=True, impls=("reference",), rounds=1, calls=1,
                                 out=str(out), only=one_each)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(report["rows"], default=str))
    rows = report["rows"]
    assert {r["subject"] for r in rows} == set(runner.SUBJECTS)
    for r in rows:
        assert set(runner.COLUMNS) <= set(r), r["case"]
        if r["kind"] in ("impl", "run"):
            assert r["ok"] is True and r["error"] is None, (r["case"], r["error"])
            assert r["median_ms"] > 0 and r["timer"] == "wall" and r["device_ms"] is None
        if r["kind"] == "impl":  # the reference checked against itself: the jitted run equals the oracle
            assert max(r["err"]) <= 1e-5, (r["case"], r["err"])
            assert r["rounds"] and (r["bytes"] == 0 or (r["gbps"] > 0 and r["copy_gbps"] > 0 and r["vs_copy"] > 0))
    ops = {r["op"] for r in rows}
    assert {"kvjax.state.gdn_pool.gdn_decode", "kvjax.state.gdn_pool.conv_decode", "kvjax.ops.paged_attention",
            "kvjax.ops.mla_decode", "kvjax.ops.mlp.swiglu"} <= ops
    conv = [r for r in rows if r["subject"] == "conv"]
    assert all(r["anchor"] == "reference" and r["vs_anchor"] == pytest.approx(1.0) for r in conv)


def test_interpret_is_checked_against_the_reference(bench):
    runner, _, _ = bench
    (case,) = [c for c in runner.subject_cases("attention", small=True) if "SWA" in c.name and "fp8" not in c.name]
    rows = runner.run_case(case, "attention", runner.Run(small=True, impls=("reference", "interpret"), rounds=1,
                                                          calls=1, anchors=None))
    by = {r["impl"]: r for r in rows}
    assert by["interpret"]["ok"] is True and 0 < by["interpret"]["err"][0] <= 2e-2
    assert by["whole row"]["kind"] == "anchor" and by["whole row"]["ok"] is None  # timed, not compared
    assert by["interpret"]["vs_anchor"] == pytest.approx(by["whole row"]["median_ms"] / by["interpret"]["median_ms"])


def _toy_case(case_mod, impls, anchor=None, torch_anchor=False):
    x = jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)  # f32[64, 64]

    def run(impl):
        if impl == "missing":
            from kvjax.errors import UnknownImplError

            raise UnknownImplError("toy: no implementation 'missing'")
        f = jax.jit(lambda a: a * 2.0 + (0.5 if impl == "wrong" else 0.0))
        return lambda: f(x)

    setup = lambda: case_mod.Setup(run=run, reference=lambda: (x * 2.0,))  # noqa: E731
    return case_mod.Case("toy", "toy_op", {"N": 64}, impls, setup, anchor=anchor, bytes=64 * 64 * 8)


def test_failed_check_is_reported_not_timed_and_unavailable_is_no_verdict(bench):
    runner, case_mod, _ = bench
    anchors = {"copies": {}, "anchors": {"toy": {"ext": {"wall_ms": 1.0, "device_ms": None}}}}
    run = runner.Run(small=True, impls=None, rounds=1, calls=1, anchors=anchors)
    rows = {r["impl"]: r for r in runner.run_case(_toy_case(case_mod, ("good", "wrong", "missing"),
                                                            anchor="torch:ext"), "toy", run)}
    assert rows["good"]["ok"] is True and rows["good"]["median_ms"] > 0
    assert rows["good"]["vs_anchor"] == pytest.approx(1.0 / rows["good"]["median_ms"])
    assert rows["wrong"]["ok"] is False and rows["wrong"]["median_ms"] is None and "check failed" in rows["wrong"][
        "error"]
    assert rows["missing"]["ok"] is None and "UnknownImplError" in rows["missing"]["error"]
    assert rows["torch:ext"]["kind"] == "anchor" and rows["torch:ext"]["median_ms"] == 1.0


def test_timing_helpers(bench):
    _, _, timing = bench
    a = np.array([3.0, 4.0])
    assert timing.rel_err(a, a) == 0.0
    assert timing.rel_err(a + np.array([0.3, 0.4]), a) == pytest.approx(0.1)
    assert np.isnan(timing.rel_err(np.array([np.nan, 1.0]), a))
    f = jax.jit(lambda v: v + 1)
    x = jnp.ones((1000,))
    assert timing.wall_ms(lambda: f(x), n=2, rounds=2) > 0
    assert timing.device_ms(lambda: f(x), n=2) is None  # CPU: no device records, the runner uses wall clock
    t = timing.interleaved({"a": lambda: f(x), "b": lambda: f(x)}, rounds=2, n=2)
    assert set(t) == {"a", "b"} and len(t["a"]["wall_rounds"]) == 2 and t["a"]["device_ms"] is None
    copy = timing.xla_copy(1 << 16, n=2)
    assert copy["bytes"] == 1 << 16 and copy["wall_ms"] > 0


def test_table_prints_every_row(bench, capsys):
    runner, case_mod, _ = bench
    run = runner.Run(small=True, impls=None, rounds=1, calls=1, anchors=None)
    rows = runner.run_case(_toy_case(case_mod, ("good",), anchor="good"), "toy", run)
    runner.print_table({"date": "d", "device": "cpu", "jax": jax.__version__, "rows": rows})
    text = capsys.readouterr().out
    assert "toy" in text and "good" in text and "1.00" in text


def test_runner_clips_errors_at_a_word_boundary_and_writes_under_benchmarks_out(bench):
    """Issue 33 item 8: ``--small`` cut error text mid-word and wrote ``bench.json`` into the repository root."""
    runner, _, _ = bench
    text = "UnknownImplError: pallas declines: needs a GPU, this is cpu; " * 3
    for limit in (30, 57, 100):
        short = runner.clip(text, limit)
        assert len(short) <= limit and short.endswith(" …")
        kept = short[:-2].split()
        assert kept == text.split()[: len(kept)]  # whole words only: the last kept word is not cut
    assert runner.clip("a\nb  c", 50) == "a b c"
    out = Path(runner.DEFAULT_OUT)
    assert out.parent == BENCH / "out"
    gitignore = (BENCH.parent / ".gitignore").read_text().split()
    assert "/benchmarks/out/" in gitignore
