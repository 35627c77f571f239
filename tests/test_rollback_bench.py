"""``benchmarks/rollback.py`` on a CPU (the kernel in interpret mode): every variant runs, with the bytes model of its
docstring and both rollbacks' figures printed."""

from __future__ import annotations

from helpers.bench import import_bench


def test_rollback_benchmark_smoke(capsys):
    bench = import_bench("rollback")
    report = bench.main(["--interpret", "--shapes", "2x2", "--copy-bytes", str(1 << 20)])
    printed = capsys.readouterr().out
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"step buffer", "step buffer + zeroed buffer", "pool slots"}
    J, s = bench.DRAFTS + 1, 2 * 128 * 128 * 4  # positions; one row's state over its 2 value heads
    assert rows["step buffer"]["bytes"] == 2 * (J + 4) * s and rows["pool slots"]["bytes"] == 2 * (J + 1) * s
    assert rows["step buffer"]["vs_buffer"] == 1.0
    for r in rows.values():
        assert r["wall_ms"] > 0 and f"| 2 | 2 | {r['variant']} |" in printed
